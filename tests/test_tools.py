"""The measuring tools' own pieces that can be wrong without a benchmark noticing."""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import struct

import pytest
import torch

from tools import delivery, floor, machine, ports, shm_floor


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


@pytest.mark.timeout(60)
def test_delivery_delays_count_each_read_from_its_earliest_new_write():
    """tools/delivery.py's matching: a read takes what was written since the previous read of
    that ring, and its delay counts from the earliest of it, classified by the reader's state
    at that write and by the reading thread; reads outside the window, or that find nothing
    new, count for nothing."""
    traces = {
        "0": ([(1_000, "1", True), (5_000, "1", False), (5_200, "1", True), (15_000, "1", False)],
              [(3_000, "1", "MainThread")]),
        "1": ([(2_000, "0", True)],
              [(1_500, "0", "rpc-worker1-0"), (9_000, "0", "zmq-io-1"), (9_500, "0", "zmq-io-1"),
               (20_000, "0", "rpc-worker1-0")]),
    }
    found = delivery.delays(traces, 0, 10_000)
    assert dict(found) == {
        ("0", "1", "spinning", "waiting thread"): [0.5],
        ("0", "1", "asleep", "I/O thread"): [4.0],  # from 5,000, not 5,200
        ("1", "0", "spinning", "waiting thread"): [1.0],
    }
    printed = delivery.table(found, 2, 100.0)
    assert "worker0 -> worker1" in printed and "in all: 3 us a step waiting for delivery (3% of a step)" in printed


@pytest.mark.timeout(180)
def test_delivery_traces_a_one_hop_step():
    """tools/delivery.py on real processes: it still finds the endpoint's ring functions it
    wraps, and the messages of every step are read, both ways (two each way a step: some
    reads may take two at once)."""
    steps = 30
    step_us, found = delivery.measure(pipeline=False, steps=steps, warmup=10)
    assert step_us > 0
    for sender, receiver in (("0", "1"), ("1", "0")):
        reads = [delay for key, delays in found.items() if key[:2] == (sender, receiver) for delay in delays]
        assert len(reads) >= steps, (sender, receiver, len(reads))
        assert all(delay >= 0 for delay in reads)


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("switch", ["outcome", "engine-past-send"])
def test_the_in_launch_ab_runs_both_sides_of_a_switch(switch):
    """tools/ab_inlaunch.py: a short one-hop run with each switch: both sides run (the
    steps check their gradients) and the line it prints holds a ratio per round."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "ab_inlaunch.py"), "hop", switch,
                           "--rounds", "2", "--steps", "20"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [line for line in done.stdout.splitlines() if line.startswith(f"hop, {switch}:")]
    assert len(line) == 1 and line[0].endswith("of 2 below 1"), done.stdout


def _phase_rows(lines: list) -> dict:
    """tools/phases.py's table rows (after its heading), by phase: the row's other fields."""
    return {line[:24].strip(): line[24:].split() for line in lines[1:]}


def test_phases_table_takes_each_phase_median_over_launches():
    """tools/phases.py's table: per phase, the median over launches of each framework, and
    their ratio (pure: no processes)."""
    from tools import phases

    found = {"tp": [[1, 100, 2, 200, 3, 4, 310], [3, 300, 2, 400, 3, 4, 712], [2, 200, 2, 300, 3, 4, 511]],
             "zmq": [[1, 50, 2, 600, 3, 4, 660], [1, 70, 2, 600, 3, 4, 680], [1, 60, 2, 600, 3, 4, 670]]}
    lines = phases.table("hop", found)
    assert len(lines) == 1 + 7  # the heading, six phases and the whole step
    rows = _phase_rows(lines)
    assert rows["rpc_sync"] == ["200.0", "us", "60.0", "us", "0.30x"]
    assert rows["backward"] == ["300.0", "us", "600.0", "us", "2.00x"]
    assert rows["whole step"][4] == "1.31x"  # 670 / 511


def test_phases_table_shows_a_framework_not_measured_as_a_dash():
    """tools/phases.py's table with ours alone (--frameworks zmq): TensorPipe's column and the
    ratios are "-", ours keeps its figures."""
    from tools import phases

    rows = _phase_rows(phases.table("hop", {"zmq": [[1, 50, 2, 600, 3, 4, 660]]}))
    assert rows["backward"] == ["-", "600.0", "us", "-"]
    assert rows["whole step"] == ["-", "660.0", "us", "-"]


@pytest.mark.timeout(180)
def test_phases_runs_the_one_hop_step():
    """tools/phases.py end to end, briefly, with ours alone (TensorPipe's init_rpc needs numpy,
    which the test extras do not install): its group runs the one-hop step (which checks its
    gradient) and every phase gets a figure."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "phases.py"), "hop", "--steps", "20",
                           "--launches", "1", "--frameworks", "zmq"], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = ["enter", "rpc_sync", "loss", "backward", "get_gradients", "exit", "whole step"]
    rows = [line for line in done.stdout.splitlines() if line[:24].strip() in expected]
    assert [row[:24].strip() for row in rows] == expected, done.stdout
    for row in rows:
        tp, ours, unit, ratio = row[24:].split()
        assert tp == "-" and ratio == "-" and unit == "us" and float(ours.replace(",", "")) > 0, row


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
