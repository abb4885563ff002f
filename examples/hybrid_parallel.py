"""Hybrid parallelism: DistributedDataParallel trainers plus a parameter server over RPC,
written for torch's RPC (PyTorch's "Combining DDP with the distributed RPC framework").

Worker ``ps`` (rank 0) holds an embedding table as a ``RemoteModule`` and hands it to the
trainers (ranks 1..N) in an RPC; each trainer looks up its batch in the remote table, runs a
DDP-wrapped local head (a gloo process group of the trainers only), and one
``DistributedOptimizer`` updates both from a distributed autograd context. DDP averages the
head's gradients over the trainers inside ``dist_autograd.backward``, so every trainer's head
stays identical.

Run it unchanged on torch's TensorPipe backend, or on zmqautograd without touching it:

    python examples/hybrid_parallel.py
    python -m zmqautograd.run examples/hybrid_parallel.py

It prints the held-out loss per epoch, then one JSON line with the final parameters (the
tests compare the two backends' lines). ``--mode`` picks a DDP variant: ``find_unused``
(``find_unused_parameters=True``), ``find_unused_skip`` (the same, with a branch that some
trainers skip on some steps: torch's dist autograd fails there with an internal assert,
zmqautograd averages as DDP does without it), ``no_sync`` (every other step under
``no_sync()``: the heads drift apart, as they do in torch), ``two_contexts`` (two dist
autograd contexts open at once on the same DDP model, from two threads: DDP averages the
gradients of the first backward after the last forward only, as in torch).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.nn import RemoteModule
from torch.distributed.optim import DistributedOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

NUM_EMBEDDINGS, DIM, CLASSES, BATCH = 100, 16, 4, 24


class Table(nn.Module):
    """The parameter server's embedding table (deterministic start)."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(NUM_EMBEDDINGS, DIM, mode="sum")
        with torch.no_grad():
            self.bag.weight.copy_(torch.randn(NUM_EMBEDDINGS, DIM, generator=torch.Generator().manual_seed(0)) * 0.3)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(indices, offsets)


class Head(nn.Module):
    """A trainer's local model, wrapped in DDP; ``extra`` is the branch that ``find_unused``
    skips on some steps."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1)
        self.fc = nn.Linear(DIM, CLASSES)
        self.extra = nn.Linear(DIM, CLASSES)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        out = self.fc(x)
        return out + self.extra(x) if use_extra else out


def batch(trainer: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A synthetic batch: bags of indices whose class is set by their index range."""
    generator = torch.Generator().manual_seed(1000 * trainer + step)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=generator)
    width = NUM_EMBEDDINGS // CLASSES
    indices = (labels.repeat_interleave(3) * width + torch.randint(0, width, (3 * BATCH,), generator=generator))
    offsets = torch.arange(0, 3 * BATCH, 3)
    return indices, offsets, labels


_trainer: dict = {}


def train(table: RemoteModule, trainer: int, trainers: int, steps: int, mode: str) -> dict:
    """Runs on each trainer (called by ``ps`` once per epoch): ``steps`` steps, then this
    trainer's head."""
    if not _trainer:  # the first epoch: the model and the optimizer, kept for the next
        head = Head()
        model = DDP(head, find_unused_parameters=mode.startswith("find_unused"))
        params = table.remote_parameters() + [rpc.RRef(p) for p in model.parameters()]
        _trainer.update(head=head, model=model, optimizer=DistributedOptimizer(torch.optim.SGD, params, lr=0.05),
                        epoch=0)
    head, model, optimizer = _trainer["head"], _trainer["model"], _trainer["optimizer"]
    first = _trainer["epoch"] * steps
    _trainer["epoch"] += 1
    loss_fn = nn.CrossEntropyLoss()

    def step_in_context(step: int) -> tuple[int, float]:
        indices, offsets, labels = batch(trainer, step)
        with dist_autograd.context() as context_id:
            # find_unused_skip: trainer 1 uses the extra branch on every step, the others on
            # even steps only (locally unused, globally used on odd ones).
            use_extra = mode != "find_unused_skip" or trainer == 1 or step % 2 == 0
            loss = loss_fn(model(table.forward(indices, offsets), use_extra), labels)
            dist_autograd.backward(context_id, [loss])
            optimizer.step(context_id)
            return context_id, loss.item()

    losses: list[float] = []
    first_grads: list = []  # two_contexts: the head's gradients in each context, first step
    for step in range(first, first + steps):
        if mode == "no_sync" and step % 2 == 1:
            with model.no_sync():
                losses.append(step_in_context(step)[1])
        elif mode == "two_contexts":
            loss, grads = _two_contexts(model, table, trainer, step, loss_fn, optimizer)
            losses.append(loss)
            first_grads = first_grads or grads
        else:
            losses.append(step_in_context(step)[1])
        dist.barrier()  # every update of this step is in before any trainer's next forward
    return {"head": [p.detach().tolist() for p in head.parameters()], "losses": losses, "grads": first_grads}


