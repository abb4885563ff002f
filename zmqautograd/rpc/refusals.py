"""Refusals of what a member is not entitled to (docs/security.md): a message that acts on a
call, a context, a backward pass or an RRef fork that its sender takes no part in. Each is
counted by peer and answered with ``NotEntitledError`` where the sender waits for an answer;
the first refusal of each peer is logged as a warning and the rest at debug level, so that a
member that keeps trying cannot flood the log. The legitimate work goes on untouched."""

from __future__ import annotations

import logging
import threading
from collections import Counter

from .errors import NotEntitledError

log = logging.getLogger("zmqautograd.security")


class PeerLog:
    """Lines about what peers sent that failed here: each peer's first at the level asked,
    the rest at debug level (a member that keeps sending them must not flood the log)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()
        self._seen: set[str] = set()

    def log(self, peer: object, level: int, message: str, *args: object, exc_info: bool = False) -> None:
        with self._lock:
            first = str(peer) not in self._seen
            if first and len(self._seen) < 65536:
                self._seen.add(str(peer))
        if first:
            self._logger.log(level, message + " (further ones of this peer are logged at debug level)", *args,
                             exc_info=exc_info)
        else:
            self._logger.debug(message, *args, exc_info=exc_info)


class Refusals:
    """The refusals of one layer of one worker (``where`` names it in the log)."""

    def __init__(self, where: object) -> None:
        self.where = where
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def refuse(self, peer: int | str | None, what: str) -> NotEntitledError:
        """Count and log a refusal of ``peer``'s message (``what`` says what it asked for
        and why it may not); the error to answer it with."""
        name = "an unknown sender" if peer is None else f"worker {peer}"
        with self._lock:
            self._counts[str(peer)] += 1
            first = self._counts[str(peer)] == 1
        message = f"{self.where} refused {what} from {name}: it takes no part in it"
        log.log(logging.WARNING if first else logging.DEBUG, "%s%s", message,
                " (further refusals of this peer are logged at debug level)" if first else "")
        return NotEntitledError(message)

    def count(self, peer: int | str | None = None) -> int:
        """Refusals so far, of ``peer`` or of everyone."""
        with self._lock:
            return sum(self._counts.values()) if peer is None else self._counts[str(peer)]
