"""A/B of two source trees in one run: the one-hop step, a small ``rpc_sync``, a small
``rpc_async`` waited on at once and a batch of 64 (``wait_all``), or rows
of tools/bench_scale.py (``--rows``).

For a change that moves code rather than patching one switch (``ab_inlaunch.py`` flips a
switch inside one launch), this runs both trees, launch by launch alternately (A B B A ...),
each launch fresh processes on loopback TCP. It reports per operation the median wall time
per step and the CPU seconds per step summed over the processes (less noisy on a shared VM
than wall time), and the ratios B/A: of the medians, and the median of each launch's B paired
with the A launch beside it (drift of the machine cancels), with that ratio's quartiles and
how many pairs B won. Where the quartiles straddle 1, the change is within the noise.

    python tools/lab/ab_trees.py TREE_A TREE_B [--launches 8] [--steps 2000]
    python tools/lab/ab_trees.py TREE_A TREE_B --rows one-hop,threads:4,threads:16 [--launches 16] [--steps 400]

A tree is a checkout of this repository (``git worktree add``) whose ``zmqautograd/transport``
resolves (a symlink to ``../transport``), run with ``PYTHONPATH`` set to it. ``--rows`` takes
the tools/lab rows (one-hop, threads:N, fan-out:N, chain:N), each run by that tree's
tools/bench_scale.py as its table would (zmqautograd only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OPERATIONS = ("hop", "rpc_small", "async_small", "async_64")
BATCHED = {"async_64": 16}  # operation: fewer steps by this factor (each is a batch)


def _add(a, b):
    return a + b


def _process_seconds() -> float:
    return time.process_time()


def _worker(rank: int, port: int, steps: int, queue) -> None:
    import torch

    import zmqautograd.autograd as dist_autograd
    import zmqautograd.rpc as rpc

    torch.set_num_threads(1)
    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        x = torch.ones(16, requires_grad=True)
        small = torch.ones(4)
        results = {}
        for name in OPERATIONS:
            count = steps // BATCHED.get(name, 1)
            for _ in range(count // 10):  # warm up
                _step(name, rpc, dist_autograd, x, small)
            peer = rpc.rpc_sync("w1", _process_seconds)
            cpu, start = time.process_time(), time.perf_counter()
            for _ in range(count):
                _step(name, rpc, dist_autograd, x, small)
            wall = time.perf_counter() - start
            cpu = time.process_time() - cpu + rpc.rpc_sync("w1", _process_seconds) - peer
            results[name] = (wall / count, cpu / count)
        queue.put(results)
    rpc.shutdown()


def _step(name, rpc, dist_autograd, x, small) -> None:
    import torch

    if name == "hop":
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("w1", _add, args=(x, x))
            dist_autograd.backward(context_id, [y.sum()])
    elif name == "rpc_small":
        rpc.rpc_sync("w1", _add, args=(small, small))
    elif name == "async_small":
        rpc.rpc_async("w1", _add, args=(small, small)).wait()
    else:  # 64 in flight, as tools/bench.py's throughput
        torch.futures.wait_all([rpc.rpc_async("w1", _add, args=(small, small)) for _ in range(64)])


_BENCH_KINDS = {"one-hop": "one hop", "threads": "threads", "fan-out": "fan-out", "chain": "chain"}


def bench_rows(spec: str) -> dict[int, list[tuple[str, int]]]:
    """tools/lab rows ("one-hop,threads:4,fan-out:8") as tools/bench_scale.py's rows, by the
    processes each needs."""
    by_world: dict[int, list[tuple[str, int]]] = {}
    for row in spec.split(","):
        kind, _, value = row.partition(":")
        if kind not in _BENCH_KINDS or (kind != "one-hop") != bool(value) or (value and not value.isdigit()):
            raise ValueError(f"{row!r} is not a row (one-hop, threads:N, fan-out:N, chain:N)")
        world = int(value) if kind in ("fan-out", "chain") else 2
        by_world.setdefault(world, []).append((_BENCH_KINDS[kind], int(value) if value else 1))
    return by_world


def row_name(row: tuple[str, int]) -> str:
    """How a bench_scale row is named in a launch's results and the report."""
    return f"{row[0]}:{row[1]}"


