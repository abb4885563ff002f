"""Demo: a model split over 3 worker processes, trained from a driver with distributed
autograd and the DistributedOptimizer, on loopback.

Worker i holds stage i of an MLP (built there with ``rpc.remote``). Every step the driver
sends a batch through the three stages (``rref.rpc_sync().forward``), computes the loss, runs
``dist_autograd.backward``, which carries the backward pass back through all three workers,
and steps the ``DistributedOptimizer``, which updates each stage's parameters on its own
worker with that step's gradients. It prints the loss falling and the steps per second, then
checks the model against held-out data.

With ``--elastic`` the group is dynamic (``init_rpc`` without ``world_size``) and training
goes on when a worker is lost: the driver keeps a checkpoint of every stage (every
``CHECKPOINT_EVERY`` steps), and when a step fails it waits a while for the lost worker to
come back (a restarted container rejoins under its name), rebuilds the lost stages there or,
if it does not come back, on the surviving workers, rewinds every stage to the checkpoint and
trains on. ``tools/compose.py --faults`` breaks containers under it.

    python tools/demo.py [--steps 300]          # all four processes on this machine
    RANK=r WORLD_SIZE=4 MASTER_ADDR=host MASTER_PORT=29500 python tools/demo.py   # one of them
    RANK=r MASTER_ADDR=host MASTER_PORT=29500 python tools/demo.py --elastic   # one, elastic
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zmqautograd.autograd as dist_autograd  # noqa: E402
import zmqautograd.rpc as rpc  # noqa: E402
from tools import ports  # noqa: E402
from zmqautograd.rpc import cluster_secret  # noqa: E402
from zmqautograd.optim import DistributedOptimizer  # noqa: E402

WORKERS = 3
WORLD = WORKERS + 1
IN, HIDDEN, OUT = 16, 64, 1
SIZES = [(IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)]
CHECKPOINT_EVERY = 50  # steps (--elastic)


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

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: value.detach().clone() for name, value in self.state_dict().items()}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(state)


# ------------------------------------------------------------------------------ driver


class Model:
    """The three stages, each an RRef to a ``Stage`` on its worker, and the optimizer over
    their parameters."""

    def __init__(self, hosts: list[str], states: list[dict] | None = None):
        self.hosts = hosts
        self.stages = [rpc.remote(host, Stage, args=(i,)) for i, host in enumerate(hosts)]
        if states is not None:
            for stage, state in zip(self.stages, states):
                stage.rpc_sync().restore(state)
        params = [p for stage in self.stages for p in stage.rpc_sync().parameter_rrefs()]
        self.optimizer = DistributedOptimizer(torch.optim.SGD, params, lr=0.1, momentum=0.9)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage.rpc_sync().forward(x)
        return x

    def snapshot(self) -> list[dict]:
        return [stage.rpc_sync().snapshot() for stage in self.stages]


def train(steps: int, batch: int, init_method: str, elastic: bool = False, rejoin_wait: float = 20.0) -> None:
    hosts = [f"worker{i + 1}" for i in range(WORKERS)]
    model = Model(hosts)
    checkpoint = (0, model.snapshot()) if elastic else None
    x_all, y_all = make_data(0, 8192)
    print(f"driver + {WORKERS} workers, one model stage each, distributed autograd over zmqautograd "
          f"({init_method}{', elastic' if elastic else ''}); batch {batch}\n")

    started = last_time = time.perf_counter()
    step = last_step = 0
    while step < steps:
        index = torch.arange(step * batch, (step + 1) * batch) % x_all.shape[0]
        try:
            with dist_autograd.context() as context_id:
                loss = torch.nn.functional.mse_loss(model(x_all[index]), y_all[index])
                dist_autograd.backward(context_id, [loss])
                model.optimizer.step(context_id)
            if checkpoint is not None and (step + 1) % CHECKPOINT_EVERY == 0:
                checkpoint = (step + 1, model.snapshot())
        except RuntimeError as exc:  # a worker lost, say: when, and what the error names
            print(f"step {step} failed at {time.time():.3f}: {exc}", flush=True)
            if checkpoint is None:
                raise
            model = recover(model, checkpoint, rejoin_wait)
            step = last_step = checkpoint[0]
            continue
        if step % 50 == 0 or step == steps - 1:
            now = time.perf_counter()
            rate = (step + 1 - last_step) / (now - last_time)  # over the steps since the last line
            last_time, last_step = now, step + 1
            print(f"step {step:4d}  loss {loss.item():.5f}  {rate:6.1f} steps/s", flush=True)
        step += 1
    x, y = make_data(10_000, 2048)
    with torch.no_grad():
        held_out = torch.nn.functional.mse_loss(model(x), y).item()
        baseline = torch.nn.functional.mse_loss(torch.zeros_like(y), y).item()
    print(f"\nheld-out loss {held_out:.5f} (predicting zero: {baseline:.5f}); "
          f"{steps} steps in {time.perf_counter() - started:.1f} s")
    assert held_out < baseline / 4, "the model did not learn"
    if elastic:
        for name in sorted(set(model.hosts)):
            rpc.rpc_sync(name, _finish)


# ------------------------------------------------------------------------------ elastic


def _alive(name: str) -> bool:
    try:
        return rpc.rpc_sync(name, _ping, timeout=5) == name
    except RuntimeError:
        return False


def _ping() -> str:
    return rpc.get_worker_info().name


def recover(model: Model, checkpoint: tuple[int, list[dict]], rejoin_wait: float) -> Model:
    """A model like ``model`` on the workers alive now, every stage at ``checkpoint``: a lost
    worker's stages go back to it if it rejoins within ``rejoin_wait`` seconds, else to the
    survivors (fewest stages first). Raises if no worker is left."""
    lost = sorted({host for host in model.hosts if not _alive(host)})
    if not lost:
        raise RuntimeError("a step failed but every worker answers: not a lost worker")
    hosts = list(model.hosts)
    for name in lost:
        waited = time.monotonic()
        back = _alive(name)
        while not back and time.monotonic() - waited < rejoin_wait:
            time.sleep(0.5)  # (nothing tells this process that a worker joined: look again)
            back = _alive(name)
        if back:
            print(f"{name} rejoined after {time.monotonic() - waited:.1f} s", flush=True)
            continue
        survivors = sorted({host for host in hosts if host not in lost}, key=hosts.count)
        if not survivors:
            raise RuntimeError(f"every worker is lost ({', '.join(lost)}): training cannot go on")
        hosts = [survivors[0] if host == name else host for host in hosts]
        print(f"{name} did not come back within {rejoin_wait:.0f} s", flush=True)
    moved = ", ".join(f"stage {i} on {host}" for i, host in enumerate(hosts) if model.hosts[i] in lost)
    print(f"training goes on from the checkpoint of step {checkpoint[0]}: {moved}", flush=True)
    return Model(hosts, checkpoint[1])


_finished = threading.Event()


def _finish() -> None:
    _finished.set()


def serve_until_finished() -> None:
    """A worker of an elastic group: serve until the driver says training is over, or is gone
    (shutdown in a dynamic group does not wait for the others): it left the group, or this
    worker lost it (a partition: the group's log, on the driver, is out of reach too)."""
    agent = rpc._get_current_rpc_agent()
    while not _finished.wait(1.0):
        if "driver" not in _members() or agent.is_lost(0):
            return


def wait_for_workers(timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    wanted = {f"worker{i + 1}" for i in range(WORKERS)}
    while not wanted <= _members():
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers missing after {timeout:.0f} s: {sorted(wanted - _members())}")
        time.sleep(0.2)


def _members() -> set[str]:
    """The names in the group now (torch's agent API, as in a dynamic TensorPipe group)."""
    return {info.name for info in rpc._get_current_rpc_agent().get_worker_infos()}


def run(rank: int, init_method: str, steps: int, batch: int, busy_poll: float = 0.0) -> None:
    options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=60, busy_poll=busy_poll)
    rpc.init_rpc("driver" if rank == 0 else f"worker{rank}", rank=rank, world_size=WORKERS + 1,
                 rpc_backend_options=options)
    if rank == 0:
        train(steps, batch, init_method)
    rpc.shutdown()


def run_elastic(rank: int, steps: int, batch: int, rejoin_wait: float) -> None:
    """One process of an elastic group, joined with env:// (MASTER_ADDR, MASTER_PORT, RANK)."""
    options = rpc.ZmqRpcBackendOptions(init_method="env://", rpc_timeout=60)
    rpc.init_rpc("driver" if rank == 0 else f"worker{rank}", rank=rank, rpc_backend_options=options)
    if rank == 0:
        wait_for_workers()
        train(steps, batch, "env://", elastic=True, rejoin_wait=rejoin_wait)
    else:
        serve_until_finished()
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=int(os.environ.get("DEMO_STEPS") or 300),
                        help="training steps (default: $DEMO_STEPS, else 300)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--busy-poll", type=float, default=0.0, metavar="SECONDS",
                        help="opt-in busy polling of every worker's I/O thread (docs/transport.md)")
    parser.add_argument("--elastic", action="store_true", default=bool(os.environ.get("DEMO_ELASTIC")),
                        help="a dynamic group that trains on when a worker is lost (default: $DEMO_ELASTIC); "
                             "one process of it per RANK")
    parser.add_argument("--rejoin-wait", type=float, default=20.0, metavar="SECONDS",
                        help="how long the elastic driver waits for a lost worker to come back")
    args = parser.parse_args()
    if args.elastic:
        if "RANK" not in os.environ:
            raise SystemExit("--elastic runs one process per RANK (MASTER_ADDR, MASTER_PORT, RANK)")
        os.environ.pop("WORLD_SIZE", None)  # env:// without it: a dynamic group
        run_elastic(int(os.environ["RANK"]), args.steps, args.batch, args.rejoin_wait)
        return
    if "RANK" in os.environ:
        # One process of a group launched elsewhere (torchrun, docker-compose): join with env://
        # (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
        if int(os.environ.get("WORLD_SIZE", "0")) != WORLD:
            raise SystemExit(f"the demo runs with WORLD_SIZE={WORLD} (a driver and {WORKERS} workers)")
        run(int(os.environ["RANK"]), "env://", args.steps, args.batch, args.busy_poll)
        return
    port = ports.free_port()
    # The group's cluster secret, made for the four processes this starts (they inherit it):
    # only they can join the group (docs/security.md).
    cluster_secret.for_children()
    # The four processes fork from one server that imported torch and zmqautograd first, so
    # they share one address layout: where they take turns on fewer CPUs than processes,
    # each runs its share faster than with a layout of its own, as spawn gives them
    # (docs/performance.md, "Address layouts").
    mp.set_forkserver_preload(["torch", "zmqautograd.rpc", "zmqautograd.autograd", "zmqautograd.optim"])
    mp.start_processes(run, args=(f"tcp://127.0.0.1:{port}", args.steps, args.batch, args.busy_poll),
                       nprocs=WORKERS + 1, start_method="forkserver")


if __name__ == "__main__":
    main()
