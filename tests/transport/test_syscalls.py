"""Doorbell system calls that keep the GIL (transport/syscalls.py), on real datagram sockets:
what they read and send, their errors, and that no other thread runs while they are made."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from zmqautograd.transport import syscalls

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(sys.platform != "linux", reason="Linux doorbells")]


@contextlib.contextmanager
def _doorbell() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A bound non-blocking datagram socket in the abstract namespace and one connected to it."""
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    bell.bind(f"\0zmqautograd-test-{os.getpid()}-{id(bell)}")
    ringer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
    ringer.connect(bell.getsockname())
    try:
        yield bell, ringer
    finally:
        ringer.close()
        bell.close()


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


@pytest.fixture(params=["libc", "python"])
def path(request, monkeypatch) -> str:
    """Each test on both ways of making the calls (Python's wrappers where libc is not loaded)."""
    if request.param == "python":
        monkeypatch.setattr(syscalls, "_LIBC", None)
    return request.param


def test_libc_is_loaded_on_linux():
    assert syscalls._LIBC is not None


def test_a_drain_takes_every_datagram_and_counts_them(path):
    with _doorbell() as (bell, ringer):
        assert syscalls.drain_datagrams(bell.fileno()) == 0
        for _ in range(5):
            assert syscalls.send_byte(ringer, b"\0")
        assert _readable(bell)
        assert syscalls.drain_datagrams(bell.fileno()) == 5
        assert not _readable(bell)
        assert syscalls.drain_datagrams(bell.fileno()) == 0


def test_a_drain_goes_on_past_a_full_batch(monkeypatch):
    monkeypatch.setattr(syscalls._LIBC, "batch", ctypes.c_uint(2))
    with _doorbell() as (bell, ringer):
        for _ in range(5):
            ringer.send(b"\1")
        assert syscalls.drain_datagrams(bell.fileno()) == 5
        assert not _readable(bell)


def test_a_closed_descriptor_is_an_error_not_an_empty_doorbell(path):
    with _doorbell() as (bell, ringer):
        ringer.send(b"\0")  # readable: the drain gets as far as the receive
        fd = os.dup(bell.fileno())
        os.close(fd)
        with pytest.raises(OSError) as raised:
            syscalls.drain_datagrams(fd)
        assert raised.value.errno == errno.EBADF


def test_sending_to_a_full_gone_or_closed_doorbell_fails_quietly(path):
    with _doorbell() as (bell, ringer):
        sent = 0
        while syscalls.send_byte(ringer, b"\0"):  # the queue is bounded (net.unix.max_dgram_qlen)
            sent += 1
            assert sent < 100_000
        assert sent > 0 and syscalls.drain_datagrams(bell.fileno()) == sent
        bell.close()
        assert not syscalls.send_byte(ringer, b"\0")  # the doorbell is gone
        ringer.close()
        assert not syscalls.send_byte(ringer, b"\0")  # closed: nothing is sent anywhere


def _ran_meanwhile(call: Callable[[], object], calls: int = 200) -> bool:
    """Whether another thread, waiting for the GIL all along, ran while this thread made
    ``calls`` calls: it gets the GIL only when a call lets it go (the forced switch interval
    is set far beyond the calls' time)."""
    ran: list[bool] = []
    go = threading.Event()

    def run_once() -> None:
        go.wait()
        ran.append(True)

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=run_once, daemon=True)
    thread.start()
    sys.setswitchinterval(5.0)
    try:
        go.set()  # it is now runnable, waiting for the GIL that this thread holds
        for _ in range(calls):
            call()
        during = bool(ran)
    finally:
        sys.setswitchinterval(interval)
    thread.join(10)
    assert ran, "the other thread never ran"
    return during


def test_the_calls_keep_the_gil():
    """The point of the module: no other thread runs while a doorbell is emptied or rung."""
    with _doorbell() as (bell, ringer):
        assert not _ran_meanwhile(lambda: syscalls.drain_datagrams(bell.fileno()))
        assert not _ran_meanwhile(lambda: syscalls.send_byte(ringer, b"\0") and syscalls.drain_datagrams(bell.fileno()))
