"""Listed as a module in tests/rpc/test_allowed_functions.py's ``allowed_functions``: what
a member may reach through it (its own public functions and classes) and what it must not
(the modules and functions it imported, its private names, dunders, methods)."""

from __future__ import annotations

import os
from os import system  # noqa: F401 - imported to be reached for: it must not be
from typing import Any, Callable

import torch  # noqa: F401 - as above: torch.os.system is os.system


def double(x: Any) -> Any:
    return 2 * x


def call(function: Callable, *args: Any) -> Any:
    """Calls what it is given: a function that got through as a value would run here."""
    return function(*args)


def pid() -> int:
    return os.getpid()


class Stage:
    """A class with a listed method (``forward``) and one that is not (``scaled``)."""

    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def touch(self, path: str) -> None:
        """Creates ``path``: a method no peer may reach unless it is listed."""
        open(path, "w").close()


def _private(path: str) -> None:
    open(path, "w").close()
