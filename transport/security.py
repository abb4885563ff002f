"""Who may talk to an endpoint, proven inside ZeroMQ's handshake (docs/transport.md, "Security").

Two ways, one per endpoint:

* :class:`Membership` (what the RPC layer always uses): every member has credentials of its
  own, made fresh when it starts, and the endpoint knows each member's public part (the RPC
  layer learns them at rendezvous). Over ``"curve"`` (authenticated and encrypted, CurveZMQ;
  the RPC layer's default) it holds its own CURVE key pair; over ``"plain"`` (authenticated,
  not encrypted) it shows an HMAC of its own random token over the two names.
  The ZAP handler admits a connection only with a member's credentials, names it by that
  member (ZMQ's ``User-Id``), and the endpoint then checks that the connection calls itself
  by that name. A connection that fails is closed by libzmq: no byte of it reaches the codec.
* :class:`ClusterKeys`: CURVE key pairs derived from one shared cluster secret, for embedders
  of the transport alone; any holder of the secret may connect under any name.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import zmq
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends authentication requests
ENVIRONMENT_VARIABLE = "ZMQAUTOGRAD_CLUSTER_SECRET"
ZAP_DOMAIN = b"zmqautograd"


class SocketOptions(Protocol):
    """A zmq socket, as far as the credentials are concerned."""

    def setsockopt(self, option: int, optval: int | bytes) -> None: ...
MECHANISMS = ("plain", "curve")
TOKEN_BYTES = 32
NONCE_BYTES = 16


class Refusal(Exception):
    """Why a connection or a HELLO was refused (said in the log, counted by the endpoint)."""


class NotYetKnown(Refusal):
    """Credentials of nobody admitted so far, while more members may still be admitted (a
    peer that finished the rendezvous first connects before we have read its record): the
    endpoint holds the request until :meth:`Membership.seal` or a deadline."""


def _need_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("encryption needs CURVE, and this libzmq was built without it "
                           "(encrypt=False authenticates without it)")


@dataclass(frozen=True)
class Credentials:
    """One member's credentials: ``public`` is what the others must know of it (the token
    over "plain", which the store is trusted with; the z85 public key over "curve"),
    ``secret`` what only it holds (the CURVE secret key; empty over "plain")."""

    mechanism: str
    public: bytes
    secret: bytes = b""

    @classmethod
    def generate(cls, mechanism: str) -> Credentials:
        if mechanism == "plain":
            return cls("plain", os.urandom(TOKEN_BYTES).hex().encode())
        if mechanism == "curve":
            _need_curve()
            public, secret = zmq.curve_keypair()
            return cls("curve", public, secret)
        raise ValueError(f"unknown security mechanism {mechanism!r}: use one of {MECHANISMS}")

    def published(self) -> str:
        """What goes to the rendezvous: the public part, as text."""
        return self.public.decode()

    def __repr__(self) -> str:  # never the token in a log
        return f"Credentials({self.mechanism!r})"


def zap_refusal(request_id: bytes, text: bytes = b"not a member of this group") -> list[bytes]:
    """A ZAP reply (RFC 27) that refuses the connection ``request_id`` asked about."""
    return [b"1.0", request_id, b"400", text, b"", b""]


def _zap_admission(request_id: bytes, user_id: bytes = b"") -> list[bytes]:
    return [b"1.0", request_id, b"200", b"OK", user_id, b""]


def _tag(key: bytes, *parts: str | bytes) -> str:
    message = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class Membership:
    """The members an endpoint admits, each with its public credential, and this endpoint's
    own credentials. Names are the endpoints' identities on the wire.

    Over "plain" the connecting side sends, as its PLAIN password, an HMAC of its token over
    both names, and the accepting side proves itself in its HELLO answer with an HMAC of its
    own token over a fresh nonce of the connecting side's HELLO (``prove``/``verify``);
    messages to it wait until then. Over "curve" the handshake proves both sides.
    """

    def __init__(self, name: str, own: Credentials, secret: bytes | None = None):
        self.name = name
        self.own = own
        self.mechanism = own.mechanism
        # With a cluster secret, PLAIN credentials are keyed by it as well as by the token: a
        # token read from the store is not enough to connect.
        self._secret_key = hashlib.sha256(b"zmqautograd plain key\0" + secret).digest() if secret else None
        self._members: dict[str, bytes] = {}  # name -> public credential
        self._by_curve_key: dict[bytes, str] = {}  # raw 32-byte public key -> name
        self.sealed = False  # no more members will be admitted (seal)

    @classmethod
    def generate(cls, name: str, mechanism: str = "plain", secret: bytes | None = None) -> Membership:
        return cls(name, Credentials.generate(mechanism), secret)

    def admit(self, name: str, public: bytes | str) -> None:
        """Make ``name`` a member, proven by ``public`` (its ``Credentials.public``). The I/O
        thread reads these tables while this runs on another: the name is a member before
        the key that leads to it is in the ZAP handler's table."""
        public = public.encode() if isinstance(public, str) else bytes(public)
        raw = b""
        if self.mechanism == "curve":
            try:
                raw = z85.decode(public)
            except (ValueError, TypeError, KeyError):  # not z85
                pass
            if len(public) != 40 or len(raw) != 32:
                raise ValueError(f"member {name!r}: malformed CURVE public key")
        elif not public:
            raise ValueError(f"member {name!r}: empty token")
        previous = self._members.get(name)
        self._members[name] = public
        if self.mechanism == "curve":
            if previous is not None and previous != public:
                self._by_curve_key.pop(z85.decode(previous), None)
            self._by_curve_key[raw] = name

    def seal(self) -> None:
        """Every member is admitted: credentials of anybody else are refused from now on
        (before, the endpoint holds them a while: NotYetKnown)."""
        self.sealed = True

    def __contains__(self, name: str) -> bool:
        return name in self._members

    # ------------------------------------------------------------------ socket options

    def configure_listener(self, socket: SocketOptions) -> None:
        """Before bind: connections to this socket authenticate through the ZAP handler."""
        if self.mechanism == "curve":
            socket.setsockopt(zmq.CURVE_SERVER, 1)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, self.own.public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.own.secret)
        else:
            socket.setsockopt(zmq.PLAIN_SERVER, 1)
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def configure_connect(self, socket: SocketOptions, peer: str) -> None:
        """Before connect to member ``peer`` (libzmq takes a connection's options when it is
        made, so one ROUTER is a server for what connects to it and a client of its peers)."""
        public = self._members.get(peer)
        if public is None:
            raise Refusal(f"{peer!r} is not a member")
        if self.mechanism == "curve":
            socket.setsockopt(zmq.CURVE_SERVER, 0)
            socket.setsockopt(zmq.CURVE_SERVERKEY, public)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, self.own.public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.own.secret)
        else:
            socket.setsockopt(zmq.PLAIN_SERVER, 0)
            socket.setsockopt(zmq.PLAIN_USERNAME, self.name.encode())
            socket.setsockopt(zmq.PLAIN_PASSWORD, self._password(self.own.public, self.name, peer).encode())

    def _key(self, token: bytes) -> bytes:
        return token if self._secret_key is None else hmac.new(self._secret_key, token, hashlib.sha256).digest()

    def _password(self, token: bytes, client: str, server: str) -> str:
        return _tag(self._key(token), b"zmqautograd plain", client, server)

    # ------------------------------------------------------------------------ ZAP

    def zap_reply(self, request: list[bytes], admissible: Callable[[str], bool]) -> tuple[list[bytes], str | None, str]:
        """Answer one ZAP request (RFC 27): (reply frames, the member admitted or None, why
        not). ``admissible(name)`` says whether that member may connect now (once: a member
        already connected, or gone, is refused, so a credential seen on the wire cannot be
        used again). Raises NotYetKnown for credentials that a member admitted later may
        still have."""
        version = request[0] if request else b""
        request_id = request[1] if len(request) > 1 else b""
        mechanism = request[5] if len(request) > 5 else b""
        name: str | None = None
        why = ""
        try:
            if version != b"1.0":
                raise Refusal(f"ZAP version {version!r}")
            name = self._authenticate(mechanism, request[6:])
            if not admissible(name):
                raise Refusal(f"member {name!r} is connected already, or gone")
        except NotYetKnown:
            raise
        except Refusal as exc:
            name, why = None, str(exc)
        if name is None:
            return zap_refusal(request_id), None, why
        return _zap_admission(request_id, name.encode()), name, ""

    def _authenticate(self, mechanism: bytes, credentials: list[bytes]) -> str:
        # Whether we are sealed is read before the credentials are looked up: the thread that
        # admits members seals after it, so sealed then means every member is visible now.
        # Read after, a lookup that just missed a member admitted meanwhile would refuse it.
        unknown = Refusal if self.sealed else NotYetKnown
        if mechanism != self.mechanism.upper().encode():
            raise Refusal(f"mechanism {mechanism.decode(errors='replace')!r}, this group uses {self.mechanism.upper()}")
        if self.mechanism == "curve":
            name = self._by_curve_key.get(credentials[0] if credentials else b"")
            if name is None:
                raise unknown("a CURVE key that no member has")
            return name
        if len(credentials) != 2:
            raise Refusal("malformed PLAIN credentials")
        try:
            name = credentials[0].decode()
        except UnicodeDecodeError:
            raise Refusal("a user name that is not UTF-8") from None
        token = self._members.get(name)
        if token is None:
            raise unknown(f"{name[:60]!r} is not a member")
        if not hmac.compare_digest(self._password(token, name, self.name).encode(), credentials[1]):
            raise Refusal(f"wrong credentials for member {name!r}")
        return name

    # ------------------------------------------------------- the accepting side's proof

    def new_nonce(self) -> bytes | None:
        """What the connecting side's HELLO carries for the accepting side to prove itself
        with (None over CURVE, whose handshake proved the server already)."""
        return os.urandom(NONCE_BYTES) if self.mechanism == "plain" else None

    def prove(self, nonce: object, client: str) -> str | None:
        """The accepting side's proof for its HELLO answer to ``client``."""
        if self.mechanism != "plain" or not isinstance(nonce, bytes):
            return None
        return _tag(self._key(self.own.public), b"zmqautograd hello", nonce, self.name, client)

    def verify(self, server: str, nonce: bytes | None, proof: object) -> None:
        """The connecting side: the HELLO answer of ``server`` proves it is that member."""
        if self.mechanism != "plain":
            return  # CURVE: only the holder of the member's secret key completes the handshake
        token = self._members.get(server)
        if token is None or nonce is None:
            raise Refusal(f"{server!r} is not a member")
        expected = _tag(self._key(token), b"zmqautograd hello", nonce, server, self.name)
        if not isinstance(proof, str) or not hmac.compare_digest(expected.encode(), proof.encode()):
            raise Refusal(f"the peer at this address did not prove it is member {server!r}")


