"""CURVE from a cluster secret: members talk (encrypted); strangers are refused inside the
handshake, before any of their bytes reach the codec."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq

from transport import Message, MessageType
from transport.endpoint import Endpoint, EndpointOptions
from transport.security import ClusterKeys

pytestmark = pytest.mark.timeout(60)
SECRET = "correct horse battery staple"


def _server(received: list, arrived: threading.Condition) -> Endpoint:
    def on_message(message):
        with arrived:
            received.append(message)
            arrived.notify_all()

    return Endpoint("server", "tcp://127.0.0.1:0", on_message=on_message, options=EndpointOptions(cluster_secret=SECRET))


def _stranger_sends(address: str, configure, until=None) -> None:
    """A raw pyzmq peer that tries to get a message through; it stays connected until
    ``until()`` holds (at most 10 s) or, without one, for half a second."""
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, b"stranger")
        dealer.setsockopt(zmq.LINGER, 0)
        configure(dealer)
        dealer.connect(address)
        for _ in range(5):
            dealer.send_multipart([b"\x95\x01\x10\x01\xa8stranger\xc4\x00"], flags=zmq.NOBLOCK)
        # A stranger's connection never completes: what it waits for is the server's side.
        deadline = time.monotonic() + (10 if until else 0.5)
        while time.monotonic() < deadline and not (until and until()):
            dealer.poll(50)
        dealer.close()
    finally:
        context.term()


def test_members_talk_and_strangers_are_refused_before_decoding():
    received: list = []
    arrived = threading.Condition()
    server = _server(received, arrived)
    member = Endpoint("member", on_message=lambda m: None, options=EndpointOptions(cluster_secret=SECRET))
    try:
        member.connect("server", server.address)
        member.wait_for_peer("server", 10)
        member.send("server", Message(MessageType.PYTHON_CALL, 1, "member", {"x": torch.arange(4.0)}))
        with arrived:
            assert arrived.wait_for(lambda: len(received) == 1, 10)
        assert torch.equal(received[0].payload["x"], torch.arange(4.0))

        # 1. No CURVE at all (a plain ZMTP client): the mechanisms differ, libzmq drops it.
        _stranger_sends(server.address, lambda s: None)
        # 2. CURVE with keys from another secret: it cannot even address the server's key.
        other = ClusterKeys.from_secret("a different secret entirely")
        _stranger_sends(server.address, other.configure_connect)
        # 3. Knows the server's public key (leaked) but not the client key: refused by ZAP.
        keys = ClusterKeys.from_secret(SECRET)
        public, secret = zmq.curve_keypair()

        def leaked(socket):
            socket.curve_serverkey = keys.server_public
            socket.curve_publickey = public
            socket.curve_secretkey = secret

        _stranger_sends(server.address, leaked, until=lambda: server.refused_connections >= 1)

        # Nothing of theirs was decoded or even counted as a peer's traffic ...
        assert set(server.stats()) == {"member"}
        assert server.stats()["member"].protocol_errors == 0
        assert server.refused_connections >= 1  # case 3 went through the ZAP handler
        # ... and the member is still served.
        member.send("server", Message(MessageType.PYTHON_CALL, 2, "member", {"x": torch.ones(2)}))
        with arrived:
            assert arrived.wait_for(lambda: len(received) == 2, 10)
        assert [m.sender for m in received] == ["member", "member"]
    finally:
        member.close()
        server.close()


def test_a_worker_with_another_secret_cannot_join():
    received: list = []
    server = _server(received, threading.Condition())
    outsider = Endpoint("outsider", on_message=lambda m: None,
                        options=EndpointOptions(cluster_secret="not the cluster's secret at all"))
    try:
        outsider.connect("server", server.address)
        with pytest.raises(Exception):
            outsider.wait_for_peer("server", 2)
        assert received == []
    finally:
        outsider.close()
        server.close()


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ClusterKeys.from_secret("short")
