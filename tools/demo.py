"""Demo: data-parallel training over zmqautograd.rpc, a driver and 3 worker processes on loopback.

Each worker holds its own shard of a synthetic regression data set. Every step, the driver
sends the current weights to all workers with ``rpc_async``; each computes the loss and the
gradients of a small MLP on a batch of its shard (plain local autograd) and returns them; the
driver averages the gradients and takes an SGD step. It prints the loss falling and the steps
per second, then checks the model against held-out data.

(Distributed autograd, where the backward pass itself runs across workers, comes with the next
layer; this demo uses RPC only.)

    python tools/demo.py [--steps 300]          # all four processes on this machine
    RANK=r WORLD_SIZE=4 MASTER_ADDR=host MASTER_PORT=29500 python tools/demo.py   # one of them
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zmqautograd.rpc as rpc  # noqa: E402

WORKERS = 3
WORLD = WORKERS + 1
IN, HIDDEN, OUT = 16, 64, 1



def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same hidden function for everyone; each seed draws different points."""
    w = torch.randn(IN, generator=torch.Generator().manual_seed(99))
    x = torch.randn(n, IN, generator=torch.Generator().manual_seed(seed))
    return x, torch.sin(x @ w / 2).unsqueeze(1)


# ----------------------------------------------------------------------- on the workers

_shard: tuple[torch.Tensor, torch.Tensor] | None = None
_model: torch.nn.Module | None = None


def compute_gradients(state: dict, step: int, batch: int) -> tuple[float, list[torch.Tensor]]:
    """Loss and gradients of the model with weights ``state`` on a batch of this worker's shard."""
    global _shard, _model
    if _shard is None:
        _shard = make_data(rpc.get_worker_info().id, 4096)
        _model = make_model()
    _model.load_state_dict(state)
    x, y = _shard
    index = torch.arange(step * batch, (step + 1) * batch) % x.shape[0]
    _model.zero_grad()
    loss = torch.nn.functional.mse_loss(_model(x[index]), y[index])
    loss.backward()
    return loss.item(), [p.grad for p in _model.parameters()]


# ------------------------------------------------------------------------------ driver


def train(steps: int, batch: int, init_method: str) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    workers = [f"worker{r}" for r in range(1, WORKERS + 1)]
    print(f"driver + {WORKERS} workers over zmqautograd.rpc ({init_method}); batch {batch} per worker\n")
    started = last_time = time.perf_counter()
    last_step = 0
    for step in range(steps):
        state = model.state_dict()
        futures = [rpc.rpc_async(w, compute_gradients, args=(state, step, batch)) for w in workers]
        results = torch.futures.wait_all(futures)
        optimizer.zero_grad()
        for parameter, *grads in zip(model.parameters(), *(g for _, g in results)):
            parameter.grad = torch.stack(grads).mean(0)
        optimizer.step()
        loss = sum(l for l, _ in results) / len(results)
        if step % 50 == 0 or step == steps - 1:
            now = time.perf_counter()
            rate = (step + 1 - last_step) / (now - last_time)  # over the steps since the last line
            last_time, last_step = now, step + 1
            print(f"step {step:4d}  loss {loss:.5f}  {rate:6.1f} steps/s", flush=True)
    x, y = make_data(10_000, 2048)
    with torch.no_grad():
        held_out = torch.nn.functional.mse_loss(model(x), y).item()
        baseline = torch.nn.functional.mse_loss(torch.zeros_like(y), y).item()
    print(f"\nheld-out loss {held_out:.5f} (predicting zero: {baseline:.5f}); "
          f"{steps} steps in {time.perf_counter() - started:.1f} s")
    assert held_out < baseline / 4, "the model did not learn"


def run(rank: int, init_method: str, steps: int, batch: int) -> None:
    options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=60)
    rpc.init_rpc("driver" if rank == 0 else f"worker{rank}", rank=rank, world_size=WORKERS + 1,
                 rpc_backend_options=options)
    if rank == 0:
        train(steps, batch, init_method)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args()
    if "RANK" in os.environ:
        # One process of a group launched elsewhere (torchrun, docker-compose): join with env://
        # (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
        if int(os.environ.get("WORLD_SIZE", "0")) != WORLD:
            raise SystemExit(f"the demo runs with WORLD_SIZE={WORLD} (a driver and {WORKERS} workers)")
        run(int(os.environ["RANK"]), "env://", args.steps, args.batch)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(f"tcp://127.0.0.1:{port}", args.steps, args.batch), nprocs=WORKERS + 1)


if __name__ == "__main__":
    main()
