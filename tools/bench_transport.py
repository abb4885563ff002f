"""Transport round trips, next to a raw pyzmq ping-pong measured in the same run.

Each side runs in its own process (an echo server and the timing client), on loopback TCP.
Raw pyzmq: DEALER -> ROUTER echo, zero-copy frames, no encoding at all: the floor that any
ZeroMQ transport in Python stands on. zmqautograd: Endpoint -> Endpoint echo, the payload a
real tensor (encoded, validated and rebuilt on both sides).

The small round trip is also measured with the opt-in modes: ``inline_handlers`` on the echo
server, and ``busy_poll`` on both ends, which is compared with a raw pyzmq ping-pong whose two
ends also spin (poll without sleeping, yielding the CPU) instead of sleeping in ``recv``.

``stolen``: the share of the machine's CPU time the hypervisor stole while a row was measured
(tools/machine.py); before and after the table, the rate of a plain Python loop and the
time of a blocking wake-up round trip (the same).

    python tools/bench_transport.py [--rounds 15] [--small-per-round 300]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torch warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402
import zmq  # noqa: E402

from zmqautograd.transport import Message, MessageType  # noqa: E402
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions  # noqa: E402
from zmqautograd.transport.tensors import as_buffer  # noqa: E402
from tools.machine import StealMeter, kind_line, speed_line  # noqa: E402

SIZES_MB = (1, 16, 64)


# ----------------------------------------------------------------------------- raw pyzmq


BUSY_POLL = 0.02  # seconds of spinning after traffic, in the busy-polling variants


def _spin_until_readable(socket: zmq.Socket) -> None:
    """What busy polling does, for raw pyzmq: poll without sleeping (yielding the CPU) for up
    to BUSY_POLL before the blocking receive."""
    until = time.perf_counter() + BUSY_POLL
    while not socket.poll(0) and time.perf_counter() < until:
        os.sched_yield()


def _raw_server(address_queue: mp.Queue, spin: bool = False) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind("tcp://127.0.0.1:*")
    address_queue.put(socket.getsockopt(zmq.LAST_ENDPOINT).decode())
    while True:
        if spin:
            _spin_until_readable(socket)
        frames = socket.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            return
        socket.send_multipart(frames, copy=False)


def _spawn_server(target) -> tuple[mp.Process, str]:
    """Start ``target(address_queue)`` in a fresh process; return it and the address it bound."""
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    process = ctx.Process(target=target, args=(address_queue,), daemon=True)
    process.start()
    return process, address_queue.get(timeout=60)


class RawClient:
    """DEALER client of a raw ROUTER echo server in another process."""

    def __init__(self, spin: bool = False) -> None:
        self.server, address = _spawn_server(functools.partial(_raw_server, spin=spin))
        self.spin = spin
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(address)
        self.header = b"h" * 32

    def round_trip(self, payload: torch.Tensor) -> None:
        buffer = as_buffer(payload) if payload.numel() > 64 else bytes(8)
        self.socket.send_multipart([self.header, buffer], copy=False)
        if self.spin:
            _spin_until_readable(self.socket)
        frames = self.socket.recv_multipart(copy=False)
        assert frames[1].buffer.nbytes == memoryview(buffer).nbytes

    def close(self) -> None:
        self.socket.send_multipart([b"stop"])
        self.server.join(10)
        self.socket.close(0)
        self.context.term()


# ----------------------------------------------------------------------------- zmqautograd


def _endpoint_server(address_queue: mp.Queue, inline_handlers: bool = False, busy_poll: float = 0.0) -> None:
    stop = threading.Event()

    def echo(message: Message) -> None:
        if isinstance(message.payload, str) and message.payload == "stop":
            stop.set()
            return
        endpoint.send(message.sender, Message(MessageType.PYTHON_RET, message.id, "server", message.payload))

    endpoint = Endpoint("server", on_message=echo, inline_handlers=inline_handlers,
                        options=EndpointOptions(busy_poll=busy_poll))
    address_queue.put(endpoint.address)
    endpoint.expect("client")
    stop.wait()
    endpoint.close()


class EndpointClient:
    """zmqautograd Endpoint client of an Endpoint echo server in another process."""

    def __init__(self, inline_handlers: bool = False, busy_poll: float = 0.0) -> None:
        self.server, address = _spawn_server(
            functools.partial(_endpoint_server, inline_handlers=inline_handlers, busy_poll=busy_poll)
        )
        self.endpoint = Endpoint("client", options=EndpointOptions(busy_poll=busy_poll))
        self.endpoint.connect("server", address)
        self.endpoint.wait_for_peer("server", 30)
        self.ids = iter(range(1, 1 << 62))

    def round_trip(self, payload) -> Message:
        self.endpoint.send("server", Message(MessageType.PYTHON_CALL, next(self.ids), "client", payload))
        reply = self.endpoint.recv(30)
        assert reply.payload.numel() == payload.numel()
        return reply

    def close(self) -> None:
        self.endpoint.send("server", Message(MessageType.PYTHON_CALL, next(self.ids), "client", "stop"))
        self.server.join(10)
        self.endpoint.close()


def compare(clients: dict, payload: torch.Tensor, rounds: int, per_round: int) -> dict[str, float]:
    """Median seconds per round trip for each client, alternating clients every round so that
    both see the same machine noise."""
    for client in clients.values():
        for _ in range(3):
            client.round_trip(payload)  # warm up: connections, allocator, page cache
    samples: dict[str, list[float]] = {name: [] for name in clients}
    for _ in range(rounds):
        for name, client in clients.items():
            start = time.perf_counter()
            for _ in range(per_round):
                client.round_trip(payload)
            samples[name].append((time.perf_counter() - start) / per_round)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per size")
    parser.add_argument("--small-per-round", type=int, default=300)
    args = parser.parse_args()
    print(kind_line(), flush=True)
    print(speed_line("before"), flush=True)
    clients = {
        "raw": RawClient(),
        "ours": EndpointClient(),
        "inline": EndpointClient(inline_handlers=True),
        "raw_spin": RawClient(spin=True),
        "busy": EndpointClient(busy_poll=BUSY_POLL),
    }
    # The opt-in variants, measured for the small round trip only (where the hand-overs and
    # wake-ups they save show): (client, its baseline, what it is).
    variants = [
        ("inline", "raw", "opt-in inline_handlers on the server"),
        ("busy", "raw_spin", f"opt-in busy_poll={BUSY_POLL} both ends; raw pyzmq spinning too"),
    ]
    try:
        rows = [("small", torch.zeros(2), args.small_per_round)]
        rows += [(f"{mb}MB", torch.ones(mb << 20, dtype=torch.uint8), 1 if mb > 1 else 5) for mb in SIZES_MB]
        print(f"{'round trip':<12}{'raw pyzmq':>14}{'zmqautograd':>14}{'ratio':>8}{'stolen':>9}   goal", flush=True)
        for key, payload, per_round in rows:
            contenders = clients if key == "small" else {k: clients[k] for k in ("raw", "ours")}
            steal = StealMeter()
            result = compare(contenders, payload, args.rounds, per_round)
            goal = "<= 2.0x" if key == "small" else "<= 1.3x" if key == "64MB" else ""
            unit, scale = ("us", 1e6) if key == "small" else ("ms", 1e3)
            print(
                f"{key:<12}{result['raw'] * scale:>11.1f} {unit}{result['ours'] * scale:>11.1f} {unit}"
                f"{result['ours'] / result['raw']:>7.2f}x{steal.text():>9}   {goal}",
                flush=True,
            )
            for name, baseline, what in variants:
                if name in result:
                    print(
                        f"{'  ' + name:<12}{result[baseline] * scale:>11.1f} {unit}{result[name] * scale:>11.1f} {unit}"
                        f"{result[name] / result[baseline]:>7.2f}x{'':>9}   ({what})",
                        flush=True,
                    )
    finally:
        for client in clients.values():
            client.close()
    print(speed_line("after"), flush=True)


if __name__ == "__main__":
    main()
