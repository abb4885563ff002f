"""Waiting threads receive from the ROUTER themselves (transport/waiter.py): the thread that
waits for a message is the one the kernel wakes, and it receives the message without a
hand-over from the I/O thread; without EPOLLEXCLUSIVE everything still works through the I/O
thread."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tests.conftest import poll_until

from zmqautograd.transport import waiter as transport_waiter
from zmqautograd.transport import waiting
from zmqautograd.transport import EndpointClosedError, Message, MessageType
from zmqautograd.transport.endpoint import Endpoint
from zmqautograd.rpc.pool import ElasticPool

from tests.workers import start_server

pytestmark = pytest.mark.timeout(120)

linux_only = pytest.mark.skipif(transport_waiter.EXCLUSIVE is None, reason="needs epoll with EPOLLEXCLUSIVE (Linux)")


class ReceivingThreads:
    """An ``on_envelope`` that records which thread received each application message."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, peer, envelope) -> bool:
        self.names.append(threading.current_thread().name)
        return False  # then routed as usual

    def share(self, name: str) -> float:
        return self.names.count(name) / len(self.names)


def sleeps_of(monkeypatch, waiter) -> list:
    """The timeouts of ``waiter``'s sleeps from now on (its class's ``sleep``, wrapped for
    the test): a wait that must end without sleeping leaves it empty."""
    sleeps: list = []
    sleep = type(waiter).sleep

    def counted_sleep(sleeper, timeout):
        if sleeper is waiter:
            sleeps.append(timeout)
        return sleep(sleeper, timeout)

    monkeypatch.setattr(type(waiter), "sleep", counted_sleep)
    return sleeps


def _echo_pair(server_options: dict, client_options: dict, server_receivers=None):
    """An echo server and a pull-style client, both in this process, on loopback TCP."""
    server: Endpoint | None = None

    def echo(message: Message) -> None:
        server.send(message.sender, Message(MessageType.PYTHON_RET, message.id, "echo", message.payload))

    server = Endpoint("echo", on_message=echo, on_envelope=server_receivers, **server_options)
    client = Endpoint("asker", **client_options)
    client.connect("echo", server.address)
    client.wait_for_peer("echo", 30)
    return server, client


@linux_only
def test_the_thread_in_recv_receives_its_answers_itself():
    """Against a server in another process: the answers reach the caller of recv() without
    the I/O thread (it would receive them all without waiting threads that read)."""
    received = ReceivingThreads()
    server = start_server()
    client = Endpoint("asker", on_envelope=received)
    try:
        client.connect(server.identity, server.address)
        client.wait_for_peer(server.identity, 60)
        for seq in range(300):
            client.send(server.identity, Message(MessageType.PYTHON_CALL, seq + 1, "asker", {"op": "echo", "data": seq}))
            reply = client.recv(30)
            assert (reply.id, reply.payload) == (seq + 1, seq)
        # The caller is asleep in recv() when its answer comes in all but odd cases (it was
        # preempted between its send and its sleep); then the I/O thread receives it.
        assert received.share(threading.current_thread().name) > 0.5, received.names[:20]
    finally:
        client.close()
        server.stop()


def _call_and_receive(client: Endpoint, calls: range) -> list:
    replies = []
    for seq in calls:
        client.send("echo", Message(MessageType.PYTHON_CALL, seq + 1, "asker", seq))
        replies.append(client.recv(30).payload)
    return replies


@linux_only
def test_the_dispatcher_receives_what_it_delivers():
    received = ReceivingThreads()
    server, client = _echo_pair({}, {}, server_receivers=received)
    try:
        assert _call_and_receive(client, range(300)) == list(range(300))
        assert received.share(server._dispatch_thread.name) > 0.5, received.names[:20]
    finally:
        client.close()
        server.close()


