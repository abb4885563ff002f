"""Same-host lending of big buffers (transport/lending.py): a peer on this host reads them from
the sender's memory; real server processes, real sockets."""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import time

import pytest

from tests.conftest import poll_until
import torch
import zmq

from zmqautograd.transport import Message, MessageType
from zmqautograd.transport import lending
from zmqautograd.transport.codec import Codec
from zmqautograd.transport.endpoint import Endpoint
from zmqautograd.transport.faults import FaultPolicy
from zmqautograd.transport.errors import LocalProtocolError, RemoteProtocolError

from tests.transport.test_endpoint import Client
from tests.workers import start_server, tensor_digest

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    process = start_server("lending-server")
    yield process
    process.stop()


def _call_stats(client) -> dict:
    return client.call({"op": "stats"})


def test_big_tensors_to_a_same_host_peer_are_lent_read_once_and_released(server):
    client = Client(server, identity="lender")
    try:
        big = torch.randn(1 << 20)  # 4 MiB
        wide = torch.randn(1024, 512, dtype=torch.float64).t()  # 4 MiB, sent as it lies (strided)
        small = torch.arange(10)
        for _ in range(3):
            echoed = client.call({"op": "echo", "data": [big, wide, small]})
            assert torch.equal(echoed[0], big) and torch.equal(echoed[1], wide) and torch.equal(echoed[2], small)
            assert echoed[1].stride() == wide.stride()
            echoed[0].add_(1)  # the received tensors own their memory: the sender's is untouched
            assert not torch.equal(echoed[0], big)
        assert client.call({"op": "digest", "data": big}) == tensor_digest(big)
        ours = client.endpoint.stats()[server.identity]
        theirs = _call_stats(client)
        assert ours.buffers_lent == 7 and theirs["buffers_borrowed"] == 7  # the small tensor travelled
        assert theirs["buffers_lent"] == 6 and ours.buffers_borrowed == 6  # the echoes came back lent
        # The server read each buffer before its handler ran, and said so before it answered.
        assert ours.buffers_on_loan == 0
        # We released what it lent us when we read it, before the stats call went out.
        assert theirs["buffers_on_loan"] == 0
        # Lent buffers travel as empty frames: the socket carried little of the 4 MiB payloads.
        assert ours.bytes_sent >= 7 * (4 << 20)  # counted as sent, though
    finally:
        client.close()


def test_lending_turned_off_sends_every_byte_through_the_socket(server):
    client = Client(server, identity="no-lender", lend_min=0)
    try:
        big = torch.randn(1 << 20)
        assert torch.equal(client.call({"op": "echo", "data": big}), big)
        # Off on one side is off both ways: we offer the server nothing to read, and we
        # answer its offer with nothing.
        assert client.endpoint.stats()[server.identity].buffers_lent == 0
        assert client.endpoint.stats()[server.identity].buffers_borrowed == 0
        assert _call_stats(client)["buffers_borrowed"] == 0
    finally:
        client.close()


def test_buffers_below_lend_min_go_through_the_socket(server):
    client = Client(server, identity="high-min", lend_min=8 << 20)
    try:
        medium = torch.randn(1 << 20)  # 4 MiB: below the 8 MiB minimum
        large = torch.randn(3 << 20)  # 12 MiB
        echoed = client.call({"op": "echo", "data": [medium, large]})
        assert torch.equal(echoed[0], medium) and torch.equal(echoed[1], large)
        assert client.endpoint.stats()[server.identity].buffers_lent == 1
    finally:
        client.close()


def _lent_call(codec: Codec, message_id: int, sender: str, table: list) -> list:
    """A call with one 4 MiB tensor whose frame is replaced by the lent-buffer table given."""
    frames = codec.encode(Message(MessageType.PYTHON_CALL, message_id, sender, {"op": "echo", "data": torch.ones(1 << 20)}))
    return [lending.encode_table(table), frames[0], b""]


