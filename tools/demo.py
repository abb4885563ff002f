"""Demo: a model split over 3 worker processes, trained from a driver with distributed
autograd and the DistributedOptimizer, on loopback.

Worker i holds stage i of an MLP (built there with ``rpc.remote``). Every step the driver
sends a batch through the three stages (``rref.rpc_sync().forward``), computes the loss, runs
``dist_autograd.backward``, which carries the backward pass back through all three workers,
and steps the ``DistributedOptimizer``, which updates each stage's parameters on its own
worker with that step's gradients. It prints the loss falling and the steps per second, then
checks the model against held-out data.

    python tools/demo.py [--steps 300]          # all four processes on this machine
    RANK=r WORLD_SIZE=4 MASTER_ADDR=host MASTER_PORT=29500 python tools/demo.py   # one of them
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zmqautograd.autograd as dist_autograd  # noqa: E402
import zmqautograd.rpc as rpc  # noqa: E402
from tools import ports  # noqa: E402
from zmqautograd.optim import DistributedOptimizer  # noqa: E402

WORKERS = 3
WORLD = WORKERS + 1
IN, HIDDEN, OUT = 16, 64, 1
SIZES = [(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)]


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same hidden function for every draw; each seed draws different points."""
    w = torch.randn(IN, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ w / 2).unsqueeze(1)


class Stage(torch.nn.Module):
    """One stage of the model; lives on a worker."""

    def __init__(self, index: int):
        super().__init__()
        torch.manual_seed(index)
        fan_in, fan_out = SIZES[index]
        self.linear = torch.nn.Linear(fan_in, fan_out)
        self.last = index == len(SIZES) - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y if self.last else torch.tanh(y)

    def parameter_rrefs(self) -> list:
        return [rpc.RRef(p) for p in self.parameters()]


# ------------------------------------------------------------------------------ driver


def train(steps: int, batch: int, init_method: str) -> None:
    stages = [rpc.remote(f"worker{i + 1}", Stage, args=(i,)) for i in range(WORKERS)]
    params = [p for stage in stages for p in stage.rpc_sync().parameter_rrefs()]
    optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)
    x_all, y_all = make_data(0, 8192)
    print(f"driver + {WORKERS} workers, one model stage each, distributed autograd over zmqautograd "
          f"({init_method}); batch {batch}\n")

    def model(x: torch.Tensor) -> torch.Tensor:
        for stage in stages:
            x = stage.rpc_sync().forward(x)
        return x

    started = last_time = time.perf_counter()
    last_step = 0
    for step in range(steps):
        index = torch.arange(step * batch, (step + 1) * batch) % x_all.shape[0]
        try:
            with dist_autograd.context() as context_id:
                loss = torch.nn.functional.mse_loss(model(x_all[index]), y_all[index])
                dist_autograd.backward(context_id, [loss])
                optimizer.step(context_id)
        except RuntimeError as exc:  # a worker lost, say: when, and what the error names
            print(f"step {step} failed at {time.time():.3f}: {exc}", flush=True)
            raise
        if step % 50 == 0 or step == steps - 1:
            now = time.perf_counter()
            rate = (step + 1 - last_step) / (now - last_time)  # over the steps since the last line
            last_time, last_step = now, step + 1
            print(f"step {step:4d}  loss {loss.item():.5f}  {rate:6.1f} steps/s", flush=True)
    x, y = make_data(10_000, 2048)
    with torch.no_grad():
        held_out = torch.nn.functional.mse_loss(model(x), y).item()
        baseline = torch.nn.functional.mse_loss(torch.zeros_like(y), y).item()
    print(f"\nheld-out loss {held_out:.5f} (predicting zero: {baseline:.5f}); "
          f"{steps} steps in {time.perf_counter() - started:.1f} s")
    assert held_out < baseline / 4, "the model did not learn"


def run(rank: int, init_method: str, steps: int, batch: int, busy_poll: float = 0.0) -> None:
    options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=60, busy_poll=busy_poll)
    rpc.init_rpc("driver" if rank == 0 else f"worker{rank}", rank=rank, world_size=WORKERS + 1,
                 rpc_backend_options=options)
    if rank == 0:
        train(steps, batch, init_method)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=int(os.environ.get("DEMO_STEPS") or 300),
                        help="training steps (default: $DEMO_STEPS, else 300)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--busy-poll", type=float, default=0.0, metavar="SECONDS",
                        help="opt-in busy polling of every worker's I/O thread (docs/transport.md)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        # One process of a group launched elsewhere (torchrun, docker-compose): join with env://
        # (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
        if int(os.environ.get("WORLD_SIZE", "0")) != WORLD:
            raise SystemExit(f"the demo runs with WORLD_SIZE={WORLD} (a driver and {WORKERS} workers)")
        run(int(os.environ["RANK"]), "env://", args.steps, args.batch, args.busy_poll)
        return
    port = ports.free_port()
    # The four processes fork from one server that imported torch and zmqautograd first, so
    # they share one address layout: where they take turns on fewer CPUs than processes,
    # each runs its share faster than with a layout of its own, as spawn gives them
    # (docs/performance.md, "Address layouts").
    mp.set_forkserver_preload(["torch", "zmqautograd.rpc", "zmqautograd.autograd", "zmqautograd.optim"])
    mp.start_processes(run, args=(f"tcp://127.0.0.1:{port}", args.steps, args.batch, args.busy_poll),
                       nprocs=WORKERS + 1, start_method="forkserver")


if __name__ == "__main__":
    main()
