"""A/B of two source trees in one run: the one-hop step and a small ``rpc_sync``.

For a change that moves code rather than patching one switch (``ab_inlaunch.py`` flips a
switch inside one launch), this runs both trees, launch by launch alternately (A B B A ...),
each launch two fresh processes on loopback TCP. It reports per operation the median wall time
per step and the CPU seconds per step summed over both processes (less noisy on a shared VM
than wall time), and the ratios B/A.

    python tools/lab/ab_trees.py TREE_A TREE_B [--launches 8] [--steps 2000]

A tree is a checkout of this repository (``git worktree add``) whose ``zmqautograd/transport``
resolves (a symlink to ``../transport``), run with ``PYTHONPATH`` set to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

OPERATIONS = ("hop", "rpc_small")


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
            for _ in range(steps // 10):  # warm up
                _step(name, rpc, dist_autograd, x, small)
            peer = rpc.rpc_sync("w1", _process_seconds)
            cpu, start = time.process_time(), time.perf_counter()
            for _ in range(steps):
                _step(name, rpc, dist_autograd, x, small)
            wall = time.perf_counter() - start
            cpu = time.process_time() - cpu + rpc.rpc_sync("w1", _process_seconds) - peer
            results[name] = (wall / steps, cpu / steps)
        queue.put(results)
    rpc.shutdown()


def _step(name, rpc, dist_autograd, x, small) -> None:
    if name == "hop":
        with dist_autograd.context() as context_id:
            y = rpc.rpc_sync("w1", _add, args=(x, x))
            dist_autograd.backward(context_id, [y.sum()])
    else:
        rpc.rpc_sync("w1", _add, args=(small, small))


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
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_launch:
        _launch(args.steps)
        return 0
    if len(args.trees) != 2:
        parser.error("give two trees")
    samples: dict = {tree: {name: [] for name in OPERATIONS} for tree in args.trees}
    here = os.path.abspath(__file__)
    for launch in range(args.launches):
        order = args.trees if launch % 2 == 0 else args.trees[::-1]
        for tree in order:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            out = subprocess.run([sys.executable, here, "--one-launch", "--steps", str(args.steps)],
                                 env=env, cwd=tree, capture_output=True, text=True, timeout=900, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            for name in OPERATIONS:
                samples[tree][name].append(result[name])
        print(f"launch {launch + 1}/{args.launches} done", flush=True)
    a, b = args.trees
    print(f"{'operation':<10} {'A wall us':>10} {'B wall us':>10} {'B/A':>6} {'A cpu us':>10} {'B cpu us':>10} {'B/A':>6}")
    for name in OPERATIONS:
        wa = statistics.median(s[0] for s in samples[a][name]) * 1e6
        wb = statistics.median(s[0] for s in samples[b][name]) * 1e6
        ca = statistics.median(s[1] for s in samples[a][name]) * 1e6
        cb = statistics.median(s[1] for s in samples[b][name]) * 1e6
        print(f"{name:<10} {wa:>10.1f} {wb:>10.1f} {wb / wa:>6.3f} {ca:>10.1f} {cb:>10.1f} {cb / ca:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
