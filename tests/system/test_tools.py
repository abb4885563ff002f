"""The measuring tools' own pieces that can be wrong without a benchmark noticing."""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import socket
import struct
import sys

import pytest
import torch

from tools import floor, machine, ports, shm_floor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(60)
def test_shm_floor_ring_wraps_records_of_any_length():
    """Records of odd lengths, written and read one at a time through several wraps of the
    requests ring: each comes back whole, and the answers ring next to it stays untouched (a
    wrap mark written unaligned near the end once ran into the answers ring's head)."""
    memory = shm_floor.create()
    try:
        requests, answers = shm_floor._rings(memory)
        answers_at = shm_floor._HEADER + shm_floor._RING_BYTES
        # Two records that end 2 bytes before the end of the ring (each takes 4 + 4 + 4 bytes
        # besides its frame: lengths and the frame count), then one that must wrap.
        lengths = [shm_floor._RING_BYTES // 2 - 13] * 2 + [10]
        lengths += random.Random(4).choices(range(0, 40_000), k=300) + [1, 2, 3, 5, 7]
        for number, length in enumerate(lengths):
            frames = [bytes([number % 251]) * length]
            requests.put(frames)
            assert requests.get() == frames, f"record {number} of {length} bytes"
            answers_header = bytes(memory.buf[answers_at:answers_at + shm_floor._HEADER])
            assert answers_header == bytes(shm_floor._HEADER), f"record {number} wrote past the requests ring"
        assert sum(lengths) > 3 * shm_floor._RING_BYTES  # wrapped several times
        del requests, answers
    finally:
        memory.close()
        memory.unlink()


@pytest.mark.timeout(60)
def test_shm_floor_ring_refuses_a_record_no_writer_writes():
    """A published record of 0 bytes (seen once in a bench run's warm-up) ends the floor's
    read with an error that says where and whether the length ever came, not a bare
    struct.error from deep in the decoding."""
    memory = shm_floor.create()
    try:
        requests, answers = shm_floor._rings(memory)
        struct.pack_into("<Q", memory.buf, 64, 8)  # the requests ring's tail: 8 bytes of zeros published
        with pytest.raises(RuntimeError, match=r"record of 0 bytes at ring offset 0 \(head 0, tail 8\); still so 1 s later"):
            requests.get()
        del requests, answers
    finally:
        memory.close()
        memory.unlink()


def _group_measuring_a_constant(rank: int, conn, done) -> None:
    from tools.bench import _measure_on_command
    _measure_on_command(conn, lambda: 1.5)


def _group_failing_in_warm_up(rank: int, conn, done) -> None:
    raise RuntimeError("warm-up failed on purpose")


@pytest.mark.timeout(60)
def test_one_hop_floor_computes_local_autograds_gradient_and_keeps_no_graph():
    """tools/floor.py's one-hop floor: its two calls, made here directly, give the gradient
    local autograd gives for the same computation, and the serving side forgets the graph."""
    x = torch.randn(3, requires_grad=True)
    grad = torch.randn(3)
    (expected,) = torch.autograd.grad([x * 2], [x], [grad])
    y = floor.hop_forward(7, x.detach().clone())
    assert not y.requires_grad and torch.equal(y, x.detach() * 2)
    assert 7 in floor._HOP_GRAPHS
    assert torch.equal(floor.hop_backward(7, grad), expected)
    assert floor._HOP_GRAPHS == {}


def _serve_shm_floor(name: str) -> None:
    torch.set_num_threads(1)
    shm_floor.serve(name)


@pytest.mark.timeout(120)
def test_one_hop_floor_runs_between_two_processes():
    """The one-hop floor as the bench runs it: a spawned serving side on the shared-memory
    rings, steps whose gradients it checks, and a clean stop."""
    memory = shm_floor.create()
    server = multiprocessing.get_context("spawn").Process(target=_serve_shm_floor, args=(memory.name,))
    server.start()
    try:
        client = shm_floor.Client(memory.name)
        seconds = client.one_hop(10)
        assert 0 < seconds < 5
        client.close()  # tells the serving side to stop, after its answer
        server.join(30)
        assert server.exitcode == 0
    finally:
        if server.is_alive():
            server.kill()
        memory.close()
        memory.unlink()


@pytest.mark.timeout(180)
def test_bench_leaves_out_a_reference_group_that_fails():
    """tools/bench.py's turn-taking: a failing group named optional (the floors) is left out
    with its error, the others' samples are all there; a failing group that is not optional
    ends the run with its error."""
    from tools import bench

    groups = {"measured": (_group_measuring_a_constant, (), 1), "floor": (_group_failing_in_warm_up, (), 1)}
    samples, stolen = bench.interleaved(groups, launches=1, rounds=3, optional=frozenset({"floor"}))
    assert samples == {"measured": [1.5, 1.5, 1.5], "floor": []}
    assert len(stolen["measured"]) == 3 and stolen["floor"] == []
    with pytest.raises(Exception, match="warm-up failed on purpose"):
        bench.interleaved(groups, launches=1, rounds=1)


@pytest.mark.timeout(60)
def test_wake_round_trip_measures_and_leaves_nothing_behind():
    """The benchmarks' wake-up yardstick (tools/machine.py): a positive time for a round trip
    through a forked process, which is reaped, with every pipe closed."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")

    def children() -> set:  # of every thread of this process, zombies included
        found = set()
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/children") as listing:
                found.update(listing.read().split())
        return found

    open_before, children_before = sorted(os.listdir("/proc/self/fd")), children()
    seconds = machine.wake_round_trip(50)
    assert seconds is not None and 0 < seconds < 0.5
    assert sorted(os.listdir("/proc/self/fd")) == open_before
    assert children() == children_before  # the child was waited for: no zombie left
    line = machine.speed_line("now")
    assert "blocking wake-up round trip" in line and "after 0.5 ms asleep" in line


@pytest.mark.timeout(60)
def test_after_sleep_times_the_same_backward_warm_and_after_a_nap():
    """The benchmarks' after-sleep yardstick (tools/machine.py): two medians of a small
    backward, positive and far below the naps between the pieces (the naps are not counted)."""
    warm, slept = machine.after_sleep(pieces=40, nap=0.01)
    assert 0 < warm < 0.005 and 0 < slept < 0.005


@pytest.mark.timeout(30)
def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range(monkeypatch):
    """tools/ports.py: no port handed out twice, none from the range connect() draws its
    local ports from (a rendezvous store once lost its port to one), and one of the
    ephemeral range only where the range below is too small."""
    start = ports.ephemeral_start()
    given = [ports.free_port() for _ in range(40)]
    assert len(set(given)) == 40
    assert all(20000 <= port < start for port in given)
    with socket.socket() as listener:  # free means bindable now
        listener.bind(("127.0.0.1", given[-1]))
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 20500)  # a range below too small
    assert ports.free_port() >= start  # the kernel's own choice, from its ephemeral range



def test_kind_line_names_the_cpu_and_the_hypervisor():
    """tools/machine.py: the CPU model and the hypervisor from /proc/cpuinfo-style text (pure),
    and the line itself on this machine."""
    cpuinfo = "processor\t: 0\nmodel name\t: Intel(R)  Xeon(R) Processor\nflags\t\t: fpu vme hypervisor lahf_lm\n"
    assert machine._cpu_model(cpuinfo) == "Intel(R) Xeon(R) Processor"
    assert machine._cpu_model("processor\t: 0\n") == "unknown CPU"
    assert machine._hypervisor(cpuinfo, "KVM") == "a KVM guest"
    assert machine._hypervisor(cpuinfo, None) == "a guest VM"
    assert machine._hypervisor(cpuinfo.replace(" hypervisor", ""), "KVM") == "no hypervisor flag"
    assert machine._hypervisor(cpuinfo.replace(" hypervisor", " hypervisor_x"), "KVM") == "no hypervisor flag"
    line = machine.kind_line()
    assert line.startswith("machine: ") and " CPU(s), " in line and os.uname().release in line


@pytest.mark.timeout(60)
def test_gil_handovers_names_what_gave_the_gil_up():
    """tools/lab/gil_handovers.py: native stacks of futex calls (innermost first) by cause."""
    from tools.lab import gil_handovers

    taken_after_free = ["__futex_abstimed_wait_common", "take_gil", "PyEval_AcquireThread",
                        "pybind11::gil_scoped_acquire::gil_scoped_acquire", "THPVariable_clear", "THPVariable_dealloc"]
    assert gil_handovers.cause_of(taken_after_free) == "the GIL, after torch: a tensor object freed"
    after_lock = ["futex_wait", "take_gil", "PyEval_RestoreThread", "acquire_timed", "lock_PyThread_acquire_lock"]
    assert gil_handovers.cause_of(after_lock) == "the GIL, after a blocking lock acquire (Lock, Condition, queue)"
    after_op = ["futex_wake", "drop_gil", "PyEval_SaveThread", "pybind11::gil_scoped_release::gil_scoped_release",
                "torch::autograd::THPVariable_view", "method_vectorcall_VARARGS_KEYWORDS"]
    assert gil_handovers.cause_of(after_op) == "the GIL, after torch: an op called from Python (it releases the GIL)"
    assert gil_handovers.cause_of(["futex_wake", "__new_sem_post", "PyThread_release_lock"]) == \
        "waking a thread (lock release)"
    assert gil_handovers.cause_of(["futex_wait", "__GI___lll_lock_wait"]).startswith("other: futex_wait < ")


@pytest.mark.timeout(60)
def test_gil_drops_places_each_drop_in_what_its_thread_ran():
    """tools/lab/gil_drops.py: a drop is placed by thread and time in the profile log: in a
    builtin while one runs (with the Python function around it), else in the Python function
    (a tensor freed there); drops outside the window are not counted."""
    from tools.lab import gil_drops

    events = [  # (ns, thread, name; None for a return)
        (10, 1, "py:a.py:step"), (20, 1, "c:Tensor.view"), (30, 1, None), (40, 2, "py:b.py:serve"),
        (50, 1, "py:a.py:inner"), (60, 1, None), (70, 2, None),
    ]
    drops = [(5, 1), (25, 1), (45, 2), (55, 1), (65, 1), (80, 1), (200, 1), (45, 3)]
    counted = gil_drops._where(events, drops, 0, 100)
    assert counted == {
        "(outside the log)": 1,  # thread 1 before its first logged call
        "c:Tensor.view  <  py:a.py:step": 1,
        "py:b.py:serve": 1,
        "py:a.py:inner": 1,
        "py:a.py:step": 2,  # after the builtin and after inner returned
        "(a thread that ran no Python while logged)": 1,
    }


@pytest.mark.timeout(60)
def test_calls_per_message_takes_the_control_calls_out():
    """tools/lab/calls_per_message.py: N steps are the second window (2N steps) less the
    first (N): the calls that read the counts, alike in both, cancel out."""
    from tools.lab import calls_per_message as cpm

    first = {"a.py:f": 10, "builtin:len": 3}  # before: control calls only
    second = {"a.py:f": 10 + 5 + 40, "builtin:len": 3 + 2 + 80, cpm.RECEIVED: 1 + 20}  # + control + N steps
    third = {"a.py:f": 55 + 5 + 80, "builtin:len": 85 + 2 + 160, cpm.RECEIVED: 21 + 1 + 40}  # + control + 2N
    counts = cpm.steps_of(first, second, third)
    assert counts == {"a.py:f": 40, "builtin:len": 80, cpm.RECEIVED: 20}
    assert cpm.summary(counts, 20) == {"python": 3.0, "builtin": 4.0, "opcodes": 0.0, "received": 1.0, "sent": 0.0}
    assert cpm.module_of("rpc/calls.py:Calling.call") == "rpc/calls.py" == cpm.module_of("opcodes:rpc/calls.py:Calling.call")
    assert cpm.module_of("builtin:len") == "builtins"
    assert cpm.function_name(os.path.join(ROOT, "zmqautograd", "rpc", "calls.py"), "Calling.call") == \
        "rpc/calls.py:Calling.call"


@pytest.mark.timeout(240)
def test_calls_per_message_counts_a_one_hop_step():
    """The tool on the one-hop row: each process receives and sends the step's 2 messages
    (the call and its answer, the gradients and theirs), with calls counted on every thread."""
    import re
    import subprocess

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "lab", "calls_per_message.py"), "one-hop",
                           "--steps", "20", "--top", "3"], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.findall(r"worker(\d): (\d+) Python calls, (\d+) builtin calls; ([\d.]+) messages in, ([\d.]+) out",
                       done.stdout)
    assert [rank for rank, *_ in found] == ["0", "1"], done.stdout
    for _, python, builtin, received, sent in found:
        assert int(python) > 50 and int(builtin) > 50
        # (A heartbeat may come in, a batch of context releases go out on its own.)
        assert 1.9 < float(received) < 2.5 and 1.9 < float(sent) < 2.5, done.stdout


@pytest.mark.timeout(240)
def test_phases_splits_a_fan_out_step_into_its_phases():
    """tools/lab/phases.py fan4, ours alone: every phase of the fan-out step gets a time, and
    the step's gradients were right (the tool checks them each step; a wrong one fails it)."""
    import subprocess

    from tools.lab.phases import FAN_PHASES

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "lab", "phases.py"), "fan4", "--steps", "20",
                           "--launches", "1", "--frameworks", "zmq"], capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line[:24].strip(): line[24:].split() for line in done.stdout.splitlines()[3:]}
    assert set(rows) == set(FAN_PHASES) | {"whole step"}, done.stdout
    for cells in rows.values():
        assert cells[0] == "-" and float(cells[1].replace(",", "")) > 0 and cells[2] == "us", done.stdout


