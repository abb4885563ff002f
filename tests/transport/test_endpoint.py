"""The ZeroMQ endpoint with real worker processes and real sockets (loopback TCP and ipc)."""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import queue
import signal
import tempfile
import threading
import time

import pytest

from tests.conftest import poll_until
import torch
import zmq

from zmqautograd.transport import (
    EndpointClosedError,
    LocalProtocolError,
    Message,
    MessageType,
    PeerLostError,
    UnknownPeerError,
)
from zmqautograd.transport.codec import PROTOCOL_VERSION, Codec
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions
from zmqautograd.transport.io_loop import tick_after

from tests.workers import start_server, tensor_digest

pytestmark = pytest.mark.timeout(120)

_ids = itertools.count(1)


class Client:
    """A pull-style endpoint talking to one server, with request/response helpers."""

    def __init__(self, server, identity: str = "client", **options):
        self.server = server
        self.lost: queue.SimpleQueue = queue.SimpleQueue()
        self.send_errors: queue.SimpleQueue = queue.SimpleQueue()
        self.endpoint = Endpoint(
            identity,
            options=EndpointOptions(**options) if options else None,
            on_peer_lost=lambda peer, error: self.lost.put((time.monotonic(), peer, error)),
            on_send_error=lambda peer, message_id, error: self.send_errors.put((peer, message_id, error)),
        )
        self.endpoint.connect(server.identity, server.address)
        self.endpoint.wait_for_peer(server.identity, 60)

    def send(self, payload, message_id: int | None = None) -> int:
        message_id = message_id or next(_ids)
        self.endpoint.send(self.server.identity, Message(MessageType.PYTHON_CALL, message_id, self.endpoint.identity, payload))
        return message_id

    def call(self, payload, timeout: float = 60):
        message_id = self.send(payload)
        reply = self.endpoint.recv(timeout)
        assert reply.type is MessageType.PYTHON_RET and reply.id == message_id
        return reply.payload

    def close(self):
        self.endpoint.close()


@pytest.fixture(scope="module")
def server():
    process = start_server()
    yield process
    process.stop()


@pytest.fixture
def client(server):
    c = Client(server, identity=f"client-{next(_ids)}")
    yield c
    c.close()


def test_64mb_tensor_integrity(client):
    tensor = torch.randn(16 << 20)  # 64 MiB of float32
    assert client.call({"op": "digest", "data": tensor}) == tensor_digest(tensor)
    echoed = client.call({"op": "echo", "data": tensor})
    assert torch.equal(echoed, tensor)
    echoed.mul_(2)  # the received tensor is writable and owns its memory


def test_10000_small_messages_arrive_in_order(client):
    for seq in range(10_000):
        client.send({"op": "record", "seq": seq})
    log = client.call({"op": "log"})
    mine = [seq for sender, seq in log if sender == client.endpoint.identity]
    assert mine == list(range(10_000))
    # And back: 10,000 replies, in the order they were asked for.
    ids = [client.send({"op": "echo", "data": seq}) for seq in range(10_000)]
    replies = [client.endpoint.recv(60) for _ in ids]
    assert [r.id for r in replies] == ids
    assert [r.payload for r in replies] == list(range(10_000))


def test_eight_threads_sending_at_once(client):
    per_thread = 500
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def sender(thread_index: int) -> None:
        try:
            barrier.wait(10)
            for seq in range(per_thread):
                client.send({"op": "record", "seq": (thread_index, seq)})
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    log = client.call({"op": "log"})
    mine = [tuple(seq) for sender, seq in log if sender == client.endpoint.identity]
    assert len(mine) == 8 * per_thread
    for thread_index in range(8):  # each thread's messages arrive in its own order
        assert [s for t, s in mine if t == thread_index] == list(range(per_thread))


