"""Shared-memory rings negotiated between two endpoints on one host: offers, the bell,
reading and writing them (the rings themselves are shm.py)."""

from __future__ import annotations

import logging
import select
import time
from typing import TYPE_CHECKING, Any

from . import shm
from .codec import Envelope, MessageType
from .errors import (
    ProtocolError,
)
from .peers import PeerState, _Peer

if TYPE_CHECKING:
    from .endpoint import Endpoint

log = logging.getLogger(__name__)

_RING_READS = 16  # reads of one ring per turn (a writer that never stops cannot hold us)

_RING_CHUNK = 1 << 20  # bytes taken from a ring per read

# Up to this many rings, a look reads each ring's tail; beyond, only the rings the writers
# marked in our Flags page (shm.Flags.take_marks). A look through the marks costs more than
# a look at one or three rings (tools/bench_instr.py: marks always, 1.6% more instructions
# per step in the one-hop step, 2.1% in fan-out 3) and less than one at fifteen (fan-out
# 16 with this threshold: each worker 3.8% fewer, the group 2.0%).
_LOOK_AT_EACH = 3


def _offered_number(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError("malformed SHM_OFFER")
    return value


class RingProtocol:
    """The endpoint's side of the shared-memory rings (part of ``Endpoint``)."""

    def _own_bell(self: Endpoint) -> tuple[shm.Bell, shm.Flags]:
        """Our doorbell and flags: made with shared memory, so there wherever a ring is."""
        bell, flags = self._bell, self._flags
        assert bell is not None and flags is not None, "a ring without the doorbell"
        return bell, flags

    def _note_ring_peer(self: Endpoint, record: _Peer, hello: Any) -> None:
        """A peer's HELLO (its payload): if it is a process of our host, we will make the ring
        it writes to us once it has something to say (``_offer_ring``). Rings are made on
        first use, not for every peer of the host: a peer that never sends us a call or an
        answer (the workers of a fan-out, among themselves) costs no memory, and N workers
        of one host that talk to one driver make 2(N - 1) rings, not N(N - 1)."""
        if self._shm_host is None:
            return
        info = hello.get("shm") if isinstance(hello, dict) else None
        if not isinstance(info, dict) or info.get("host") != self._shm_host or type(info.get("pid")) is not int:
            return
        record.ring_pid = info["pid"]  # the only process whose ring we will map
        record.ring_due = True

    def _offer_ring(self: Endpoint, record: _Peer) -> None:
        """The first message of the layers above from a peer of our host came through the
        socket (socket lock held): make the ring it will write to us, and tell it where (with
        our flags and doorbell). It answers SHM_START, behind everything it sent us through
        the socket."""
        record.ring_due = False
        slots = self._ring_slots
        slot = slots.index(None) if None in slots else len(slots)
        if slot >= shm.Flags.SLOTS:
            log.info("endpoint %s: no ring for %s (%d peers on this host have one): it sends through the socket",
                     self.identity, record.name, slot)
            return
        try:
            ring = shm.Ring.create(self.options.shm_ring)
        except OSError as exc:
            log.info("endpoint %s: no ring for %s (%s): it sends through the socket", self.identity, record.name, exc)
            return
        record.ring_in, record.ring_slot = ring, slot
        if slot == len(slots):
            slots.append(record)  # (the list only grows: readers index it without the lock)
        else:
            slots[slot] = record
        # One frame more than the codec allows: a lent-buffer table may come first.
        record.decoder = shm.StreamDecoder(self.codec.max_frames + 1, self.codec.max_message_bytes + (1 << 20))
        bell, flags = self._own_bell()
        self._send_control(record.name, MessageType.SHM_OFFER,
                           {"fd": ring.fd, "capacity": ring.capacity, "flags": flags.fd, "bell": bell.address,
                            "slot": slot})

    def _ring_offered(self: Endpoint, record: _Peer, envelope: Envelope) -> None:
        """The peer made a ring for us: map it, then (through the outbox, so behind every
        message already queued for the socket) say SHM_START and write there from then on."""
        if record.ring_pid is None or record.ring_out is not None:
            return  # not on our host, or shared memory is off here
        payload = self._control_payload(record.name, envelope)
        try:
            if not isinstance(payload, dict):
                raise ValueError("malformed SHM_OFFER")
            fd, capacity, flags_fd, slot = (_offered_number(payload.get(key))
                                            for key in ("fd", "capacity", "flags", "slot"))
            if not capacity:
                raise ValueError("malformed SHM_OFFER")
            self._open_bell(record, payload)
            flags = shm.Flags.open(record.ring_pid, flags_fd, slot)
            try:
                ring = shm.Ring.open(record.ring_pid, fd, capacity)
            except BaseException:
                flags.close()
                raise
        except (OSError, ValueError) as exc:
            log.info("endpoint %s: cannot use the ring of %s (%s): messages to it go through the socket",
                     self.identity, record.name, exc)
            return
        with self._lock:
            self._post_locked(("shm_start", record.name, ring, flags))

    def _open_bell(self: Endpoint, record: _Peer, payload: dict) -> None:
        if record.bell is None:
            address = payload.get("bell")
            if not isinstance(address, str):
                raise ValueError("no doorbell address")
            record.bell = shm.open_bell(address)

    def _start_ring(self: Endpoint, peer: str, ring: shm.Ring, flags: shm.Flags) -> None:
        """On the I/O thread, in outbox order: SHM_START through the socket, then the ring."""
        record = self._peers.get(peer)
        if record is None or record.state is not PeerState.READY or record.ring_out is not None:
            ring.close()
            flags.close()
            return
        self._send_control(peer, MessageType.SHM_START, {"bell": self._own_bell()[0].address})
        record.ring_out, record.peer_flags = ring, flags

    def _ring_started(self: Endpoint, record: _Peer, envelope: Envelope) -> None:
        """Everything the peer sent through the socket before it came first: read its ring."""
        if record.ring_in is None or record.ring_in_active:
            return
        payload = self._control_payload(record.name, envelope)
        try:
            self._open_bell(record, payload if isinstance(payload, dict) else {})
        except (OSError, ValueError) as exc:
            # It then learns of room in the ring on its heartbeat ticks only.
            log.warning("endpoint %s: cannot open the doorbell of %s: %s", self.identity, record.name, exc)
        record.ring_in.close_descriptor()  # the writer has it mapped
        record.ring_in_active = True
        self._rings_in = (*self._rings_in, record)
        self._read_ring(record)  # it may have written already

    def _receive_rings(self: Endpoint, drain: bool = True, every: bool = False) -> None:
        """Read the rings that hold data (under the socket lock), after emptying the doorbell
        (``drain``); write what waited for room in the peers' rings. Beyond a few rings, only
        those whose writers marked them are looked at, unless ``every``."""
        if drain and (bell := self._bell) is not None:
            bell.drain()
        rings = self._rings_in
        if every or len(rings) <= _LOOK_AT_EACH:
            for record in rings:
                ring = record.ring_in
                if ring is not None and ring.has_data():
                    self._read_ring(record)
        elif (flags := self._flags) is not None:
            # Most looks find most rings empty: the marks say which are not, in a look at
            # one word, then one copy of a few bytes, instead of a look at each ring.
            slots = self._ring_slots
            marked = flags.take_marks(len(slots))
            if marked:
                shm.fence()  # our cleared marks before the looks at the tails (Flags.take_marks)
                for slot in marked:
                    record = slots[slot]
                    if record is not None and record.ring_in_active:
                        self._read_ring(record)
        if self._unwritten:
            self._flush_unwritten()

    def _read_every_ring(self: Endpoint) -> None:
        """Read every ring that holds data, marked or not (under the socket lock): on each
        heartbeat tick, so that data whose mark went astray (a writer that stored another
        value there, say) waits a tick at most, never for good."""
        self._receive_rings(drain=False, every=True)

    def _read_ring(self: Endpoint, record: _Peer) -> None:
        ring, decoder = record.ring_in, record.decoder
        if decoder is None or ring is None:
            return
        routing_id = record.routing_id
        for _ in range(_RING_READS):
            if record.decoder is None:
                return  # the peer was lost while we handed over what we read
            chunk = ring.read(_RING_CHUNK)
            if chunk is None:
                return
            shm.fence()  # our new head before the look at its flag (transport/shm.py)
            if ring.take_writer_waiting() and record.bell is not None:
                shm.ring_bell(record.bell)
            try:
                messages = decoder.feed(chunk)
            except ProtocolError as exc:
                with self._lock:
                    self._stats[record.name].protocol_errors += 1
                record.decoder = None
                self._peer_lost(record.name, f"malformed shared-memory stream: {exc}")
                return
            for frames in messages:
                frames.insert(0, routing_id)
                self._handle_incoming(frames)
            if len(chunk) < _RING_CHUNK:
                # All there was. What the writer publishes after our look sets the pending
                # flag or rings our doorbell (transport/shm.py): no look again needed now.
                return
        # More is waiting: for the next turn (ours or another thread's).
        bell, flags = self._own_bell()
        flags.mark(record.ring_slot)
        bell.ring()

    def _write_ring(self: Endpoint, record: _Peer, wrote: bool = False) -> None:
        """Write what waits for the peer's ring, as far as there is room (socket lock held);
        what has no room waits for the peer's doorbell call (or our next tick). Ring the peer
        unless it spins (also when ``wrote``: the caller wrote part of a message already)."""
        ring, unwritten = record.ring_out, record.unwritten
        assert ring is not None, "callers write only to peers with a ring"
        asked = False
        while unwritten:
            piece = unwritten[0]
            written = ring.write(piece)
            if written:
                wrote = True
                record.unwritten_bytes -= written
                if written == len(piece):
                    unwritten.popleft()
                else:
                    unwritten[0] = piece[written:]
                continue
            if asked:
                break
            # Full: ask the reader to ring us once it made room, then look once more (it may
            # have made room before it saw the flag).
            ring.set_writer_waiting(True)
            shm.fence()
            asked = True
        if unwritten:
            self._unwritten.add(record.name)
        else:
            self._unwritten.discard(record.name)
            if asked:
                ring.set_writer_waiting(False)
        if wrote:
            self._ring_written(record)

    @staticmethod
    def _ring_written(record: _Peer) -> None:
        """We published data in the peer's ring: mark it pending, and ring the peer's
        doorbell unless a thread of the peer spins."""
        flags = record.peer_flags
        assert flags is not None, "mapped with the ring"
        flags.mark_pending()
        shm.fence()  # our new tail and mark before the look at the reader's flag
        if record.bell is not None and not flags.spinning():
            shm.ring_bell(record.bell)

    def _flush_unwritten(self: Endpoint) -> None:
        for name in tuple(self._unwritten):
            record = self._peers.get(name)
            if record is None or record.ring_out is None:
                self._unwritten.discard(name)
            else:
                self._write_ring(record)

    def _finish_rings(self: Endpoint) -> None:
        """On close, before GOODBYE: write what still waits for room in peers' rings, for up
        to ``close_linger`` (as libzmq lingers over what its queues hold)."""
        deadline = time.monotonic() + self.options.close_linger
        while self._unwritten:
            self._flush_unwritten()
            remaining = deadline - time.monotonic()
            if not self._unwritten or remaining <= 0:
                return
            bell = self._own_bell()[0]
            select.select([bell.fd], [], [], min(remaining, 0.05))  # a reader made room
            bell.drain()

    def _close_rings(self: Endpoint, record: _Peer) -> None:
        """Unmap the peer's rings and close its doorbell (socket lock held)."""
        if record.ring_in is not None:
            self._rings_in = tuple(r for r in self._rings_in if r is not record)
            if self._ring_slots[record.ring_slot] is record:
                self._ring_slots[record.ring_slot] = None  # (a mark left there only costs a look)
            record.ring_in.close()
        if record.ring_out is not None:
            record.ring_out.close()
        if record.peer_flags is not None:
            record.peer_flags.close()
        if record.bell is not None:
            record.bell.close()
        record.ring_in = record.decoder = record.ring_out = record.peer_flags = record.bell = None
        record.ring_in_active = False
        record.unwritten.clear()
        record.unwritten_bytes = 0
        self._unwritten.discard(record.name)
