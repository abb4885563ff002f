"""Futures whose errors do not keep alive what waited on them.

``torch.futures.Future.set_exception`` keeps the exception and raises that same object from
every ``wait()`` and ``value()``. A raised exception collects, in its traceback, the frames it
passes through, so after a wait the stored exception holds the waiter's frames and through
them its locals: typically the future itself, the call's arguments, RRefs. That cycle runs
through the future's C++ side, which Python's garbage collector cannot see into, so it is
never freed (found by a stress run that killed a worker: 900 RRefs, and the values their
owners kept for them, leaked in 30 s; tests/rpc/test_futures.py).

So our futures keep the error without a traceback (its text is kept, for the answer to a
remote caller and for whoever reads the error) and raise a fresh copy of it from each wait:
the copy's traceback belongs to that raise alone, and goes when the caller lets go of it.
"""

from __future__ import annotations

import copy
import logging
import threading
import traceback
from _thread import allocate_lock as _allocate_lock
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class Future(torch.futures.Future):
    """``torch.futures.Future`` with errors as described above."""

    def set_exception(self, result: Any) -> None:
        _keep_error(result)
        self._set_unwrap_func(_raise_copy)
        self.set_result(result)


def _keep_error(error: Any) -> None:
    """What both kinds of future do with an error they are to hold: refuse what is not an
    Exception (torch's own check and message), then keep it without its traceback."""
    if not isinstance(error, Exception):
        raise AssertionError(f"{error} is of type {type(error)}, not an Exception.")
    keep_without_traceback(error)


def keep_without_traceback(error: BaseException) -> None:
    """Drop ``error``'s traceback (and those of the errors it was raised from), keeping what
    it said as text for ``traceback_text``."""
    if error.__traceback__ is not None and getattr(error, "_traceback_text", None) is None:
        error._traceback_text = _formatted(error)  # type: ignore[attr-defined]  # (an attribute of our own)
    seen = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:  # (a chain may loop)
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__


def traceback_text(error: BaseException) -> str:
    """The traceback of ``error`` as text: where it was first raised, if a future kept it."""
    kept = getattr(error, "_traceback_text", None)
    return kept if kept is not None else _formatted(error)