def test_a_peer_lending_an_unmapped_address_gets_a_protocol_error_and_the_server_goes_on(server):
    client = Client(server, identity="bad-lender")
    try:
        codec = Codec()
        for message_id, address in ((901, 4096), (902, 1 << 46)):  # never mapped in a process
            frames = _lent_call(codec, message_id, "bad-lender", [[1, 77, address, 4 << 20]])
            client.endpoint.send_encoded(server.identity, message_id, frames)
            peer, rejected_id, error = client.send_errors.get(timeout=30)
            assert (peer, rejected_id) == (server.identity, message_id)
            assert isinstance(error, LocalProtocolError)
            assert "cannot read the 4194304 bytes 'bad-lender' lent at" in str(error)
            assert errno.errorcode[errno.EFAULT] in str(error) or "Bad address" in str(error)
        assert torch.equal(client.call({"op": "echo", "data": torch.ones(1 << 20)}), torch.ones(1 << 20))
    finally:
        client.close()


def test_lent_buffers_from_a_peer_that_never_proved_it_shares_our_host_are_refused(server):
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.ROUTING_ID, b"raw-lender")
    raw.connect(server.address)
    codec = Codec()
    try:
        # HELLO without the lending fields: the server makes no offer, so it reads nothing.
        raw.send_multipart(codec.encode(Message(MessageType.HELLO, 0, "raw-lender", {"identity": "raw-lender"})))
        assert raw.poll(10_000)
        assert codec.decode(raw.recv_multipart()).type is MessageType.HELLO
        buffer = ctypes.create_string_buffer(4 << 20)  # readable, were the server to try
        raw.send_multipart(_lent_call(codec, 903, "raw-lender", [[1, 5, ctypes.addressof(buffer), 4 << 20]]))
        assert raw.poll(10_000)
        reply = codec.decode(raw.recv_multipart())
        assert reply.type is MessageType.PROTOCOL_ERROR and reply.id == 903
        assert "has not verified it can read its memory" in reply.payload["error"]
        # Malformed tables are refused, naming the message, before anything is read.
        address = ctypes.addressof(buffer)
        for message_id, table in (
            (904, [[2, 5, address, 4 << 20]]),  # no such frame
            (905, [[1, 5, address]]),  # too short
            (906, [[1, 5, address, 4 << 20], [1, 6, address, 4 << 20]]),  # the same frame twice
            (907, []),
        ):
            raw.send_multipart(_lent_call(codec, message_id, "raw-lender", table))
            assert raw.poll(10_000)
            reply = codec.decode(raw.recv_multipart())
            assert reply.type is MessageType.PROTOCOL_ERROR and reply.id == message_id, reply
    finally:
        raw.close(0)
        context.term()


def test_a_partition_injected_after_a_loan_does_not_keep_the_lent_buffer_for_ever():
    """A partition drops everything from the peer, but not the release of a buffer lent to it
    before: dropping that would only leak the buffer (fault-injection runs heal partitions)."""
    policy = FaultPolicy()
    answers: queue.SimpleQueue = queue.SimpleQueue()
    lender = Endpoint("lender", faults=policy, on_message=lambda message: answers.put(message.id))
    borrower = Endpoint("borrower")  # pull-style: a message is decoded (and read) in recv()

    def read_and_answer(message_id: int) -> None:
        """The borrower reads the call (releasing the loan at once) and answers after: the
        release travels ahead of the answer."""
        assert torch.equal(borrower.recv(10).payload, big)
        borrower.send("lender", Message(MessageType.PYTHON_RET, message_id, "borrower", None))

    try:
        lender.connect("borrower", borrower.address)
        lender.wait_for_peer("borrower", 10)
        big = torch.randn(1 << 20)
        # The lender lends once it has the borrower's LEND_READY, which may come after the
        # first calls: they go through the socket until then.
        message_id = 0
        while lender.stats()["borrower"].buffers_lent == 0 and message_id < 100:
            message_id += 1
            lender.send("borrower", Message(MessageType.PYTHON_CALL, message_id, "lender", big))
            read_and_answer(message_id)
            assert answers.get(timeout=10) == message_id
        assert lender.stats()["borrower"].buffers_lent >= 1
        assert lender.stats()["borrower"].buffers_on_loan == 0  # released ahead of the answer
        lender.send("borrower", Message(MessageType.PYTHON_CALL, 1000, "lender", big))
        # send() may leave the message queued for the I/O thread (behind others queued there):
        # the loan is made when it goes out.
        poll_until(lambda: lender.stats()["borrower"].buffers_on_loan == 1, 10, "the loan")
        policy.partition("borrower")
        assert lender.stats()["borrower"].buffers_on_loan == 1
        assert torch.equal(borrower.recv(10).payload, big)  # read: the release goes out
        # Nothing from the borrower can tell us the release arrived (the partition drops it
        # all), so this waits on the count itself.
        poll_until(lambda: lender.stats()["borrower"].buffers_on_loan == 0, 10, "the loan's release")
    finally:
        lender.close()
        borrower.close()