def test_ipc_transport_and_peer_stats():
    with tempfile.TemporaryDirectory() as folder:
        server = start_server("ipc-server", f"ipc://{folder}/server.sock")
        client = Client(server)
        try:
            payload = torch.arange(100_000, dtype=torch.float64)  # 800 KB
            assert torch.equal(client.call({"op": "echo", "data": payload}), payload)
            stats = client.endpoint.stats()["ipc-server"]
            assert stats.messages_sent >= 2 and stats.messages_received >= 2  # HELLO + call / reply
            assert stats.bytes_sent > 800_000 and stats.bytes_received > 800_000
            assert stats.send_errors == 0 and stats.protocol_errors == 0
        finally:
            client.close()
            server.stop()


def test_killed_peer_detected_within_bound():
    """SIGKILL: the connection closes, and the peer is lost within the configured bound."""
    server = start_server("doomed")
    client = Client(server, heartbeat_interval=0.2, peer_timeout=2.0)
    try:
        assert client.call({"op": "echo", "data": 1}) == 1
        killed_at = time.monotonic()
        server.kill()
        detected_at, peer, error = client.lost.get(timeout=10)
        assert peer == "doomed" and isinstance(error, PeerLostError)
        assert detected_at - killed_at < 2.0, f"detected after {detected_at - killed_at:.2f} s"
        with pytest.raises(PeerLostError, match="doomed"):
            client.send({"op": "echo", "data": 2})
        assert client.endpoint.peers()["doomed"] == "lost"
    finally:
        client.close()
        server.stop()


def test_silent_peer_detected_by_heartbeat_timeout():
    """SIGSTOP keeps the connection open but silences the peer: only heartbeats can tell."""
    server = start_server("frozen")
    client = Client(server, heartbeat_interval=0.1, peer_timeout=1.0, close_linger=0.2)
    try:
        assert client.call({"op": "echo", "data": 1}) == 1
        stopped_at = time.monotonic()
        server.kill(signal.SIGSTOP)
        message_id = client.send({"op": "echo", "data": torch.zeros(1 << 20)})  # will never be answered
        detected_at, peer, error = client.lost.get(timeout=10)
        assert peer == "frozen" and "no message or heartbeat" in str(error)
        assert 0.9 <= detected_at - stopped_at < 1.0 + 2 * 0.1 + 0.5
        assert message_id  # sent before the loss: failing it is the layer above's job (pending futures)
        started = time.monotonic()
        client.close()  # queued bytes to a frozen peer must not hang close
        assert time.monotonic() - started < 2.0
    finally:
        server.kill(signal.SIGCONT)
        server.stop()


def test_a_long_peer_timeout_keeps_quiet_connections_through_libzmq_pings():
    """With peer_timeout 63.6 s, libzmq pings every 31.8 s. A ping that carried its timeout
    as a TTL closed the connection 64 ms later at the other end (libzmq keeps the TTL in
    16-bit milliseconds: 65,600 wraps to 64) unless something else came through the
    socket: between workers of one host, nothing else does (their messages use the rings)."""
    server = start_server("patient")
    client = Client(server, heartbeat_interval=1.0, peer_timeout=63.6)
    try:
        assert client.call({"op": "echo", "data": 1}) == 1
        with pytest.raises(queue.Empty):  # past the first ping (and the TTL's 64 ms)
            client.lost.get(timeout=36)
        assert client.call({"op": "echo", "data": 2}) == 2
        assert client.endpoint.peers()["patient"] == "ready"
    finally:
        client.close()
        server.stop()


def test_liveness_bounds_beyond_what_libzmq_and_the_os_count_still_work():
    """A heartbeat interval of 116 days and a peer_timeout of 232: libzmq's times are C ints
    of milliseconds (24.8 days) and epoll waits no longer either; the endpoint failed to bind
    ("value too large to convert to int"), then its I/O thread died on its first sleep. An
    infinite peer_timeout is refused by name."""
    options = EndpointOptions(heartbeat_interval=1e7, peer_timeout=2e7)
    a = Endpoint("patient-a", options=options)
    b = Endpoint("patient-b", options=options)
    try:
        b.connect("patient-a", a.address)
        b.wait_for_peer("patient-a", float("inf"))  # (as long as it takes)
        b.send("patient-a", Message(MessageType.PYTHON_CALL, 1, "patient-b", "still here"))
        assert a.recv(30).payload == "still here"
        assert a.peers()["patient-b"] == b.peers()["patient-a"] == "ready"
    finally:
        b.close()
        a.close()
    with pytest.raises(ValueError, match="peer_timeout must be a finite number of seconds, got inf"):
        EndpointOptions(peer_timeout=float("inf"))


