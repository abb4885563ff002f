"""The thread pool that runs incoming calls.

It keeps up to ``size`` threads, and grows past that while calls are stuck behind threads that
wait on nested RPCs, so a user function that itself makes RPCs never deadlocks, even when every
thread is inside such a call (torch issue #23569):

* ``blocking()`` marks a wait the library knows about (``rpc_sync`` inside a pool thread): a
  replacement thread starts at once if work is queued, and work that arrives while it waits
  gets a thread at once as well (threads in such waits do not count toward ``size``): a
  chain of nested calls deeper than the pool (A calls B calls A ...) goes on without stalls.
* a watchdog covers waits it cannot see (a user function calling ``Future.wait()``): if work
  has been queued with every thread busy and none finishing for ``stall_after`` seconds, it
  adds a thread.

Threads beyond ``size`` leave again when they find no work.

**Fairness.** Work is queued by the peer it came from (:meth:`ElasticPool.submit_from`) and
taken round-robin between peers: a peer that floods the pool with slow calls delays another
peer's call by one call of its own at most, never by its whole backlog.

**Receiving while idle.** With :meth:`ElasticPool.receive_while_idle`, one idle thread at a
time (the *reader*) waits in the endpoint's ``wait_until`` instead of on the pool's condition:
it receives from the socket itself, so a request that arrives while the pool is idle wakes
that thread directly and it runs the call, where otherwise the endpoint's I/O thread would
wake to receive it and then wake a pool thread (transport/waiter.py, measured in
docs/transport.md).

**Wake-ups.** Waking a thread for each call costs a context switch and a GIL hand-over, and
under the GIL a second thread runs Python no faster than the first. So work that arrives while
a thread is running a call it started less than ``handoff`` ago is left for that thread,
which takes it as soon as it is done. A thread is woken only when no thread is making such
progress: every thread is idle, or has been inside its current call for longer than
``handoff`` (a call that blocks, sleeps or runs long); the watchdog checks this again every
``handoff`` while work waits, so queued work starts at most about ``handoff`` later than with
a thread per call (measured in docs/transport.md: the rpc_async throughput 1.6x with 1 woken
thread instead of 16).

**Held work.** A thread that finishes a call while more work waits for it may *hold* its
answer (:meth:`ElasticPool.hold`) and send it with the answers of the calls it runs next:
sent back to back, they leave while libzmq's I/O thread is still awake from the first, and
arrive together, so both ends pay one wake-up for the batch instead of one per answer
(measured in the README: rpc_async throughput). Held work runs when its thread runs out of
work, before it waits on a nested call (``blocking()``), once ``max_held`` items are held, or
on the watchdog, when the thread's current call has taken longer than ``handoff``: an answer
waits at most about ``handoff`` behind calls that came after it, the bound queued work
already has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zmqautograd.transport.endpoint import Endpoint
    from zmqautograd.transport.waiter import AnyWaiter

log = logging.getLogger(__name__)


class _ThreadPool(threading.local):
    pool: "ElasticPool | None" = None  # a class default: reading it on other threads never misses


_current_pool = _ThreadPool()


class _FairQueue(deque):
    """Work by the peer it came from (None: the worker's own), taken round-robin between
    peers, in order within each (see "Fairness" above). Used under the pool's lock.

    The deque itself holds the peers that have work, the one to take from next first: a look
    at whether work waits (its truth, which idle and spinning threads take often) costs what
    a plain deque's does. ``items`` counts the work."""

    __slots__ = ("_queues", "items")

    def __init__(self) -> None:
        super().__init__()
        self._queues: dict[Any, deque] = {}
        self.items = 0

    def append(self, item: tuple, peer: Any = None) -> None:  # type: ignore[override]
        queue = self._queues.get(peer)
        if queue is None:
            queue = self._queues[peer] = deque()
            deque.append(self, peer)
        queue.append(item)
        self.items += 1

    def queued(self, peer: Any) -> int:
        """How many items of ``peer``'s wait."""
        queue = self._queues.get(peer)
        return len(queue) if queue is not None else 0

    def popleft(self) -> tuple:
        peer = self[0]
        queue = self._queues[peer]
        item = queue.popleft()
        if queue:
            if len(self) > 1:
                self.rotate(-1)  # that peer's next item after everyone else's
        else:
            del self._queues[peer]
            deque.popleft(self)
        self.items -= 1
        return item


class ElasticPool:
    def __init__(
        self, size: int, name: str, stall_after: float = 0.5, max_threads: int = 1024, handoff: float = 0.005,
        init_thread: Callable[[], None] | None = None, max_held: int = 16,
    ):
        self.size = size
        self.init_thread = init_thread  # run first on every thread the pool starts
        self.name = name
        self.stall_after = stall_after
        self.max_threads = max_threads
        self.handoff = handoff
        self.max_held = max_held
        self._held: dict[threading.Thread, list] = {}  # thread -> its held work (hold())
        self._lock = threading.Lock()
        self._work_ready = threading.Condition(self._lock)  # idle threads wait here
        self._watch_wakeup = threading.Condition(self._lock)
        self._work = _FairQueue()
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting for work
        self._waking = 0  # threads woken or started that have not looked at the queue yet
        self._running: dict[threading.Thread, float] = {}  # thread -> when it started its call
        self._blocked = 0  # threads in blocking(): waiting on a nested call, not counted in ``size``
        self._watch_asleep = False  # the watchdog is in its long sleep
        self._last_progress = time.monotonic()
        self._closed = False
        self._serial = 0
        self.start_failures = 0  # threads the process could not start (_start_thread)
        self.stall_starts = 0  # threads the watchdog started after a stall of stall_after
        self._start_failure_logged = -1e9
        self._full_logged = -1e9  # when the pool last said it had max_threads threads, all taken
        self._receiver: Endpoint | None = None  # the endpoint an idle thread receives from (receive_while_idle)
        self._reader: threading.Thread | None = None  # the idle thread that receives
        self._reader_waiter: AnyWaiter | None = None  # its Waiter, once it sleeps
        self._reader_woken = False  # woken for work (counted in _waking)
        self._watchdog = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._watchdog.start()

    def receive_while_idle(self, endpoint: Endpoint) -> None:
        """Let one idle thread at a time wait in ``endpoint.wait_until``, receiving (see the
        module's docstring). Its ``executor`` must be this pool's ``submit``."""
        self._receiver = endpoint

    def submit(self, function: Callable, *args: Any) -> None:
        self._submit(None, function, args)

    def submit_from(self, function: Callable, peer: str, *args: Any) -> None:
        """``submit(function, peer, *args)`` for work that came from ``peer``, queued fairly
        among peers (an endpoint's ``executor``)."""
        self._submit(peer, function, (peer, *args))

    def _submit(self, peer: Any, function: Callable, args: tuple) -> None:
        with self._lock:
            if self._closed:
                # Shutting down: work that arrives now is not run (its caller's call fails by
                # timeout or when this worker's endpoint closes). Never an exception here: the
                # caller may be an I/O thread.
                log.info("pool %s is shut down: dropped %s", self.name, getattr(function, "__qualname__", function))
                return
            self._work.append((function, args), peer)
            if self._reader is not threading.current_thread():  # the reader takes what it received
                self._dispatch_locked(time.monotonic(), grow_past_size=False)

    def queued_from(self, peer: str) -> int:
        """How much work from ``peer`` waits for a thread (a hint: it may change at once)."""
        return self._work.queued(peer)

    def has_work(self) -> bool:
        """Whether work waits for a thread (a hint: it may change at once)."""
        return bool(self._work)

    def should_hold(self) -> bool:
        """Whether the calling thread had better hold what it is about to send (:meth:`hold`):
        it is one of ours, and work waits that it will take next or it holds something already
        (what it sends goes after that)."""
        return _current_pool.pool is self and (bool(self._work) or threading.current_thread() in self._held)

    def hold(self, function: Callable, *args: Any) -> None:
        """Run ``function(*args)`` later, together with what the calling pool thread holds
        after it (see the module's docstring), in the order they were held: on that thread, or
        on the watchdog when the thread's current call runs long (the thread's later sends may
        then go before them). Only on a pool thread. ``function`` handles its own errors (they
        are logged)."""
        me = threading.current_thread()
        with self._lock:
            held = self._held.setdefault(me, [])
            held.append((function, args))
            full = len(held) >= self.max_held
            if full:
                del self._held[me]
            else:
                self._watch_soon_locked()  # it bounds how long this waits
        if full:
            self._run_held(held)

    def _run_held(self, held: list) -> None:
        for function, args in held:
            try:
                function(*args)
            except Exception:  # noqa: BLE001 - never the caller's failure
                log.exception("pool %s: held %s failed", self.name, getattr(function, "__qualname__", function))

    def _release_held_locked(self, thread: threading.Thread) -> None:
        """Run what ``thread`` holds, on the calling thread (caller holds the lock; released
        meanwhile)."""
        held = self._held.pop(thread, None)
        if held:
            self._lock.release()
            try:
                self._run_held(held)
            finally:
                self._lock.acquire()

    def owns_current_thread(self) -> bool:
        """Whether the calling thread is one of this pool's (cheaper than entering
        ``blocking()`` just to find out)."""
        return _current_pool.pool is self

    @contextmanager
    def blocking(self):
        """Wrap a wait inside a pool thread: queued work gets a thread meanwhile."""
        if _current_pool.pool is not self:
            yield
            return
        me = threading.current_thread()
        with self._lock:
            self._release_held_locked(me)  # what it held must not wait behind this wait
            self._running.pop(me, None)  # waiting, not making progress
            self._blocked += 1
            self._dispatch_locked(time.monotonic(), grow_past_size=True)
        try:
            yield
        finally:
            with self._lock:
                self._blocked -= 1
                self._running[me] = time.monotonic()

    @property
    def thread_count(self) -> int:
        return len(self._threads)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            self._work_ready.notify_all()
            self._watch_wakeup.notify_all()
            if self._reader_waiter is not None:
                self._reader_waiter.wake()
        current = threading.current_thread()
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))
        self._watchdog.join(timeout)

    # ------------------------------------------------------------------------- internals

    def _dispatch_locked(self, now: float, grow_past_size: bool) -> bool:
        """Make sure queued work gets a thread (caller holds the lock). False when it was left
        for a thread that is making progress, or every thread is busy."""
        if self._work.items <= self._waking:
            return True  # threads on their way will take it
        if self._waking:
            # A woken thread has not run yet (typically: the I/O thread holds the GIL while it
            # hands over a burst of messages); it takes the rest after its first item.
            self._watch_soon_locked()
            return False
        handoff = self.handoff
        for started in self._running.values():
            if now - started < handoff:
                self._watch_soon_locked()  # that thread takes it, or the watchdog wakes one
                return False
        if self._idle > self._waking:
            self._waking += 1
            self._work_ready.notify()
            return True
        if self._reader_waiter is not None and not self._reader_woken:
            self._reader_woken = True
            self._waking += 1
            self._reader_waiter.wake()
            return True
        # Threads waiting on nested calls (blocking()) do not count: work that arrives while
        # they wait (the nested calls of a chain deeper than the pool, coming back) gets a
        # thread at once, not after the watchdog's stall_after.
        limit = self.max_threads if grow_past_size else min(self.max_threads, self.size + self._blocked)
        if len(self._threads) < limit and self._start_thread():
            return True
        if len(self._threads) >= self.max_threads and self._blocked and now - self._full_logged > 10:
            self._full_logged = now
            log.warning("pool %s has all its %d threads (max_threads), %d of them waiting on nested calls, and %d "
                        "calls wait for one: a chain of nested calls deeper than that waits until a call returns "
                        "or times out", self.name, len(self._threads), self._blocked, self._work.items)
        self._watch_soon_locked()
        return False

    def _watch_soon_locked(self) -> None:
        if self._watch_asleep:
            self._watch_asleep = False
            self._watch_wakeup.notify()

    def _start_thread(self) -> bool:  # caller holds the lock
        """Whether a thread started. Where the process may start no more (a limit on threads
        or memory), the queued work waits for the threads there are (back-pressure: the
        peer's calls queue up instead of failing), and the watchdog tries again."""
        self._serial += 1
        thread = threading.Thread(target=self._run, name=f"{self.name}-{self._serial}", daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:  # "can't start new thread"
            self.start_failures += 1
            now = time.monotonic()
            if now - self._start_failure_logged > 10:
                self._start_failure_logged = now
                log.warning("pool %s could not start a thread (%s; %d so far): its %d threads run the %d "
                            "queued calls as they finish", self.name, exc, self.start_failures, len(self._threads),
                            self._work.items)
            return False
        # The new thread touches these under the lock we hold: counting it after start is safe.
        self._threads.add(thread)
        self._waking += 1
        return True

    def _run(self) -> None:
        _current_pool.pool = self
        if self.init_thread is not None:
            try:
                self.init_thread()
            except Exception:  # a thread that cannot be set up still runs calls
                log.exception("pool %s: init_thread failed", self.name)
        me = threading.current_thread()
        work = self._work

        def stop_reading() -> bool:
            # Woken, it leaves even when another thread took the work meanwhile: its wake-up
            # counts in _waking until it has looked at the queue (else submits would wait for
            # a thread that went back to sleep).
            return bool(work) or self._closed or self._reader_woken

        was_reader = False
        with self._lock:
            self._waking -= 1
            while True:
                if self._closed:
                    self._release_held_locked(me)
                    break
                if work:
                    function, args = work.popleft()
                    self._running[me] = now = time.monotonic()
                    if was_reader and work:
                        # What it received beyond this call: its submits did not look for
                        # threads, so look now, with this thread counted as making progress
                        # (it takes the rest itself unless its call takes over ``handoff``).
                        self._dispatch_locked(now, grow_past_size=False)
                    was_reader = False
                    self._lock.release()
                    try:
                        function(*args)  # submitted functions handle their own errors...
                    except BaseException:  # ...but a thread must never die of one (SystemExit included)
                        log.exception("pool %s: %s failed", self.name, getattr(function, "__qualname__", function))
                    finally:
                        del function, args  # release the call's data before waiting again
                        self._lock.acquire()
                        self._running.pop(me, None)
                        self._last_progress = time.monotonic()
                    continue
                if me in self._held:  # out of work: what it held goes now
                    # Sending counts as progress: work that comes meanwhile waits for this
                    # thread rather than waking another (the wake-up policy above).
                    self._running[me] = time.monotonic()
                    self._release_held_locked(me)
                    self._running.pop(me, None)
                    continue
                if len(self._threads) > self.size:
                    break  # surplus, and nothing to do: leave
                if self._receiver is not None and self._reader is None:
                    self._read_while_idle(me, stop_reading)
                    was_reader = True
                    continue
                self._idle += 1
                self._work_ready.wait()
                self._idle -= 1
                self._waking = max(0, self._waking - 1)
            self._threads.discard(me)

    def _read_while_idle(self, me: threading.Thread, stop_reading: Callable[[], bool]) -> None:
        """Be the reader until work comes (caller holds the lock; released meanwhile: the
        endpoint takes its socket lock, and its receiving calls ``submit``)."""
        self._reader = me
        receiver = self._receiver
        assert receiver is not None, "called only while there is one"
        self._lock.release()
        try:
            waiter = receiver.waiter()
            with self._lock:
                self._reader_waiter = waiter
            receiver.wait_until(stop_reading, for_work=True)
        except Exception:  # the endpoint is unusable: wait on the condition from now on
            log.exception("pool %s: receiving while idle failed", self.name)
            self._receiver = None
        finally:
            self._lock.acquire()
            self._reader = self._reader_waiter = None
            if self._reader_woken:
                self._reader_woken = False
                self._waking = max(0, self._waking - 1)

    def _release_stale_held_locked(self, now: float) -> None:
        """On the watchdog: run what threads hold whose current call has taken longer than
        ``handoff`` (caller holds the lock; released meanwhile)."""
        for thread in [t for t in self._held if now - self._running.get(t, now) > self.handoff]:
            self._release_held_locked(thread)

    def _watch(self) -> None:
        with self._lock:
            while not self._closed:
                if self._held:
                    self._release_stale_held_locked(time.monotonic())
                if self._work.items > self._waking or self._held:
                    now = time.monotonic()
                    if self._work.items > self._waking and not self._dispatch_locked(now, grow_past_size=False) and not self._idle and self._reader is None and (
                        now - self._last_progress > self.stall_after and len(self._threads) < self.max_threads
                    ):
                        # Every thread busy and none finishing: some wait on something we
                        # cannot see. Another thread keeps the queue moving.
                        if self._start_thread():
                            self.stall_starts += 1
                        self._last_progress = now
                    self._watch_wakeup.wait(self.handoff)
                else:
                    self._watch_asleep = True
                    self._watch_wakeup.wait(self.stall_after / 2)
                    self._watch_asleep = False
