"""Same-host shared-memory rings (transport/shm.py): the ring and stream format on their own,
then endpoints in this process and in a server process, over real sockets and real shared
memory."""

from __future__ import annotations

import contextlib
import errno
import multiprocessing
import os
import queue
import resource
import select
import struct
import threading
import time

import pytest

from tests.conftest import poll_until
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqautograd.transport import Message, MessageType, PeerLostError
from zmqautograd.transport import memory, ring_protocol, shm, waiting
from zmqautograd.transport import waiter as transport_waiter
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions
from zmqautograd.transport.errors import RemoteProtocolError

from tests.transport.test_endpoint import Client, _runnable_share
from tests.transport.test_waiting_threads import sleeps_of
from tests.workers import start_server

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not shm.SUPPORTED, reason="shared-memory rings need x86-64 Linux"),
]


_wait_for = poll_until  # for states nothing signals (a ring switched on)


# ------------------------------------------------------------------ the ring on its own


def _pump(writer: shm.Ring, reader: shm.Ring, decoder: shm.StreamDecoder, messages, read_limit: int) -> list:
    """Write ``messages`` through the ring, reading whenever it is full (one thread does
    both sides); the messages decoded, as lists of bytes."""
    out, pending = [], []
    for message in messages:
        pieces = shm.encode(message)
        assert all(len(piece) for piece in pieces)  # a writer takes 0 bytes as "the ring is full"
        pending.extend(pieces)
        while pending:
            written = writer.write(pending[0])
            if written == len(pending[0]):
                pending.pop(0)
                continue
            pending[0] = pending[0][written:]
            chunk = reader.read(read_limit)
            assert chunk is not None  # full, so there is something to read
            out += decoder.feed(chunk)
    while (chunk := reader.read(read_limit)) is not None:
        out += decoder.feed(chunk)
    return [[bytes(frame) for frame in frames] for frames in out]


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(64, 5000),
    read_limit=st.integers(1, 6000),
    messages=st.lists(st.lists(st.binary(max_size=9000), min_size=1, max_size=4), max_size=12),
)
def test_the_ring_carries_messages_of_any_size_whole_and_in_order(capacity, read_limit, messages):
    reader = shm.Ring.create(capacity)
    writer = shm.Ring.open(os.getpid(), reader.fd, capacity)
    try:
        decoder = shm.StreamDecoder(max_frames=8, max_message_bytes=1 << 20)
        assert _pump(writer, reader, decoder, messages, read_limit) == messages
        assert not reader.has_data()
    finally:
        writer.close()
        reader.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([0, 8, 1000, 4096, 8192, 65536, 4097]), min_size=1, max_size=6))
def test_encode_never_yields_an_empty_piece(sizes):
    # Big frames go as they are, small parts are joined: two big 8-byte multiples in a row
    # once produced an empty join between them, which a writer could never write.
    frames = [bytes(size) for size in sizes]
    pieces = shm.encode(frames)
    assert all(len(piece) for piece in pieces)
    reader = shm.Ring.create(1 << 20)
    writer = shm.Ring.open(os.getpid(), reader.fd, 1 << 20)
    try:
        for piece in pieces:
            assert writer.write(piece) == len(piece)
        [decoded] = shm.StreamDecoder(8, 1 << 20).feed(reader.read(1 << 20))
        assert [bytes(frame) for frame in decoded] == frames
    finally:
        writer.close()
        reader.close()


def test_decoded_frames_are_writable_and_aligned_for_tensors():
    reader = shm.Ring.create(1 << 16)
    writer = shm.Ring.open(os.getpid(), reader.fd, 1 << 16)
    try:
        for piece in shm.encode([b"abc", struct.pack("<5d", 0, 1, 2, 3, 4)]):
            assert writer.write(piece) == len(piece)
        [frames] = shm.StreamDecoder(4, 1 << 20).feed(reader.read(1 << 20))
        assert bytes(frames[0]) == b"abc"
        assert not frames[1].readonly
        tensor = torch.frombuffer(frames[1], dtype=torch.float64)
        assert tensor.data_ptr() % 8 == 0 and tensor.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize(
    "stream, error",
    [
        ((0).to_bytes(4, "little") + bytes(4), "message with 0 frames"),
        ((99).to_bytes(4, "little") + bytes(4), "message with 99 frames (limit 8)"),
        ((1).to_bytes(4, "little") + bytes(4) + (2 << 20).to_bytes(8, "little"), "message of 2097152 bytes"),
    ],
)
def test_a_malformed_stream_is_a_protocol_error(stream, error):
    with pytest.raises(RemoteProtocolError, match="shared-memory stream: " + error.replace("(", r"\(").replace(")", r"\)")):
        shm.StreamDecoder(8, 1 << 20).feed(bytearray(stream))


