"""zmqautograd next to TensorPipe as the work grows: more workers, nested chains, concurrent
passes. Each framework runs alone in its own processes (one intra-op thread each), the two
taking turns launch by launch in one run; every row prints the time per step of both, their
ratio, and the CPU seconds per step summed over all processes of the group (each process's
``time.process_time()`` read before and after the timed loop), with its ratio.

Rows (every step is a distributed autograd step: forward, ``backward``, ``get_gradients``):

* ``one hop``: the driver calls one worker, world 2.
* ``fan-out N``: the driver calls its N-1 workers at once (``rpc_async``), sums, world N.
* ``chain N``: a nested chain through N-1 workers (each worker's function calls the next).
* ``T threads``: T driver threads each running one-hop steps at once, world 2 (per step:
  the run's time over all threads' steps).
* ``idle 16``: 16 workers that do nothing for 10 s: CPU seconds in total (per 10 s).

    python tools/bench_scale.py [--launches 2] [--steps 60] [--worlds 2,4,8,16] [--chain 8] [--threads 1,4,16]
                                [--no-idle] [--zmq spin=0 ...] [--ab spin_under_load=1 ...]

``--ab KEY=VALUE`` adds a third group to every launch, zmqautograd with these options (B),
and prints its figures and its ratios to the plain one (B/A): an A/B in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tools import ports  # noqa: E402
from tools.machine import kind_line  # noqa: E402

WIDTH = 16


ZMQ_OPTIONS: dict = {}  # --zmq key=value: more ZmqRpcBackendOptions, for every zmqautograd group
AB_OPTIONS: dict = {}  # --ab key=value: the options of group B, on top of ZMQ_OPTIONS


def parse_options(items: list[str]) -> dict[str, float]:
    """``KEY=VALUE`` arguments (--zmq, --ab) as ZmqRpcBackendOptions fields (numbers)."""
    return {key: float(value) for key, _, value in (item.partition("=") for item in items)}


def _join(rank: int, world: int, framework: str, port: int) -> tuple:
    torch.set_num_threads(1)
    if framework == "tp":
        import torch.distributed.autograd as autograd
        import torch.distributed.rpc as rpc

        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=16, rpc_timeout=120)
    else:
        import zmqautograd.autograd as autograd  # type: ignore[no-redef]
        import zmqautograd.rpc as rpc  # type: ignore[no-redef]

        # (``--zmq rpc_timeout=...`` replaces the 120 s: a backward pass's idle check is due then.)
        options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **{"rpc_timeout": 120, **ZMQ_OPTIONS})
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    return rpc, autograd


# ------------------------------------------------------------------ what workers run


def layer(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * 1.5)


def chain(x: torch.Tensor, rest: list[str]) -> torch.Tensor:
    """This worker's step of a nested chain: its layer, then the rest of the chain."""
    import torch.distributed.rpc as tp_rpc

    import zmqautograd.rpc as zmq_rpc

    y = layer(x)
    if not rest:
        return y
    rpc = zmq_rpc if zmq_rpc._is_initialized() else tp_rpc
    return rpc.rpc_sync(rest[0], chain, args=(y, rest[1:]))


def cpu_now() -> float:
    return time.process_time()


def cpu_of_group(rpc, others: list[str]) -> float:
    """CPU seconds used so far by this process and the workers ``others``, summed."""
    return time.process_time() + sum(rpc.rpc_sync(w, cpu_now) for w in others)


# ------------------------------------------------------------------------ the steps


def one_hop_step(rpc, autograd, x: torch.Tensor) -> None:
    with autograd.context() as context_id:
        y = rpc.rpc_sync("worker1", layer, args=(x,))
        autograd.backward(context_id, [y.sum()])
        autograd.get_gradients(context_id)


def fan_out_step(rpc, autograd, x: torch.Tensor, workers: list[str]) -> None:
    with autograd.context() as context_id:
        futures = [rpc.rpc_async(w, layer, args=(x,)) for w in workers]
        total = torch.stack([f.wait() for f in futures]).sum()
        autograd.backward(context_id, [total])
        autograd.get_gradients(context_id)


def chain_step(rpc, autograd, x: torch.Tensor, workers: list[str]) -> None:
    with autograd.context() as context_id:
        y = rpc.rpc_sync(workers[0], chain, args=(x, workers[1:]))
        autograd.backward(context_id, [y.sum()])
        autograd.get_gradients(context_id)


