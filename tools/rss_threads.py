"""Bounded memory under load: 16 driver threads issue calls as fast as they can for 30 s
(each thread: a dist autograd one-hop step, then an ``rpc_async`` it waits for, in turn),
while the resident memory (RSS) of both processes is read every few seconds. Prints RSS
after the warm-up, its growth per 10 s over the run, and the calls made.

    python tools/rss_threads.py [--threads 16] [--seconds 30] [--warmup 5]

Exits non-zero if a call fails or a thread hangs.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tools import bench_scale, ports  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drive(rpc, autograd, seconds: float, threads: int, samples: list, counts: list, errors: list) -> None:
    x = torch.randn(4, bench_scale.WIDTH, requires_grad=True)
    stop = time.monotonic() + seconds

    def run(index: int) -> None:
        try:
            while time.monotonic() < stop:
                bench_scale.one_hop_step(rpc, autograd, x)
                rpc.rpc_async("worker1", torch.add, args=(x.detach(), 1)).wait()
                counts[index] += 2
        except BaseException as exc:  # noqa: BLE001 - reported by the driver
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    while time.monotonic() < stop and not errors:
        samples.append((rss_bytes(), rpc.rpc_sync("worker1", rss_bytes)))
        time.sleep(min(2.0, max(0.0, stop - time.monotonic())))  # the sampling period
    for t in workers:
        t.join(max(0.0, stop + 60 - time.monotonic()))
        if t.is_alive():
            errors.append(TimeoutError("a driver thread hung: still running 60 s after the end"))
            return
    samples.append((rss_bytes(), rpc.rpc_sync("worker1", rss_bytes)))


def group_main(rank: int, port: int, threads: int, seconds: float, warmup: float, results) -> None:
    rpc, autograd = bench_scale._join(rank, 2, "zmq", port)
    if rank == 0:
        errors: list = []
        _drive(rpc, autograd, warmup, threads, [], [0] * threads, errors)
        samples: list = []
        counts = [0] * threads
        if not errors:
            _drive(rpc, autograd, seconds, threads, samples, counts, errors)
        results.put((samples, sum(counts), [repr(e) for e in errors]))
    rpc.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--trace", action="store_true", help="print every sample (one every 2 s)")
    args = parser.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(group_main, args=(ports.free_port(), args.threads, args.seconds, args.warmup, results),
                       nprocs=2, start_method="spawn")
    samples, calls, errors = results.get()
    mib = 1 << 20
    first, last = samples[0], samples[-1]
    print(f"{args.threads} threads, {args.seconds:.0f} s after {args.warmup:.0f} s of warm-up: {calls} calls "
          f"({calls / args.seconds:.0f}/s)")
    if args.trace:
        print("  samples (MiB, driver/worker): " + " ".join(f"{d / mib:.1f}/{w / mib:.1f}" for d, w in samples))
    for name, i in (("driver", 0), ("worker", 1)):
        peak = max(s[i] for s in samples)
        print(f"  {name}: RSS {first[i] / mib:.1f} MiB -> {last[i] / mib:.1f} MiB (peak {peak / mib:.1f} MiB), "
              f"{(last[i] - first[i]) / mib / args.seconds * 10:+.2f} MiB per 10 s")
    for error in errors:
        print("  error:", error)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
