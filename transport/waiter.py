"""Threads that read the ROUTER themselves while they wait (leader/follower receiving).

A thread that waits for an answer (``Endpoint.recv``, ``rpc_sync``) or for work (the
dispatcher) would otherwise sleep until the I/O thread has received the message and woken it:
two threads woken per message where one would do, and on the development VM each wake-up of
a sleeping thread costs 60-80 us (docs/transport.md, "Waiting threads receive"). So a waiting
thread sleeps on the ROUTER's descriptor as well as on its own wake-up descriptor, and when
input arrives it receives the message itself, under the socket lock, exactly as the I/O
thread would (same validation, same routing): the message it waited for needs no hand-over.

Which sleeper the kernel wakes is what makes this pay. Two sleepers watch the ROUTER's
descriptor, both with ``EPOLLEXCLUSIVE``: the waiting thread that most recently started to
wait (the *reading waiter*; it takes the role from the one before), then the I/O thread.
Linux wakes only the first of them that is asleep, in the order they registered, and the
new reading waiter moves the I/O thread's registration behind its own. So input wakes the
thread most likely to want it (a caller that has just sent its request; a pool thread that
has just gone idle, rather than a thread that has waited for a long time), and the I/O
thread only when that thread is not asleep (it then receives and hands over as before).
Correctness never depends on this order: whoever wakes receives under the socket lock, and
whatever it receives goes where it belongs, with a wake-up for the thread that waits for it.
When several threads wait for answers at once none of them reads, and the I/O thread receives
for all (transport/waiting.py, ``_take_reading_role``); they sleep on a lock (``Waiter.arm``).

Without ``EPOLLEXCLUSIVE`` (not Linux, or Linux < 4.5) waiting threads never watch the ROUTER
and only sleep on their wake-up descriptor; the I/O thread receives everything.
"""

from __future__ import annotations

import logging
import os
import select
from _thread import LockType, allocate_lock, get_ident

log = logging.getLogger(__name__)

EXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", None) if hasattr(select, "epoll") else None
_EXCLUSIVE_IN = select.EPOLLIN | EXCLUSIVE if EXCLUSIVE is not None else 0  # (used only with EXCLUSIVE)
_HAS_EVENTFD = hasattr(os, "eventfd")


# The longest one sleep lasts: epoll and poll refuse timeouts beyond about 24.8 days, lock
# waits beyond threading.TIMEOUT_MAX (OverflowError), and a caller's timeout (inf, say) or
# heartbeat interval may ask for more. A sleep cut short is a spurious wake-up, which every
# caller handles (it looks again).
LONGEST_SLEEP = 3600.0


def _milliseconds(timeout: float) -> int:
    """``select.poll``'s timeout for ``timeout`` seconds, rounded up (never sleeps short)."""
    return max(0, int(timeout * 1000 + 0.999))


def _sleep_on(lock: LockType, timeout: float | None) -> None:
    """Sleep until ``lock`` is released or ``timeout`` seconds pass. Returning with the lock
    taken again is the reset: the next sleep waits for a new release."""
    lock.acquire(timeout=-1 if timeout is None else max(0.0, min(timeout, LONGEST_SLEEP)))


def _wake_on(lock: LockType) -> None:
    """End the sleep on ``lock`` (:func:`_sleep_on`), or the next one."""
    try:
        lock.release()
    except RuntimeError:
        pass  # already woken


def _close_poller(poller: select.epoll | select.poll) -> None:
    close = getattr(poller, "close", None)  # an epoll owns a descriptor; a poll object does not
    if close is not None:
        close()


_ONE = (1).to_bytes(8, "little")  # an eventfd's increment (a pipe takes any bytes)


def _wake_descriptors() -> tuple[int, int]:
    """A wake-up descriptor, non-blocking: (read end, write end); one eventfd where there
    are eventfds, else a pipe."""
    if _HAS_EVENTFD:
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return fd, fd
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


def _reset(read_fd: int) -> None:
    """Consume the wake-ups a descriptor holds, so that the next sleep waits for a new one."""
    try:
        os.read(read_fd, 512)
    except (BlockingIOError, OSError):
        pass


def _close_descriptors(read_fd: int, write_fd: int) -> None:
    os.close(read_fd)
    if write_fd != read_fd:
        os.close(write_fd)


