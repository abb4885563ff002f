"""Futures whose errors do not keep alive what waited on them.

``torch.futures.Future.set_exception`` keeps the exception and raises that same object from
every ``wait()`` and ``value()``. A raised exception collects, in its traceback, the frames it
passes through, so after a wait the stored exception holds the waiter's frames and through
them its locals: typically the future itself, the call's arguments, RRefs. That cycle runs
through the future's C++ side, which Python's garbage collector cannot see into, so it is
never freed (found by a stress run that killed a worker: 900 RRefs, and the values their
owners kept for them, leaked in 30 s; tests/test_futures.py).

So our futures keep the error without a traceback (its text is kept, for the answer to a
remote caller and for whoever reads the error) and raise a fresh copy of it from each wait:
the copy's traceback belongs to that raise alone, and goes when the caller lets go of it.
"""

from __future__ import annotations

import copy
import traceback
from typing import Any

import torch


class Future(torch.futures.Future):
    """``torch.futures.Future`` with errors as described above."""

    def set_exception(self, result: Any) -> None:
        if not isinstance(result, Exception):  # torch's own check
            raise AssertionError(f"{result} is of type {type(result)}, not an Exception.")
        keep_without_traceback(result)
        self._set_unwrap_func(_raise_copy)
        self.set_result(result)


def keep_without_traceback(error: BaseException) -> None:
    """Drop ``error``'s traceback (and those of the errors it was raised from), keeping what
    it said as text for ``traceback_text``."""
    if error.__traceback__ is not None and getattr(error, "_traceback_text", None) is None:
        error._traceback_text = _formatted(error)
    seen = set()
    while error is not None and id(error) not in seen:  # (a chain may loop)
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def traceback_text(error: BaseException) -> str:
    """The traceback of ``error`` as text: where it was first raised, if a future kept it."""
    kept = getattr(error, "_traceback_text", None)
    return kept if kept is not None else _formatted(error)


def _formatted(error: BaseException) -> str:
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def _raise_copy(error: Exception) -> None:
    raise _copy(error)


def _copy(error: Exception) -> Exception:
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
