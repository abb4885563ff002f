"""Who may connect and how a connection starts: ZAP answers (CURVE keys, cluster membership),
connecting, HELLO and its answer (see endpoint.py and security.py)."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import zmq

from .bulk import listen_host
from .codec import Envelope, ExtensionNotDecoded, Message, MessageType
from .errors import (
    ProtocolError,
)
from .io_loop import _EVENTS, _POLLIN, OpenSocket, _frames_nbytes
from .peers import PeerState, PeerStats, _Peer
from .security import ClusterKeys, Membership, NotYetKnown, Refusal, zap_refusal

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)

_ZAP_HELD_MAX = 64  # connections waiting to be identified (NotYetKnown), at most

def _peer_host(address: str | None, fd: int | None) -> str | None:
    """The peer's host: from the address we connected to, else from the connection it made."""
    if address is not None:
        return listen_host(address)
    if fd is None:
        return None
    try:
        with socket.socket(fileno=os.dup(fd)) as connection:
            return connection.getpeername()[0]
    except OSError:
        return None


def _zap_address(request: list[bytes]) -> str:
    return request[3].decode(errors="replace") if len(request) > 3 else "?"


class Handshake:
    """The endpoint's authentication and HELLO exchange (part of ``Endpoint``)."""

    def _zap_and_guard(self: Endpoint) -> tuple[OpenSocket, Membership | ClusterKeys]:
        zap, guard = self._zap, self._guard
        assert zap is not None and guard is not None, "ZAP is answered only with a membership or a cluster secret"
        return zap, guard

    def _authenticate(self: Endpoint) -> None:
        """Answer libzmq's ZAP requests: a connection without a member's credentials is
        refused here, inside the handshake, before any message of it exists."""
        zap = self._zap_and_guard()[0]
        # (Plain ints: with pyzmq's flag enums, each look built two enum members in Python,
        # on every turn of the I/O thread.)
        while zap.get(_EVENTS) & _POLLIN:
            frames = zap.recv_multipart()
            # A ROUTER, not a REP: it may hold a request and take the next (a REP takes none
            # until it answers, so one held stranger stalled every connection after it).
            # libzmq's ZAP client sends an empty delimiter first; the route is what precedes it.
            try:
                split = frames.index(b"") + 1
            except ValueError:
                log.warning("endpoint %s: a ZAP request without a delimiter, dropped", self.identity)
                continue
            self._answer_zap(frames[:split], frames[split:], time.monotonic() + self.options.connect_timeout)

    def _answer_zap(self: Endpoint, route: list[bytes], request: list[bytes], deadline: float) -> None:
        zap, guard = self._zap_and_guard()
        try:
            reply, admitted, why = guard.zap_reply(request, self._admissible)
        except NotYetKnown as exc:
            # Perhaps a member whose record we have not read yet: asked again as members are
            # admitted (members_changed), refused once all are or at the deadline. A bounded
            # number: strangers cannot make us hold more.
            held = self._zap_held
            if len(held) >= _ZAP_HELD_MAX:
                oldest_route, oldest = held.popleft()[:2]
                self._answer_zap_refused(oldest_route, oldest, "too many connections waiting to be identified")
            held.append((route, request, deadline, str(exc)))
            return
        zap.send_multipart(route + reply)
        if admitted is None:
            self._refused(f"a connection from {_zap_address(request)}", why)

    def _answer_zap_refused(self: Endpoint, route: list[bytes], request: list[bytes], why: str) -> None:
        self._zap_and_guard()[0].send_multipart(route + zap_refusal(request[1] if len(request) > 1 else b""))
        self._refused(f"a connection from {_zap_address(request)}", why)

    def _answer_held_zap(self: Endpoint, now: float | None = None) -> None:
        """Held ZAP requests again (membership changed), or refused (``now`` past their
        deadline)."""
        held, self._zap_held = self._zap_held, deque[tuple[list[bytes], list[bytes], float, str]]()
        for route, request, deadline, why in held:
            if now is not None and now >= deadline:
                self._answer_zap_refused(route, request, why)
            else:
                self._answer_zap(route, request, deadline)

    def members_changed(self: Endpoint) -> None:
        """Tell the endpoint that its membership admitted members (or was sealed): held
        connections are looked at again."""
        with self._lock:
            self._check_open()
            self._post_locked(("zap",))

    def _admissible(self: Endpoint, member: str) -> bool:
        """Whether member ``member`` may connect now: once, before its HELLO (I/O thread)."""
        record = self._peers.get(member)
        return record is None or record.state is PeerState.EXPECTED

    def _refused(self: Endpoint, what: str, why: str) -> None:
        self.refused_connections += 1
        log.warning("endpoint %s: refused %s: %s", self.identity, what, why)

    def _connect(self: Endpoint, peer: str, address: str) -> None:
        try:
            if self._guard is not None:
                self._guard.configure_connect(self._router, peer)
            self._router.setsockopt(zmq.CONNECT_ROUTING_ID, peer.encode())
            self._router.connect(address)
        except (zmq.ZMQError, Refusal) as exc:
            self._peer_lost(peer, f"cannot connect to {address}: {exc}")
            return
        self._by_address[address] = peer
        record = self._peers[peer]
        record.nonce = self._guard.new_nonce() if self._guard is not None else None
        self._send_hello(peer, nonce=record.nonce)

    def _send_hello(self: Endpoint, peer: str, nonce: bytes | None = None, proof: str | None = None) -> None:
        payload: dict[str, Any] = {"identity": self.identity, "max_bytes": self.codec.max_message_bytes}
        if nonce is not None:
            payload["nonce"] = nonce
        if proof is not None:
            payload["proof"] = proof
        if self._host_key is not None:
            payload["lend"] = {"host": self._host_key, "pid": os.getpid(), "challenge": self._challenge}
        if self._shm_host is not None:
            payload["shm"] = {"host": self._shm_host, "pid": os.getpid()}
        if self._bulk is not None:
            payload["bulk"] = self._bulk.hello(peer)  # over CURVE only: it carries a key
        self._send_control(peer, MessageType.HELLO, payload, hello=True)

    def _send_control(self: Endpoint, peer: str, kind: MessageType, payload: Any, hello: bool = False) -> None:
        frames = self.codec.encode(Message(kind, 0, self.identity, payload))
        self._send_to_peer(peer, 0, frames, _frames_nbytes(frames), hello)

    def _hello(self: Endpoint, peer: str, envelope_frame: Any, envelope: Envelope) -> _Peer | None:
        """A HELLO: register or confirm the peer, flush what waited for it, answer it. None:
        refused (a connection that is not that member's)."""
        record = self._peers.get(peer)
        if record is not None and record.state in (PeerState.READY, PeerState.LOST):
            return record  # said already (or gone): a HELLO again changes nothing
        accepted = record is None or record.state is PeerState.EXPECTED
        membership = self.membership
        hello = self._control_payload(peer, envelope)
        if not isinstance(hello, dict):
            hello = {}
        if membership is not None:
            try:
                if accepted:
                    # The handshake named the member whose credentials it showed (User-Id):
                    # the connection must call itself that, and a HELLO never comes through
                    # a ring (those exist only after it).
                    user = envelope_frame.get("User-Id") if type(envelope_frame) is zmq.Frame else None
                    if user != peer or peer not in membership:
                        raise Refusal(f"a HELLO as {peer[:60]!r} over a connection of member {user!r}")
                else:
                    membership.verify(peer, record.nonce if record is not None else None, hello.get("proof"))
            except Refusal as exc:
                if accepted:
                    self._refused(f"a HELLO from {peer[:60]!r}", str(exc))
                    self._stats.setdefault(peer, PeerStats()).protocol_errors += 1
                else:
                    self._peer_lost(peer, f"refused: {exc}")
                return None
        with self._lock:
            record = self._peers.get(peer)
            if record is None:
                record = self._new_peer_locked(peer, PeerState.EXPECTED)
            if record.state is PeerState.LOST:
                return record
            record.state = PeerState.READY
            limit = hello.get("max_bytes")
            record.max_bytes = limit if type(limit) is int and limit > 0 else None
            waiting, record.waiting = record.waiting, deque()
        if accepted:
            # Read pending monitor events first: a DISCONNECTED for an older connection that
            # used the same file descriptor must not be taken for this peer's.
            self._read_monitor()
            fd = envelope_frame.get(zmq.SRCFD)
            record.fd = fd
            self._by_fd[fd] = peer
            proof = self._guard.prove(hello.get("nonce"), peer) if self._guard is not None else None
            self._send_hello(peer, proof=proof)
        if self._bulk is not None and "bulk" in hello:
            self._bulk.offered(peer, hello["bulk"], _peer_host(record.address, record.fd))
        for message_id, frames, nbytes in waiting:
            self._send_to_peer(peer, message_id, frames, nbytes)
        if self._host_key is not None or self._shm_host is not None:
            self._offer_to_lend(record, hello)
            self._note_ring_peer(record, hello)
        record.ready.set()
        return record

    def _control_payload(self: Endpoint, peer: str, envelope: Envelope) -> Any:
        try:
            return self.codec.decode_payload(envelope, plain=True)
        except (ProtocolError, ExtensionNotDecoded) as exc:
            log.warning("endpoint %s: malformed %s from %s: %s", self.identity, envelope.type.name, peer, str(exc))
            return None