@linux_only
def test_threads_that_wait_for_answers_at_once_leave_the_receiving_to_the_io_thread(monkeypatch):
    """A caller alone receives its answers itself; callers waiting at once leave it to the I/O
    thread, which wakes each (a reading caller would receive and hand over the others'
    answers), and they sleep on their locks, not on descriptors; every answer arrives either
    way, and no wait stays noted."""
    received = ReceivingThreads()
    server, client = _echo_pair({}, {"on_envelope": received})
    sleeps: list[tuple[str, bool]] = []  # (thread, on its lock)
    sleep = transport_waiter.Waiter.sleep

    def noted_sleep(self, timeout):
        sleeps.append((threading.current_thread().name, self._on_lock))
        sleep(self, timeout)

    monkeypatch.setattr(transport_waiter.Waiter, "sleep", noted_sleep)
    try:
        _call_and_receive(client, range(50))  # warm: connected both ways
        received.names.clear()
        sleeps.clear()
        replies: list = []
        callers = [threading.Thread(target=lambda n=n: replies.extend(_call_and_receive(client, range(n, 1000, 4))),
                                    name=f"caller-{n}") for n in range(4)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        assert sorted(replies) == list(range(1000))
        assert received.share(client._io_thread.name) > 0.5, received.names[:40]
        callers_sleeps = [on_lock for name, on_lock in sleeps if name.startswith("caller-")]
        assert sum(callers_sleeps) > len(callers_sleeps) / 2, sleeps[:40]
        assert client._answer_waits == {}

        received.names.clear()
        assert _call_and_receive(client, range(300)) == list(range(300))
        assert received.share(threading.current_thread().name) > 0.5, received.names[:40]
    finally:
        client.close()
        server.close()


@linux_only
def test_a_wait_that_began_long_ago_does_not_stop_a_caller_from_receiving():
    """A thread that waits for something slow (a shutdown barrier, a long call) is no caller in
    a loop of calls: a caller that waits after it still receives its own answers."""
    received = ReceivingThreads()
    server, client = _echo_pair({}, {"on_envelope": received})
    stop = threading.Event()
    waiter = None

    def wait_long() -> None:
        nonlocal waiter
        waiter = client.waiter()
        client.wait_until(stop.is_set, 60)

    slow = threading.Thread(target=wait_long)
    try:
        _call_and_receive(client, range(50))
        slow.start()
        _until(lambda: len(client._answer_waits) == 1)
        time.sleep(waiting._CALLERS_WINDOW * 1.5)  # the age of that wait is what this test is about
        received.names.clear()
        assert _call_and_receive(client, range(300)) == list(range(300))
        assert received.share(threading.current_thread().name) > 0.5, received.names[:40]
    finally:
        stop.set()
        if waiter is not None:
            waiter.wake()
        slow.join(30)
        client.close()
        server.close()


def test_without_epoll_exclusive_the_io_thread_receives_everything(monkeypatch):
    """The portable path (no EPOLLEXCLUSIVE): waiting threads only sleep on their wake-up
    descriptor, and messages, order and timeouts are as before."""
    monkeypatch.setattr(transport_waiter, "EXCLUSIVE", None)
    received = ReceivingThreads()
    server, client = _echo_pair({}, {}, server_receivers=received)
    try:
        for seq in range(200):
            client.send("echo", Message(MessageType.PYTHON_CALL, seq + 1, "asker", seq))
        assert [client.recv(30).payload for _ in range(200)] == list(range(200))
        assert set(received.names) == {server._io_thread.name}
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.recv(0.2)
        assert 0.15 < time.monotonic() - start < 5
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("watching", [False, True], ids=["on its lock", "on its descriptors"])
def test_a_waiter_is_woken_before_or_during_its_sleep_and_at_its_timeout(watching):
    """A waiter that does not watch the ROUTER sleeps on its lock: its wake-up leaves its
    descriptor untouched (no write, poll and read). Either way a wake-up that came before
    the sleep ends it at once and is used up by it, one that comes during it ends it, and
    without one the sleep ends at its timeout."""
    waiter = transport_waiter.Waiter(reads=True)
    try:
        waiter.arm(watching)
        waiter.wake()  # before the sleep
        assert waiter.has_input() is watching
        start = time.monotonic()
        waiter.sleep(30)
        assert time.monotonic() - start < 10
        assert not waiter.has_input()
        waiter.waiting = False

        waiter.arm(watching)
        waking = threading.Thread(target=waiter.wake)  # before or during the sleep
        waking.start()
        start = time.monotonic()
        waiter.sleep(30)
        assert time.monotonic() - start < 10
        waking.join(10)
        waiter.waiting = False

        waiter.wake()  # not waiting: nothing to wake, nothing left for the next sleep
        waiter.arm(watching)
        start = time.monotonic()
        waiter.sleep(0.2)
        assert 0.15 < time.monotonic() - start < 10
        waiter.waiting = False
    finally:
        waiter.close()


def test_no_wake_up_is_lost_when_waits_switch_between_lock_and_descriptor_sleeps():
    """A waiter whose waits sleep on its lock or on its descriptors, by turns at random, and a
    completer that makes each wait's condition true and wakes it at random moments (before
    the wait arms, while it looks, while it sleeps): no sleep runs to its 5 s timeout (a
    lost wake-up: the completer's went where the sleep was not). A sleep that ends with its
    condition still false took a wake-up left over from an earlier wait: allowed."""
    import random

    rounds = 3000
    done = [False] * rounds
    waiter = transport_waiter.Waiter(reads=True)
    randomness = random.Random(4)
    kinds = [randomness.random() < 0.5 for _ in range(rounds)]
    pauses = [randomness.randrange(0, 300) for _ in range(rounds)]
    slept_out: list[float] = []
    sleeps = {True: 0, False: 0}  # by kind: on its descriptors, on its lock
    reached = -1  # the round the waiter is in
    stopped = False

    def complete() -> None:
        for i in range(rounds):
            while reached < i:
                if stopped:
                    return
                os.sched_yield()
            for _ in range(pauses[i]):  # a random moment, in bytecodes (no sleep: it would be ms)
                pass
            done[i] = True
            waiter.wake()

    waiter.sleeper = threading.get_ident()
    completer = threading.Thread(target=complete)
    completer.start()
    try:
        for i in range(rounds):
            reached = i
            while not slept_out:
                waiter.arm(kinds[i])
                if done[i]:
                    break
                start = time.monotonic()
                sleeps[kinds[i]] += 1
                waiter.sleep(5)
                waiter.waiting = False
                if time.monotonic() - start >= 4:  # (done[i] may be true by now: its wake-up was lost)
                    slept_out.append(time.monotonic() - start)
            waiter.waiting = False
            if slept_out:
                break
    finally:
        stopped = True
        completer.join(30)
        waiter.close()
    assert not slept_out, f"{len(slept_out)} sleeps ran to their timeout"
    assert min(sleeps.values()) > rounds / 20, sleeps  # both kinds slept, many times


def test_waits_noted_by_many_threads_at_once_without_a_lock_all_end():
    """Waits for an answer are noted and ended without the socket lock (transport/waiting.py,
    ``_take_reading_role``). 16 threads beginning and ending waits at once, with the
    interpreter switching threads every 10 us (so a switch lands inside any loop over the
    waits): none fails, and none stays noted."""
    import sys

    endpoint = Endpoint("many-waits")
    errors: list[BaseException] = []
    interval = sys.getswitchinterval()

    def wait_often() -> None:
        try:
            for _ in range(300):
                looks = iter([False, True])  # not ready at the first look: the wait is noted
                assert endpoint.wait_until(looks.__next__, 30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=wait_often) for _ in range(16)]
    sys.setswitchinterval(1e-5)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        sys.setswitchinterval(interval)
        endpoint.close()
    assert not errors, errors[:3]
    assert not any(thread.is_alive() for thread in threads)
    assert endpoint._answer_waits == {}


