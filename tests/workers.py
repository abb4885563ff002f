"""Worker processes for the multi-process transport tests.

Each runs a real :class:`zmqautograd.transport.endpoint.Endpoint` in a spawned process and reports its
address through a multiprocessing queue. The tests talk to it over real sockets.
"""

from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import signal
import threading
from dataclasses import dataclass

import torch

from zmqautograd.transport import Message, MessageType
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions
from zmqautograd.transport.tensors import as_buffer


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a contiguous CPU tensor's bytes (no numpy needed)."""
    return hashlib.sha256(as_buffer(tensor.contiguous())).hexdigest()


def serve(address_queue, identity: str, bind: str, options: dict | None = None) -> None:
    """An echo server. Payloads are dicts with an "op":

    echo (reply with "data"), digest (reply with the sha256 of tensor "data"), record (append
    (sender, "seq") to a log, no reply), log (reply with the log), stats (reply with the
    endpoint's PeerStats of the sender, as a dict), exit.
    """
    log: list = []
    done = threading.Event()

    def handle(message: Message) -> None:
        op = message.payload.get("op") if isinstance(message.payload, dict) else None
        reply = None
        if op == "echo":
            reply = message.payload["data"]
        elif op == "digest":
            reply = tensor_digest(message.payload["data"])
        elif op == "record":
            log.append((message.sender, message.payload["seq"]))
            return
        elif op == "log":
            reply = list(log)
        elif op == "stats":  # this server's counters for the asking peer
            reply = dataclasses.asdict(endpoint.stats()[message.sender])
        elif op == "exit":
            done.set()
            return
        endpoint.send(message.sender, Message(MessageType.PYTHON_RET, message.id, identity, reply))

    endpoint = Endpoint(
        identity, bind, on_message=handle, options=EndpointOptions(**(options or {}))
    )
    address_queue.put((endpoint.address, os.getpid()))
    done.wait()
    endpoint.close()


@dataclass
class ServerProcess:
    """A spawned echo server: its process, address and identity."""

    process: mp.Process
    address: str
    identity: str

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def start_server(identity: str = "server", bind: str = "tcp://127.0.0.1:0", options: dict | None = None) -> ServerProcess:
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    process = ctx.Process(target=serve, args=(address_queue, identity, bind, options), daemon=True)
    process.start()
    address, _pid = address_queue.get(timeout=90)
    return ServerProcess(process, address, identity)
