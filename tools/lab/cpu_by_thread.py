"""Where the CPU of a step goes, by process and by thread: one row of tools/bench_scale.py
(zmqautograd, or TensorPipe with ``--framework tp``), with each thread's CPU seconds (/proc/self/task/TID/stat, utime + stime)
read before and after the timed loop in every process, divided by the steps, the times
threads went to sleep per step (voluntary context switches), in all and by role, and how long
they were runnable but waited for a CPU (schedstat's run-queue delay). Threads are named by role: the driver's threads, the endpoint's I/O and dispatch threads, the pool, the
timers, libzmq's own (ZMQbg/...).

It measures the checkout it is in (it puts that first on ``sys.path``, as bench_scale does):
to measure another tree, run that tree's copy. The first line names the folder measured.

    python tools/lab/cpu_by_thread.py one-hop|threads:16|fan-out:16|chain:9 [--steps 200] [--framework tp]
                                      [--zmq heartbeat_interval=50 --zmq peer_timeout=100 ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch.multiprocessing as mp  # noqa: E402

from tools import bench_scale, ports  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _role(name: str) -> str:
    """A thread's role from its Python or kernel name."""
    for pattern, role in ((r"^MainThread$", "main"), (r"^driver-", "driver threads"), (r"^zmq-io-", "endpoint I/O"),
                          (r"^zmq-dispatch-", "endpoint dispatch"), (r"watchdog$", "pool watchdog"),
                          (r"^rpc-", "pool"), (r"timers", "timers"), (r"^ZMQbg", "libzmq"),
                          (r"^rref-release", "rref release")):
        if re.search(pattern, name):
            return role
    return name


def cpu_by_role(skip: frozenset[int] = frozenset()) -> dict[str, float]:
    """CPU seconds used so far by each role of thread in this process (live threads; the
    caller compares two readings), and under "sleeps" the times its threads went to sleep
    (voluntary context switches: each is a wake-up later)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[str, float] = collections.defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in skip:
            continue  # an ended driver thread on its way out (counted by itself)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
            queued = _queued_seconds(f"/proc/self/task/{tid}/schedstat")
        except OSError:
            continue  # it ended meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = (int(fields[11]) + int(fields[12])) / _TICK
        role = _role(names.get(int(tid), comm))
        found[role] += seconds
        slept = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
        found["sleeps"] += slept
        found["sleeps of " + role] += slept
        found["queued"] += queued
        found["queued of " + role] += queued
    return dict(found)


def _queued_seconds(path: str) -> float:
    """Seconds a thread has spent runnable but waiting for a CPU (the second field of its
    schedstat: run-queue delay)."""
    with open(path) as f:
        return int(f.read().split()[1]) / 1e9


def _group(rank: int, world: int, port: int, row: str, steps: int, framework: str, results, zmq_options: dict) -> None:
    bench_scale.ZMQ_OPTIONS.update(zmq_options)  # (a spawned process starts without them)
    rpc, autograd = bench_scale._join(rank, world, framework, port)
    if rank == 0:
        step, threads, others = bench_scale.lab_row(row, rpc, autograd, world)

        ended: list[float] = []  # CPU of driver threads, read by each as it ends (then /proc forgets it)
        slept: list[int] = []  # and their sleeps
        queued: list[float] = []  # and their waits for a CPU

        def steps_on_thread(count: int) -> None:
            start, sleeps = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            waited = _queued_seconds("/proc/thread-self/schedstat")
            steps_loop(count)
            ended.append(time.thread_time() - start)
            slept.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - sleeps)
            queued.append(_queued_seconds("/proc/thread-self/schedstat") - waited)

        def steps_loop(count: int) -> None:
            for _ in range(count):
                step()

        steps_loop(20)
        before = [cpu_by_role()] + [rpc.rpc_sync(w, cpu_by_role) for w in others]
        start = time.perf_counter()
        count = max(1, steps // threads)
        workers = [threading.Thread(target=steps_on_thread, args=(count,), name=f"driver-{i}") for i in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        elapsed = time.perf_counter() - start
        after = [cpu_by_role(frozenset(t.native_id for t in workers if t.native_id is not None))] + [
            rpc.rpc_sync(w, cpu_by_role) for w in others]
        total = count * threads
        per_process = []
        for b, a in zip(before, after):
            per_process.append({role: (a[role] - b.get(role, 0.0)) / total for role in a})
        per_process[0]["driver threads"] = sum(ended) / total
        per_process[0]["sleeps"] += sum(slept) / total
        per_process[0]["sleeps of driver threads"] = sum(slept) / total
        per_process[0]["queued"] += sum(queued) / total
        per_process[0]["queued of driver threads"] = sum(queued) / total
        results.put((elapsed / total, per_process))
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("row", help="one-hop, threads:N, fan-out:N (world N) or chain:N (N processes)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--framework", choices=["zmq", "tp"], default="zmq", help="tp: TensorPipe, for comparison")
    parser.add_argument("--zmq", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZmqRpcBackendOptions field (numbers), e.g. heartbeat_interval=50 with "
                             "peer_timeout=100 (which must exceed it)")
    args = parser.parse_args()
    zmq_options = bench_scale.parse_options(args.zmq)
    world = bench_scale.lab_world(args.row)
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_group, args=(world, ports.free_port(), args.row, args.steps, args.framework, results, zmq_options),
                       nprocs=world, start_method="spawn")
    seconds, per_process = results.get()
    print(f"{args.row}: {seconds * 1e6:.0f} us per step; CPU per step by process and thread role (ms); "
          f"zmqautograd from {ROOT}")
    totals: dict[str, float] = collections.defaultdict(float)
    for rank, roles in enumerate(per_process):
        sleeps = roles.pop("sleeps", 0.0)
        by_role = {role.removeprefix("sleeps of "): roles.pop(role) for role in list(roles) if role.startswith("sleeps of ")}
        queued = roles.pop("queued", 0.0)
        queued_by_role = {role.removeprefix("queued of "): roles.pop(role) for role in list(roles)
                          if role.startswith("queued of ")}
        shown = ", ".join(f"{role} {ms * 1e3:.2f}" for role, ms in sorted(roles.items(), key=lambda kv: -kv[1]) if ms > 0)
        slept = ", ".join(f"{role} {n:.1f}" for role, n in sorted(by_role.items(), key=lambda kv: -kv[1]) if n >= 0.05)
        print(f"  worker{rank}: {sum(roles.values()) * 1e3:.2f}  ({shown}); {sleeps:.1f} sleeps per step ({slept})")
        waited = ", ".join(f"{role} {s * 1e3:.2f}" for role, s in sorted(queued_by_role.items(), key=lambda kv: -kv[1])
                           if s >= 5e-5)
        print(f"           runnable, waiting for a CPU: {queued * 1e3:.2f} ({waited})")
        for role, ms in roles.items():
            totals[role] += ms
        totals["sleeps"] += sleeps
        totals["queued"] += queued
    sleeps = totals.pop("sleeps")
    queued = totals.pop("queued")
    print(f"  all: {sum(totals.values()) * 1e3:.2f}  (" + ", ".join(
        f"{role} {ms * 1e3:.2f}" for role, ms in sorted(totals.items(), key=lambda kv: -kv[1]) if ms > 0)
        + f"); {sleeps:.1f} sleeps per step; {queued * 1e3:.2f} ms runnable, waiting for a CPU")


if __name__ == "__main__":
    main()