def test_wait_until_returns_when_woken_or_at_its_timeout():
    endpoint = Endpoint("waits")
    try:
        start = time.monotonic()
        assert endpoint.wait_until(lambda: False, 0.2) is False
        assert 0.15 < time.monotonic() - start < 5

        flag = threading.Event()
        waiter = endpoint.waiter()

        def complete() -> None:
            _until(lambda: waiter.waiting)  # the main thread is waiting: it must be woken
            flag.set()
            waiter.wake()

        threading.Thread(target=complete).start()
        start = time.monotonic()
        assert endpoint.wait_until(flag.is_set, 30) is True
        assert time.monotonic() - start < 10
    finally:
        endpoint.close()


def test_wait_until_does_its_idle_work_where_it_would_wait(monkeypatch):
    """wait_until's ``idle`` on a thread that does not spin (no rings here): every piece, the
    first time the wait finds its condition false, before the thread sleeps and before it
    arms its waiter (nobody spends a wake-up on it meanwhile); never when the condition
    holds at once. A condition that the idle work makes true ends the wait without a sleep;
    a wait that times out did its work once."""
    endpoint = Endpoint("idles")
    try:
        done: list = []
        assert endpoint.wait_until(lambda: True, 5, idle=lambda: bool(done.append("idle"))) is True
        assert done == []
        waiter = endpoint.waiter()
        flag = threading.Event()
        sleeps = sleeps_of(monkeypatch, waiter)

        def work() -> bool:  # three pieces; the last makes the condition true
            done.append(waiter.waiting)
            if len(done) < 3:
                return True
            flag.set()
            return False

        assert endpoint.wait_until(flag.is_set, 30, idle=work) is True
        assert sleeps == []  # (nothing wakes it: a sleep would have lasted to the deadline)
        assert done == [False, False, False]
        assert endpoint.wait_until(lambda: False, 0.2, idle=lambda: bool(done.append("again"))) is False
        assert done == [False, False, False, "again"]
    finally:
        endpoint.close()