def test_only_our_rings_are_mapped():
    fd = os.memfd_create("not-a-ring")
    try:
        os.ftruncate(fd, 256 + 4096)
        with pytest.raises(ValueError, match="is not a ring"):
            shm.Ring.open(os.getpid(), fd, 4096)
        with pytest.raises(ValueError, match="is not a ring of 8192 bytes"):
            shm.Ring.open(os.getpid(), fd, 8192)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="is not a doorbell address"):
        shm.open_bell("\0some-other-socket")


def test_a_new_ring_takes_no_page_fault_on_either_side():
    """A ring's pages exist and both sides map them when it is made: the first pass through
    the ring costs no page fault per page on the message path (it cost two per 8 KiB, writer
    and reader, until the ring had wrapped once)."""
    capacity = 1 << 20
    reader = shm.Ring.create(capacity)
    writer = shm.Ring.open(os.getpid(), reader.fd, capacity)
    piece = memoryview(bytes(range(256)) * 64)  # 16 KiB, made before counting
    try:
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(capacity // len(piece)):  # fills the ring exactly: no read needed
            assert writer.write(piece) == len(piece)
        data = reader._data
        checksum = sum(data[offset] for offset in range(0, capacity, 4096))  # a look at every page
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
    finally:
        writer.close()
        reader.close()
    assert checksum == 0  # what each page begins with: byte 0 of the piece
    assert faults < 16, f"{faults} page faults for {capacity // 4096} pages written and read"


def test_the_doorbell_wakes_a_poller_and_drains():
    bell = shm.Bell()
    ringer = shm.open_bell(bell.address)
    try:
        assert select.select([bell.fd], [], [], 0)[0] == []
        shm.ring_bell(ringer)
        shm.ring_bell(ringer)
        assert select.select([bell.fd], [], [], 10)[0] == [bell.fd]
        bell.drain()
        assert select.select([bell.fd], [], [], 0)[0] == []
    finally:
        ringer.close()
        bell.close()
    with pytest.raises(OSError):
        shm.open_bell(bell.address)  # gone with its socket


# --------------------------------------------------------------- endpoints in this process


@contextlib.contextmanager
def _paired(rings: bool = True, **options):
    """Two connected endpoints in this process, ``b`` receiving with recv(); lost peers of
    ``b`` go to the queue yielded with them; both closed at the end. ``rings``: start once
    both send through their rings."""
    lost: queue.SimpleQueue = queue.SimpleQueue()
    a = Endpoint("a", options=EndpointOptions(**options))
    b = Endpoint("b", options=EndpointOptions(**options), on_peer_lost=lambda peer, error: lost.put((peer, error)))
    try:
        a.connect("b", b.address)
        b.expect("a")
        a.wait_for_peer("b", 30)
        b.wait_for_peer("a", 30)
        if rings:
            _onto_rings(a, b)
        yield a, b, lost
    finally:
        a.close()
        b.close()


def _onto_rings(hub: Endpoint, *others: Endpoint) -> None:
    """Rings are made on first use: a message each way between ``hub`` and each of
    ``others`` (received and checked), then wait until both sides write to their rings."""
    for other in others:
        hub.send(other.identity, Message(MessageType.PYTHON_CALL, 1, hub.identity, "ring, please"))
        other.send(hub.identity, Message(MessageType.PYTHON_CALL, 1, other.identity, "ring, please"))
    for endpoint in others:
        assert endpoint.recv(30).payload == "ring, please"
    for _ in others:
        assert hub.recv(30).payload == "ring, please"
    _wait_for(lambda: all(o.stats()[hub.identity].shared_memory and hub.stats()[o.identity].shared_memory
                          for o in others))


def _client_on_rings(client: Client, server) -> None:
    """A call both ways (rings are made on first use), then wait until both use them."""
    assert client.call({"op": "echo", "data": "ring, please"}) == "ring, please"
    _wait_for(lambda: client.endpoint.stats()[server.identity].shared_memory)
    _wait_for(lambda: client.call({"op": "stats"})["shared_memory"])


def _mapped_rings() -> int:
    """Rings this process has mapped (ours and the ones peers made for us)."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:zmqautograd-ring" in line for line in maps)


def test_messages_still_queued_for_a_full_ring_leave_before_goodbye():
    # A 4 KiB ring: most of the 300 messages wait for room when close() starts; close flushes
    # them (within close_linger), and the receiver reads the ring before it takes the
    # GOODBYE, which travels through the socket, as the loss of that peer.
    before = _mapped_rings()
    with _paired(shm_ring=4096, close_linger=10.0) as (a, b, lost):
        payload = bytes(1000)
        for seq in range(300):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", [seq, payload]))
        a.close()
        received = [b.recv(30) for _ in range(300)]
        assert [m.payload[0] for m in received] == list(range(300))
        assert all(m.payload[1] == payload for m in received)
        peer, error = lost.get(timeout=30)
        assert peer == "a" and "closed its endpoint" in str(error)
    assert _mapped_rings() == before  # closed endpoints hold no ring memory


def test_a_lost_peers_ring_is_read_before_its_loss_is_taken():
    # The race this covers: a peer publishes into its ring and closes, and our reader takes
    # its GOODBYE (socket) in a batch whose look at the rings came before that data. Forced
    # here by keeping b from reading its rings at all but through the loss itself: what a
    # wrote must still arrive, in order, and before b reports the loss. Short heartbeats: a
    # tick (which reads every ring, here nothing) passes while the data waits.
    ticked = threading.Event()

    def read_no_ring(drain: bool = True, every: bool = False) -> None:
        if every:
            ticked.set()

    with _paired(spin=0, heartbeat_interval=0.02) as (a, b, lost):
        b._receive_rings = read_no_ring  # only _peer_lost's own read remains
        for seq in range(5):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", [seq]))
        ticked.clear()
        assert ticked.wait(30)
        a.close()
        peer, error = lost.get(timeout=30)
        assert peer == "a" and "closed its endpoint" in str(error)
        assert [b.recv(5).payload[0] for _ in range(5)] == list(range(5))


def test_marks_name_the_rings_written_since_the_last_take():
    flags = shm.Flags.create()
    writers = {slot: shm.Flags.open(os.getpid(), flags.fd, slot) for slot in (0, 3, 9, shm.Flags.SLOTS - 1)}
    try:
        assert flags.take_marks(16) == ()
        writers[9].mark_pending()
        writers[3].mark_pending()
        writers[3].mark_pending()
        assert flags.take_marks(16) == [3, 9]  # each once, in slot order
        assert flags.take_marks(16) == ()  # taken: cleared
        assert flags.take_pending()  # the spinner's word is marked as before
        writers[9].mark_pending()
        assert flags.take_marks(10) == [9]
        writers[shm.Flags.SLOTS - 1].mark_pending()
        flags.mark(0)  # the reader's own: data left in that ring
        assert flags.take_marks(shm.Flags.SLOTS) == [0, shm.Flags.SLOTS - 1]
        with pytest.raises(ValueError, match="out of range"):
            shm.Flags.open(os.getpid(), flags.fd, shm.Flags.SLOTS)
    finally:
        for writer in writers.values():
            writer.close()
        flags.close()


@contextlib.contextmanager
def _star(count: int, **options):
    """Endpoints ``w0``..``w{count-1}`` connected to ``hub`` (in this process), all on rings."""
    hub = Endpoint("hub", options=EndpointOptions(**options))
    spokes = [Endpoint(f"w{i}", options=EndpointOptions(**options)) for i in range(count)]
    try:
        for spoke in spokes:
            spoke.connect("hub", hub.address)
            hub.expect(spoke.identity)
        for spoke in spokes:
            spoke.wait_for_peer("hub", 30)
            hub.wait_for_peer(spoke.identity, 30)
        _onto_rings(hub, *spokes)
        yield hub, spokes
    finally:
        for endpoint in [hub, *spokes]:
            endpoint.close()


def test_a_look_reads_only_the_rings_written_to(monkeypatch):
    # More peers with a ring into the hub than a look reads one by one, all but two silent:
    # what those two write arrives (in order, without a heartbeat tick's look at every ring,
    # switched off here), and no look asks any ring whether it has data: the marks say which.
    with _star(ring_protocol._LOOK_AT_EACH + 2, spin=0) as (hub, spokes):
        monkeypatch.setattr(Endpoint, "_read_every_ring", lambda self: None)
        looked = []
        has_data = shm.Ring.has_data
        monkeypatch.setattr(shm.Ring, "has_data", lambda ring: looked.append(ring) or has_data(ring))
        for seq in range(100):
            spokes[seq % 2].send("hub", Message(MessageType.PYTHON_CALL, seq + 1, spokes[seq % 2].identity, seq))
        received = [hub.recv(30) for _ in range(100)]
        for sender in ("w0", "w1"):
            assert [m.payload for m in received if m.sender == sender] == list(range(sender == "w1", 100, 2))
        assert looked == []


def test_a_ring_whose_mark_went_astray_is_read_on_the_next_tick(monkeypatch):
    # Writers that publish without their marks (peers that stored something else there):
    # their messages wait for the reader's next heartbeat tick, which reads every ring.
    with _star(ring_protocol._LOOK_AT_EACH + 1, spin=0, heartbeat_interval=0.2) as (hub, spokes):
        monkeypatch.setattr(shm.Flags, "mark_pending", lambda flags: None)
        for seq in range(5):
            spokes[0].send("hub", Message(MessageType.PYTHON_CALL, seq + 1, "w0", seq))
        assert [hub.recv(30).payload for _ in range(5)] == list(range(5))


def test_a_message_of_several_big_frames_goes_through_the_ring():
    # Tensors of 64 KiB (below lend_min: not lent) travel as frames of their own, one after
    # the other, with nothing to join between them.
    with _paired() as (a, b, _lost):
        tensors = [torch.randn(16384), torch.randn(16384), torch.arange(8192, dtype=torch.int64)]
        a.send("b", Message(MessageType.PYTHON_CALL, 1, "a", tensors))
        received = b.recv(30).payload
        assert all(torch.equal(x, y) for x, y in zip(received, tensors))


def test_a_malformed_ring_stream_loses_that_peer_and_the_endpoint_goes_on():
    with _paired() as (a, b, lost), Endpoint("c") as c:
        with a._socket_lock:  # as a's own sends do: one writer at a time
            record = a._peers["b"]
            record.ring_out.write(memoryview(b"\xff" * 64))  # 0xffffffff frames
            shm.ring_bell(record.bell)
        peer, error = lost.get(timeout=30)
        assert peer == "a" and "malformed shared-memory stream" in str(error)
        assert b.stats()["a"].protocol_errors == 1
        with pytest.raises(PeerLostError):
            b.send("a", Message(MessageType.PYTHON_CALL, 1, "b", None))
        c.connect("b", b.address)
        b.expect("c")
        c.send("b", Message(MessageType.PYTHON_CALL, 7, "c", "still here"))
        message = b.recv(30)
        assert (message.sender, message.payload) == ("c", "still here")


# ------------------------------------------------------------------ against a server process


@pytest.fixture(scope="module")
def server():
    process = start_server("shm-server")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def small_ring_server():
    # Rings smaller than most messages, and no lending: everything is streamed through them.
    process = start_server("small-ring-server", options={"shm_ring": 4096, "lend_min": 0, "spin": 0.0})
    yield process
    process.stop()


def test_messages_to_a_same_host_peer_switch_to_shared_memory_in_order(server):
    client = Client(server, identity="shm-client")
    try:
        # Sent at once: the first go through the socket, the rest through the ring once the
        # switch is made; the server must see them in the order they were sent.
        for seq in range(3000):
            client.send({"op": "record", "seq": seq})
        log = client.call({"op": "log"})
        assert [seq for sender, seq in log if sender == "shm-client"] == list(range(3000))
        _wait_for(lambda: client.endpoint.stats()[server.identity].shared_memory)
        # and its answers come back that way, once the server has our offer of the ring it
        # writes to: the offer comes through the socket, and a call through our ring may be
        # read before it.
        _wait_for(lambda: client.call({"op": "stats"})["shared_memory"])
        tensors = [torch.randn(1000), torch.arange(70_000, dtype=torch.int16), torch.randn(600, 600).t()]
        echoed = client.call({"op": "echo", "data": tensors})
        assert all(torch.equal(x, y) for x, y in zip(echoed, tensors))
        assert echoed[2].stride() == tensors[2].stride()
        received = client.endpoint.stats()[server.identity].messages_received
        assert received >= 3  # the answers were counted as the socket's are
    finally:
        client.close()


def test_messages_larger_than_the_ring_stream_through_it(small_ring_server):
    client = Client(small_ring_server, identity="small-ring-client", shm_ring=4096, lend_min=0, spin=0.0)
    try:
        _client_on_rings(client, small_ring_server)
        big = torch.randn(1 << 18)  # 1 MiB: 256 rings' worth, both ways
        ids = []
        for seq in range(200):
            ids.append(client.send({"op": "echo", "data": big if seq % 50 == 0 else seq}))
        replies = [client.endpoint.recv(60) for _ in ids]
        assert [r.id for r in replies] == ids
        for seq, reply in enumerate(replies):
            if seq % 50 == 0:
                assert torch.equal(reply.payload, big)
            else:
                assert reply.payload == seq
        assert client.call({"op": "stats"})["shared_memory"]
    finally:
        client.close()


def test_sleeping_readers_are_woken_by_the_doorbell(small_ring_server):
    # spin=0 on both sides: every message finds its reader asleep, so each one needs a ring.
    client = Client(small_ring_server, identity="bell-client", spin=0.0)
    try:
        _client_on_rings(client, small_ring_server)
        for seq in range(200):
            assert client.call({"op": "echo", "data": seq}) == seq
    finally:
        client.close()


def test_shared_memory_off_on_one_side_keeps_both_directions_on_the_socket(server):
    client = Client(server, identity="socket-client", shm_ring=0)
    try:
        for seq in range(50):
            assert client.call({"op": "echo", "data": seq}) == seq
        assert not client.endpoint.stats()[server.identity].shared_memory
        assert not client.call({"op": "stats"})["shared_memory"]
    finally:
        client.close()


def test_a_killed_peer_is_lost_and_its_ring_released():
    before = _mapped_rings()
    process = start_server("doomed-shm-server")
    client = Client(process, identity="survivor")
    try:
        _client_on_rings(client, process)
        assert _mapped_rings() == before + 2  # ours, that it writes to, and its
        process.kill()
        _when, peer, error = client.lost.get(timeout=60)
        assert peer == process.identity and isinstance(error, PeerLostError)
        with pytest.raises(PeerLostError):
            client.send({"op": "echo", "data": 1})
        assert _mapped_rings() == before
    finally:
        client.close()
        process.stop()


def test_waiting_threads_stop_spinning_once_their_spin_is_over():
    # After traffic, a thread waiting for a message that does not come spins for ``spin``
    # (and the I/O thread as long), then sleeps: over 1.5 s of such a wait the process uses a
    # small fraction of a CPU, where a spin that never ended would use all of one.
    with _paired() as (a, b, _lost):
        for seq in range(100):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
            assert b.recv(30).payload == seq
        cpu_before = time.process_time()
        with pytest.raises(TimeoutError):
            b.recv(1.5)  # spins up to ``spin``, then sleeps until the timeout
        used = time.process_time() - cpu_before
        assert used < 0.5, f"an idle wait of 1.5 s used {used:.2f} s of CPU"


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread states from /proc")
def test_the_io_thread_spins_after_ring_traffic_for_io_spin_not_for_spin():
    """A waiting thread may spin up to ``spin`` (learnt per kind of wait); the I/O thread's
    window after traffic, which is not learnt, is ``shm.IO_SPIN`` at most: here, with a spin
    of 5 s, it is asleep soon after the traffic it received. Every message arrives, in order."""
    assert shm.IO_SPIN < 0.01 < shm.DEFAULT_SPIN
    with _paired(spin=5.0, heartbeat_interval=5.0, peer_timeout=60.0) as (a, b, _lost):
        received = b.stats()["a"].messages_received
        for seq in range(20):  # nobody waits in b: its I/O thread receives them
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
        poll_until(lambda: b.stats()["a"].messages_received >= received + 20, 30, "b's I/O thread received all 20")
        awake = _runnable_share(b._io_thread.native_id, 0.3)
        assert awake <= 0.25, f"b's I/O thread was awake in {awake:.0%} of the 0.3 s after its traffic"
        assert [b.recv(30).payload for _ in range(20)] == list(range(20))


def test_a_learnt_spin_covers_the_gaps_that_a_spin_can_cover():
    limit = 0.002
    spin = limit
    for _ in range(20):  # input comes 50 ms after each wait begins: no spin would catch it
        spin = waiting.learn_spin(spin, 0.05, limit)
    assert spin == 0.0
    assert waiting.learn_spin(spin, 3e-4, limit) == limit  # one that a spin would have caught
    assert waiting.learn_spin(6e-4, None, limit) == pytest.approx(3e-4)  # none came: halved
    assert waiting.learn_spin(limit, 1.9e-3, limit) == limit
    assert waiting.learn_spin(limit, 2.1e-3, limit) == pytest.approx(1e-3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0, 1)), max_size=60))
def test_a_learnt_spin_stays_between_nothing_and_its_limit(gaps):
    limit = 0.002
    spin = limit
    for gap in gaps:
        spin = waiting.learn_spin(spin, gap, limit)
        assert spin == 0.0 or waiting._MIN_SPIN <= spin <= limit


@pytest.mark.skipif(transport_waiter.EXCLUSIVE is None, reason="waiting threads spin only where they read (Linux)")
def test_a_thread_spins_only_while_what_it_waits_for_comes_within_a_spin():
    # Once a thread's messages come 30 ms apart (longer than any spin) it sleeps at once when
    # it waits, and an answer that comes soon after its call makes it spin again. Every
    # message arrives, in order, either way.
    with _paired(heartbeat_interval=5.0, peer_timeout=60.0) as (a, b, _lost):
        stop = threading.Event()

        def echo() -> None:  # a answers every message of b
            while not stop.is_set():
                try:
                    message = a.recv(0.2)
                except TimeoutError:
                    continue
                a.send("b", Message(MessageType.PYTHON_RET, message.id, "a", message.payload))

        def spin_of_b() -> float:
            return b._spin_length(b.waiter(), False)

        echoing = threading.Thread(target=echo, daemon=True)
        echoing.start()
        try:
            for seq in range(50):  # rings set up, threads warm
                b.send("a", Message(MessageType.PYTHON_CALL, seq + 1, "b", seq))
                assert b.recv(30).payload == seq

            # Nine waits without input in their spin take it from 20 ms to none; a wait that finds
            # its message already there (b's thread held up for 30 ms on a loaded machine)
            # restores it. So: slow messages until b no longer spins, within 200.
            settled = threading.Event()
            sent = 0

            def send_slowly() -> None:
                nonlocal sent
                while sent < 200 and not settled.is_set():
                    time.sleep(0.03)  # the gap between messages is what this test is about
                    a.send("b", Message(MessageType.PYTHON_CALL, 100 + sent, "a", sent))
                    sent += 1

            sender = threading.Thread(target=send_slowly)
            sender.start()
            received = []
            while spin_of_b() > 0 and len(received) < 200:
                received.append(b.recv(30).payload)
            assert spin_of_b() == 0.0, f"b still spins after {len(received)} messages 30 ms apart"
            settled.set()
            sender.join(30)
            received += [b.recv(30).payload for _ in range(sent - len(received))]
            assert received == list(range(sent))
            # Under load an answer may take longer than a spin; one that does not is enough.
            for seq in range(2000):
                b.send("a", Message(MessageType.PYTHON_CALL, 200 + seq, "b", seq))
                assert b.recv(30).payload == seq
                if spin_of_b() > 0:
                    break
            assert spin_of_b() > 0, "no answer came within a spin of its call in 2000 calls"
        finally:
            stop.set()
            echoing.join(30)


@pytest.mark.skipif(transport_waiter.EXCLUSIVE is None, reason="waiting threads spin only where they read (Linux)")
def test_a_spinning_wait_does_its_idle_work_between_looks(monkeypatch):
    """wait_until's ``idle`` on a thread that spins: a piece of it between looks at the
    input instead of a yield, while the process stays marked as spinning (peers that write
    to its rings need not ring its doorbell), until no piece remains; the wait then ends as
    any does, when its condition holds, seen by the spin (nothing wakes a sleeper here)."""
    with _paired(spin=60.0, heartbeat_interval=5.0, peer_timeout=60.0) as (a, b, _lost):
        pieces: list = []
        sleeps = sleeps_of(monkeypatch, b.waiter())  # (this thread's, which waits below)

        def work() -> bool:
            pieces.append(b._spinning)
            return len(pieces) < 3

        done = threading.Event()

        def end_the_wait_after_the_work() -> None:
            poll_until(lambda: len(pieces) == 3, 30, "the idle work done")
            done.set()

        ender = threading.Thread(target=end_the_wait_after_the_work, daemon=True)
        ender.start()
        assert b.wait_until(done.is_set, 30, idle=work) is True
        assert sleeps == []  # seen by the spin, not after a sleep timed out
        ender.join(30)
        assert pieces == [True, True, True]


@pytest.mark.skipif(transport_waiter.EXCLUSIVE is None or not os.path.exists("/proc/self/task"),
                    reason="waiting threads spin only where they read (Linux); reads thread states from /proc")
def test_a_caller_waiting_for_its_answer_takes_the_spin_from_a_thread_waiting_for_work():
    """An idle thread waiting for work spins (here for up to 60 s); a caller that then waits
    for its answer takes the spin over: the idle thread stops spinning and sleeps (it no
    longer reads), the caller receives its message itself. Before, the idle thread spun on
    beside the caller, receiving for it, and the caller slept until woken."""
    with _paired(spin=60.0, heartbeat_interval=5.0, peer_timeout=60.0) as (a, b, _lost):
        stop = threading.Event()
        idle: list = []

        def wait_for_work() -> None:
            idle.append((threading.get_native_id(), b.waiter()))
            b.wait_until(stop.is_set, 60, for_work=True)

        worker = threading.Thread(target=wait_for_work, daemon=True)
        worker.start()
        failures: list = []
        try:
            poll_until(lambda: b._spinning, 30, "the idle thread spins for work")
            native_id = idle[0][0]

            def send_once_the_idle_thread_sleeps() -> None:
                # Sent once the caller waits (a message that came before would be in b's
                # queue already, and the caller would not wait at all) and the idle thread
                # has stopped spinning: asleep through 50 ms.
                try:
                    poll_until(lambda: _runnable_share(native_id, 0.05, 5) == 0.0, 10,
                               "the idle thread asleep while the caller waits")
                except AssertionError as error:
                    failures.append(error)
                a.send("b", Message(MessageType.PYTHON_CALL, 1, "a", "for the caller"))

            sender = threading.Thread(target=send_once_the_idle_thread_sleeps, daemon=True)
            sender.start()
            assert b.recv(30).payload == "for the caller"
            sender.join(30)
            assert not failures, failures[0]
            awake = _runnable_share(native_id, 0.3)
            assert awake <= 0.25, f"the idle thread was runnable in {awake:.0%} of the 0.3 s after"
            assert worker.is_alive()  # still waiting for work, asleep
        finally:
            stop.set()
            if idle:
                idle[0][1].wake()
            worker.join(30)
        assert not worker.is_alive()


def test_a_peer_whose_doorbell_cannot_be_reached_stays_on_the_socket(monkeypatch):
    # As between network namespaces, whose abstract sockets cannot reach each other: the
    # offer is declined on that side, and messages keep flowing through the socket, in order.
    def unreachable(address):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(shm, "open_bell", unreachable)
    with _paired(rings=False) as (a, b, _lost):
        for seq in range(200):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
        assert [b.recv(30).payload for _ in range(200)] == list(range(200))
        b.send("a", Message(MessageType.PYTHON_RET, 1, "b", "back"))
        assert a.recv(30).payload == "back"
        assert not a.stats()["b"].shared_memory and not b.stats()["a"].shared_memory


def test_a_ring_is_made_when_its_writer_first_has_something_to_say():
    # Peers of one host that never send each other a message (the workers of a fan-out,
    # among themselves) cost no ring: heartbeats go on through the socket. The first
    # message one way makes the ring for that way only.
    before = _mapped_rings()
    with _paired(rings=False, heartbeat_interval=0.05) as (a, b, _lost):
        _wait_for(lambda: a.stats()["b"].heartbeats_received >= 3 and b.stats()["a"].heartbeats_received >= 3)
        assert _mapped_rings() == before
        assert not a.stats()["b"].shared_memory and not b.stats()["a"].shared_memory
        for seq in range(100):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
        assert [b.recv(30).payload for _ in range(100)] == list(range(100))
        _wait_for(lambda: a.stats()["b"].shared_memory)
        assert _mapped_rings() == before + 2  # made by b, mapped by a
        assert not b.stats()["a"].shared_memory
        b.send("a", Message(MessageType.PYTHON_RET, 1, "b", "back"))
        assert a.recv(30).payload == "back"
        _wait_for(lambda: b.stats()["a"].shared_memory)
        assert _mapped_rings() == before + 4
        for seq in range(100):  # and both ways through them, in order
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
            b.send("a", Message(MessageType.PYTHON_RET, seq + 1, "b", -seq))
        assert [b.recv(30).payload for _ in range(100)] == list(range(100))
        assert [a.recv(30).payload for _ in range(100)] == [-seq for seq in range(100)]
    assert _mapped_rings() == before


def test_a_partition_injected_while_a_ring_is_made_does_not_lose_what_comes_through_it_after():
    # A ring is made on a peer's first message: a partition injected right then used to drop
    # the peer's SHM_START, and the peer went on writing to a ring nobody read, after the
    # partition healed too. (Found as a flake of the lending test of a partition.)
    from zmqautograd.transport.faults import FaultPolicy

    policy = FaultPolicy()
    first = threading.Event()

    def on_message(message: Message) -> None:
        if message.id == 1:
            policy.partition("b")  # the SHM_OFFER for b's ring is on its way; b's SHM_START not yet
            first.set()
        received.put(message.payload)

    received: queue.SimpleQueue = queue.SimpleQueue()
    a = Endpoint("a", faults=policy, on_message=on_message)
    b = Endpoint("b")
    try:
        a.connect("b", b.address)
        b.expect("a")
        a.wait_for_peer("b", 30)
        b.send("a", Message(MessageType.PYTHON_CALL, 1, "b", "first"))
        assert first.wait(30)
        _wait_for(lambda: b.stats()["a"].shared_memory)  # b writes to the ring now
        assert received.get(timeout=30) == "first"
        policy.heal("b")
        for seq in range(3, 53):
            b.send("a", Message(MessageType.PYTHON_CALL, seq, "b", seq))
        assert [received.get(timeout=30) for _ in range(50)] == list(range(3, 53))
        assert a.stats()["b"].shared_memory is False  # (a writes nothing to b)
    finally:
        a.close()
        b.close()


def test_a_ring_that_would_crowd_memory_is_not_made_and_the_peer_stays_on_the_socket(monkeypatch):
    # Shared memory does not fail its allocation when memory runs out: the kernel's OOM
    # killer ends a process instead (a 1 TiB ring killed the process that made it). With
    # less than eight rings' worth of memory available, no ring is made, and messages flow
    # through the socket, in order.
    assert memory.figures()[0] > 0  # (read from /proc/meminfo here)
    capacity = 1 << 20
    monkeypatch.setattr(memory, "figures", lambda: (8 * capacity - 1, 64 << 30))
    with pytest.raises(OSError, match="more than an eighth") as refused:
        shm.Ring.create(capacity)
    assert refused.value.errno == errno.ENOMEM
    with _paired(rings=False, shm_ring=capacity) as (a, b, _lost):
        for seq in range(200):
            a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
        assert [b.recv(30).payload for _ in range(200)] == list(range(200))
        b.send("a", Message(MessageType.PYTHON_RET, 1, "b", "back"))
        assert a.recv(30).payload == "back"
        assert not a.stats()["b"].shared_memory and not b.stats()["a"].shared_memory
    # And a ring beyond any use is refused with the options, before anything is made.
    with pytest.raises(ValueError, match="shm_ring must be 0 .off. or from 4096 to 1073741824 bytes"):
        EndpointOptions(shm_ring=1 << 40)
    assert EndpointOptions(shm_ring=1 << 30).shm_ring == 1 << 30


def test_rings_never_take_the_memory_available_below_an_eighth_of_the_total(monkeypatch):
    # Each ring is small, their sum is not (a ring per direction and pair of processes that
    # talk, on one host): whatever each would take, the memory still available stays above
    # an eighth of the total, and the rings beyond that are not made.
    capacity = 1 << 20
    total = 64 << 30
    monkeypatch.setattr(memory, "figures", lambda: (total // 8 + capacity, total))  # less its header
    with pytest.raises(OSError, match="would leave less than an eighth of the memory") as refused:
        shm.Ring.create(capacity)
    assert refused.value.errno == errno.ENOMEM
    monkeypatch.setattr(memory, "figures", lambda: (total // 8 + 2 * capacity, total))
    shm.Ring.create(capacity).close()


def _publish_and_watch(pid: int, ring_fd: int, flags_fd: int, capacity: int, seconds: float, result) -> None:
    """A writer in another process: publish small messages for ``seconds``, watching the
    reader's head and its spinning flag (which the reader keeps set); put how often the head
    read behind what it read before, and how often the flag read unset."""
    writer = shm.Ring.open(pid, ring_fd, capacity)
    flags = shm.Flags.open(pid, flags_fd, 0)
    piece = memoryview(bytes(8))
    head_behind = flag_unset = last = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(200):
            writer.write(piece)
            head = writer._load(shm._HEAD)
            head_behind += head < last
            last = max(last, head)
            flag_unset += not flags.spinning()
    result.put((head_behind, flag_unset))
    writer.close()
    flags.close()


@pytest.mark.timeout(60)
def test_a_peer_never_reads_a_position_or_flag_that_went_back():
    """Each side stores its position (the reader its flags too) while the other polls it
    from another process: a load must see the old value or the new one, never one that went
    back. (A store that zeroes the word before it writes it, as ``struct.pack_into`` does,
    showed this test's reader a tail of 0 ~2,000 times in 1.5 s on the development VM, and
    made the benchmark's shared-memory floor read a record of 0 bytes.)"""
    capacity = 1 << 16
    reader = shm.Ring.create(capacity)
    flags = shm.Flags.create()
    flags.set_spinning(True)
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    writer = context.Process(target=_publish_and_watch,
                             args=(os.getpid(), reader.fd, flags.fd, capacity, 1.5, result))
    writer.start()
    try:
        tail_behind = last = 0
        watched = time.monotonic() + 10
        while writer.is_alive() and time.monotonic() < watched:
            for _ in range(200):
                tail = reader._load(shm._TAIL)
                tail_behind += tail < last
                last = max(last, tail)
                reader.read(capacity)  # stores the head the writer polls
                flags.set_spinning(True)  # stores the value the flag has
        writer.join(30)
        head_behind, flag_unset = result.get(timeout=30)
        assert writer.exitcode == 0 and last > 0
        assert (tail_behind, head_behind, flag_unset) == (0, 0, 0)
    finally:
        if writer.is_alive():
            writer.kill()
        reader.close()
        flags.close()
