"""Doorbell system calls that never block, made without letting the GIL go.

Python's own wrappers (``os.read``, ``socket.send``, ``select.poll``) let the GIL go around
every system call. Where other threads wait for the GIL (a driver with many caller threads,
the I/O thread against the pool), each such point is a hand-over: a futex wake-up and a
context switch, 6-13 us of CPU here, for a call that takes a few microseconds and cannot
block. A call through ``ctypes.PyDLL`` keeps the GIL (a send costs about 1 us more than
Python's when alone). One ``recvmmsg`` also empties a doorbell that several writers rang,
where reads take one call per datagram and one more that fails (with an exception).

Linux only (the doorbells are, see transport/shm.py); elsewhere, or where libc cannot be
loaded, the same functions use Python's wrappers.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys

_BATCH = 64  # datagrams taken by one recvmmsg
_MSG_DONTWAIT = 0x40
_MSG_NOSIGNAL = 0x4000
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(_IoVec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


class _Libc:
    """libc's ``recvmmsg`` and ``send`` as GIL-keeping calls, with the structures
    that every drain reuses (the bytes read are thrown away; the GIL keeps drains apart).
    No ``argtypes``: converting each argument through them took half of a call's time; the
    arguments that are not C ints are passed as ready ctypes objects instead."""

    def __init__(self, libc: ctypes.PyDLL) -> None:
        self.recvmmsg, self.send = libc.recvmmsg, libc.send
        self._scratch = ctypes.create_string_buffer(8)
        self._iov = _IoVec(ctypes.cast(self._scratch, ctypes.c_void_p), len(self._scratch))
        self._vector = (_MMsgHdr * _BATCH)()
        iov = ctypes.pointer(self._iov)  # every entry reads into the same scratch bytes
        for entry in self._vector:
            entry.hdr.iov = iov
            entry.hdr.iovlen = 1
        self.vector = ctypes.byref(self._vector)
        self.batch = ctypes.c_uint(_BATCH)
        self.one = ctypes.c_size_t(1)


def _load() -> _Libc | None:
    if sys.platform != "linux":
        return None
    try:
        return _Libc(ctypes.PyDLL(None, use_errno=True))
    except (OSError, AttributeError):
        return None


_LIBC = _load()


def drain_datagrams(fd: int) -> int:
    """Read and drop every datagram queued on the non-blocking socket ``fd``; how many.
    Raises OSError for anything but an empty queue (a closed descriptor, say)."""
    libc = _LIBC
    if libc is None:
        return _drain_by_reads(fd)
    taken = 0
    while True:
        got = libc.recvmmsg(fd, libc.vector, libc.batch, _MSG_DONTWAIT, None)
        if got < 0:
            code = ctypes.get_errno()
            if code == errno.EINTR:
                continue
            if code in _AGAIN:
                return taken
            raise OSError(code, os.strerror(code))
        taken += got
        if got < libc.batch.value:
            return taken


def _drain_by_reads(fd: int) -> int:
    taken = 0
    try:
        while True:
            os.read(fd, 16)
            taken += 1
    except (BlockingIOError, InterruptedError):
        return taken


def send_byte(sock: socket.socket, byte: bytes) -> bool:
    """Send the one-byte datagram ``byte`` on the connected non-blocking ``sock`` (closed:
    nothing is sent); whether it went (a full queue or a gone peer: it did not)."""
    if _LIBC is None:
        try:
            return sock.send(byte) == 1
        except OSError:
            return False
    libc = _LIBC
    fd = sock.fileno()  # -1 once closed: EBADF, nothing sent
    while libc.send(fd, byte, libc.one, _MSG_DONTWAIT | _MSG_NOSIGNAL) != 1:
        if ctypes.get_errno() != errno.EINTR:
            return False
    return True