def test_close_wakes_every_thread_waiting_in_recv():
    endpoint = Endpoint("closing")
    outcomes: list[str] = []

    def receive() -> None:
        try:
            endpoint.recv()
        except EndpointClosedError:
            outcomes.append("closed")

    threads = [threading.Thread(target=receive) for _ in range(3)]
    for thread in threads:
        thread.start()
    _until(lambda: len(endpoint._recv_waiters) == 3)  # all three inside recv()
    endpoint.close()
    for thread in threads:
        thread.join(10)
    assert outcomes == ["closed"] * 3


@linux_only
def test_an_idle_pool_thread_receives_the_request_it_runs():
    """An endpoint whose executor is an ElasticPool receiving while idle: a request wakes the
    idle pool thread, which receives it and runs it (no I/O thread, no hand-over)."""
    received = ReceivingThreads()
    ran_on: list[str] = []
    pool = ElasticPool(4, "serve")
    server: Endpoint | None = None

    def handle(message: Message) -> None:
        ran_on.append(threading.current_thread().name)
        server.send(message.sender, Message(MessageType.PYTHON_RET, message.id, "served", message.payload))

    server = Endpoint("served", on_message=handle, executor=pool.submit, on_envelope=received)
    pool.receive_while_idle(server)
    client = Endpoint("asker")
    try:
        client.connect("served", server.address)
        client.wait_for_peer("served", 30)
        for seq in range(300):
            client.send("served", Message(MessageType.PYTHON_CALL, seq + 1, "asker", seq))
            assert client.recv(30).payload == seq
        pairs = list(zip(received.names, ran_on))
        assert sum(name.startswith("serve-") and name == ran for name, ran in pairs) > len(pairs) / 2, pairs[:20]
        # A burst: what the reader received beyond its own call still finds threads.
        for seq in range(50):
            client.send("served", Message(MessageType.PYTHON_CALL, 1000 + seq, "asker", seq))
        assert sorted(client.recv(30).payload for _ in range(50)) == list(range(50))
    finally:
        client.close()
        server.close()
        pool.shutdown()
    assert pool.thread_count == 0


_until = poll_until


@linux_only
def test_a_woken_pool_reader_whose_work_was_taken_stays_countable():
    """The race the 4-worker suite hit: the pool wakes its reading thread for a call, another
    thread takes the call first, and the reader must not go back to sleep still counted as
    'on its way' (every later call would then wait for it for ever)."""
    endpoint = Endpoint("idle-pool")
    pool = ElasticPool(2, "steal")
    pool.receive_while_idle(endpoint)
    ran = threading.Event()
    try:
        pool.submit(lambda: None)  # starts a thread, which then waits as the reader
        _until(lambda: pool._reader_waiter is not None and pool._reader_waiter.waiting)
        with pool._lock:  # what the race does, in one step: wake the reader, then steal
            pool._work.append((lambda: None, ()))
            pool._dispatch_locked(time.monotonic(), grow_past_size=False)
            assert pool._reader_woken
            pool._work.popleft()
        _until(lambda: not pool._reader_woken)  # it looked, found nothing, and is countable again
        pool.submit(ran.set)
        assert ran.wait(30)
    finally:
        pool.shutdown()
        endpoint.close()


def test_threads_that_get_no_descriptors_wait_on_a_lock(monkeypatch, caplog):
    """At the open-file limit a waiting thread gets a LockWaiter: slower, never a failure,
    and said once (a pool grown by nested calls makes hundreds of them)."""

    class NoDescriptors(transport_waiter.Waiter):
        def __init__(self, reads: bool = False) -> None:
            raise OSError(24, "Too many open files")

    # (Waiters only: the endpoint's own descriptors are made at its start, where the limit
    # is an error; tests/transport/test_endpoint.py runs a real endpoint at the limit.)
    monkeypatch.setattr(transport_waiter, "Waiter", NoDescriptors)
    monkeypatch.setattr(transport_waiter, "_lock_waiters", 0)
    caplog.set_level("DEBUG", logger=transport_waiter.__name__)
    server, client = _echo_pair({}, {})
    try:
        assert isinstance(client.waiter(), transport_waiter.LockWaiter)
        assert isinstance(server._dispatch_waiter, transport_waiter.LockWaiter)
        said = [r for r in caplog.records if "gets no descriptors" in r.getMessage()]
        assert len(said) >= 2 and [r.levelname for r in said].count("WARNING") == 1
        assert _call_and_receive(client, range(100)) == list(range(100))
        start = time.monotonic()
        assert client.wait_until(lambda: False, 0.2) is False
        assert 0.15 < time.monotonic() - start < 5
    finally:
        client.close()
        server.close()
