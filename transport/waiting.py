"""Waiting threads: callers of ``recv`` and ``wait_until`` receive from the ROUTER and the
rings themselves while they wait, as the I/O thread would (see endpoint.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import shm
from .waiter import AnyWaiter, Waiter, new_waiter

if TYPE_CHECKING:
    from .endpoint import Endpoint

_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))

_DESCRIPTOR_LOOKS = 4  # a spinning thread's looks at the rings per look at its descriptors
_CALLERS_WINDOW = 0.1  # seconds: a wait for an answer that began longer ago is no loop of calls
_MIN_SPIN = 5e-5  # seconds: a learnt spin shorter than this does not spin at all


def learn_spin(current: float, gap: float | None, limit: float) -> float:
    """The next spin of a kind of wait that spun for ``current``, where input came ``gap``
    seconds after the thread began to watch for it (None: none came before the wait ended).
    A gap that a spin of ``limit`` covers restores the spin to ``limit``; a longer one halves
    it, to zero below ``_MIN_SPIN``. So a thread spins as long as ever where input comes soon
    after it begins to wait, as in a loop of calls, and after a few waits that outlast any
    spin it sleeps at once: on a machine with more runnable processes than cores, such a
    spin takes turns on a core from the processes that have work, for a wake-up it does not
    save."""
    if gap is not None and gap <= limit:
        return limit
    current /= 2
    return current if current >= _MIN_SPIN else 0.0


def _spin_poll(poll: Callable[[float], bool], until: float) -> bool:
    """Poll without sleeping until ``until`` (``time.monotonic``); whether anything became
    ready. Between polls the thread yields its CPU (and the GIL) to anything runnable."""
    clock = time.monotonic
    while True:
        if poll(0):
            return True
        if clock() >= until:
            return False
        _yield_cpu()


class WaitingThreads:
    """The endpoint's waiting threads (part of ``Endpoint``)."""

    _reading_waiter: AnyWaiter | None  # the one watching the ROUTER (socket lock)

    def waiter(self: Endpoint) -> AnyWaiter:
        """The calling thread's :class:`~transport.waiter.Waiter` for :meth:`wait_until`:
        whoever makes the condition of that thread's wait true calls its ``wake()``."""
        waiter = getattr(self._thread_local, "waiter", None)
        if waiter is None:
            waiter = self._thread_local.waiter = new_waiter(self._waiters_read)
        return waiter

    def wait_until(self: Endpoint, ready: Callable[[], bool], timeout: float | None = None, *,
                   for_work: bool = False, idle: Callable[[], bool] | None = None) -> bool:
        """Block the calling thread until ``ready()`` is true (True) or ``timeout`` seconds
        have passed (False). Meanwhile the thread receives from the socket itself, exactly as
        the I/O thread would, so that the message it waits for wakes it directly, with no
        thread hand-over (transport/waiter.py). Whoever makes ``ready()`` true from another
        thread (or a callback this receiving runs) then calls ``waiter().wake()`` of the
        waiting thread. ``ready`` must be quick and must not block. ``for_work``: the thread
        waits for work rather than for an answer (an idle pool thread); each kind of wait
        learns its own spin (see :meth:`_spin_length`). ``idle``: work for time the thread
        would otherwise only wait, in pieces: each call does one and says whether more
        remain. A spinning thread does a piece instead of yielding, between its looks at
        its input (peers keep writing to our rings without ringing); a thread that does not
        spin does them all once it has taken what came, before it sleeps."""
        return self._wait(self.waiter(), ready, timeout, for_work, idle)

    def _take_reading_role(self: Endpoint, waiter: AnyWaiter, for_work: bool) -> tuple[bool, object | None]:
        """Note the wait and decide who watches the ROUTER: whether ``waiter`` does, and the
        token that ends a wait for an answer (``_end_answer_wait``).

        A thread that waits for work reads (the most recent waiter first), and so does one
        that waits for an answer while no other thread has begun to wait for one in the last
        ``_CALLERS_WINDOW`` seconds: its input then wakes it directly. When callers wait at
        once, none of them reads: the I/O thread receives for all and wakes each with its own
        answer. A reading caller would receive their answers too, wake them, and hand its
        role on when its own came, each a wake-up and a fight for the GIL (docs/performance.md,
        "Callers waiting at once"). A wait that began longer ago (a shutdown barrier, a long
        call) is no loop of calls: it counts no more.

        The waits are noted without the socket lock, which a thread that receives or sends
        holds across system calls: under the GIL a dict's item is set or deleted at once, and
        ``list`` copies its values at once. Where nothing is to change (callers wait and the
        I/O thread reads already; this waiter reads already) the lock is not taken at all: a
        caller that waited for it let the GIL go (a hand-over when callers wait at once).
        Two waits that begin together each see the other: neither reads."""
        token = None
        callers = False
        if not for_work:
            now = time.monotonic()
            waits = self._answer_waits
            token = object()
            waits[token] = now
            if len(waits) > 1:
                callers = sum(1 for began in list(waits.values()) if now - began < _CALLERS_WINDOW) > 1
        reading = self._reading_waiter
        if callers:
            if reading is None:
                return False, token
        elif not waiter.reads:
            return False, token
        elif reading is waiter:
            return True, token
        with self._socket_lock:  # the descriptors are valid only while the ROUTER is open
            if not self._router_open:
                return False, token
            if callers:
                if self._reading_waiter is not None:
                    self._move_reading_role(None)  # the I/O thread, always behind, takes over
                return False, token
            if self._reading_waiter is not waiter:
                self._move_reading_role(waiter)
            return True, token

    def _stop_reading_here(self: Endpoint) -> None:
        """The calling thread is about to block outside a wait (a frame waiting for bytes
        still on their way: transport/bulk.py): if it watches the ROUTER, the I/O thread
        takes that over, so that the endpoint receives meanwhile (heartbeats included)."""
        reading = self._reading_waiter
        if reading is None:
            return
        mine = reading is getattr(self._thread_local, "waiter", None) or (
            reading is self._dispatch_waiter and threading.current_thread() is self._dispatch_thread)
        if not mine:
            return
        with self._socket_lock:
            if self._reading_waiter is reading and self._router_open:
                self._move_reading_role(None)
        with self._lock:
            self._wake_io_locked()  # what the waiter's descriptors saw last is the I/O thread's now

    def _end_answer_wait(self: Endpoint, token: object) -> None:
        del self._answer_waits[token]  # (no lock: see _take_reading_role)

    def _move_reading_role(self: Endpoint, waiter: AnyWaiter | None) -> None:
        """Watch the ROUTER with ``waiter`` (None: with none; the I/O thread, which always
        watches it last in line, then receives) from now on (socket lock held, ROUTER open)."""
        previous = self._reading_waiter
        for fd in self._shared_fds:
            if previous is not None:
                previous.detach(fd)
            if waiter is not None:
                waiter.attach(fd)
        if waiter is not None:
            self._io_poller.go_last()
        self._reading_waiter = waiter

    def _wait(self: Endpoint, waiter: AnyWaiter, ready: Callable[[], bool], timeout: float | None,
              for_work: bool = False, idle: Callable[[], bool] | None = None) -> bool:
        if ready():
            return True
        reads, token = self._take_reading_role(waiter, for_work)
        try:
            return self._wait_counted(waiter, ready, timeout, for_work, reads, idle)
        finally:
            if token is not None:
                self._end_answer_wait(token)

    def _wait_counted(self: Endpoint, waiter: AnyWaiter, ready: Callable[[], bool], timeout: float | None,
                      for_work: bool, reads: bool, idle: Callable[[], bool] | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        # The waiter whose spin this wait uses and teaches; None: this wait never spins.
        learner = waiter if isinstance(waiter, Waiter) and reads and self.options.spin else None
        spin = self._spin_length(learner, for_work) if learner is not None else 0.0
        watched_from = None  # when this thread began to watch for input (learn_spin's sample)
        if type(waiter) is Waiter:
            waiter.sleeper = threading.get_ident()
        try:
            while True:
                if reads:
                    self._read_for_waiter()
                    # It reads until another thread's wait takes the role away; this pass
                    # took what may have woken it while it still watched.
                    reads = self._reading_waiter is waiter
                    if not reads:
                        learner = None
                        spin = 0.0
                if idle is not None and not (spin and self._rings_in) and not ready():
                    while idle():  # no spin to do it in: all now, unarmed (nobody wakes us)
                        pass
                    idle = None
                    continue  # then what came meanwhile
                waiter.arm(reads)  # from here on, whoever makes ready() true wakes us
                if ready():
                    break
                if learner is not None and watched_from is None and self._rings_in and not self._spinning:
                    watched_from = time.monotonic()  # a sample only where no other thread spins
                if spin and self._rings_in:  # spin first (bounded by the deadline), then sleep
                    until = time.monotonic() + spin
                    received = self._received
                    spun = self._spin(waiter, ready, until if deadline is None else min(until, deadline), for_work, idle)
                    idle = None  # (what the spin left stays with its owner, for a later wait)
                    if spun or self._received != received:  # the spin saw input: it paid
                        if learner is not None and watched_from is not None:
                            self._learn_spin(learner, for_work, time.monotonic() - watched_from)
                            watched_from = None
                    if spun:
                        break
                    if spun is None:
                        continue
                remaining = None
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        if learner is not None and watched_from is not None:
                            self._learn_spin(learner, for_work, None)
                        return False
                waiter.sleep(remaining)
                waiter.waiting = False
                if learner is not None and watched_from is not None:
                    self._learn_spin(learner, for_work, time.monotonic() - watched_from)
                    watched_from = None
        finally:
            waiter.waiting = False
        return True

    def _spin_length(self: Endpoint, learner: Waiter, for_work: bool) -> float:
        """How long a wait of this kind spins before it sleeps: what the thread's waits of
        this kind have shown to pay (``learn_spin``), at most ``spin``."""
        learnt = learner.spin_for[for_work]
        return self.options.spin if learnt is None else learnt

    def _learn_spin(self: Endpoint, learner: Waiter, for_work: bool, gap: float | None) -> None:
        limit = self.options.spin
        learner.spin_for[for_work] = learn_spin(self._spin_length(learner, for_work), gap, limit)

    def _spin(self: Endpoint, waiter: AnyWaiter, ready: Callable[[], bool], until: float,
              for_work: bool = False, idle: Callable[[], bool] | None = None) -> bool | None:
        """Receive without sleeping until ``ready()`` (True) or ``until`` (False), yielding
        the CPU (and the GIL) between looks; None: nothing was ready, but a ring got data as
        the spin ended, or the spin was handed over (look again before sleeping). One thread
        spins at a time; while it does, peers that write to our rings need not ring our
        doorbell (transport/shm.py).

        A caller that waits for an answer and reads (``_take_reading_role``) takes the spin
        over from a thread that waits for work (an idle pool thread), which stops at its next
        look: else the caller would sleep while the pool thread received its answer and woke
        it, a wake-up and a GIL hand-over per answer, with the pool thread still spinning
        beside it (about once a step of a fan-out's driver). ``idle``: pieces of work done
        between looks instead of yielding (wait_until)."""
        flags, bell = self._flags, self._bell
        if flags is None or bell is None:
            return False  # no shared memory here: nothing to spin on
        clock = time.monotonic
        while True:
            with self._socket_lock:
                if not self._router_open:
                    return False
                if not self._spinning:
                    self._spinning = True
                    self._spinning_for_work = for_work
                    self._spin_wanted = False
                    flags.set_spinning(True)
                    break
                if for_work or not self._spinning_for_work or self._reading_waiter is not waiter:
                    return False
                self._spin_wanted = True
            # The spinner still receives (our answer among the rest) until it sees the request.
            if ready():
                return True
            if clock() >= until:
                return False
            _yield_cpu()
        has_input = waiter.has_input
        result = False
        handed_over = False
        looks = 0
        try:
            while True:
                # Cheap looks first (one word of shared memory, our descriptors): the full
                # receive takes the socket lock, asks libzmq and looks at every ring.
                if flags.take_pending():
                    shm.fence()  # see Flags.take_pending
                    # Seen in shared memory: the rings alone, no doorbell to empty and no
                    # ROUTER to ask (system calls); input there shows in has_input below.
                    self._read_for_waiter(rings_only=True)
                    if ready():
                        result = True
                        break
                looks += 1
                # Our descriptors (a system call) one look in _DESCRIPTOR_LOOKS: the rings
                # carry what peers on this host send, and a look that is shorter by a system
                # call sees their data sooner.
                if looks % _DESCRIPTOR_LOOKS == 0 and has_input():
                    self._read_for_waiter()
                if ready():
                    result = True
                    break
                if self._spin_wanted:
                    handed_over = True  # to a caller (above): look again, without the spin
                    break
                if clock() >= until:
                    break
                if idle is None or not idle():
                    idle = None
                    _yield_cpu()
        finally:
            with self._socket_lock:
                self._spinning = False
                missed = False
                if self._router_open:
                    flags.set_spinning(False)
                    # A writer that saw us spinning did not ring: look once more, after the
                    # fence that orders our "not spinning" before the look (transport/shm.py).
                    shm.fence()
                    missed = flags.pending()
                    if missed and result:
                        bell.ring()  # we leave: whoever sleeps takes it
        return None if (missed or handed_over) and not result else result

    def _read_for_waiter(self: Endpoint, rings_only: bool = False) -> None:
        """Receive what waits in the ROUTER and the rings, on a waiting thread (as the I/O
        thread would); ``rings_only``: the rings alone, without emptying the doorbell (a
        spinner that saw their pending word)."""
        with self._socket_lock:
            if not self._router_open:
                return
            if rings_only:
                self._receive_rings(drain=False)
                more = False
            else:
                more = self._receive_batch()
            # The I/O thread finishes what we leave: a long burst, connections gone.
            needs_io = more or bool(self._closing)
        if needs_io and self._io_asleep:
            with self._lock:
                self._wake_io_locked()
