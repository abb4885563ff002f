"""Distributed autograd embedded in an RPC framework of its own: ``multiprocessing`` pipes.

``PipeRpc`` is a small RPC framework, as an embedder would already have one: two processes,
one duplex pipe, messages pickled by the pipe, calls served on a thread pool. Nothing of
``zmqautograd.rpc`` runs. ``PipePort`` plugs ``zmqautograd.autograd`` into it
(``zmqautograd/autograd/embed.py`` says what a port does), and from then on the usual API
works: ``context()``, ``backward()``, ``get_gradients()``.

The computation: worker 0 holds ``w0``, worker 1 holds ``w1``. Worker 0 sends ``x`` to
worker 1, which answers ``tanh(x @ w1)``; worker 0 computes ``((h @ w0) ** 2).sum()``
and runs ``backward`` from there. The gradients of both weights are compared with local
autograd on the same computation.

    python examples/embed_pipes.py
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc
from zmqautograd.autograd.embed import EmbeddedPort, attach, detach

# ------------------------------------------------------------------ the embedder's framework


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a value, in order (lists, tuples and dicts looked into)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for item in items for t in _tensors(item)]


def _wire(value: Any) -> Any:
    """What the pipe sends: tensors as leaves (a tensor in a graph cannot be pickled), with
    their requires_grad flag; the receiver's autograd records where they came from."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(_wire(item) for item in value)
    if isinstance(value, dict):
        return {key: _wire(item) for key, item in value.items()}
    return value


class PipeRpc:
    """Calls to the process at the other end of ``conn``. A request is ``("call", id, kind,
    function, args, metadata)``; its answer ``("answer", id, value, error, metadata)``;
    ``("close",)`` ends the conversation.
    ``kind`` is "user" for the framework's own calls and "autograd" for the engine's."""

    def __init__(self, rank: int, conn: Any) -> None:
        self.rank = rank
        self.peer = 1 - rank
        self._conn = conn
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, tuple[torch.futures.Future, str]] = {}
        self._closing = False  # set by close(): the end of the conversation is expected
        self._served = ThreadPoolExecutor(4, thread_name_prefix=f"pipe{rank}")
        self.port = PipePort(self)
        attach(self.port)  # before the first message can arrive
        self._reader = threading.Thread(target=self._read, name=f"pipe{rank}-reader", daemon=True)
        self._reader.start()

    def rpc_sync(self, function: Callable, *args: Any) -> Any:
        """Run ``function(*args)`` at the peer; recorded into the current autograd context."""
        metadata = self.port.call_leaving(self.peer)
        args = _wire(args)
        self.port.record_call(self.peer, metadata, _tensors(args))
        value, answer_metadata = self.request("user", function, args, metadata).wait()
        self.port.record_answer(self.peer, answer_metadata, _tensors(value))
        return value

    def request(self, kind: str, function: Callable, args: tuple, metadata: Any = None) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        call_id = next(self._ids)
        self._pending[call_id] = (future, kind)
        self._send(("call", call_id, kind, function, args, metadata))
        return future

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message)  # plain pickle, as over a wire (no shared-memory handles)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _read(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as exc:  # the peer is gone: fail what waits for it
                if self._closing:
                    return  # our close(): the peer closed its end after our ("close",)
                self.port.peer_lost(self.peer, exc)
                for future, _ in self._pending.values():
                    future.set_exception(ConnectionError(f"worker {self.peer} is gone: {exc!r}"))
                return
            if message[0] == "close":  # the peer is done
                return
            if message[0] == "call":
                self._served.submit(self._serve, *message[1:])
            else:
                _, call_id, value, error, metadata = message
                future, kind = self._pending.pop(call_id)
                if error is not None:
                    future.set_exception(error)
                else:  # a user call's answer carries its autograd metadata
                    future.set_result((value, metadata) if kind == "user" else value)

    def _serve(self, call_id: int, kind: str, function: Callable, args: tuple, metadata: Any) -> None:
        if kind == "autograd":  # the engine's own call: the port runs only its protocol functions
            self.port.serve(self.peer, function, args).add_done_callback(
                lambda done: self._answer(call_id, done, kind))
            return
        answer: torch.futures.Future = torch.futures.Future()
        try:
            with self.port.serving(self.peer, metadata, _tensors(args)) as served:
                value = function(*args)
            answer.set_result((_wire(value), served.answer(_tensors(value))))
        except Exception as exc:  # noqa: BLE001 - the caller gets it
            answer.set_exception(exc)
        self._answer(call_id, answer, kind)

    def _answer(self, call_id: int, done: torch.futures.Future, kind: str) -> None:
        try:
            result = done.value()
        except Exception as exc:  # noqa: BLE001 - sent back
            self._send(("answer", call_id, None, RuntimeError(str(exc)), None))
            return
        if kind == "user":
            value, metadata = result
            self._send(("answer", call_id, value, None, metadata))
        else:
            self._send(("answer", call_id, _wire(result), None, None))

    def close(self) -> None:
        """Tell the peer we are done, and stop: the connection is closed once our reader has
        seen the peer close its end (closing it under the reader would break its read)."""
        self._closing = True
        self._send(("close",))
        self._served.shutdown(wait=True)
        self._reader.join(30)
        self._conn.close()


