"""A stranger with raw pyzmq: a process that reaches a worker's port (and perhaps the
rendezvous store) but did not join the group. It tries what an attacker would and reports
what came back. Run as ``python -m tests.stranger ADDRESS MARKER`` from another network
namespace, or call :func:`attack` in-process."""

from __future__ import annotations

import json
import pickle
import sys
import time

import msgpack
import zmq

from transport import Codec, Message, MessageType

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
    create ``marker``, forged answers (ids 1..64), forged control messages and garbage. Returns
    per configuration how many messages came back (0 when the handshake was refused)."""
    codec = Codec()
    report: dict = {}
    context = zmq.Context()
    try:
        for kind, configure in _configurations(server_key).items():
            received = 0
            for name in names or ["0", "1", "stranger"]:
                dealer = context.socket(zmq.DEALER)
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
                frames += [codec.encode(Message(MessageType.GOODBYE, 0, name))]
                frames += [[b"\x95\x01\x10\x01\xa8stranger\xc4\x00"], [b"garbage"]]
                for message in frames:
                    try:
                        dealer.send_multipart(message, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break  # its queue is full: the handshake never completed
                deadline = time.monotonic() + linger
                while time.monotonic() < deadline:
                    if dealer.poll(20):
                        dealer.recv_multipart()
                        received += 1
                dealer.close()
            report[kind] = received
    finally:
        context.term()
    return report


def read_store(host: str, port: int) -> dict:
    """What a stranger finds in the rendezvous store (torch's TCPStore, unauthenticated): the
    member records of the first round."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    records = {}
    for rank in range(16):
        key = f"zmqautograd/1/member/{rank}"
        if not store.check([key]):
            break
        records[rank] = store.get(key).decode()
    return records


def _record(text: str) -> dict:
    record = json.loads(text)
    return json.loads(record["record"]) if "record" in record else record  # signed ones too


def main() -> None:
    address, marker = sys.argv[1], sys.argv[2]
    store = sys.argv[3] if len(sys.argv) > 3 else None
    found = {}
    if store:
        host, port = store.rsplit(":", 1)
        found = read_store(host, int(port))
        addresses = [_record(r)["address"] for r in found.values()]
    else:
        addresses = [address]
    reports = {a: attack(a, marker) for a in addresses}
    print(json.dumps({"store_records": len(found), "reports": reports}), flush=True)


if __name__ == "__main__":
    main()