class Waiter:
    """How one thread waits: a wake-up descriptor, and, while it is the reading waiter, the
    ROUTER's (``attach``/``detach``; only waiters that ``reads`` may be attached).

    The protocol with whoever completes what it waits for: the waiter sets ``waiting`` before
    its last look at the condition, the completer makes the condition true before it calls
    :meth:`wake`; so either the waiter sees the condition or the completer sees ``waiting``
    (statements are ordered under the GIL), and a wake-up that comes before the sleep leaves
    the descriptor readable, so the sleep returns at once.
    """

    __slots__ = ("waiting", "sleeper", "reads", "spin_for", "_read_fd", "_write_fd", "_poller", "_epoll",
                 "_on_lock", "_asleep", "__weakref__")

    def __init__(self, reads: bool = False) -> None:
        self.waiting = False
        # A wait that does not watch the ROUTER sleeps on a lock instead of its descriptor:
        # released without letting the GIL go, taken with one drop, against a write, a poll
        # and a read (three), each a chance for another thread to take the GIL (a hand-over
        # when callers wait at once, as 16 driver threads do).
        self._on_lock = False
        self._asleep = allocate_lock()
        self._asleep.acquire()
        self.sleeper = 0  # the thread that waits on it (set by whoever makes it wait)
        # How long this thread's next wait spins before it sleeps, learnt from its waits
        # (transport/waiting.py), by what it waits for: [an answer, work]. None: not yet.
        self.spin_for: list[float | None] = [None, None]
        self.reads = reads and EXCLUSIVE is not None
        self._read_fd, self._write_fd = _wake_descriptors()
        self._epoll = EXCLUSIVE is not None
        self._poller: select.epoll | select.poll
        try:
            if self._epoll:
                self._poller = select.epoll()  # (a descriptor: may fail at the open-file limit)
                self._poller.register(self._read_fd, select.EPOLLIN)
            else:
                self._poller = select.poll()
                self._poller.register(self._read_fd, select.POLLIN)
        except BaseException:
            _close_descriptors(self._read_fd, self._write_fd)  # (close() would not: no poller)
            raise

    def attach(self, fd: int) -> None:
        """Watch the ROUTER's descriptor (or the doorbell's) too (another thread may call
        this while we sleep). Only where ``EXCLUSIVE`` exists (``reads``)."""
        self._poller.register(fd, _EXCLUSIVE_IN)

    def detach(self, fd: int) -> None:
        try:
            self._poller.unregister(fd)
        except (OSError, ValueError):
            pass  # closed meanwhile (its thread is gone)

    def arm(self, watching: bool) -> None:
        """Begin a wait's last look at its condition: from here on, :meth:`wake` wakes it.
        ``watching``: whether it watches the ROUTER (it sleeps on its descriptors), else it
        sleeps on its lock. Fixed for the sleep that follows: only its own thread gives it
        the ROUTER to watch; another thread that takes that away leaves it on descriptors
        that its wake-up still reaches."""
        self._on_lock = not watching
        self.waiting = True

    def wake(self) -> None:
        """Wake the thread if it sleeps (any thread may call this, any number of times). The
        waiting thread itself, which completes what it waits for while it receives, needs no
        wake-up: it looks at its condition before it sleeps (saves a system call, and a
        spurious wake-up of its next wait)."""
        if self.waiting and self.sleeper != get_ident():
            if self._on_lock:
                _wake_on(self._asleep)
                return
            try:
                os.write(self._write_fd, _ONE)
            except (BlockingIOError, OSError):
                pass  # already readable (a full pipe), or closed: nobody sleeps on it

    def has_input(self) -> bool:
        """Whether a sleep would return at once: woken, or (when attached) input on the
        ROUTER or the doorbell. For spinning waiters; it consumes nothing."""
        return bool(self._poller.poll(0))

    def sleep(self, timeout: float | None) -> None:
        """Sleep until woken, until the ROUTER has input (when it watches it), or ``timeout``
        seconds; a wake-up that came before returns at once."""
        if self._on_lock:
            _sleep_on(self._asleep, timeout)
            return
        if self._epoll:
            events = self._poller.poll(-1 if timeout is None else min(timeout, LONGEST_SLEEP))
        else:
            events = self._poller.poll(None if timeout is None else _milliseconds(min(timeout, LONGEST_SLEEP)))
        for fd, _ in events:
            if fd == self._read_fd:  # woken: reset, so that the next sleep waits for a new wake-up
                _reset(fd)

    def close(self) -> None:
        poller = getattr(self, "_poller", None)
        if poller is None:  # closed already, or __init__ failed before making it
            return
        del self._poller
        _close_poller(poller)
        _close_descriptors(self._read_fd, self._write_fd)

    __del__ = close