def test_unknown_peer_closed_endpoint_and_connect_timeout():
    endpoint = Endpoint("lonely", options=EndpointOptions(heartbeat_interval=0.1, peer_timeout=1.0, connect_timeout=0.5))
    lost = queue.SimpleQueue()
    endpoint._on_peer_lost = lambda peer, error: lost.put((peer, str(error)))
    try:
        with pytest.raises(UnknownPeerError, match="nobody"):
            endpoint.send("nobody", Message(MessageType.PYTHON_CALL, 1, "lonely"))
        endpoint.expect("ghost")  # never connects
        peer, reason = lost.get(timeout=5)
        assert peer == "ghost" and "did not complete HELLO" in reason
    finally:
        endpoint.close()
    with pytest.raises(EndpointClosedError):
        endpoint.send("ghost", Message(MessageType.PYTHON_CALL, 1, "lonely"))
    endpoint.close()  # idempotent


def test_messages_wait_for_an_expected_peer_then_flow(server):
    """The accepting side may send before the connecting side's HELLO: the messages wait."""
    received = queue.SimpleQueue()
    acceptor = Endpoint("a-accept", on_message=received.put)
    connector = Endpoint("b-connect")
    try:
        acceptor.add_peer("b-connect", connector.address)  # sorts first: it will wait
        acceptor.send("b-connect", Message(MessageType.PYTHON_CALL, 1, "a-accept", "early"))
        connector.add_peer("a-accept", acceptor.address)  # connects
        message = connector.recv(10)
        assert message.payload == "early" and message.sender == "a-accept"
        connector.send("a-accept", Message(MessageType.PYTHON_RET, 1, "b-connect", "reply"))
        assert received.get(timeout=10).payload == "reply"
    finally:
        connector.close()
        acceptor.close()


def test_slow_handler_does_not_stall_the_socket():
    release = threading.Event()
    handled = queue.SimpleQueue()

    def slow(message):
        release.wait(30)
        handled.put(message.payload)

    receiver = Endpoint("slow-receiver", on_message=slow)
    sender = Endpoint("fast-sender", options=EndpointOptions(heartbeat_interval=0.1, peer_timeout=5.0))
    try:
        sender.connect("slow-receiver", receiver.address)
        sender.wait_for_peer("slow-receiver", 10)
        for seq in range(50):
            sender.send("slow-receiver", Message(MessageType.PYTHON_CALL, seq + 1, "fast-sender", seq))
        # While the handler is blocked, the I/O thread keeps receiving and answering heartbeats.
        poll_until(lambda: receiver.stats()["fast-sender"].messages_received >= 51, 10, "51 messages received")
        assert sender.peers()["slow-receiver"] == "ready"
        release.set()
        assert [handled.get(timeout=10) for _ in range(50)] == list(range(50))
    finally:
        release.set()
        sender.close()
        receiver.close()


