"""Helpers shared by the tests of every layer.

The tests are laid out like the code: ``transport/``, ``rpc/``, ``autograd/`` (with the
optimizer), ``system/`` (whole programs, faults, containers) and ``upstream/`` (torch's own
suites, ported). Modules at this level hold what several of them use: worker harnesses
(``spmd.py``, ``rpc_harness.py``, ``workers.py``, ``netns.py``) and the functions workers run
by reference (``*_functions.py``, ``*_cases.py``), which keep their import paths.
"""

from __future__ import annotations

import time
from typing import Callable


def poll_until(condition: Callable[[], object], timeout: float = 30.0, what: str = "condition",
               interval: float = 0.005) -> None:
    """Look at ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds.
    Only for states nothing signals (another process's state, a counter of the transport):
    where an event or a future exists, wait on that instead."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(interval)
