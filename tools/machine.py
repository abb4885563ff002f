"""What the machine did to a benchmark: CPU time the hypervisor stole from this VM, and how
fast it ran Python and woke sleeping processes.

On a shared VM the hypervisor runs other guests on "our" CPUs; Linux counts that time as
*steal* (the 8th field of /proc/stat's ``cpu`` line). On the development VM the slow runs
were the runs with steal: a 2-process ``rpc_sync`` loop took 630-760 us in runs with at most
0.15 s stolen, and 2.2-2.3 ms in runs with 2.9-4.2 s stolen (docs/performance.md, "Earlier
sessions"). So the benchmarks print the share of the machine's CPU time stolen while they
measured: read a figure next to its steal.

Nothing was stolen on the later VMs, and yet their speed differed 3-4x from one to the next
and changed within a session (docs/performance.md): the benchmarks also print the rate of a
plain Python loop before and after they measure, the yardstick the notes compare VMs by (it
does not catch every slow phase), and the time a blocking wake-up round trip between two
processes takes (``wake_round_trip``): where the hypervisor makes waking a sleeping CPU dear,
frameworks whose threads block to wait pay it on every message. First of all they print
which kind of machine it is (``kind_line``): TensorPipe's figures moved 2x between kinds
whose Python ran alike.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time


def _steal_seconds() -> float | None:
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None  # not Linux, or a kernel without the field


class StealMeter:
    """Started at construction; ``share()`` is the fraction of all CPUs' time stolen since
    (None where the kernel does not say)."""

    def __init__(self) -> None:
        self._steal = _steal_seconds()
        self._start = time.monotonic()

    def share(self) -> float | None:
        steal = _steal_seconds()
        if steal is None or self._steal is None:
            return None
        elapsed = time.monotonic() - self._start
        return (steal - self._steal) / (elapsed * (os.cpu_count() or 1)) if elapsed > 0 else 0.0

    def text(self) -> str:
        return percent(self.share())


def percent(share: float | None) -> str:
    """A stolen share as the benchmarks print it."""
    return "n/a" if share is None else f"{share * 100:.1f}%"


def python_loop_rate(seconds: float = 1.0) -> int:
    """How many times a second this process runs a loop of 1,000 integer additions (the
    development VMs did 11,000-61,000)."""
    clock = time.perf_counter
    start = clock()
    loops = 0
    while clock() - start < seconds:
        total = 0
        for i in range(1000):
            total += i
        loops += 1
    return int(loops / (clock() - start))


def wake_round_trip(rounds: int = 1000) -> float | None:
    """Seconds a byte takes to go from this process to a forked one and back through two
    pipes, each side blocked in ``read`` until it comes: two wake-ups of a sleeping thread
    (None where there is no ``fork``). What it costs is up to the hypervisor: with nothing
    else to run, a CPU whose threads all sleep halts, and waking it again goes through the
    host. On the nested guest of docs/performance.md ("fdb2db7.."), 80-160 us, against
    13-18 us while other processes kept both CPUs busy, and 1 us for the same ping-pong
    through spinning on shared memory. Threads that block to wait (TensorPipe's) pay it on
    every message; zmqautograd's waiting threads spin first (``spin``)."""
    if not hasattr(os, "fork"):
        return None
    to_child, from_parent = os.pipe()
    to_parent, from_child = os.pipe()
    child = os.fork()
    if child == 0:  # only system calls here: safe in a fork of a threaded process
        try:
            os.close(from_parent)  # so that the parent's end closing reads as the end
            os.close(to_parent)
            for _ in range(rounds):
                if not os.read(to_child, 1):
                    break
                os.write(from_child, b"w")
        finally:
            os._exit(0)
    os.close(to_child)
    os.close(from_child)
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            os.write(from_parent, b"w")
            os.read(to_parent, 1)
        return (time.perf_counter() - start) / rounds
    finally:
        os.close(from_parent)  # the child, if still reading (we were interrupted), stops
        os.waitpid(child, 0)
        os.close(to_parent)


def after_sleep(pieces: int = 300, nap: float = 0.0005) -> tuple[float, float] | None:
    """Seconds a small backward (a pipeline stage's: ``tanh(x @ w)``, 32x64 by 64x64, through
    ``torch.autograd.grad``) takes in a loop (warm) and right after this process slept
    ``nap`` seconds, medians (None without torch). The time spent asleep is not counted.

    Where nothing else keeps the CPU busy, it halts while the process sleeps, and the work
    after waking runs slower, not only later: on the 2-vCPU KVM guest of docs/performance.md
    ("3f30019.."), 40-61 us warm against 116-164 us after 0.2 or 2 ms asleep, and 70-94 us
    when a spinning process kept that CPU busy meanwhile. A thread that blocks to wait, on
    a CPU with nothing else to run, pays this on the work after each wake-up, on top of
    the wake-up itself; zmqautograd's waiting threads spin first (``spin``)."""
    try:
        import torch
    except ImportError:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=generator, requires_grad=True)
    x = torch.randn(32, 64, generator=generator, requires_grad=True)
    clock = time.perf_counter

    def piece() -> float:
        out = torch.tanh(x @ weight)
        grad = torch.ones_like(out)
        start = clock()
        torch.autograd.grad([out], [x, weight], [grad])
        return clock() - start

    for _ in range(pieces // 4):
        piece()
    warm = [piece() for _ in range(pieces)]
    slept = []
    for _ in range(pieces):
        time.sleep(nap)
        slept.append(piece())
    return statistics.median(warm), statistics.median(slept)


def _cpu_model(cpuinfo: str) -> str:
    """The CPU model that /proc/cpuinfo's text names first (x86's ``model name``; other
    architectures' ``Model`` or ``cpu model``)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return " ".join(value.split())
    return "unknown CPU"


def _hypervisor(cpuinfo: str, dmesg_vendor: str | None) -> str:
    """Whether the CPU says it runs under a hypervisor (x86's ``hypervisor`` flag), and which
    one where the kernel said (``dmesg_vendor``)."""
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    if "hypervisor" not in flags.partition(":")[2].split():
        return "no hypervisor flag"
    return f"a {dmesg_vendor} guest" if dmesg_vendor else "a guest VM"


def _hypervisor_vendor() -> str | None:
    """The hypervisor's name as the kernel gives it (Xen's sysfs file, or the line of its log
    that says which it detected); None where it does not say."""
    try:
        with open("/sys/hypervisor/type") as kind:  # Xen
            return kind.read().strip() or None
    except OSError:
        pass
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in log.splitlines():
        if "Hypervisor detected:" in line:
            return line.split("Hypervisor detected:", 1)[1].strip() or None
    return None


def kind_line() -> str:
    """Which machine a run was on, as the benchmarks print it first: CPUs this process may
    use, their model, the hypervisor, the kernel (figures of different kinds of machine
    differ by more than most changes do: docs/performance.md, "bc48d0f..")."""
    try:
        with open("/proc/cpuinfo") as info:
            cpuinfo = info.read()
    except OSError:
        cpuinfo = ""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    system = os.uname()
    return (f"machine: {cpus} CPU(s), {_cpu_model(cpuinfo)}, {_hypervisor(cpuinfo, _hypervisor_vendor())}, "
            f"{system.sysname} {system.release}")


def speed_line(when: str) -> str:
    """The machine's Python speed and the cost of waking a sleeping process ``when`` (a word:
    "before", "after"), as the benchmarks print them."""
    # The loop first: its second lets processes a benchmark just ended finish exiting, whose
    # work would keep the CPUs awake and the wake-up cheap (17 us once, against 80-160 idle).
    parts = [f"a Python loop of 1,000 additions {python_loop_rate():,} times a second"]
    wake = wake_round_trip()
    if wake is not None:
        parts.append(f"a blocking wake-up round trip {wake * 1e6:,.0f} us")
    pieces = after_sleep()
    if pieces is not None:
        parts.append(f"a stage's backward {pieces[0] * 1e6:,.0f} us warm, {pieces[1] * 1e6:,.0f} us after 0.5 ms asleep")
    return f"machine {when}: " + "; ".join(parts)