def test_malformed_multipart_messages_get_protocol_errors_and_worker_keeps_serving(client):
    raw_context = zmq.Context()
    raw = raw_context.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-intruder")
    raw.connect(client.server.address)
    codec = Codec()
    try:
        bad_messages = [
            [b"\xff\xfe not msgpack"],
            [b""],
            [codec.encode(Message(MessageType.PYTHON_CALL, 5, "raw-intruder", None))[0][:3]],  # truncated
            [Codec().encode(Message(MessageType.PYTHON_CALL, 6, "someone-else", None))[0]],  # spoofed sender
            [__import__("msgpack").packb([PROTOCOL_VERSION + 1, 16, 7, "raw-intruder", b""])],
            [b"x"] * 70_000,  # absurd frame count
        ]
        for frames in bad_messages:
            raw.send_multipart(frames)
            assert raw.poll(10_000), f"no answer to {frames[0][:20]!r}"
            reply = codec.decode(raw.recv_multipart())
            assert reply.type is MessageType.PROTOCOL_ERROR
            assert "Error" in reply.payload["error"]
        # A well-formed message from a peer that never said HELLO is refused too.
        raw.send_multipart(codec.encode(Message(MessageType.PYTHON_CALL, 8, "raw-intruder", None)))
        assert raw.poll(10_000)
        reply = codec.decode(raw.recv_multipart())
        assert reply.type is MessageType.PROTOCOL_ERROR and "before HELLO" in reply.payload["error"]
        # The worker is still up and serves valid calls correctly.
        assert torch.equal(client.call({"op": "echo", "data": torch.ones(3)}), torch.ones(3))
    finally:
        raw.close(0)
        raw_context.term()


def test_peer_rejecting_our_payload_reports_a_send_error(client):
    """A payload the peer cannot decode fails that message on our side, typed and identified."""
    class Evil(Codec):
        def encode(self, message):
            frames = super().encode(message)
            return [frames[0], b"\0" * 3] if len(frames) == 2 else frames  # wrong buffer size

    client.endpoint.codec = Evil()
    try:
        message_id = client.send({"op": "echo", "data": torch.ones(4)})
    finally:
        client.endpoint.codec = Codec()
    peer, failed_id, error = client.send_errors.get(timeout=10)
    assert (peer, failed_id) == ("server", message_id)
    assert isinstance(error, LocalProtocolError) and "rejected message" in str(error)
    assert client.call({"op": "echo", "data": 5}) == 5


def test_close_with_dead_peer_does_not_hang():
    server = start_server("dies-before-close")
    client = Client(server, heartbeat_interval=0.2, peer_timeout=5.0, detect_disconnect=False, close_linger=0.5)
    server.kill(signal.SIGSTOP)
    try:
        for _ in range(4):
            client.send({"op": "echo", "data": torch.zeros(4 << 20)})  # 64 MiB queued to a frozen peer
        started = time.monotonic()
        client.close()
        assert time.monotonic() - started < 3.0
    finally:
        server.kill(signal.SIGCONT)
        server.stop()


def test_bind_failure_is_a_clear_error():
    with pytest.raises(RuntimeError, match="could not bind"):
        Endpoint("bad-bind", "tcp://256.0.0.1:1")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_travel_through_pinned_staging(client):
    from zmqautograd.transport.staging import default_pool

    tensor = torch.randn(1 << 20, device="cuda")
    assert torch.equal(client.call({"op": "echo", "data": tensor}), tensor)  # server maps cuda:0 -> cuda:0
    allocations = default_pool().allocations
    for _ in range(5):
        assert torch.equal(client.call({"op": "echo", "data": tensor}), tensor)
    assert default_pool().allocations == allocations  # staging buffers are reused


def _open_descriptors() -> list[str]:
    """What this process's descriptors are open on (those closed meanwhile left out)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # (the listing's own descriptor, say)
    return sorted(found)


@contextlib.contextmanager
def _at_the_open_file_limit():
    """This process out of descriptors (a real limit) for the block's duration."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1, hard))
    try:
        try:
            while True:  # (fills every free number below the limit)
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        yield
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_peer_that_does_not_connect_while_descriptors_ran_out_says_so():
    """Out of descriptors, libzmq can neither accept nor make a connection, and retries;
    the wait for the peer ends at its timeout, saying that the descriptors ran out (it
    named only the peer)."""
    endpoint = Endpoint("waits-for-nobody")
    try:
        endpoint.expect("nobody")
        with pytest.raises(TimeoutError, match="did not connect within 0.2 s$"):
            endpoint.wait_for_peer("nobody", 0.2)
        with _at_the_open_file_limit():
            with pytest.raises(TimeoutError) as raised:
                endpoint.wait_for_peer("nobody", 0.2)
        assert "did not connect within 0.2 s; this process is out of descriptors (its open-file limit is " in str(
            raised.value)
    finally:
        endpoint.close()