def _formatted(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _raise_copy(error: Exception) -> None:
    raise _copy(error)


def _copy(error: BaseException) -> BaseException:
    """A new exception of ``error``'s type, message and attributes (not its traceback)."""
    try:
        fresh = copy.copy(error)  # through __reduce__: right for types that define it
    except Exception:  # noqa: BLE001 - a constructor that takes other arguments than .args
        fresh = type(error).__new__(type(error), *error.args)
        fresh.args = error.args
        fresh.__dict__.update(getattr(error, "__dict__", {}))
    fresh.__cause__ = error.__cause__
    fresh.__suppress_context__ = error.__suppress_context__
    return fresh


class Outcome:
    """A future for the library's own bookkeeping (a backward pass's end, the answer to a
    gradient request): set once, from any thread; callbacks run on the thread that sets it,
    or at once on the thread that adds one after. Errors as ``Future``'s: kept without
    their traceback, a fresh copy raised from each ``value()`` / ``wait()``.

    Not a ``torch.futures.Future``: a pass went through several of those (its end, the
    callbacks on it, the answer that follows from it), and through pybind11 each costs
    more than the Python here (measured warm: making one 1.4 us, each callback added 1.5
    us, setting one 2 us and more per callback; this class a fraction of each). Where a
    torch future is required (a user's ``async_execution`` function must return one), use
    ``Future``."""

    __slots__ = ("_lock", "_finished", "_value", "_error", "_callbacks", "_event")

    def __init__(self) -> None:
        self._lock = _allocate_lock()
        self._finished = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Outcome], Any]] = []
        self._event: threading.Event | None = None  # made by the first wait() that blocks

    def done(self) -> bool:
        return self._finished

    def set_result(self, value: Any) -> None:
        self._set(value, None)

    def set_exception(self, error: BaseException) -> None:
        _keep_error(error)
        self._set(None, error)

    def _set(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._finished:
                raise RuntimeError("this Outcome was set already")
            self._value, self._error = value, error
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []  # (added from now on: run at once)
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            self._run(callback)

    def _run(self, callback: Callable) -> None:
        try:
            callback(self)
        except Exception:  # noqa: BLE001 - as torch's futures: logged, the others still run
            log.exception("callback %r of an Outcome failed", callback)

    def add_done_callback(self, callback: Callable[["Outcome"], Any]) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        self._run(callback)

    def then(self, callback: Callable[["Outcome"], Any]) -> "Outcome":
        """An Outcome set to ``callback(self)`` once this one is set (or to what it raised)."""
        following = Outcome()

        def chain(done: Outcome) -> None:
            try:
                value = callback(done)
            except Exception as exc:  # noqa: BLE001 - the following outcome's error
                following.set_exception(exc)
                return
            following.set_result(value)

        self.add_done_callback(chain)
        return following

    def value(self) -> Any:
        """The result, or a fresh copy of the error (only once set)."""
        if self._error is not None:
            raise _copy(self._error)
        return self._value

    def wait(self) -> Any:
        if not self._finished:
            with self._lock:
                if not self._finished and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None:
                event.wait()
        return self.value()


def complete_future(future: Any, value: Any, error: BaseException | None) -> None:
    """Complete ``future`` with ``error``, or with ``value`` when there is none (an answer's
    ``(value, error)``)."""
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def settle_from(target: Any, done: Any, convert: Callable | None = None) -> None:
    """Complete ``target`` as ``done`` completed (its value through ``convert``, if given),
    unless it is complete already."""
    if target.done():
        return
    try:
        value = done.value()
        target.set_result(value if convert is None else convert(value))
    except Exception as exc:  # noqa: BLE001 - the value's failure, for whoever waits on target
        target.set_exception(exc)


def outcome_of(future: Any) -> tuple[Any, BaseException | None]:
    """A done future's ``(value, None)``, or ``(None, error)``."""
    try:
        return future.value(), None
    except Exception as exc:  # noqa: BLE001 - handed on as the outcome
        return None, exc


def when_all_done(futures: list, callback: Callable[[], Any]) -> None:
    """Run ``callback()`` once every future of ``futures`` is done, failed ones included (on
    the thread that completes the last; at once when all are done already)."""
    _settle_once(futures, lambda _: callback(), first_error=False, observed=True)


def _settle_once(futures: list, settle: Callable[[BaseException | None], None], first_error: bool,
                 observed: bool) -> None:
    """Call ``settle`` exactly once: with the error of the first future that fails where
    ``first_error``, else (or if none fails) with None once all are done. ``observed`` False:
    only where ``settle`` runs no user code, by a callback that leaves an rpc_async future
    unobserved (calls.py: completed where its answer arrives, maybe on the I/O thread)."""
    state = {"remaining": len(futures), "settled": False}
    lock = _allocate_lock()

    def one_done(done: Any) -> None:
        error = outcome_of(done)[1] if first_error else None
        with lock:
            state["remaining"] -= 1
            if state["settled"] or (error is None and state["remaining"] > 0):
                return
            state["settled"] = True
        settle(error)

    if not futures:
        settle(None)
    for future in futures:
        if observed:
            future.add_done_callback(one_done)
        else:
            torch._C.Future.add_done_callback(future, one_done)


# ------------------------------------------------------------- torch.futures.wait_all et al.
#
# torch documents that ``torch.futures.wait_all`` and ``collect_all`` end at the first error
# among their futures. They wait in C++, which sees a future fail only when C++ failed it:
# our futures keep their errors as results (above), and from Python a torch future can be
# failed only through ``then``, which turns the error into a RuntimeError of another text. So
# for lists that hold futures of ours, both are replaced (``_install``) by the same contract
# kept here: the first error ends the wait, raised with its own type; other lists go to
# torch's own functions unchanged.

_torch_wait_all = torch.futures.wait_all
_torch_collect_all = torch.futures.collect_all


def _any_ours(futures: Any) -> bool:
    return isinstance(futures, (list, tuple)) and any(isinstance(f, Future) for f in futures)


def wait_all(futures: list) -> list:
    """``torch.futures.wait_all``, exiting at the first error (see above)."""
    if not _any_ours(futures):
        return _torch_wait_all(futures)
    ended = threading.Event()
    first: list[BaseException | None] = []

    def settle(error: BaseException | None) -> None:
        first.append(error)
        ended.set()

    _settle_once(list(futures), settle, first_error=True, observed=False)  # (settle only wakes this thread)
    # rpc_async calls' futures (calls.py, _CallFuture): this thread receives their answers
    # itself while it waits, as their wait() does.
    awaits = next((f._await_answers for f in futures if getattr(f, "_await_answers", None) is not None), None)
    if awaits is not None and not ended.is_set():
        awaits([f for f in futures if getattr(f, "_await_answers", None) == awaits], ended.is_set)
    ended.wait()
    error = first.pop()
    if error is not None:
        try:
            raise error.with_traceback(None)  # (a copy our future raised for this wait alone)
        finally:
            del error
    return [future.wait() for future in futures]


def collect_all(futures: list) -> torch.futures.Future:
    """``torch.futures.collect_all``: a future of the futures once all are done, failed
    with the first error (see above)."""
    if not _any_ours(futures):
        return _torch_collect_all(futures)
    collected = Future()
    futures = list(futures)

    def settle(error: BaseException | None) -> None:
        if error is not None:
            collected.set_exception(error)
        else:
            collected.set_result(futures)

    _settle_once(futures, settle, first_error=True, observed=True)  # (the user's callbacks on ``collected`` run in settle)
    return collected


def _install() -> None:
    if getattr(torch.futures.wait_all, "__module__", "") != __name__:
        torch.futures.wait_all = wait_all  # type: ignore[assignment]
        torch.futures.collect_all = collect_all  # type: ignore[assignment]


_install()