class PipePort(EmbeddedPort):
    """Distributed autograd's port over ``PipeRpc``: the engine's calls as "autograd" calls."""

    def __init__(self, rpc: PipeRpc) -> None:
        super().__init__(rpc.rank, timeout=30.0)
        self._rpc = rpc

    def send_call(self, to: int, function: Callable, args: tuple) -> torch.futures.Future:
        if to != self._rpc.peer:
            raise ValueError(f"no worker {to}: this framework connects two workers")
        return self._rpc.request("autograd", function, _wire(args))


# ------------------------------------------------------------------ the program

SIZE = 4
_state: dict[str, Any] = {}  # worker 1's weight


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, SIZE, generator=generator)
    w0 = torch.randn(SIZE, 2, generator=generator)
    w1 = torch.randn(SIZE, SIZE, generator=generator)
    return x, w0, w1


def layer(h: torch.Tensor) -> torch.Tensor:
    """Worker 1's part of the forward pass."""
    return torch.tanh(h @ _state["w1"])


def gradients_here(context_id: int) -> torch.Tensor:
    """Worker 1's gradient of its weight in the context."""
    return dist_autograd.get_gradients(context_id)[_state["w1"]]


def contexts_left_after(seconds: float) -> int:
    """On worker 1: the autograd contexts it still holds once none is left or ``seconds``
    passed. Releases come in a batch a moment after a context ends, and nothing here signals
    them, so this looks at the count."""
    deadline = time.monotonic() + seconds
    while _context_count() and time.monotonic() < deadline:
        time.sleep(0.005)
    return _context_count()


def _context_count() -> int:
    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def _worker1(conn: Any) -> None:
    _state["w1"] = _weights()[2].requires_grad_()
    rpc = PipeRpc(1, conn)
    rpc._reader.join()  # serve until worker 0 says it is done
    detach()


def run(steps: int = 3) -> dict[str, float]:
    """Worker 0's program: ``steps`` passes, each compared with local autograd. The largest
    differences seen, the smallest norm of worker 1's gradient, and how many contexts
    worker 1 still held at the end."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    worker1 = ctx.Process(target=_worker1, args=(there,), daemon=True)
    worker1.start()
    there.close()  # worker 1's end
    x, w0, w1_start = _weights()
    w0.requires_grad_()
    rpc = PipeRpc(0, here)
    worst = {"w0": 0.0, "w1": 0.0, "w1_norm": 0.0}
    try:
        for step in range(steps):
            xs = x * (step + 1)
            with dist_autograd.context() as context_id:
                h = rpc.rpc_sync(layer, xs.requires_grad_())
                loss = ((h @ w0) ** 2).sum()
                dist_autograd.backward(context_id, [loss])
                grad_w0 = dist_autograd.get_gradients(context_id)[w0]
                grad_w1 = rpc.request("user", gradients_here, (context_id,)).wait()[0]
            w1 = w1_start.clone().requires_grad_()
            ((torch.tanh(xs.detach() @ w1) @ w0) ** 2).sum().backward()
            worst["w0"] = max(worst["w0"], (grad_w0 - w0.grad).abs().max().item())
            worst["w1"] = max(worst["w1"], (grad_w1 - w1.grad).abs().max().item())
            worst["w1_norm"] = min(worst["w1_norm"] or float("inf"), grad_w1.norm().item())
            w0.grad = None
        worst["contexts_left_on_worker1"] = rpc.request("user", contexts_left_after, (2.0,)).wait()[0]
        worst["rpc_running"] = zmqautograd.rpc._is_initialized()  # none of zmqautograd.rpc ran
    finally:
        detach()
        rpc.close()
        worker1.join(30)
    worst["worker1_exit"] = worker1.exitcode
    return worst


if __name__ == "__main__":
    result = run()
    print(f"largest difference from local autograd: w0 {result['w0']:.2e}, w1 {result['w1']:.2e}; "
          f"contexts left on worker 1: {result['contexts_left_on_worker1']}")
    if max(result["w0"], result["w1"]) > 1e-5 or result["contexts_left_on_worker1"]:
        raise SystemExit("FAILED")
    print("OK")
