"""A/B of a change inside one launch: the one-hop or the 4-stage pipeline step of
tools/bench.py, with a switch flipped in every process between rounds.

On the nested development VMs, launches of the same code differ by up to a third (the
processes' address layouts, the host's phase; docs/performance.md), so two versions measured
in separate launches compare launches, not code. Here rank 0 runs rounds of steps with the
switch off (A) and on (B), alternating which goes first, and prints both medians and the
ratio B/A of each round's pair: a change that helps shows as most ratios below 1.

A switch restores the code before a change by patching it from outside (see ``SWITCHES``);
``on`` is the code as it is.

    python tools/ab_inlaunch.py hop|pipe SWITCH [--rounds 10] [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.autograd.graph import GradientEdge  # noqa: E402

from tools import ports  # noqa: E402


def _outcome(on: bool) -> None:
    """3ecdf8c: a pass's end and a gradient request's answer as Outcomes (off: torch futures)."""
    from zmqautograd.autograd import api, engine
    from zmqautograd.rpc.futures import Future, Outcome

    engine.Outcome = api.Outcome = Outcome if on else Future


_CURRENT_ROOTS = None


def _engine_past_send(on: bool) -> None:
    """1aec7da: a group's engine call starts past its send function (off: at the function)."""
    global _CURRENT_ROOTS
    from zmqautograd.autograd import engine

    if _CURRENT_ROOTS is None:
        _CURRENT_ROOTS = engine._engine_roots
    engine._engine_roots = _CURRENT_ROOTS if on else (
        lambda entries: (tuple(GradientEdge(node, slot) for node, slot in entries), tuple(entries.values())))


SWITCHES = {"outcome": _outcome, "engine-past-send": _engine_past_send}


def _set(switch: str, on: bool) -> None:
    SWITCHES[switch](on)


def _run(rank: int, port: int, kind: str, switch: str, rounds: int, steps: int, world: int) -> None:
    torch.set_num_threads(1)
    import zmqautograd.autograd as dist_autograd
    import zmqautograd.rpc as rpc
    from tools.bench import WIDTH, stage

    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}")
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        if kind == "hop":
            x = torch.ones(2, requires_grad=True)

            def step() -> None:
                with dist_autograd.context() as context_id:
                    y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
                    dist_autograd.backward(context_id, [y.sum()])
                    assert dist_autograd.get_gradients(context_id)[x][0] == 2
        else:
            x = torch.randn(32, WIDTH, requires_grad=True)

            def step() -> None:
                with dist_autograd.context() as context_id:
                    h = stage(x)
                    for worker in ("worker1", "worker2", "worker3"):
                        h = rpc.rpc_sync(worker, stage, args=(h,))
                    dist_autograd.backward(context_id, [h.sum()])

        for _ in range(steps):
            step()
        medians: dict[bool, list[float]] = {False: [], True: []}
        clock = time.perf_counter
        for number in range(rounds):
            for on in ((False, True) if number % 2 == 0 else (True, False)):
                _set(switch, on)
                for peer in range(1, world):
                    rpc.rpc_sync(f"worker{peer}", _set, args=(switch, on))
                for _ in range(steps // 10):  # the switched code warms up
                    step()
                times = []
                for _ in range(steps):
                    start = clock()
                    step()
                    times.append(clock() - start)
                medians[on].append(statistics.median(times) * 1e6)
        ratios = [b / a for a, b in zip(medians[False], medians[True])]
        print(f"{kind}, {switch}: A (off) {statistics.median(medians[False]):,.0f} us, B (on) "
              f"{statistics.median(medians[True]):,.0f} us; B/A by round: median {statistics.median(ratios):.3f} "
              f"[{' '.join(f'{r:.2f}' for r in ratios)}], {sum(r < 1 for r in ratios)} of {rounds} below 1", flush=True)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("hop", "pipe"))
    parser.add_argument("switch", choices=sorted(SWITCHES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    world = 2 if args.kind == "hop" else 4
    mp.start_processes(_run, args=(ports.free_port(), args.kind, args.switch, args.rounds, args.steps, world),
                       nprocs=world, start_method="spawn")


if __name__ == "__main__":
    main()
