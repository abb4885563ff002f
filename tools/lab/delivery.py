"""How long messages wait between processes: the delivery delay of every message of a
distributed autograd step, link by link.

    python3 tools/delivery.py              # the one-hop step of tools/bench.py (2 processes)
    python3 tools/delivery.py --pipeline   # its 4-stage pipeline step (4 processes)

A step's time is work on some process plus messages waiting to be read. Every process notes,
on the monotonic clock they all share, when it published a message in a peer's
shared-memory ring (transport/shm.py), with whether a thread of that peer was spinning then
(else the writer rang the peer's doorbell: nobody was looking, the reader was asleep or
busy), and when one of its own threads read a peer's ring. A read takes everything published
before it; its delay counts from the earliest of those writes. The table gives, per link,
reader state and reading thread, the number of reads, the median and 90th percentile delay,
and below it the delay per step in all. On the nested guest of docs/performance.md
("22e8ca1.."), a spinning reader took its message after a median 8-30 us, a sleeping one
after 115-280 us, and a 4-stage pipeline step spent ~1.2 ms of its 6-10 ms waiting for
delivery, a one-hop step 60 us of 1.5 ms.

Peers on one host only (the rings; the default there). It wraps the endpoint's private ring
functions in each process before ``init_rpc``: tests/system/test_tools.py runs it, so a rename
shows there.
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import sys
import threading
import time
import warnings
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tools import ports  # noqa: E402
from tools.lab import next_result  # noqa: E402

# This process's trace, filled by the wrapped ring functions (``_install``).
_writes: list = []  # (ns, receiver, whether a thread of the receiver was spinning)
_reads: list = []  # (ns, sender, the reading thread's name)


def _install() -> None:
    """Wrap the endpoint's ring write and ring read with timestamps (before ``init_rpc``)."""
    from zmqautograd.transport import endpoint

    ring_written = endpoint.Endpoint._ring_written  # a staticmethod, looked up as its function
    read_ring = endpoint.Endpoint._read_ring

    def traced_ring_written(record):
        _writes.append((time.perf_counter_ns(), record.name, record.peer_flags.spinning()))
        return ring_written(record)

    def traced_read_ring(self, record):
        _reads.append((time.perf_counter_ns(), record.name, threading.current_thread().name))
        return read_ring(self, record)

    endpoint.Endpoint._ring_written = staticmethod(traced_ring_written)
    endpoint.Endpoint._read_ring = traced_read_ring


def _clear() -> None:
    _writes.clear()
    _reads.clear()


def _take() -> tuple[list, list]:
    return list(_writes), list(_reads)


def delays(traces: dict[str, tuple[list, list]], start: int, end: int) -> dict[tuple, list[float]]:
    """The delay of each read between ``start`` and ``end`` (ns), in us, keyed by (sender,
    receiver, "spinning" or "asleep", "waiting thread" or "I/O thread"). ``traces`` maps each
    process's endpoint name to its (writes, reads)."""
    sent = defaultdict(list)  # (sender, receiver) -> [(ns, spinning)], in time order
    for sender, (writes, _) in traces.items():
        for at, receiver, spinning in writes:
            sent[(sender, receiver)].append((at, spinning))
    for link in sent.values():
        link.sort()
    found: dict[tuple, list[float]] = defaultdict(list)
    for receiver, (_, reads) in traces.items():
        previous: dict[str, int] = {}  # per sender: its ring's previous read here
        for at, sender, thread in sorted(reads):
            link = sent.get((sender, receiver), [])
            after = previous.get(sender, start)
            previous[sender] = at
            if not start <= at <= end:
                continue
            first = bisect.bisect_right(link, (after, True))  # the earliest write after the last read
            if first == len(link) or link[first][0] > at:
                continue  # nothing new (a look that found a part of a message, say)
            written, spinning = link[first]
            reader = "I/O thread" if thread.startswith("zmq-io") else "waiting thread"
            found[(sender, receiver, "spinning" if spinning else "asleep", reader)].append((at - written) / 1000)
    return found


def table(found: dict[tuple, list[float]], steps: int, step_us: float) -> str:
    """The printed table (``delays``' result over ``steps`` steps of ``step_us`` each)."""
    lines = [f"{'link':<22}{'reader':<10}{'read by':<16}{'reads':>7}{'median':>11}{'p90':>11}"]
    for (sender, receiver, state, reader), values in sorted(found.items()):
        values = sorted(values)
        p90 = values[min(len(values) - 1, len(values) * 9 // 10)]
        lines.append(f"{f'worker{sender} -> worker{receiver}':<22}{state:<10}{reader:<16}{len(values):>7}"
                     f"{statistics.median(values):>8,.1f} us{p90:>8,.1f} us")
    waited = sum(sum(values) for values in found.values()) / steps
    lines.append(f"in all: {waited:,.0f} us a step waiting for delivery ({waited / step_us:.0%} of a step)")
    return "\n".join(lines)


def _run(rank: int, world: int, port: int, steps: int, warmup: int, results) -> None:
    warnings.filterwarnings("ignore")  # torch's numpy and c10d chatter (tools/bench.py's import)
    torch.set_num_threads(1)
    _install()
    import zmqautograd.autograd as autograd
    import zmqautograd.rpc as rpc
    from tools.bench import one_hop_backward, pipeline_step

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    try:
        if rank == 0:
            step = pipeline_step if world == 4 else one_hop_backward
            step(rpc, autograd, warmup)
            for peer in range(1, world):
                rpc.rpc_sync(f"worker{peer}", _clear)
            _clear()
            start = time.perf_counter_ns()
            seconds = step(rpc, autograd, steps)
            end = time.perf_counter_ns()
            traces = {"0": _take()}
            for peer in range(1, world):
                traces[str(peer)] = rpc.rpc_sync(f"worker{peer}", _take)
            results.put((seconds, start, end, traces))
    finally:
        rpc.shutdown()


def measure(pipeline: bool, steps: int, warmup: int = 100) -> tuple[float, dict[tuple, list[float]]]:
    """Run ``steps`` steps after ``warmup``; the mean step in us and ``delays``' result."""
    port = ports.free_port()
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    world = 4 if pipeline else 2
    processes = mp.start_processes(_run, args=(world, port, steps, warmup, results), nprocs=world,
                                   start_method="spawn", join=False)
    # Read while they run: rank 0 blocks on a full pipe until its traces are read.
    seconds, start, end, traces = next_result(processes, results)
    while not processes.join():
        pass
    return seconds * 1e6, delays(traces, start, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", action="store_true", help="the 4-stage pipeline step instead of one hop")
    parser.add_argument("--steps", type=int, default=None, help="steps measured (default: 300 pipeline, 1,000 one hop)")
    args = parser.parse_args()
    steps = args.steps or (300 if args.pipeline else 1000)
    step_us, found = measure(args.pipeline, steps)
    what = "4-stage pipeline steps (4 processes)" if args.pipeline else "one-hop steps (2 processes)"
    print(f"delivery of each message, {steps} {what}, torch.set_num_threads(1); a step took {step_us:,.0f} us")
    print(table(found, steps, step_us))


if __name__ == "__main__":
    main()
