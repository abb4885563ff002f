"""The floor of a pure-Python RPC design on this machine that sends each call as a ZeroMQ
message of its own, encoded with zmqautograd's codec: raw pyzmq and that codec, nothing else.

No agent, no pool, no futures, no socket lock: one thread on each side, a DEALER that sends a
call encoded exactly as ``rpc_sync`` encodes it (function reference, argument tuple, tensor
frame) and a ROUTER that decodes it, runs the function and sends the encoded answer back.
What is left is what every call of such a layer must pay: encoding and decoding with msgpack
in Python, and libzmq's send and receive (with its own I/O thread on each side). A design that
packed many calls into one message, or a faster codec, could go beyond it. ``tools/bench.py`` measures its throughput in the standalone table, so that the
RPC layer's overhead over this floor, and TensorPipe's figures against it, are measured in one
run. (Not its latency: one thread blocking in libzmq's receive is slower than zmqautograd's
``rpc_sync``, whose waiting thread receives for itself; ``tools/bench_transport.py``'s raw
ping-pong is the floor there.)

It also has the floor of distributed autograd's one hop (``CallingSide.one_hop``, the bench's
"one hop fwd+bwd" workload): the forward call and the backward step as two such calls, with
PyTorch's engine run on each side as any design built on it must (the worker keeps the graph
of the call between the two). No contexts, no send or recv functions, no completion protocol,
and the caller's gradient goes to its leaf without an engine call: what a pure-Python design
on this transport and PyTorch's engine pays at least, 4 messages and 2 engine calls a step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import zmq

from zmqautograd.transport import Message, MessageType
from zmqautograd.rpc.serialization import RpcCodec, encode_function, resolve_function

_STOP = "stop"
# The serving side's graphs between a hop's forward and its backward, by the caller's key
# (the serving side is one thread).
_HOP_GRAPHS: dict = {}


def hop_forward(key: int, x: torch.Tensor) -> torch.Tensor:
    """The forward call of a one-hop floor step: ``x * 2`` recorded, its graph kept."""
    received = x.requires_grad_()
    y = torch.mul(received, 2)
    _HOP_GRAPHS[key] = (received, y)
    return y.detach()


def hop_backward(key: int, grad: torch.Tensor) -> torch.Tensor:
    """The backward step of a one-hop floor step: the kept graph run by PyTorch's engine."""
    received, y = _HOP_GRAPHS.pop(key)
    return torch.autograd.grad([y], [received], [grad])[0]


def answer(codec: RpcCodec, frames: list) -> tuple[list, bool]:
    """The encoded answer to the call in ``frames``, and whether that call said to stop."""
    envelope = codec.decode_envelope(frames)
    payload = codec.decode_payload(envelope)
    stop = payload == _STOP
    value = None if stop else resolve_function(payload["f"])(*payload["a"], **payload["k"])
    return codec.encode(Message(MessageType.PYTHON_RET, envelope.id, "1", {"v": value})), stop


def serve(port: int) -> None:
    """Answer calls on ``tcp://127.0.0.1:port`` until told to stop (on the calling thread)."""
    codec = RpcCodec(allow_pickle=False)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{port}")
    try:
        stop = False
        while not stop:
            frames = router.recv_multipart(copy=False)
            reply, stop = answer(codec, frames[1:])
            router.send_multipart([frames[0], *reply])
    finally:
        router.close(linger=0)
        context.term()


class CallingSide:
    """The calling side of a floor: ``rpc_sync`` and a batch of calls in flight, as the RPC
    benchmarks make them. Subclasses move the frames (``_put``, ``_get``)."""

    def __init__(self) -> None:
        self._codec = RpcCodec(allow_pickle=False)
        self._ids = 0

    def _put(self, frames: list) -> None:
        raise NotImplementedError

    def _get(self) -> list:
        raise NotImplementedError

    def _send(self, function: Any, args: tuple) -> None:
        self._ids += 1
        payload = {"f": encode_function(function), "a": list(args), "k": {}}
        self._put(self._codec.encode(Message(MessageType.PYTHON_CALL, self._ids, "0", payload)))

    def _receive(self) -> Any:
        return self._codec.decode_payload(self._codec.decode_envelope(self._get()))["v"]

    def rpc_sync(self, to: str, function: Any, args: tuple = ()) -> Any:
        self._send(function, args)
        return self._receive()

    def one_hop(self, steps: int) -> float:
        """Seconds a step of the one-hop floor takes (the module's docstring)."""
        x = torch.ones(2, requires_grad=True)
        start = time.perf_counter()
        for step in range(steps):
            gradients = {}
            y = self.rpc_sync("worker1", hop_forward, (step, x.detach())).requires_grad_()
            (gy,) = torch.autograd.grad([y.sum()], [y])
            gradients[x] = self.rpc_sync("worker1", hop_backward, (step, gy))
            assert gradients[x][0] == 2
        return (time.perf_counter() - start) / steps

    def throughput(self, batches: int, in_flight: int = 64) -> float:
        """Calls per second, ``in_flight`` sent before their answers are read (as the RPC
        benchmark's ``wait_all`` over 64 ``rpc_async`` calls)."""
        x = torch.zeros(2)
        start = time.perf_counter()
        for _ in range(batches):
            for _ in range(in_flight):
                self._send(torch.add, (x, 1))
            for _ in range(in_flight):
                self._receive()
        return batches * in_flight / (time.perf_counter() - start)

    def _stop(self) -> None:
        """Tell the serving side to return (after its answer)."""
        self._ids += 1
        self._put(self._codec.encode(Message(MessageType.PYTHON_CALL, self._ids, "0", _STOP)))
        self._receive()


class Client(CallingSide):
    """The calling side over a ZeroMQ DEALER."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.connect(f"tcp://127.0.0.1:{port}")

    def _put(self, frames: list) -> None:
        self._dealer.send_multipart(frames)

    def _get(self) -> list:
        return self._dealer.recv_multipart(copy=False)

    def close(self) -> None:
        self._stop()
        self._dealer.close(linger=0)
        self._context.term()