def test_the_table_checks_every_entry_against_the_frames():
    frames = [b"", b"abc"]
    assert lending.decode_table(lending.encode_table([[1, 3, 4096, 10]]), frames) == [(1, 3, 4096, 10)]
    for table in ([[2, 3, 4096, 10]], [[0, 3, 4096, 10]], [[3, 3, 4096, 10]], [[1, 3, 0, 10]], [[1, 3, 4096, 0]],
                  [[1, -3, 4096, 10]], [[1, 3, 4096, "10"]], [1], {"a": 1}):
        with pytest.raises(RemoteProtocolError):
            lending.decode_table(lending.encode_table(table), frames)
    with pytest.raises(RemoteProtocolError, match="not valid msgpack"):
        lending.decode_table(bytes((lending.LENT_MARK,)) + b"\x92\x01", frames)
    # No envelope can be taken for a table: every envelope is a msgpack array.
    assert not lending.is_table(Codec().encode(Message(MessageType.PYTHON_CALL, 1, "x", None))[0])


def test_reading_a_peers_memory_needs_the_challenge_where_it_says():
    if lending.host_key() is None:
        pytest.skip("no process_vm_readv or pidfd_open here")
    challenge = os.urandom(lending.CHALLENGE_BYTES)
    offer = lending.Offer.from_hello(
        {"lend": {"host": lending.host_key(), "pid": os.getpid(), "challenge": challenge}}, lending.host_key()
    )
    reader = lending.Reader.verify(os.getpid(), offer.message(), challenge)
    data = torch.arange(1000, dtype=torch.int32)
    assert torch.equal(torch.frombuffer(reader.read(data.data_ptr(), 4000), dtype=torch.int32), data)
    with pytest.raises(RemoteProtocolError, match="challenge is not where"):
        lending.Reader.verify(os.getpid(), offer.message(), os.urandom(lending.CHALLENGE_BYTES))
    with pytest.raises(OSError):
        lending.Reader.verify(os.getpid(), 4096, challenge)
    # A buffer that ends in an unmapped page: the kernel copies the mapped part, then the
    # next read from there fails; the whole read fails with EFAULT.
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = os.sysconf("SC_PAGE_SIZE")
    address = libc.mmap(None, 2 * page, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    ctypes.memset(address, 7, page)
    assert libc.munmap(ctypes.c_void_p(address + page), ctypes.c_size_t(page)) == 0
    assert torch.equal(torch.frombuffer(reader.read(address, page), dtype=torch.uint8), torch.full((page,), 7, dtype=torch.uint8))
    with pytest.raises(OSError) as caught:
        reader.read(address, 2 * page)
    assert caught.value.errno == errno.EFAULT
    libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(page))
    # Another host, or a malformed HELLO: no offer.
    assert lending.Offer.from_hello({"lend": {"host": "elsewhere", "pid": 1, "challenge": challenge}}, lending.host_key()) is None
    assert lending.Offer.from_hello({"lend": {"host": lending.host_key(), "pid": 1, "challenge": b"short"}}, lending.host_key()) is None


def test_a_read_after_the_peer_exited_is_not_trusted():
    if lending.host_key() is None:
        pytest.skip("no process_vm_readv or pidfd_open here")
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    pidfd = os.pidfd_open(child.pid)
    reader = lending.Reader(child.pid, pidfd)
    assert lending.is_alive(pidfd)
    child.stdin.close()
    child.wait(30)
    with pytest.raises(OSError) as caught:
        reader.read(4096, 16)
    assert caught.value.errno in (errno.ESRCH, errno.EFAULT)
    reader.close()


def _self_reader(pool) -> "lending.Reader":
    """A Reader of this process's own memory (the challenge shown where it says)."""
    challenge = os.urandom(lending.CHALLENGE_BYTES)
    offer = lending.Offer.from_hello(
        {"lend": {"host": lending.host_key(), "pid": os.getpid(), "challenge": challenge}}, lending.host_key()
    )
    return lending.Reader.verify(os.getpid(), offer.message(), challenge, pool)