def lab_world(row: str) -> int:
    """The processes of a tools/lab row: N for fan-out:N and chain:N, else 2."""
    kind, _, value = row.partition(":")
    return int(value) if kind in ("fan-out", "chain") else 2


def steps_by_kind(rpc, autograd, x: torch.Tensor, others: list[str]) -> dict:
    """The driver's step of each kind of row, as a function of no arguments."""
    return {
        "one hop": lambda: one_hop_step(rpc, autograd, x),
        "fan-out": lambda: fan_out_step(rpc, autograd, x, others),
        "chain": lambda: chain_step(rpc, autograd, x, others),
    }


def lab_row(row: str, rpc, autograd, world: int) -> tuple:
    """A tools/lab row (one-hop, threads:N, fan-out:N, chain:N) on the driver: its step as a
    function, the driver threads that run it, and the other workers."""
    kind, _, value = row.partition(":")
    others = [f"worker{r}" for r in range(1, world)]
    steps = steps_by_kind(rpc, autograd, torch.randn(4, WIDTH, requires_grad=True), others)
    step = steps["one hop" if kind in ("one-hop", "threads") else kind]
    return step, int(value) if kind == "threads" else 1, others


def _timed(rpc, world: int, steps: int, step) -> tuple[float, float]:
    """Seconds per step, and CPU seconds per step summed over every process of the group."""
    others = [f"worker{r}" for r in range(1, world)]
    for _ in range(max(3, steps // 10)):
        step()
    cpu_before = cpu_of_group(rpc, others)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    cpu_after = cpu_of_group(rpc, others)
    return elapsed / steps, (cpu_after - cpu_before) / steps


def _timed_threads(rpc, autograd, x: torch.Tensor, world: int, threads: int, count: int) -> tuple[float, float]:
    """``threads`` long-lived driver threads each running ``count`` one-hop steps at once:
    seconds and CPU seconds (all processes) per step, over all their steps."""
    others = [f"worker{r}" for r in range(1, world)]
    for _ in range(3):
        one_hop_step(rpc, autograd, x)
    gate = threading.Barrier(threads + 1)
    errors: list = []

    def run() -> None:
        try:
            gate.wait(60)
            for _ in range(count):
                one_hop_step(rpc, autograd, x)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    cpu_before = cpu_of_group(rpc, others)
    start = time.perf_counter()
    gate.wait(60)
    for t in workers:
        t.join(300)
    elapsed = time.perf_counter() - start
    cpu_after = cpu_of_group(rpc, others)
    if errors:
        raise errors[0]
    return elapsed / (threads * count), (cpu_after - cpu_before) / (threads * count)


def group_main(rank: int, world: int, framework: str, port: int, steps: int, rows: list, results,
               zmq_options: dict) -> None:
    ZMQ_OPTIONS.update(zmq_options)
    rpc, autograd = _join(rank, world, framework, port)
    if rank == 0:
        x = torch.randn(4, WIDTH, requires_grad=True)
        found = {}
        others = [f"worker{r}" for r in range(1, world)]
        steps_of = steps_by_kind(rpc, autograd, x, others)
        for row in rows:
            kind, value = row
            if kind in steps_of:
                step = steps_of[kind]
                per, count = 1, steps if kind != "chain" else max(10, steps // 2)
            elif kind == "threads":
                found[row] = _timed_threads(rpc, autograd, x, world, value, max(10, steps // value * 2))
                continue
            elif kind == "idle":
                cpu_before = cpu_of_group(rpc, others)
                time.sleep(10)  # idle on purpose: what waiting workers cost is the measurement
                cpu_after = cpu_of_group(rpc, others)
                found[row] = (10.0, cpu_after - cpu_before)
                continue
            else:
                raise ValueError(kind)
            seconds, cpu = _timed(rpc, world, count, step)
            found[row] = (seconds / per, cpu / per)
        results.put(found)
    rpc.shutdown()


def launch(world: int, framework: str, steps: int, rows: list) -> dict:
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    options = {**ZMQ_OPTIONS, **AB_OPTIONS} if framework == "zmq-b" else ZMQ_OPTIONS
    mp.start_processes(group_main, args=(world, framework, ports.free_port(), steps, rows, results, options),
                       nprocs=world, start_method="spawn")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=2, help="launches per framework and world (medians)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--worlds", default="2,4,8,16", help="fan-out world sizes")
    parser.add_argument("--chain", type=int, default=8, help="processes of the nested chain (driver included)")
    parser.add_argument("--threads", default="1,4,16", help="driver threads running one-hop steps at once")
    parser.add_argument("--no-idle", action="store_true", help="skip the 16 idle workers row")
    parser.add_argument("--zmq", action="append", default=[], metavar="KEY=VALUE",
                        help="a ZmqRpcBackendOptions field for zmqautograd's groups (numbers), e.g. spin=0")
    parser.add_argument("--ab", action="append", default=[], metavar="KEY=VALUE",
                        help="also run zmqautograd with these options (B) and print B/A")
    args = parser.parse_args()
    ZMQ_OPTIONS.update(parse_options(args.zmq))
    AB_OPTIONS.update(parse_options(args.ab))
    frameworks = ("tp", "zmq", "zmq-b") if AB_OPTIONS else ("tp", "zmq")

    plans: dict[int, list] = {}
    plans.setdefault(2, []).append(("one hop", 1))
    for threads in map(int, args.threads.split(",")):
        plans.setdefault(2, []).append(("threads", threads))
    for world in map(int, args.worlds.split(",")):
        if world > 2:
            plans.setdefault(world, []).append(("fan-out", world))
    plans.setdefault(args.chain, []).append(("chain", args.chain))
    if not args.no_idle:
        plans.setdefault(16, []).append(("idle", 16))

    print(f"{kind_line()}; torch {torch.__version__}; each framework alone in its processes, "
          f"{args.launches} launch(es) each, medians", flush=True)
    samples: dict = {}
    for world in sorted(plans):
        for _ in range(args.launches):
            for framework in frameworks:  # taking turns, so all see the same machine
                found = launch(world, framework, args.steps, plans[world])
                for row, value in found.items():
                    samples.setdefault((row, framework), []).append(value)
    if AB_OPTIONS:
        print("B: zmqautograd with " + ", ".join(f"{k}={v:g}" for k, v in AB_OPTIONS.items()))
    b_head = f"   {'B':>10} {'B/A':>6}   {'CPU/step B':>11} {'B/A':>6}" if AB_OPTIONS else ""
    print(f"\n{'row':<14} {'TensorPipe':>12} {'zmqautograd':>12} {'ratio':>7}   "
          f"{'CPU/step TP':>12} {'CPU/step ours':>13} {'ratio':>7}{b_head}")
    for world in sorted(plans):
        for row in plans[world]:
            tp = [statistics.median(v) for v in zip(*samples[(row, "tp")])]
            ours = [statistics.median(v) for v in zip(*samples[(row, "zmq")])]
            b = [statistics.median(v) for v in zip(*samples[(row, "zmq-b")])] if AB_OPTIONS else None
            kind, value = row
            name = {"one hop": "one hop", "fan-out": f"fan-out {value}", "chain": f"chain {value}",
                    "threads": f"{value} threads", "idle": f"idle {value}"}[kind]
            if kind == "idle":
                b_idle = f"   {'(10 s)':>10} {'':>6}   {b[1]:>10.2f}s {b[1] / ours[1]:>5.2f}x" if b else ""
                print(f"{name:<14} {'(10 s)':>12} {'(10 s)':>12} {'':>7}   {tp[1]:>11.2f}s {ours[1]:>12.2f}s "
                      f"{ours[1] / tp[1]:>6.2f}x{b_idle}")
                continue
            b_step = (f"   {b[0] * 1e6:>8.0f}us {b[0] / ours[0]:>5.2f}x   {b[1] * 1e3:>9.2f}ms "
                      f"{b[1] / ours[1]:>5.2f}x") if b else ""
            print(f"{name:<14} {tp[0] * 1e6:>10.0f}us {ours[0] * 1e6:>10.0f}us {ours[0] / tp[0]:>6.2f}x   "
                  f"{tp[1] * 1e3:>10.2f}ms {ours[1] * 1e3:>11.2f}ms {ours[1] / tp[1]:>6.2f}x{b_step}", flush=True)


if __name__ == "__main__":
    main()
