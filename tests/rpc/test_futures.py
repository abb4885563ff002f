"""Our futures (zmqautograd/rpc/futures.py). Their errors: waiting on a failed future does
not keep the waiter's frames alive, each wait raises an error of the same type, message and
attributes, and where the error was first raised stays readable; for ``Future`` (a torch
future) and ``Outcome`` (the library's own, lighter one) alike. ``Outcome``'s callbacks,
``then`` and blocking ``wait``."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch

from zmqautograd.transport import PeerLostError
from zmqautograd.rpc.futures import Future, Outcome, traceback_text
from zmqautograd.rpc.serialization import encode_exception

pytestmark = pytest.mark.timeout(30)


class _Marker:
    pass


def _wait_and_swallow(future, marker) -> None:
    """A waiter whose frame refers to the future and to ``marker``, as a caller's does."""
    try:
        future.wait()
    except RuntimeError:
        pass


def _marker_survives(kind) -> bool:
    future = kind()
    future.set_exception(PeerLostError("3", "lost peer '3'"))
    marker = _Marker()
    alive = weakref.ref(marker)
    _wait_and_swallow(future, marker)
    _wait_and_swallow(future, marker)
    del marker, future
    gc.collect()
    return alive() is not None


KINDS = pytest.mark.parametrize("kind", [Future, Outcome], ids=["Future", "Outcome"])


@KINDS
def test_waiting_on_a_failed_future_keeps_nothing_alive(kind):
    # (torch's own set_exception raises the one stored error from every wait: its traceback
    # then holds the waiter's frame, and the cycle through the future's C++ side is never
    # collected.)
    assert not _marker_survives(kind)


@KINDS
def test_each_wait_raises_a_fresh_error_of_the_same_kind(kind):
    future = kind()
    future.set_exception(PeerLostError("3", "lost peer '3': connection closed"))
    raised = []
    for wait in (future.wait, future.value, future.wait):
        with pytest.raises(PeerLostError, match="lost peer '3'") as caught:
            wait()
        raised.append(caught.value)
    assert len({id(error) for error in raised}) == 3
    assert all(error.peer == "3" for error in raised)
    assert future.done()


def _fails_deep_inside() -> None:
    raise ValueError("bad value")


@KINDS
def test_where_an_error_was_first_raised_stays_readable_and_travels(kind):
    try:
        _fails_deep_inside()
    except ValueError as exc:
        error = exc
    future = kind()
    future.set_exception(error)
    assert error.__traceback__ is None  # kept without it: the future holds no frames
    with pytest.raises(ValueError, match="bad value") as caught:
        future.wait()
    text = traceback_text(caught.value)
    assert "_fails_deep_inside" in text and "ValueError: bad value" in text
    assert "_fails_deep_inside" in encode_exception(caught.value)["traceback"]  # what a remote caller reads


class _TwoArgumentError(RuntimeError):
    def __init__(self, code: int, what: str):
        super().__init__(f"{code}: {what}")
        self.code = code


@KINDS
def test_an_error_whose_constructor_takes_other_arguments_is_raised_as_itself(kind):
    future = kind()
    future.set_exception(_TwoArgumentError(7, "odd"))
    with pytest.raises(_TwoArgumentError, match="7: odd") as caught:
        future.wait()
    assert caught.value.code == 7


def test_an_outcomes_callbacks_run_once_set_or_at_once_after_and_a_failing_one_is_logged(caplog):
    outcome = Outcome()
    seen = []
    outcome.add_done_callback(lambda done: seen.append(("before", done.value())))
    outcome.add_done_callback(lambda done: 1 / 0)  # logged; the others still run
    outcome.add_done_callback(lambda done: seen.append(("also before", done.value())))
    assert not outcome.done() and seen == []
    with caplog.at_level(logging.ERROR, logger="zmqautograd.rpc.futures"):
        outcome.set_result(5)
    assert outcome.done() and seen == [("before", 5), ("also before", 5)]
    assert "ZeroDivisionError" in caplog.text
    outcome.add_done_callback(lambda done: seen.append(("after", done.value())))
    assert seen[-1] == ("after", 5)
    with pytest.raises(RuntimeError, match="set already"):
        outcome.set_result(6)
    assert outcome.value() == 5


def test_an_outcomes_then_carries_the_result_or_the_error():
    outcome = Outcome()
    doubled = outcome.then(lambda done: done.value() * 2)
    failed = outcome.then(lambda done: {}["missing"])
    outcome.set_result(21)
    assert doubled.value() == 42
    with pytest.raises(KeyError, match="missing"):
        failed.wait()
    broken = Outcome()
    following = broken.then(lambda done: done.value())
    broken.set_exception(PeerLostError("3", "lost peer '3'"))
    with pytest.raises(PeerLostError, match="lost peer '3'"):
        following.value()


def test_an_outcomes_wait_blocks_until_another_thread_sets_it():
    outcome = Outcome()
    waiting = threading.Event()
    got = []

    def waiter():
        waiting.set()
        got.append(outcome.wait())

    threads = [threading.Thread(target=waiter) for _ in range(3)]
    for thread in threads:
        thread.start()
    waiting.wait(5)
    assert not got  # nothing set yet (a waiter that returned would show here, or in the end)
    outcome.set_result("ready")
    for thread in threads:
        thread.join(5)
    assert got == ["ready"] * 3


def test_wait_all_and_collect_all_end_at_the_first_error_of_our_futures_with_its_type():
    """torch documents that both end at the first error; with futures of ours among them
    they do (rpc/futures.py), raising the error's own type, while others still wait."""
    pending, failed, done = Future(), Future(), Future()
    done.set_result(1)
    failed.set_exception(ValueError("the first error"))
    with pytest.raises(ValueError, match="the first error"):
        torch.futures.wait_all([pending, failed, done])
    collected = torch.futures.collect_all([pending, failed])
    with pytest.raises(ValueError, match="the first error"):
        collected.wait()
    later = Future()
    threading.Thread(target=later.set_result, args=(2,)).start()
    assert torch.futures.wait_all([done, later]) == [1, 2]
    assert [f.wait() for f in torch.futures.collect_all([done, later]).wait()] == [1, 2]
    assert torch.futures.wait_all([]) == []
    plain = torch.futures.Future()  # torch's own futures: torch's own functions
    plain.set_result(3)
    assert torch.futures.wait_all([plain]) == [3]


def test_an_error_raised_by_wait_all_keeps_nothing_alive():
    future = Future()
    future.set_exception(PeerLostError("3", "lost peer '3'"))
    marker = _Marker()
    alive = weakref.ref(marker)

    def wait_all_and_swallow(futures, marker):
        try:
            torch.futures.wait_all(futures)
        except RuntimeError:
            pass

    wait_all_and_swallow([future], marker)
    del marker, future
    gc.collect()
    assert alive() is None