def _launch_rows(spec: str, steps: int) -> None:
    """One launch of ``--rows``, with this tree's tools/bench_scale.py (on PYTHONPATH)."""
    from tools import bench_scale

    results = {}
    for world, rows in bench_rows(spec).items():
        found = bench_scale.launch(world, "zmq", steps, rows)
        results.update({row_name(row): found[row] for row in rows})
    print(json.dumps(results))


def paired(a: list[float], b: list[float]) -> tuple[float, float, float, int]:
    """Launch i of B against launch i of A (run side by side): the median of the ratios B/A,
    its lower and upper quartiles, and in how many pairs B was lower."""
    ratios = sorted(y / x for x, y in zip(a, b))
    n = len(ratios)
    return statistics.median(ratios), ratios[n // 4], ratios[3 * n // 4], sum(r < 1 for r in ratios)


def report(samples_a: dict[str, list], samples_b: dict[str, list]) -> None:
    """Per operation: medians of A and B (wall time and CPU per step), their ratio, and the
    paired ratios (see :func:`paired`)."""
    print(f"{'operation':<12} {'A wall us':>10} {'B wall us':>10} {'B/A':>6} {'paired (quartiles)':>22} "
          f"{'B won':>7}   {'A cpu us':>10} {'B cpu us':>10} {'B/A':>6} {'paired':>7}")
    for name in samples_a:
        a, b = samples_a[name], samples_b[name]
        wa, wb = (statistics.median(s[0] for s in x) * 1e6 for x in (a, b))
        ca, cb = (statistics.median(s[1] for s in x) * 1e6 for x in (a, b))
        wall, low, high, won = paired([s[0] for s in a], [s[0] for s in b])
        cpu = paired([s[1] for s in a], [s[1] for s in b])[0]
        print(f"{name:<12} {wa:>10.1f} {wb:>10.1f} {wb / wa:>6.3f} {wall:>7.3f} ({low:.3f}-{high:.3f}) "
              f"{won:>3}/{len(a):<3}   {ca:>10.1f} {cb:>10.1f} {cb / ca:>6.3f} {cpu:>7.3f}")


def _launch(steps: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, port, steps, queue)) for rank in (0, 1)]
    for process in processes:
        process.start()
    print(json.dumps(queue.get(timeout=600)))
    for process in processes:
        process.join(60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--launches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=None, help="steps a launch (2000; with --rows 400)")
    parser.add_argument("--rows", help="tools/bench_scale.py rows instead: one-hop,threads:N,fan-out:N,chain:N")
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (400 if args.rows else 2000)
    if args.rows:
        try:
            names = [row_name(row) for rows in bench_rows(args.rows).values() for row in rows]
        except ValueError as exc:
            parser.error(str(exc))
    else:
        names = list(OPERATIONS)
    if args.one_launch:
        if args.rows:
            _launch_rows(args.rows, steps)
        else:
            _launch(steps)
        return 0
    if len(args.trees) != 2:
        parser.error("give two trees")
    trees = dict(zip("AB", args.trees))
    samples: dict = {label: {name: [] for name in names} for label in trees}  # (the trees may be one)
    here = os.path.abspath(__file__)
    for launch in range(args.launches):
        for label in ("A", "B") if launch % 2 == 0 else ("B", "A"):
            tree = trees[label]
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            command = [sys.executable, here, "--one-launch", "--steps", str(steps)]
            out = subprocess.run(command + (["--rows", args.rows] if args.rows else []),
                                 env=env, cwd=tree, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                print(f"ab_trees: a launch of {tree} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
                return 1
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for name in names:
                samples[label][name].append(result[name])
        print(f"launch {launch + 1}/{args.launches} done", flush=True)
    print(f"A = {trees['A']}, B = {trees['B']}; {args.launches} launches each, {steps} steps")
    report(samples["A"], samples["B"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