def sign_record(secret: bytes, key: str, value: bytes) -> str:
    """The HMAC of a rendezvous record under the cluster secret, bound to its store key (a
    record cannot be moved to another key, rank or round)."""
    return _tag(_store_key(secret), b"zmqautograd record", key, value)


def record_is_authentic(secret: bytes, key: str, value: bytes, signature: object) -> bool:
    return isinstance(signature, str) and hmac.compare_digest(sign_record(secret, key, value).encode(), signature.encode())


def _store_key(secret: bytes) -> bytes:
    return hashlib.sha256(b"zmqautograd store\0" + secret).digest()


def secret_bytes(secret: str | bytes) -> bytes:
    secret = secret.encode() if isinstance(secret, str) else bytes(secret)
    if len(secret) < 16:
        raise ValueError("the cluster secret must be at least 16 bytes long")
    return secret


@dataclass(frozen=True)
class ClusterKeys:
    """CURVE key pairs derived from one shared secret (embedders of the transport alone)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: str | bytes) -> ClusterKeys:
        _need_curve()
        secret = secret_bytes(secret)

        def pair(role: bytes) -> tuple[bytes, bytes]:
            private = z85.encode(hashlib.sha256(b"zmqautograd curve " + role + b"\0" + secret).digest())
            return zmq.curve_public(private), private

        server_public, server_secret = pair(b"server")
        client_public, client_secret = pair(b"client")
        return cls(server_public, server_secret, client_public, client_secret)

    def configure_listener(self, socket: SocketOptions) -> None:
        """Before bind: incoming connections are CURVE-server sessions."""
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    def configure_connect(self, socket: SocketOptions, peer: str = "") -> None:
        """Before connect: this outgoing connection is a CURVE client of the peer's listener."""
        socket.setsockopt(zmq.CURVE_SERVER, 0)
        socket.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        socket.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def zap_reply(self, request: list[bytes], admissible: Callable[[str], bool]) -> tuple[list[bytes], str | None, str]:
        """Answer one ZAP request: admit only the cluster's client key."""
        version, request_id = request[0], request[1]
        mechanism = request[5] if len(request) > 5 else b""
        key = request[6] if len(request) > 6 else b""
        admitted = version == b"1.0" and mechanism == b"CURVE" and key == z85.decode(self.client_public)
        if not admitted:
            return zap_refusal(request_id, b"not a member of this cluster"), None, \
                "it does not hold the cluster secret"
        return _zap_admission(request_id), "", ""

    # A shared secret names nobody: the connection's name is what its HELLO says.
    def new_nonce(self) -> bytes | None:
        return None

    def prove(self, nonce: object, client: str) -> str | None:
        return None

    def verify(self, server: str, nonce: bytes | None, proof: object) -> None:
        return None