_HARD_LIMIT_PROGRAM = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))  # a hard limit too low for 1 peer's room
from zmqautograd.transport.endpoint import Endpoint
endpoint = Endpoint("low-hard-limit")
for peer in ("a", "b"):
    endpoint.expect(peer)
print("soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
endpoint.close()
"""


def test_a_hard_open_file_limit_too_low_for_the_peers_is_raised_to_and_named_once():
    """The soft limit goes up to the hard one, and the warning says what to change, once."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _HARD_LIMIT_PROGRAM], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "INFO raised the open-file limit from 100 to 200 descriptors for 1 peers" in lines, lines
    warnings = [line for line in lines if line.startswith("WARNING") and "hard limit" in line]
    assert len(warnings) == 1 and "at most 200 files (its hard limit)" in warnings[0] and "ulimit -n" in warnings[0]
    assert "soft limit 200" in lines


def _wake_after_sending(client, seqs: range, errors: list, go_on: threading.Event | None = None) -> threading.Thread:
    """A thread that sends ``seqs`` and then wakes the I/O thread as if it slept (a sender
    wakes it when its message queued or input waits: here every time); then it waits for
    ``go_on``, if given."""
    endpoint = client.endpoint

    def run() -> None:
        try:
            for seq in seqs:
                client.send({"op": "record", "seq": seq})
            with endpoint._lock:
                endpoint._io_asleep = True
                endpoint._wake_io_locked()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        if go_on is not None:
            go_on.wait(30)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_threads_wake_the_io_thread_with_no_descriptor_of_their_own_even_at_the_limit(client):
    """Every thread wakes the I/O thread through the one eventfd of its poller. Each sending
    thread had an inproc socket of its own, made on its first wake-up: a descriptor per
    thread, and at the open-file limit (a pool grown to hundreds of threads by nested calls)
    the wake-up raised after the message had gone, with the I/O thread left asleep."""
    errors: list = []
    client.call({"op": "log"})  # (this thread's waiter made)
    before = _open_descriptors()
    go_on = threading.Event()
    threads = [_wake_after_sending(client, range(seq, seq + 1), errors, go_on) for seq in range(20)]
    me = client.endpoint.identity
    poll_until(lambda: sum(sender == me for sender, _ in client.call({"op": "log"})) == 20 or errors,
               what="the threads to send")
    alive = _open_descriptors()
    go_on.set()
    for thread in threads:
        thread.join(10)
    assert errors == []
    # (What others closed meanwhile does not count: a closed endpoint's flags page goes when
    # it is collected.)
    assert collections.Counter(alive) - collections.Counter(before) == {}, "taken by 20 threads that woke it"

    # At the open-file limit: new threads still wake it, and what they send arrives in order.
    with _at_the_open_file_limit():
        for seq in range(20, 30):
            _wake_after_sending(client, range(seq * 10, seq * 10 + 10), errors).join(10)
    assert errors == []
    sent = [seq for sender, seq in client.call({"op": "log"}) if sender == me]
    assert sorted(sent[:20]) == list(range(20))  # (the first threads sent at once)
    assert sent[20:] == list(range(200, 300))


def test_messages_sent_just_before_close_arrive_before_the_loss():
    """A peer that sends and closes at once: everything it sent arrives, then it is lost."""
    events = queue.SimpleQueue()
    receiver = Endpoint(
        "last-words-receiver",
        on_message=lambda m: events.put(("message", m.payload)),
        on_peer_lost=lambda peer, error: events.put(("lost", peer)),
    )
    try:
        for round_number in range(5):
            sender = Endpoint(f"last-words-{round_number}")
            sender.connect("last-words-receiver", receiver.address)
            for seq in range(200):
                sender.send("last-words-receiver", Message(MessageType.PYTHON_RET, seq + 1, sender.identity, seq))
            sender.close()
            got = [events.get(timeout=10) for _ in range(201)]
            assert got[:200] == [("message", seq) for seq in range(200)]
            assert got[200] == ("lost", sender.identity)
    finally:
        receiver.close()


def test_inline_handlers_run_on_the_io_thread_in_order_and_may_send():
    """Opt-in: handlers on the I/O thread itself, in order, replying from there, and the
    loss of a peer reported after its last message."""
    events = queue.SimpleQueue()

    def echo(message: Message) -> None:
        events.put(("message", message.payload, threading.current_thread().name))
        server.send(message.sender, Message(MessageType.PYTHON_RET, message.id, server.identity, message.payload))

    server = Endpoint(
        "inline-server", on_message=echo, inline_handlers=True,
        on_peer_lost=lambda peer, error: events.put(("lost", peer, threading.current_thread().name)),
    )
    try:
        client = Endpoint("inline-client")
        client.connect("inline-server", server.address)
        for seq in range(200):
            client.send("inline-server", Message(MessageType.PYTHON_CALL, seq + 1, "inline-client", seq))
        assert [client.recv(10).payload for _ in range(200)] == list(range(200))
        client.close()
        got = [events.get(timeout=10) for _ in range(201)]
        assert [event[:2] for event in got[:200]] == [("message", seq) for seq in range(200)]
        assert got[200][:2] == ("lost", "inline-client")
        assert {event[2] for event in got} == {server._io_thread.name}
    finally:
        server.close()
    with pytest.raises(ValueError, match="inline_handlers"):
        Endpoint("no-handler", inline_handlers=True)


def _runnable_share(native_id: int, seconds: float, samples: int = 60) -> float:
    """The share of ``samples`` looks over ``seconds`` that found a thread of this process
    running or runnable (``R`` in /proc), not asleep. A spinner that yields its CPU is
    runnable even while other processes take the cores (its CPU time then says little)."""
    runnable = 0
    for _ in range(samples):
        with open(f"/proc/self/task/{native_id}/stat") as stat:
            runnable += stat.read().rsplit(")", 1)[1].split()[0] == "R"
        time.sleep(seconds / samples)  # a measuring interval, not a wait for an event
    return runnable / samples


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads thread states from /proc")
def test_busy_poll_spins_after_traffic_then_sleeps():
    """Opt-in busy polling: after traffic the I/O thread keeps polling (it stays runnable
    while nothing arrives), and once busy_poll has passed without traffic it sleeps, though
    the peer's heartbeats keep arriving every 0.1 s (they do not count as traffic). The
    window follows traffic that the I/O thread received: inline handlers here, so that no
    waiting thread (a recv() caller, the dispatcher) reads the answers first; one that does
    was awake for them, and starts no window."""
    with pytest.raises(ValueError, match="busy_poll"):
        EndpointOptions(busy_poll=-1)
    fast_heartbeats = dict(heartbeat_interval=0.1, peer_timeout=5.0)
    peer = Endpoint("busy-peer", options=EndpointOptions(**fast_heartbeats),
                    on_message=lambda m: peer.send(m.sender, Message(MessageType.PYTHON_RET, m.id, "busy-peer", m.payload)))
    answers: queue.SimpleQueue = queue.SimpleQueue()
    busy = Endpoint("busy", options=EndpointOptions(busy_poll=0.6, **fast_heartbeats), on_message=answers.put,
                    inline_handlers=True)
    try:
        busy.connect("busy-peer", peer.address)

        def call(payload):
            busy.send("busy-peer", Message(MessageType.PYTHON_CALL, next(_ids), "busy", payload))
            return answers.get(timeout=10).payload

        io_thread = busy._io_thread.native_id
        assert call("ping") == "ping"  # traffic: the I/O thread spins for 0.6 s from here
        spinning = _runnable_share(io_thread, 0.3)
        time.sleep(0.5)  # the window is over; only heartbeats arrive from now on
        idle = _runnable_share(io_thread, 0.5)
        assert busy.stats()["busy-peer"].heartbeats_received >= 5
        assert spinning >= 0.5, f"the I/O thread was asleep in {1 - spinning:.0%} of 0.3 s of its busy-poll window"
        assert idle <= 0.25, f"the I/O thread was awake in {idle:.0%} of 0.5 s after its busy-poll window"
        assert [call(n) for n in range(100)] == list(range(100))  # and it still serves
    finally:
        busy.close()
        peer.close()


def test_ticks_fall_on_multiples_of_the_interval():
    """Every process on a host ticks at the same moments, so heartbeats between its idle
    peers arrive together (one wake-up per interval, not one per peer)."""
    for interval in (0.1, 1.0, 2.5):
        for now in (0.0, 0.05, 1.0, 12345.678, 98765.4321):
            tick = tick_after(now, interval)
            assert now < tick <= now + interval
            assert tick / interval == pytest.approx(round(tick / interval), abs=1e-6)


def test_idle_peers_get_a_heartbeat_every_tick():
    """Between peers that send each other nothing else, each tick sends one heartbeat each
    way: the heartbeat one tick sent does not make the next tick skip that peer (it would
    with "nothing sent for an interval", as ticks are late by varying amounts)."""
    options = EndpointOptions(heartbeat_interval=0.1, peer_timeout=5.0)
    a = Endpoint("idle-a", options=options)
    b = Endpoint("idle-b", options=options)
    try:
        b.connect("idle-a", a.address)
        poll_until(lambda: a.peers().get("idle-b") == b.peers().get("idle-a") == "ready", what="both HELLOs")
        start = time.monotonic()
        before = (a.stats()["idle-b"].heartbeats_sent, b.stats()["idle-a"].heartbeats_sent)
        time.sleep(3.0)  # a measuring interval: 30 ticks
        after = (a.stats()["idle-b"].heartbeats_sent, b.stats()["idle-a"].heartbeats_sent)
        ticks = (time.monotonic() - start) / 0.1  # (the sleep may have run over)
        sent = [later - earlier for earlier, later in zip(before, after)]
        # A tick is lost only when the I/O thread is late by a whole interval.
        assert all(0.85 * ticks <= count <= ticks + 1 for count in sent), f"heartbeats sent in {ticks:.1f} ticks: {sent}"
        assert a.peers()["idle-b"] == b.peers()["idle-a"] == "ready"
    finally:
        b.close()
        a.close()


def _openmp_threads_of_handler_threads(results) -> None:
    """In a fresh process: set one intra-op thread count, then report the OpenMP thread count
    each kind of handler thread sees (dispatcher; I/O thread with inline_handlers)."""
    from tests.rpc_functions import openmp_max_threads

    try:
        count = 1 if torch.get_num_threads() > 1 else 2  # anything but this process's default
        torch.set_num_threads(count)
        seen = []
        for inline in (False, True):
            name = f"omp-server-{inline}"

            def report(message: Message, name=name) -> None:
                servers[name].send(message.sender, Message(MessageType.PYTHON_RET, message.id, name, openmp_max_threads()))  # noqa: B023 - servers is bound before any message arrives

            servers = {name: Endpoint(name, on_message=report, inline_handlers=inline)}
            client = Endpoint(f"omp-client-{inline}")
            client.connect(name, servers[name].address)
            client.send(name, Message(MessageType.PYTHON_CALL, 1, client.identity, None))
            seen.append(client.recv(30).payload)
            client.close()
            servers[name].close()
        results.put((count, seen))
    except BaseException as exc:
        results.put(("error", repr(exc)))


def test_handler_threads_use_the_intra_op_thread_count_set_before():
    """torch.set_num_threads holds on the threads that run handlers, as on PyTorch's own
    threads (transport.tensors.adopt_torch_thread_settings)."""
    from tests.rpc_harness import spawn_and_collect

    [(count, seen)] = spawn_and_collect(_openmp_threads_of_handler_threads, [()])
    assert count != "error", seen
    if None in seen:
        pytest.skip("torch uses no GNU or Intel OpenMP runtime here")
    assert seen == [count, count], (count, seen)