def _two_contexts(model: DDP, table: RemoteModule, trainer: int, step: int, loss_fn: nn.Module,
                  optimizer: DistributedOptimizer) -> tuple[float, list]:
    """Two contexts open at once on the same DDP model, each on its own thread: forward in
    the first, forward in the second, backward in the first, backward in the second (in
    this order on every trainer), then one optimizer step per context. Returns the sum of
    the losses and the head's gradients in each context."""
    turn = threading.Condition()
    state: dict = {"turn": 0, "loss": 0.0, "error": None, "grads": [None, None]}

    def wait_turn(n: int) -> None:
        with turn:
            turn.wait_for(lambda: state["turn"] == n, timeout=60)

    def next_turn() -> None:
        with turn:
            state["turn"] += 1
            turn.notify_all()

    def run(which: int) -> None:
        try:
            indices, offsets, labels = batch(trainer, 2 * step + which)
            with dist_autograd.context() as context_id:
                wait_turn(which)
                loss = loss_fn(model(table.forward(indices, offsets)), labels)
                next_turn()
                wait_turn(2 + which)
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
                state["grads"][which] = [grads[p].tolist() for p in model.parameters()]
                next_turn()
                wait_turn(4 + which)
                optimizer.step(context_id)
                state["loss"] += loss.item()
                next_turn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the trainer's thread
            state["error"] = exc
            with turn:
                state["turn"] = -1
                turn.notify_all()

    threads = [threading.Thread(target=run, args=(which,)) for which in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if state["error"] is not None:
        raise state["error"]
    return state["loss"], state["grads"]


def evaluate(table: RemoteModule, head_state: list) -> float:
    head = Head()
    with torch.no_grad():
        for p, value in zip(head.parameters(), head_state):
            p.copy_(torch.tensor(value))
        losses = [nn.functional.cross_entropy(head(table.forward(*batch(99, s)[:2])), batch(99, s)[2]).item() for s in range(4)]
    return sum(losses) / len(losses)


def worker(rank: int, world: int, rpc_port: int, pg_port: int, steps: int, mode: str, epochs: int) -> None:
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=60)
    if rank > 0:  # the trainers' process group (DDP): bounded by its own timeout
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank - 1,
                                world_size=world - 1, timeout=timedelta(seconds=60))
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        table = RemoteModule("ps/cpu", Table)
        for epoch in range(epochs):
            futures = [rpc.rpc_async(f"trainer{t}", train, (table, t, world - 1, steps, mode), timeout=0)
                       for t in range(1, world)]
            results = [f.wait() for f in futures]
            print(f"epoch {epoch}: held-out loss {evaluate(table, results[0]['head']):.4f}", flush=True)
        weight = table.module_rref.to_here().bag.weight.detach()
        print(json.dumps({"mode": mode, "heads": [r["head"] for r in results], "losses": [r["losses"] for r in results],
                          "grads": [r["grads"] for r in results], "table": weight.tolist()}), flush=True)
    rpc.shutdown()
    if rank > 0:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--mode", choices=["plain", "find_unused", "find_unused_skip", "no_sync", "two_contexts"], default="plain")
    args = parser.parse_args(argv)
    world = args.trainers + 1
    mp.spawn(worker, args=(world, free_port(), free_port(), args.steps, args.mode, args.epochs), nprocs=world)


if __name__ == "__main__":
    sys.exit(main())
