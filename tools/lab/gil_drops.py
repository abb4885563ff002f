"""How often each process of a step lets the GIL go, and where: one row of tools/bench_scale.py
(zmqautograd) run under Linux's ``perf`` with a probe on CPython's ``drop_gil`` (root).

Every time a thread lets the GIL go (a torch op called from Python, a tensor freed, a
blocking call, a periodic switch), another thread that waits for it may take it; with
several threads that want it (the driver of ``threads:16``), each such point is a hand-over:
a sleep and a wake-up, several microseconds of CPU. Unlike time, the count per step is the
same from run to run on any machine. Waiting is switched to sleeping (``spin=0``): a
spinning thread lets the GIL go on every look.

``--where``: each drop in the driver (or ``--rank``) is matched (by thread and time, on the
monotonic clock both share) to what that thread was running, from a profile function
(``sys.setprofile``) that logs every call: the builtin (``c:``; a torch op, a lock) or the
Python function (``py:``; a tensor freed there, a switch) it happened in, with the Python
function around it.

    python tools/lab/gil_drops.py one-hop|threads:N|fan-out:N|chain:N [--steps 300] [--where [--rank R]] [--top 30]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import pickle
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.multiprocessing as mp  # noqa: E402

from tools import bench_scale, ports  # noqa: E402
from tools.lab import next_result  # noqa: E402
from tools.lab.calls_per_message import _run_steps, function_name  # noqa: E402

EVENT = "probe_libpython:drop_gil"


class _Log:
    """Every call and return of every thread, with its time and thread, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.events: list = []

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if self.on:
            if event == "c_call":
                name = "c:" + (getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?"))
            elif event == "call":
                code = frame.f_code
                name = "py:" + function_name(code.co_filename, code.co_qualname)
            else:
                name = None  # a return
            self.events.append((time.monotonic_ns(), threading.get_native_id(), name))


_log = _Log()


def _start() -> int:
    _log.events.clear()
    _log.on = True
    return os.getpid()


def _stop(where: str) -> None:
    """The window's log, to ``where``/<pid> (read after the group exits)."""
    _log.on = False
    with open(os.path.join(where, str(os.getpid())), "wb") as out:
        pickle.dump(_log.events, out)


def _group(rank: int, world: int, port: int, row: str, steps: int, where: str | None, results) -> None:
    if where is not None:
        sys.setprofile(_log.profile)
        threading.setprofile(_log.profile)
    bench_scale.ZMQ_OPTIONS.update({"spin": 0.0, "busy_poll": 0.0})
    rpc, autograd = bench_scale._join(rank, world, "zmq", port)
    if rank == 0:
        step, threads, others = bench_scale.lab_row(row, rpc, autograd, world)
        for _ in range(20):
            step()
        marks = []
        for count in (steps, 2 * steps):  # two windows: their difference is `steps` steps
            pids = [rpc.rpc_sync(w, _start) for w in others] + [_start()]
            marks.append(time.monotonic_ns())
            _run_steps(step, count, threads)
            marks.append(time.monotonic_ns())
            if where is not None and count == steps:
                for w in others:
                    rpc.rpc_sync(w, _stop, args=(where,))
                _stop(where)
        results.put((pids, marks))
    rpc.shutdown()
    sys.setprofile(None)


def _drops(data: str) -> dict[int, list[tuple[int, int]]]:
    """The drops recorded in ``data``: by process, (time in ns, thread) in time order."""
    script = subprocess.run(["perf", "script", "-i", data, "-F", "pid,tid,time", "--ns"], capture_output=True,
                            text=True, check=True, timeout=600).stdout
    found: dict[int, list] = collections.defaultdict(list)
    for line in script.splitlines():
        parts = line.replace("/", " ").replace(":", " ").split()
        if len(parts) >= 3:
            seconds, _, fraction = parts[2].partition(".")
            found[int(parts[0])].append((int(seconds) * 1_000_000_000 + int(fraction), int(parts[1])))
    for drops in found.values():
        drops.sort()
    return found


def _where(events: list, drops: list[tuple[int, int]], start: int, end: int) -> collections.Counter:
    """Each drop in [start, end) by what its thread was running then (see the docstring)."""
    by_thread: dict[int, list] = collections.defaultdict(list)
    for moment, tid, name in events:
        by_thread[tid].append((moment, name))
    stacks: dict[int, list] = {}
    cursors: dict[int, int] = collections.defaultdict(int)
    counted: collections.Counter = collections.Counter()
    for moment, tid in drops:
        if not start <= moment < end:
            continue
        log = by_thread.get(tid)
        if log is None:
            counted["(a thread that ran no Python while logged)"] += 1
            continue
        stack = stacks.setdefault(tid, [])
        cursor = cursors[tid]
        while cursor < len(log) and log[cursor][0] <= moment:
            name = log[cursor][1]
            if name is None:
                if stack:
                    stack.pop()
            else:
                stack.append(name)
            cursor += 1
        cursors[tid] = cursor
        inner = stack[-1] if stack else "(outside the log)"
        outer = next((name for name in reversed(stack) if name.startswith("py:")), "")
        counted[f"{inner}  <  {outer}" if inner.startswith("c:") else inner] += 1
    return counted


def _inner(args: argparse.Namespace) -> None:
    world = bench_scale.lab_world(args.row)
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    processes = mp.start_processes(_group, args=(world, ports.free_port(), args.row, args.steps, args.where_dir,
                                                 results), nprocs=world, start_method="spawn", join=False)
    pids, marks = next_result(processes, results)
    processes.join(120)
    with open(args.marks, "w") as out:
        out.write(repr((pids, marks)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--where", action="store_true", help="where the driver's drops happen (slower)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--rank", type=int, default=0, help="whose drops --where places (0: the driver)")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--marks", help=argparse.SUPPRESS)
    parser.add_argument("--where-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        _inner(args)
        return
    if shutil.which("perf") is None or os.geteuid() != 0:
        sys.exit("gil_drops.py needs Linux's perf (linux-perf / linux-tools), run as root")
    library = os.path.join(sysconfig.get_config_var("LIBDIR") or "", sysconfig.get_config_var("LDLIBRARY") or "")
    if not os.path.exists(library):
        sys.exit(f"gil_drops.py needs a shared libpython ({library} is missing)")
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True).stdout
    added = EVENT not in listed  # (one that was there stays)
    if added:
        subprocess.run(["perf", "probe", "-q", "-x", library, "--add", "probe_libpython:drop_gil=drop_gil"],
                       check=True, capture_output=True)
    with tempfile.TemporaryDirectory() as scratch:
        data, marks = os.path.join(scratch, "perf.data"), os.path.join(scratch, "marks")
        inner = [sys.executable, os.path.abspath(__file__), args.row, "--steps", str(args.steps), "--inner",
                 "--marks", marks]
        if args.where:
            inner += ["--where-dir", scratch]
        subprocess.run(["perf", "record", "-q", "-k", "mono", "-e", EVENT, "-o", data, "--", *inner], check=True)
        with open(marks) as source:
            pids, moments = eval(source.read())  # (our own file: a repr of ints)
        drops = _drops(data)
        first, second = (moments[0], moments[1]), (moments[2], moments[3])
        print(f"{args.row}: GIL drops per step (spin off, {args.steps} steps; the second window less the first)")
        for rank, pid in enumerate([pids[-1]] + pids[:-1]):
            times = [moment for moment, _ in drops.get(pid, [])]
            count = [bisect.bisect_left(times, end) - bisect.bisect_left(times, start) for start, end in (first, second)]
            print(f"  worker{rank}: {(count[1] - count[0]) / args.steps:7.1f}")
        if args.where:
            pid = pids[-1] if args.rank == 0 else pids[args.rank - 1]
            with open(os.path.join(scratch, str(pid)), "rb") as source:
                events = pickle.load(source)
            counted = _where(events, drops.get(pid, []), *first)
            print(f"worker{args.rank}'s drops by where they happened, per step (first window, {args.steps} steps, profiled):")
            for name, count in counted.most_common(args.top):
                print(f"  {count / args.steps:7.2f}  {name}")
    if added:
        subprocess.run(["perf", "probe", "-q", "-d", EVENT], capture_output=True)


if __name__ == "__main__":
    main()
