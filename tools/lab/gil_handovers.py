"""How often the processes of a step sleep and wake, and why: one row of tools/bench_scale.py
(zmqautograd, or TensorPipe with ``--framework tp``) runs for ``--seconds`` while Linux's
``perf`` watches its processes (root, and perf with the kernel's syscall tracepoints).

* Per process, per step: context switches, futex calls (sleeps and wake-ups on locks,
  condition variables and the GIL) and the system calls through which a Python thread gives
  the GIL up (reads, writes, sends, polls, ``sched_yield``).
* ``--causes``: the driver's futex calls (one in four, for 2 s), recorded with their native
  call stacks, grouped by what made the thread give the GIL up or take it back (a blocking
  lock, a torch op, a tensor freed, torch's bridge to a tensor's Python object, a system
  call). With several driver threads, each such point is a hand-over of the GIL: a sleep
  and a wake-up.

    python tools/lab/gil_handovers.py one-hop|threads:16|fan-out:16|chain:8 [--seconds 10] [--framework tp] [--causes]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch.multiprocessing as mp  # noqa: E402

from tools import bench_scale, ports  # noqa: E402
from tools.lab import next_result  # noqa: E402

SYSCALLS = ("futex", "read", "write", "sendto", "poll", "epoll_wait", "sched_yield")
COLUMNS = ("context-switches", *SYSCALLS)  # per process and step

# Frames between the GIL's own functions and what made a thread give it up or take it back.
_GIL_PLUMBING = frozenset((
    "PyEval_RestoreThread", "PyEval_AcquireThread", "PyEval_SaveThread", "PyEval_ReleaseThread", "PyGILState_Ensure",
    "pybind11::gil_scoped_acquire::gil_scoped_acquire", "pybind11::gil_scoped_acquire::~gil_scoped_acquire",
    "pybind11::gil_scoped_release::gil_scoped_release", "pybind11::gil_scoped_release::~gil_scoped_release",
    "acquire_timed", "_PyEval_EvalFrameDefault",
))
# What a frame says about the cause, first match wins (C++ names of torch 2.13, CPython 3.11's).
_SYSTEM_CALL = "a system call (poll, epoll, read, write, send, sched_yield)"
_CAUSES = (
    ("lock_PyThread_acquire_lock", "a blocking lock acquire (Lock, Condition, queue)"),
    ("ConcretePyInterpreterVTable::incref", "torch: a tensor's Python object referenced from C++"),
    ("ConcretePyInterpreterVTable::decref", "torch: a tensor's Python object released from C++"),
    ("THPVariable_dealloc", "torch: a tensor object freed"),
    ("THPVariable_", "torch: an op called from Python (it releases the GIL)"),
    ("THPEngine_run_backward", "torch: the autograd engine"),
    ("tensor_frombuffer", "torch: frombuffer's buffer released"),
    ("sem_post", "waking a thread (lock release)"),
    ("sem_wait", "sleeping on a lock"),
    *((key, _SYSTEM_CALL) for key in ("poll", "_Py_read", "_Py_write", "sock_", "sched_yield")),  # ("poll": epoll too)
)


def _group(rank: int, world: int, port: int, row: str, seconds: float, framework: str, results) -> None:
    rpc, autograd = bench_scale._join(rank, world, framework, port)
    if rank == 0:
        step, threads, others = bench_scale.lab_row(row, rpc, autograd, world)
        for _ in range(20):
            step()
        pids = [os.getpid()] + [rpc.rpc_sync(w, os.getpid) for w in others]
        stop = threading.Event()
        counts = [0] * threads

        def loop(index: int) -> None:
            while not stop.is_set():
                step()
                counts[index] += 1

        loops = [threading.Thread(target=loop, args=(i,), name=f"driver-{i}") for i in range(threads)]
        start = time.perf_counter()
        for t in loops:
            t.start()
        results.put(("pids", pids))  # perf attaches now, for seconds - 1
        stop.wait(seconds)
        stop.set()
        for t in loops:
            t.join()
        results.put(("done", sum(counts), time.perf_counter() - start))
    rpc.shutdown()


def _perf_stat(pid: int, seconds: float, out: str) -> subprocess.Popen:
    events = ",".join(name if name == "context-switches" else f"syscalls:sys_enter_{name}" for name in COLUMNS)
    return subprocess.Popen(["perf", "stat", "-e", events, "-p", str(pid), "-x", ",", "-o", out, "--", "sleep", f"{seconds:g}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _read_stat(path: str) -> dict[str, float]:
    found = {}
    with open(path) as lines:
        for line in lines:
            fields = line.strip().split(",")
            if len(fields) > 2 and fields[0].replace(".", "").isdigit():
                found[fields[2].replace("syscalls:sys_enter_", "")] = float(fields[0])
    return found


def cause_of(frames: list[str]) -> str:
    """What a futex call with native call stack ``frames`` (innermost first) was for: the
    GIL given up or taken back after what (``_CAUSES``), or another lock's or condition's."""
    gil = next((i for i, name in enumerate(frames) if name in ("take_gil", "drop_gil")), None)
    if gil is not None:
        frames = [name for name in frames[gil + 1:] if name not in _GIL_PLUMBING]
    cause = next((label for key, label in _CAUSES for name in frames[:3] if key in name), None)
    if cause is None:  # not the GIL (another lock, a condition variable: C++ threads), or unknown
        cause = "other: " + " < ".join(name[:60] for name in frames[:2])
    return ("the GIL, after " if gil is not None else "") + cause


def _causes(data: str) -> collections.Counter:
    """Futex calls recorded in ``data``, counted by cause (``cause_of``)."""
    script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym"], capture_output=True, text=True, check=True,
                            timeout=600).stdout
    counted: collections.Counter = collections.Counter()
    for sample in script.split("\n\n"):
        # Each line "address symbol+offset": the symbol.
        frames = [parts[1].split("+")[0] for line in sample.strip().splitlines() if len(parts := line.split(None, 1)) > 1]
        if frames:
            counted[cause_of(frames)] += 1
    return counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row", help="one-hop, threads:N, fan-out:N (world N) or chain:N (N processes)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--framework", choices=["zmq", "tp"], default="zmq", help="tp: TensorPipe, for comparison")
    parser.add_argument("--causes", action="store_true", help="also record the driver's futex calls with call stacks")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("gil_handovers.py needs Linux's perf (linux-perf / linux-tools), run as root")
    world = bench_scale.lab_world(args.row)
    results = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(_group, args=(world, ports.free_port(), args.row, args.seconds, args.framework, results),
                                 nprocs=world, start_method="spawn", join=False)
    _, pids = next_result(context, results)
    window = max(1.0, args.seconds - 1.0)
    with tempfile.TemporaryDirectory() as folder:
        perfs = [_perf_stat(pid, window, os.path.join(folder, f"{rank}.stat")) for rank, pid in enumerate(pids)]
        if args.causes:
            perfs.append(subprocess.Popen(
                ["perf", "record", "-e", "syscalls:sys_enter_futex", "-c", "4", "--call-graph", "dwarf,16384", "-p", str(pids[0]),
                 "-o", os.path.join(folder, "futex.data"), "--", "sleep", f"{min(window, 2.0):g}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for perf in perfs:
            perf.wait()
        _, steps, elapsed = next_result(context, results)
        context.join()
        rate = steps / elapsed  # steps per second
        print(f"{args.row} ({args.framework}): {elapsed / steps * 1e6:.0f} us per step; per step, by process:")
        print(f"  {'':<8} " + " ".join(COLUMNS))
        totals: collections.Counter = collections.Counter()
        for rank in range(len(pids)):
            counts = _read_stat(os.path.join(folder, f"{rank}.stat"))
            per_step = {name: counts.get(name, 0.0) / (window * rate) for name in COLUMNS}
            totals.update(per_step)
            if rank < 3 or rank == len(pids) - 1:
                print(f"  worker{rank:<2} " + " ".join(f"{per_step[name]:>{len(name)}.1f}" for name in COLUMNS))
        print(f"  {'all':<8} " + " ".join(f"{totals[name]:>{len(name)}.1f}" for name in COLUMNS))
        if args.causes:
            causes = _causes(os.path.join(folder, "futex.data"))
            total = sum(causes.values()) or 1
            print("driver's futex calls by cause (a sample of them; shares):")
            for cause, count in causes.most_common(14):
                print(f"  {count / total:6.1%}  {cause}")


if __name__ == "__main__":
    main()
