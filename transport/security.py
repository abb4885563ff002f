"""CURVE encryption and authentication from one cluster secret (DESIGN.md: security).

Every worker derives the same two CURVE key pairs from the secret: a *server* pair (each
ROUTER listens as a CURVE server with it) and a *client* pair (each ROUTER connects to its
peers as a CURVE client with it). A connecting peer must know the server's public key to even
complete the handshake, and the ZAP handler admits only the client public key the secret
gives, so a peer without the secret is refused inside libzmq, before any of its bytes reach
the codec. All traffic between workers is encrypted (CurveZMQ).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends authentication requests
ENVIRONMENT_VARIABLE = "ZMQAUTOGRAD_CLUSTER_SECRET"


@dataclass(frozen=True)
class ClusterKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> "ClusterKeys":
        if not zmq.has("curve"):
            raise RuntimeError("a cluster secret needs CURVE, and this libzmq was built without it")
        if isinstance(secret, str):
            secret = secret.encode()
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes long")

        def pair(role: bytes) -> tuple[bytes, bytes]:
            private = z85.encode(hashlib.sha256(b"zmqautograd curve " + role + b"\0" + secret).digest())
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"server")
        client_public, client_secret = pair(b"client")
        return cls(server_public, server_secret, client_public, client_secret)

    def configure_listener(self, socket: zmq.Socket) -> None:
        """Before bind: incoming connections are CURVE-server sessions."""
        socket.curve_server = True
        socket.curve_publickey = self.server_public
        socket.curve_secretkey = self.server_secret
        socket.zap_domain = b"zmqautograd"

    def configure_connect(self, socket: zmq.Socket) -> None:
        """Before connect: this outgoing connection is a CURVE client of the peer's listener
        (libzmq takes a connection's options when it is made)."""
        socket.curve_server = False
        socket.curve_serverkey = self.server_public
        socket.curve_publickey = self.client_public
        socket.curve_secretkey = self.client_secret

    def zap_reply(self, request: list[bytes]) -> tuple[list[bytes], bool]:
        """Answer one ZAP request (RFC 27): admit only the cluster's client key."""
        version, request_id = request[0], request[1]
        mechanism = request[5] if len(request) > 5 else b""
        key = request[6] if len(request) > 6 else b""
        admitted = version == b"1.0" and mechanism == b"CURVE" and key == z85.decode(self.client_public)
        status = [b"200", b"OK"] if admitted else [b"400", b"not a member of this cluster"]
        return [b"1.0", request_id, *status, b"", b""], admitted
