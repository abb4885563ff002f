"""Tests of the lab instruments (tools/lab/): not in the default suite; run them with
``python3 dev.py test tests/lab``."""

from __future__ import annotations

import os

import pytest

from tools.lab import delivery

@pytest.mark.timeout(60)
def test_delivery_delays_count_each_read_from_its_earliest_new_write():
    """tools/lab/delivery.py's matching: a read takes what was written since the previous read of
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
    """tools/lab/delivery.py on real processes: it still finds the endpoint's ring functions it
    wraps, and the messages of every step are read, both ways (two each way a step: some
    reads may take two at once)."""
    steps = 30
    step_us, found = delivery.measure(pipeline=False, steps=steps, warmup=10)
    assert step_us > 0
    for sender, receiver in (("0", "1"), ("1", "0")):
        reads = [delay for key, delays in found.items() if key[:2] == (sender, receiver) for delay in delays]
        assert len(reads) >= steps, (sender, receiver, len(reads))
        assert all(delay >= 0 for delay in reads)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("switch", ["outcome", "engine-past-send"])
def test_the_in_launch_ab_runs_both_sides_of_a_switch(switch):
    """tools/lab/ab_inlaunch.py: a short one-hop run with each switch: both sides run (the
    steps check their gradients) and the line it prints holds a ratio per round."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "lab", "ab_inlaunch.py"), "hop", switch,
                           "--rounds", "2", "--steps", "20"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-2000:]
    line = [line for line in done.stdout.splitlines() if line.startswith(f"hop, {switch}:")]
    assert len(line) == 1 and line[0].endswith("of 2 below 1"), done.stdout


def _phase_rows(lines: list) -> dict:
    """tools/lab/phases.py's table rows (after its heading), by phase: the row's other fields."""
    return {line[:24].strip(): line[24:].split() for line in lines[1:]}


def test_phases_table_takes_each_phase_median_over_launches():
    """tools/lab/phases.py's table: per phase, the median over launches of each framework, and
    their ratio (pure: no processes)."""
    from tools.lab import phases

    found = {"tp": [[1, 100, 2, 200, 3, 4, 310], [3, 300, 2, 400, 3, 4, 712], [2, 200, 2, 300, 3, 4, 511]],
             "zmq": [[1, 50, 2, 600, 3, 4, 660], [1, 70, 2, 600, 3, 4, 680], [1, 60, 2, 600, 3, 4, 670]]}
    lines = phases.table("hop", found)
    assert len(lines) == 1 + 7  # the heading, six phases and the whole step
    rows = _phase_rows(lines)
    assert rows["rpc_sync"] == ["200.0", "us", "60.0", "us", "0.30x"]
    assert rows["backward"] == ["300.0", "us", "600.0", "us", "2.00x"]
    assert rows["whole step"][4] == "1.31x"  # 670 / 511


def test_phases_table_shows_a_framework_not_measured_as_a_dash():
    """tools/lab/phases.py's table with ours alone (--frameworks zmq): TensorPipe's column and the
    ratios are "-", ours keeps its figures."""
    from tools.lab import phases

    rows = _phase_rows(phases.table("hop", {"zmq": [[1, 50, 2, 600, 3, 4, 660]]}))
    assert rows["backward"] == ["-", "600.0", "us", "-"]
    assert rows["whole step"] == ["-", "660.0", "us", "-"]


@pytest.mark.timeout(180)
def test_phases_runs_the_one_hop_step():
    """tools/lab/phases.py end to end, briefly, with ours alone (TensorPipe's init_rpc needs numpy,
    which the test extras do not install): its group runs the one-hop step (which checks its
    gradient) and every phase gets a figure."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "lab", "phases.py"), "hop", "--steps", "20",
                           "--launches", "1", "--frameworks", "zmq"], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = ["enter", "rpc_sync", "loss", "backward", "get_gradients", "exit", "whole step"]
    rows = [line for line in done.stdout.splitlines() if line[:24].strip() in expected]
    assert [row[:24].strip() for row in rows] == expected, done.stdout
    for row in rows:
        tp, ours, unit, ratio = row[24:].split()
        assert tp == "-" and ratio == "-" and unit == "us" and float(ours.replace(",", "")) > 0, row


def test_ab_trees_reads_rows_and_pairs_each_launch_with_its_neighbour():
    """tools/lab/ab_trees.py: lab rows become tools/bench_scale.py's, by the processes each
    needs; bad rows are refused; the paired ratio is the median of B/A launch by launch
    (not the ratio of the medians), with its quartiles and the pairs B won."""
    from tools.lab import ab_trees

    assert ab_trees.bench_rows("one-hop,threads:4,fan-out:8,chain:8,threads:16") == {
        2: [("one hop", 1), ("threads", 4), ("threads", 16)], 8: [("fan-out", 8), ("chain", 8)]}
    for bad in ("hop", "threads", "one-hop:2", "fan-out:x", "threads:4,"):
        with pytest.raises(ValueError, match="is not a row"):
            ab_trees.bench_rows(bad)
    # B is half of A in the first launch and twice A in the second and third: the medians
    # alone (A 2, B 4) would say 2.0.
    assert ab_trees.paired([4.0, 1.0, 2.0], [2.0, 2.0, 4.0]) == (2.0, 0.5, 2.0, 1)
    assert ab_trees.paired([1.0], [0.9]) == (0.9, 0.9, 0.9, 1)


@pytest.mark.timeout(300)
def test_ab_trees_runs_bench_scale_rows_in_both_trees():
    """The same tree twice, two launches each of two rows: every row measured in both, with
    its ratios and paired counts."""
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, os.path.join(root, "tools", "lab", "ab_trees.py"), root, root,
                           "--rows", "one-hop,threads:2", "--launches", "2", "--steps", "20"],
                          capture_output=True, text=True, timeout=280, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    for row in ("one hop:1", "threads:2"):
        line = re.search(rf"^{row}\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \(([\d.]+)-([\d.]+)\)\s+(\d)/2 ",
                         done.stdout, re.M)
        assert line, done.stdout
        a, b = float(line.group(1)), float(line.group(2))
        assert a > 0 and b > 0 and abs(float(line.group(3)) - b / a) < 0.002
        assert float(line.group(5)) <= float(line.group(4)) <= float(line.group(6))