class LockWaiter:
    """A waiter without descriptors, for when a thread cannot get any (the process is at its
    open-file limit: two descriptors per waiting thread add up in a pool grown to hundreds of
    threads by nested calls). It sleeps on a bare lock and never watches the ROUTER."""

    __slots__ = ("waiting", "_asleep")
    reads = False

    def __init__(self) -> None:
        self.waiting = False
        self._asleep = allocate_lock()
        self._asleep.acquire()

    def arm(self, watching: bool) -> None:
        self.waiting = True

    def wake(self) -> None:
        if self.waiting:
            _wake_on(self._asleep)

    def sleep(self, timeout: float | None) -> None:
        _sleep_on(self._asleep, timeout)

    def attach(self, router_fd: int) -> None:
        raise AssertionError("a LockWaiter never reads")

    detach = attach

    def has_input(self) -> bool:
        return False  # nothing but its lock: it never reads


_lock_waiters = 0  # LockWaiters made in this process

# What a waiting thread has: a Waiter, or a LockWaiter where no descriptors were left.
AnyWaiter = Waiter | LockWaiter


def new_waiter(reads: bool) -> AnyWaiter:
    """A :class:`Waiter`, or, where the process has no descriptors left, a :class:`LockWaiter`
    (slower, never a failure)."""
    global _lock_waiters
    try:
        return Waiter(reads)
    except OSError as exc:
        # Once: a pool grown by nested calls would log it for each of its hundreds of threads.
        _lock_waiters += 1
        log.log(logging.WARNING if _lock_waiters == 1 else logging.DEBUG,
                "a waiting thread gets no descriptors (%s): it waits on a lock and does not receive "
                "(thread %d so; the next ones are logged at DEBUG)", exc, _lock_waiters)
        return LockWaiter()


class IoPoller:
    """The I/O thread's sleep: the descriptors it shares with the reading waiter (the
    ROUTER's and the shared-memory doorbell's, last in line, see the module's docstring),
    those of its other sockets, and its own wake-up descriptor (:meth:`wake`). ``poll``
    returns whether anything is ready; the caller then checks every socket's
    ``ZMQ_EVENTS`` (they are edge-triggered).

    One wake-up descriptor serves every thread: an eventfd made with the poller. (Each
    sending thread had its own inproc PUSH socket: a descriptor per thread that ever woke
    the I/O thread, made on its first wake-up, which failed at the open-file limit after
    the thread's message had gone, and left the I/O thread asleep.)"""

    def __init__(self, shared_fds: list[int], other_fds: list[int]) -> None:
        self._shared_fds = shared_fds
        self._wake_read, self._wake_write = _wake_descriptors()
        self._poller: select.epoll | select.poll
        try:
            if EXCLUSIVE is not None:
                self._poller = select.epoll()
                for fd in [*other_fds, self._wake_read]:
                    self._poller.register(fd, select.EPOLLIN)
                for fd in shared_fds:
                    self._poller.register(fd, _EXCLUSIVE_IN)
                self.poll = self._poll_epoll
            else:
                self._poller = select.poll()
                for fd in [*shared_fds, *other_fds, self._wake_read]:
                    self._poller.register(fd, select.POLLIN)
                self.poll = self._poll_poll
        except BaseException:
            _close_descriptors(self._wake_read, self._wake_write)
            raise

    def wake(self) -> None:
        """End the I/O thread's sleep, or its next one (any thread; the caller makes sure
        the poller is not closed yet: the endpoint wakes it under its lock, and stops
        waking it, under that lock, before closing it)."""
        try:
            os.write(self._wake_write, _ONE)
        except (BlockingIOError, InterruptedError):
            pass  # readable already (a full pipe): it wakes

    def _poll_epoll(self, timeout: float) -> bool:
        events = self._poller.poll(min(timeout, LONGEST_SLEEP))
        for fd, _ in events:
            if fd == self._wake_read:  # woken: reset, so that the next sleep waits for a new wake-up
                _reset(fd)
        return bool(events)

    def _poll_poll(self, timeout: float) -> bool:
        events = self._poller.poll(_milliseconds(min(timeout, LONGEST_SLEEP)))
        for fd, _ in events:
            if fd == self._wake_read:
                _reset(fd)
        return bool(events)

    def go_last(self) -> None:
        """Queue behind a waiter registered since: re-register the ROUTER's descriptor (any
        thread may call this while the I/O thread sleeps)."""
        if EXCLUSIVE is not None:
            for fd in self._shared_fds:
                self._poller.unregister(fd)
                self._poller.register(fd, _EXCLUSIVE_IN)

    def close(self) -> None:
        _close_poller(self._poller)
        _close_descriptors(self._wake_read, self._wake_write)
