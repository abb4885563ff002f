"""A stranger with raw pyzmq: a process that reaches a worker's port (and perhaps the
rendezvous store) but did not join the group. It tries what an attacker would and reports
what came back. Run as ``python -m tests.stranger MARKER STORE_HOST:PORT WORLD_SIZE`` from
another network namespace (it reads the workers' addresses and public keys from the store,
as a stranger on the network can), or call :func:`attack` in-process."""

from __future__ import annotations

import json
import pickle
import sys
import time

import msgpack
import zmq

from zmqautograd.transport import Codec, Message, MessageType

EXT_PICKLE, EXT_FUNCTION = 16, 17


class _RunsACommand:
    """Unpickled, runs a shell command (the classic pickle attack)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return os.system, (self.command,)


def _payloads(marker: str) -> list[tuple[MessageType, object]]:
    """Calls that, if run, create ``marker``."""
    command = f"touch {marker}"
    by_reference = [
        {"f": msgpack.ExtType(EXT_FUNCTION, msgpack.packb(["os", "system"])), "a": [command], "k": {}},
        {"f": msgpack.ExtType(EXT_FUNCTION, msgpack.packb(["subprocess", "run"])), "a": [["touch", marker]], "k": {}},
        {"f": msgpack.ExtType(EXT_FUNCTION, msgpack.packb(["builtins", "exec"])),
         "a": [f"open({marker!r}, 'w').close()"], "k": {}},
    ]
    pickled = msgpack.ExtType(EXT_PICKLE, msgpack.packb([pickle.dumps(_RunsACommand(command)), []]))
    calls = [(MessageType.PYTHON_CALL, p) for p in by_reference]
    calls.append((MessageType.PYTHON_CALL, {"f": pickled, "a": [], "k": {}}))
    calls.append((MessageType.PYTHON_REMOTE_CALL, by_reference[0]))
    # Control messages: release an RRef fork, autograd contexts, arrive at shutdown for rank 1.
    for kind, module, name, args in (
            (MessageType.RREF_USER_DELETE, "zmqautograd.rpc.rref", "_delete_fork", [[0, 1], [0, 2]]),
            (MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ, "zmqautograd.autograd.cleanup", "cleanup_contexts", [[1, 2, 3]]),
            (MessageType.PYTHON_CALL, "zmqautograd.rpc.agent", "_arrive_at_shutdown", [1])):
        calls.append((kind, {"f": msgpack.ExtType(EXT_FUNCTION, msgpack.packb([module, name])), "a": args, "k": {}}))
    return calls


def _configurations(server_key: bytes | None) -> dict:
    """How a stranger may set up its socket: no security at all, PLAIN with guessed
    credentials, CURVE with its own keys (and the server's public key, if it learnt it)."""
    public, secret = zmq.curve_keypair()

    def plain(socket: zmq.Socket) -> None:
        socket.plain_username = b"0"
        socket.plain_password = b"0" * 64

    def curve(socket: zmq.Socket) -> None:
        socket.curve_serverkey = server_key or zmq.curve_keypair()[0]
        socket.curve_publickey = public
        socket.curve_secretkey = secret

    return {"null": lambda socket: None, "plain": plain, "curve": curve}


def attack(address: str, marker: str, names: list[str] | None = None, server_key: bytes | None = None,
           linger: float = 0.5) -> dict:
    """Connect to ``address`` in every configuration, under each of ``names`` (default: the
    names of a 2-worker group's ranks, and one of our own); say HELLO, send calls that would
    create ``marker``, forged answers and errors (ids 1..64), forged control messages (RRef
    delete, context cleanup, shutdown arrival, lending release, ring start, GOODBYE) and
    garbage. Returns
    per configuration how many messages came back (0 when the handshake was refused)."""
    codec = Codec()
    report: dict = {}
    context = zmq.Context()
    try:
        for kind, configure in _configurations(server_key).items():
            # The names at once (a worker tells connections apart by name), then one wait
            # for answers: one after the other, each waiting ``linger``, took 18 s of a
            # 3-worker test.
            dealers = []
            for name in names or ["0", "1", "stranger"]:
                dealer = context.socket(zmq.DEALER)
                dealers.append(dealer)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.setsockopt(zmq.ROUTING_ID, name.encode())
                configure(dealer)
                dealer.connect(address)
                frames = [codec.encode(Message(MessageType.HELLO, 0, name, {"identity": name}))]
                frames += [codec.encode(Message(kind_, 7 + i, name, payload))
                           for i, (kind_, payload) in enumerate(_payloads(marker))]
                frames += [codec.encode(Message(MessageType.PYTHON_RET, i, name, {"v": "forged"})) for i in range(1, 65)]
                frames += [codec.encode(Message(MessageType.EXCEPTION, i, name, {"exc": {
                    "module": "builtins", "type": "ValueError", "message": "forged", "traceback": ""}})) for i in range(1, 65)]
                frames += [codec.encode(Message(kind_, 0, name, payload)) for kind_, payload in (
                    (MessageType.LEND_RELEASE, [1, 2, 3]), (MessageType.SHM_START, {"bell": "x"}),
                    (MessageType.GOODBYE, None))]
                frames += [[b"\x95\x01\x10\x01\xa8stranger\xc4\x00"], [b"garbage"]]
                for message in frames:
                    try:
                        dealer.send_multipart(message, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break  # its queue is full: the handshake never completed
            received = 0
            poller = zmq.Poller()
            for dealer in dealers:
                poller.register(dealer, zmq.POLLIN)
            deadline = time.monotonic() + linger
            while (left := deadline - time.monotonic()) > 0:
                for dealer, _ in poller.poll(left * 1000):
                    dealer.recv_multipart()
                    received += 1
            for dealer in dealers:
                dealer.close()
            report[kind] = received
    finally:
        context.destroy(linger=0)  # (term() would wait for ever on dealers an error left open)
    return report


def read_store(host: str, port: int, world_size: int) -> dict:
    """What a stranger finds in the rendezvous store (torch's TCPStore, which anyone who
    reaches it may read): the member records of the first round, once all are there."""
    from datetime import timedelta

    import torch.distributed as dist

    deadline = time.monotonic() + 60
    while True:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
            break
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # (the store is not up yet)
    keys = [f"zmqautograd/1/member/{rank}/1" for rank in range(world_size)]  # (each rank's first record)
    store.wait(keys, timedelta(seconds=60))
    return {rank: _record(store.get(key).decode()) for rank, key in enumerate(keys)}


def _record(text: str) -> dict:
    record = json.loads(text)
    return json.loads(record["record"]) if "record" in record else record  # signed ones too


def main() -> None:
    marker, store, world_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    host, port = store.rsplit(":", 1)
    records = read_store(host, int(port), world_size)
    reports = {}
    for record in records.values():
        key = record.get("credential", "").encode() if record.get("mechanism") == "curve" else None
        reports[record["address"]] = attack(record["address"], marker, names=[str(r) for r in records] + ["x"],
                                            server_key=key)
    print(json.dumps({"store_records": len(records), "reports": reports}), flush=True)


if __name__ == "__main__":
    main()
