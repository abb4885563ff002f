"""Real multi-process RPC groups for the tests: worker processes that join with init_rpc and
serve until the driver (the test process, rank 0) shuts the group down."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import traceback

import zmq

from tools import ports
from zmqautograd.transport import Codec, Message, MessageType
from zmqautograd.transport.security import Membership
from zmqautograd import rpc

free_port = ports.free_port  # (tools/ports.py: one that no connect() takes meanwhile)


def spawn_and_collect(target, per_process_args: list[tuple], timeout: float = 90) -> list:
    """Run ``target(*args, results)`` in one fresh process per args tuple; each puts one item
    on ``results``. Returns the items, in arrival order; processes that do not exit are
    killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=target, args=(*args, results)) for args in per_process_args]
    for process in processes:
        process.start()
    try:
        return [results.get(timeout=timeout) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


def worker_main(rank: int, world_size: int, init_method: str, options: dict, errors) -> None:
    try:
        rpc.init_rpc(
            f"worker{rank}", rank=rank, world_size=world_size,
            rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options),
        )
        rpc.shutdown()  # graceful: serves everyone until every worker reaches shutdown
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise


class Group:
    """Ranks 1..world_size-1 in worker processes; rank 0 is the calling (test) process."""

    def __init__(self, world_size: int = 4, **options):
        self.world_size = world_size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        self.processes = [
            ctx.Process(target=worker_main, args=(rank, world_size, self.init_method, options, self.errors), daemon=True)
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()
        rpc.init_rpc(
            "worker0", rank=0, world_size=world_size,
            rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=self.init_method, **options),
        )

    @property
    def names(self) -> list[str]:
        return [f"worker{rank}" for rank in range(self.world_size)]

    def shutdown(self) -> None:
        try:
            rpc.shutdown()
        finally:
            for process in self.processes:
                process.join(30)
                if process.is_alive():
                    process.kill()
        failures = []
        while not self.errors.empty():
            failures.append(self.errors.get())
        assert not failures, f"worker failures: {failures}"
        assert all(p.exitcode == 0 for p in self.processes), [p.exitcode for p in self.processes]


def group_fixture(world_size: int = 4, **options):
    """A module-scoped pytest fixture ``group``: one Group serves every test of the module."""
    import pytest

    @pytest.fixture(scope="module")
    def group():
        g = Group(world_size=world_size, **options)
        yield g
        g.shutdown()

    return group


@contextlib.contextmanager
def admitted_member(name: str, worker: str = "worker1", rank: str = "1", **socket_options):
    """A raw DEALER connected to ``worker`` (wire name ``rank``) as member ``name``: the
    worker admitted it, as an embedder admits an extra peer, and it said HELLO, so that what
    it sends gets past the handshake and HELLO to the codec and the RPC layer: what a
    compromised member can do. ``socket_options``: zmq option names and values."""
    from . import security_functions as sf

    own = Membership.generate(name, rpc.rpc_sync(worker, sf.mechanism))
    rpc.rpc_sync(worker, sf.admit, args=(name, own.own.published()))
    own.admit(rank, rpc.rpc_sync(worker, sf.credential))
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, name.encode())
    raw.setsockopt(zmq.LINGER, 0)
    for option, value in socket_options.items():
        raw.setsockopt(getattr(zmq, option), value)
    own.configure_connect(raw, rank)
    raw.connect(rpc.rpc_sync(worker, sf.address))
    try:
        raw.send_multipart(Codec().encode(Message(MessageType.HELLO, 0, name, {"identity": name})))
        yield raw
    finally:
        raw.close()
        context.term()


def answers_to(raw, codec: Codec, messages: dict[int, Message], timeout: float = 10.0) -> dict[int, tuple]:
    """Send ``messages`` (by id) over ``raw`` (an ``admitted_member``); what came back for
    each, by id: (message type, payload) of its value, its error or the refusal of it."""
    for message in messages.values():
        raw.send_multipart(codec.encode(message))
    answered: dict[int, tuple] = {}
    while len(answered) < len(messages) and raw.poll(int(timeout * 1000)):
        answer = codec.decode(raw.recv_multipart())
        if answer.type in (MessageType.PROTOCOL_ERROR, MessageType.EXCEPTION, MessageType.PYTHON_RET):
            answered[answer.id] = (answer.type, answer.payload)
    return answered
