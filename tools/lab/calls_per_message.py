"""How many function calls a step makes, process by process, and per message: one row of
tools/bench_scale.py (zmqautograd) with a profile function (``sys.setprofile``, on every
thread) counting each Python function called and each builtin called from Python.

It counts calls, not time: the machine's noise does not move it, and it names what a
message's Python is made of (where callgrind sees only the interpreter). ``--opcodes`` also
counts the bytecodes each function executed (``sys.settrace`` with opcode events), which is
what the interpreter's instructions follow. Waiting is switched to sleeping (``spin=0``, no
busy polling): a spinning thread calls functions for as long as it waits. What is left
varies a little from run to run (whether an answer came before its waiter slept, say).

The counts of a window of N steps include the control calls that read them. Two windows,
of N and 2N steps, are read; their difference is N steps (the control calls are the same in
both).

    python tools/lab/calls_per_message.py one-hop|threads:N|fan-out:N|chain:N [--steps 200] [--top 25] [--by function|module]
        [--opcodes] [--zmq heartbeat_interval=50 --zmq peer_timeout=100 ...]

``--by line`` (with ``--opcodes``) lists bytecodes by source line: where within a function
they go. It measures the checkout it is in: to measure another tree, run that tree's copy.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.multiprocessing as mp  # noqa: E402

from tools import bench_scale, ports  # noqa: E402
from tools.lab import next_result  # noqa: E402

# Counted once per message: what "per message" divides by.
RECEIVED = "transport/io_loop.py:IoThread._handle_incoming"
SENT = "transport/endpoint.py:Endpoint._enqueue"


class _Counts:
    """Calls counted in this process: Python functions by code object, builtins by name; or,
    with ``opcodes``, the bytecodes each Python function executed."""

    def __init__(self) -> None:
        self.on = False
        self.python: collections.Counter = collections.Counter()
        self.builtin: collections.Counter = collections.Counter()
        self.opcodes: collections.Counter = collections.Counter()
        self.lines = False  # count opcodes by (code, line) instead of by code

    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on:
            return
        if event == "call":
            self.python[frame.f_code] += 1
        elif event == "c_call":
            self.builtin[getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")] += 1

    def trace(self, frame: Any, event: str, arg: Any) -> Any:
        """A trace function (``sys.settrace``) that counts each function's bytecodes."""
        if not self.on:
            return None
        frame.f_trace_opcodes = True
        return self._trace_opcodes

    def _trace_opcodes(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and self.on:
            self.opcodes[(frame.f_code, frame.f_lineno) if self.lines else frame.f_code] += 1
        return self._trace_opcodes

    def snapshot(self) -> dict[str, int]:
        """The counts so far, by readable name (``builtin:`` for builtins)."""
        found: collections.Counter = collections.Counter()
        for code, count in list(self.python.items()):
            found[function_name(code.co_filename, code.co_qualname)] += count
        for name, count in list(self.builtin.items()):
            found["builtin:" + name] += count
        for key, count in list(self.opcodes.items()):
            if self.lines:
                code, line = key
                found["opcodes:" + function_name(code.co_filename, f"{line} {code.co_qualname}")] += count
            else:
                found["opcodes:" + function_name(key.co_filename, key.co_qualname)] += count
        return dict(found)


_counts = _Counts()


def function_name(filename: str, qualname: str) -> str:
    """``path:qualname``, the path relative to the repository (or the library's folder)."""
    path = filename
    for prefix in (os.path.join(ROOT, "zmqautograd") + os.sep, ROOT + os.sep):
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    else:
        if "site-packages" + os.sep in path:
            path = path.split("site-packages" + os.sep, 1)[1]
        elif "python3" in path:
            path = "stdlib/" + os.path.basename(path)
    return f"{path}:{qualname}"


def module_of(name: str) -> str:
    if name.startswith("builtin:"):
        return "builtins"
    return name.removeprefix("opcodes:").rsplit(":", 1)[0]


def _start() -> None:
    _counts.on = True


def _snapshot() -> dict[str, int]:
    _counts.on = False  # reading them is not counted (it takes longer as more names come up)
    try:
        return _counts.snapshot()
    finally:
        _counts.on = True


def steps_of(first: dict[str, int], second: dict[str, int], third: dict[str, int]) -> dict[str, int]:
    """The calls of N steps from snapshots before, after N and after 2N more steps: the
    second window less the first (each holds the same control calls)."""
    names = set(first) | set(second) | set(third)
    found = {}
    for name in names:
        count = (third.get(name, 0) - second.get(name, 0)) - (second.get(name, 0) - first.get(name, 0))
        if count:
            found[name] = count
    return found


def summary(counts: dict[str, int], steps: int) -> dict[str, float]:
    """Per step: Python calls, builtin calls, bytecodes (with ``--opcodes``), messages
    received and sent (``RECEIVED``, ``SENT``)."""
    found = {"python": 0.0, "builtin": 0.0, "opcodes": 0.0}
    for name, count in counts.items():
        kind = name.split(":", 1)[0]
        found[kind if kind in ("builtin", "opcodes") else "python"] += count / steps
    return {**found, "received": counts.get(RECEIVED, 0) / steps, "sent": counts.get(SENT, 0) / steps}


def _run_steps(step, count: int, threads: int) -> None:
    """``count`` steps, spread over ``threads`` driver threads running at once (threads:N)."""

    def run(share: int) -> None:
        for _ in range(share):
            step()

    if threads == 1:
        run(count)
        return
    workers = [threading.Thread(target=run, args=(count // threads + (i < count % threads),)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def _group(rank: int, world: int, port: int, row: str, steps: int, opcodes: bool, results, zmq_options: dict,
           lines: bool = False) -> None:
    _counts.lines = lines
    # Every thread the group starts from here on is counted (the endpoint's, the pool's).
    sys.setprofile(_counts.profile)
    threading.setprofile(_counts.profile)
    if opcodes:
        sys.settrace(_counts.trace)
        threading.settrace(_counts.trace)
    bench_scale.ZMQ_OPTIONS.update({"spin": 0.0, "busy_poll": 0.0, **zmq_options})
    rpc, autograd = bench_scale._join(rank, world, "zmq", port)
    if rank == 0:
        step, threads, others = bench_scale.lab_row(row, rpc, autograd, world)
        for _ in range(20):
            step()
        for w in others:
            rpc.rpc_sync(w, _start)
        _start()
        snapshots = []
        for count in (0, steps, 2 * steps):  # steps before each snapshot
            _run_steps(step, count, threads)
            snapshots.append([_snapshot()] + [rpc.rpc_sync(w, _snapshot) for w in others])
        results.put([steps_of(*window) for window in zip(*snapshots)])
    rpc.shutdown()
    sys.setprofile(None)
    sys.settrace(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row", help="one-hop, threads:N (one-hop steps from N driver threads at once), "
                                    "fan-out:N (world N) or chain:N (N processes)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--top", type=int, default=25, help="functions (or modules) shown per process")
    parser.add_argument("--by", choices=["function", "module", "line"], default="function",
                        help="line: bytecodes by source line (implies --opcodes)")
    parser.add_argument("--opcodes", action="store_true",
                        help="also count the bytecodes each function executed (slower): what the interpreter's share of "
                             "the instructions follows; the top list then shows those")
    parser.add_argument("--zmq", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZmqRpcBackendOptions field for every process (heartbeat_interval=50 with "
                             "peer_timeout=100, which must exceed it: heartbeats practically off, which a traced "
                             "step, far slower than a real one, would inflate)")
    args = parser.parse_args()
    zmq_options = bench_scale.parse_options(args.zmq)
    if args.by == "line":
        args.opcodes = True
    world = bench_scale.lab_world(args.row)
    results = mp.get_context("spawn").SimpleQueue()
    group = mp.start_processes(_group, args=(world, ports.free_port(), args.row, args.steps, args.opcodes, results, zmq_options,
                                                   args.by == "line"),
                               nprocs=world, start_method="spawn", join=False)
    # Read before joining: the counts may not fit the pipe, and the driver waits until they are read.
    per_process = next_result(group, results)
    while not group.join():
        pass
    listed = "bytecodes" if args.opcodes else "calls"
    print(f"{args.row}: calls per step by process, {listed} by {args.by} (spin off, {args.steps} steps; "
          f"zmqautograd from {ROOT})")
    for rank, counts in enumerate(per_process):
        totals = summary(counts, args.steps)
        messages = totals["received"] + totals["sent"]
        per_message = (f"; per message (in or out) {totals['python'] / messages:.0f} Python, "
                       f"{totals['builtin'] / messages:.0f} builtin" if messages else "")
        opcodes = (f"; {totals['opcodes']:.0f} bytecodes ({totals['opcodes'] / messages:.0f} per message)"
                   if args.opcodes and messages else "")
        print(f"  worker{rank}: {totals['python']:.0f} Python calls, {totals['builtin']:.0f} builtin calls; "
              f"{totals['received']:.2f} messages in, {totals['sent']:.2f} out{per_message}{opcodes}")
        grouped: collections.Counter = collections.Counter()
        for name, count in counts.items():
            if args.opcodes == name.startswith("opcodes:"):
                grouped[module_of(name) if args.by == "module" else name.removeprefix("opcodes:")] += count
        for name, count in grouped.most_common(args.top):
            print(f"    {count / args.steps:8.2f}  {name}")


if __name__ == "__main__":
    main()
