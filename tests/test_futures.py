"""Our futures' errors (zmqautograd/rpc/futures.py): waiting on a failed future does not keep
the waiter's frames alive, each wait raises an error of the same type, message and
attributes, and where the error was first raised stays readable."""

from __future__ import annotations

import gc
import weakref

import pytest

from transport import PeerLostError
from zmqautograd.rpc.futures import Future, traceback_text
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


def _marker_survives() -> bool:
    future = Future()
    future.set_exception(PeerLostError("3", "lost peer '3'"))
    marker = _Marker()
    alive = weakref.ref(marker)
    _wait_and_swallow(future, marker)
    _wait_and_swallow(future, marker)
    del marker, future
    gc.collect()
    return alive() is not None


def test_waiting_on_a_failed_future_keeps_nothing_alive():
    # (torch's own set_exception raises the one stored error from every wait: its traceback
    # then holds the waiter's frame, and the cycle through the future's C++ side is never
    # collected.)
    assert not _marker_survives()


def test_each_wait_raises_a_fresh_error_of_the_same_kind():
    future = Future()
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


def test_where_an_error_was_first_raised_stays_readable_and_travels():
    try:
        _fails_deep_inside()
    except ValueError as exc:
        error = exc
    future = Future()
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


def test_an_error_whose_constructor_takes_other_arguments_is_raised_as_itself():
    future = Future()
    future.set_exception(_TwoArgumentError(7, "odd"))
    with pytest.raises(_TwoArgumentError, match="7: odd") as caught:
        future.wait()
    assert caught.value.code == 7