@pytest.mark.timeout(240)
def test_bench_scale_prints_both_frameworks_and_their_ratios():
    """tools/bench_scale.py, as small as it goes: one launch of each framework, world 2 (one
    hop, 2 threads, a chain of 2)."""
    import subprocess

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_scale.py"), "--launches", "1", "--steps", "10",
                           "--worlds", "2", "--chain", "2", "--threads", "2", "--no-idle"],
                          capture_output=True, text=True, timeout=220, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0] + " " + line.split()[1]: line for line in done.stdout.splitlines()
            if line.startswith(("one hop", "2 threads", "chain 2"))}
    assert set(rows) == {"one hop", "2 threads", "chain 2"}, done.stdout
    for line in rows.values():
        assert line.count("x") == 2  # a time ratio and a CPU ratio


@pytest.mark.timeout(600)
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("callgrind_control")), reason="needs valgrind")
def test_bench_instr_counts_a_step_of_both_trees_alike():
    """tools/bench_instr.py with HEAD against the working tree (the same code in a clean
    checkout): both counted, from their own trees, and alike (the measure is repeatable).
    About 70 s on 2 idle cores; beside four CPU hogs it took more than 220 s: its limits are
    for a hang, not for a busy machine."""
    import re
    import subprocess

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_instr.py"), "HEAD", "--steps", "10",
                           "--workloads", "hop"], capture_output=True, text=True, timeout=570, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"^hop\s+A\s+([\d,]+)\s+B\s+([\d,]+)\s+B/A ([\d.]+)$", done.stdout, re.M)
    assert found, done.stdout
    a, b = (int(found.group(i).replace(",", "")) for i in (1, 2))
    assert a > 100_000 and b > 100_000
    if not subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "zmqautograd", "transport"],
                          capture_output=True, text=True).stdout:
        assert 0.9 < b / a < 1.1, done.stdout


@pytest.mark.timeout(60)
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("callgrind_control")), reason="needs valgrind")
def test_bench_instr_names_a_revision_it_cannot_export():
    import subprocess

    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_instr.py"), "no-such-revision"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode != 0 and "cannot export 'no-such-revision'" in done.stderr