def test_reads_reuse_pooled_buffers_only_once_no_tensor_uses_them():
    if lending.host_key() is None:
        pytest.skip("no process_vm_readv or pidfd_open here")
    from zmqautograd.transport.staging import plain_pool

    mib = 1 << 20
    pool = plain_pool(8 * mib, lending.DEFAULT_LEND_MIN)
    reader = _self_reader(pool)
    first, second = torch.full((mib,), 1.0), torch.full((mib,), 2.0)  # 4 MiB each
    kept = torch.frombuffer(reader.read(first.data_ptr(), 4 * mib), dtype=torch.float32)
    assert pool.allocations == 1 and pool.cached_bytes == 0
    # A tensor over the first buffer still lives: the next read gets another one, and the
    # first tensor keeps its bytes.
    other = torch.frombuffer(reader.read(second.data_ptr(), 4 * mib), dtype=torch.float32)
    assert pool.allocations == 2
    assert torch.equal(kept, first) and torch.equal(other, second)
    # Views of a received tensor keep its buffer too, and so do memoryviews derived from the
    # one read returned, when that one is gone.
    view = kept.view(1024, 1024)[1:]
    del kept
    derived = memoryview(reader.read(second.data_ptr(), 4 * mib))[4:]
    assert pool.allocations == 3
    assert pool.cached_bytes == 0
    derived_tensor = torch.frombuffer(derived, dtype=torch.uint8)
    del derived
    assert pool.cached_bytes == 0
    del derived_tensor
    assert pool.cached_bytes == 4 * mib
    del view, other  # both buffers go back; with the third, one more than the bound holds
    assert pool.cached_bytes == 8 * mib
    again = torch.frombuffer(reader.read(second.data_ptr(), 3 * mib), dtype=torch.float32)  # same size class
    assert pool.allocations == 3 and torch.equal(again, second[: 3 * mib // 4])
    # A read that fails gives its buffer back.
    with pytest.raises(OSError):
        reader.read(4096, 4 * mib)
    assert pool.cached_bytes == 4 * mib
    # Idle buffers are bounded: with 4 MiB cached and 4 more wanted back, the bound (8 MiB)
    # holds; a third idle one would not fit and is dropped.
    extra = torch.frombuffer(reader.read(first.data_ptr(), 4 * mib), dtype=torch.float32)
    assert pool.cached_bytes == 0
    third = torch.frombuffer(reader.read(first.data_ptr(), 4 * mib), dtype=torch.float32)
    assert pool.allocations == 4
    del again, extra, third
    assert pool.cached_bytes == 8 * mib
    # Closed (as its endpoint closes): idle buffers are dropped, and so is what comes back later.
    late = reader.read(first.data_ptr(), 4 * mib)
    pool.close()
    assert pool.cached_bytes == 0
    del late
    assert pool.cached_bytes == 0
    reader.close()


def _echo_until_lent_back(client, tensor: torch.Tensor) -> None:
    """Echo ``tensor`` until the echo comes back lent: the server lends to us only once it
    has our LEND_READY, which can come after the first calls."""
    deadline = time.monotonic() + 30
    while client.endpoint.stats()[client.server.identity].buffers_borrowed == 0:
        assert time.monotonic() < deadline, "the server never lent to us"
        assert torch.equal(client.call({"op": "echo", "data": tensor}), tensor)


def test_lent_tensors_are_read_into_reused_buffers_end_to_end(server):
    """The echoes the server lends back are read into the client's pooled buffers: one buffer
    serves every round trip while the previous echo is gone, two while one is kept."""
    client = Client(server, identity="pooled")
    try:
        pool = client.endpoint._lend_pool
        assert pool is not None
        big = torch.randn(1 << 20)  # 4 MiB
        _echo_until_lent_back(client, big)
        for _ in range(5):
            echoed = client.call({"op": "echo", "data": big})
            assert torch.equal(echoed, big)
            del echoed
        assert pool.allocations == 1
        kept = client.call({"op": "echo", "data": big})
        changed = client.call({"op": "echo", "data": big + 1})
        assert torch.equal(kept, big) and torch.equal(changed, big + 1)
        assert pool.allocations == 2
    finally:
        client.close()
    assert pool.cached_bytes == 0  # closed with the endpoint


def test_lend_cache_zero_reads_into_fresh_buffers(server):
    client = Client(server, identity="unpooled", lend_cache=0)
    try:
        assert client.endpoint._lend_pool is None
        _echo_until_lent_back(client, torch.randn(1 << 20))  # read into a fresh buffer
    finally:
        client.close()
