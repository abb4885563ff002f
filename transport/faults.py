"""Fault injection, applied when a message is handed to the transport (DESIGN.md: faults).

Mirrors the options of torch's faulty RPC agent so that its tests port, plus network faults:

* ``messages_to_fail`` / ``num_fail_sends``: the first N sends of each named message type
  fail (the sender gets ``InjectedFaultError`` at once, as a failed send); with
  ``fail_fraction`` (and ``seed``), later sends of those types fail with that probability;
* ``messages_to_delay``: messages of a type go out that many seconds late;
* ``drop_fraction`` (with ``seed``): that fraction of messages is lost on the way, silently,
  as a network would lose them (their calls then time out);
* ``partition(peer)`` / ``heal(peer)``: nothing goes to or comes from that peer meanwhile.

Also settable without touching a program: ``ZMQAUTOGRAD_FAULTS`` holds the same options as
JSON, e.g. ``{"messages_to_fail": ["RREF_FORK_REQUEST"], "num_fail_sends": 3}``.
Transport control messages (HELLO, HEARTBEAT, GOODBYE, PROTOCOL_ERROR) are never failed, dropped
at random or delayed; only a partition stops them.
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from .codec import CONTROL_TYPES, MessageType

ENVIRONMENT_VARIABLE = "ZMQAUTOGRAD_FAULTS"

# torch's names for what travels here under another type (this runtime has no TorchScript:
# builtins and scripted functions go as Python calls).
_ALIASES = {
    "SCRIPT_CALL": "PYTHON_CALL",
    "SCRIPT_REMOTE_CALL": "PYTHON_REMOTE_CALL",
    "SCRIPT_RREF_FETCH_CALL": "PYTHON_RREF_FETCH_CALL",
}


@dataclass(frozen=True)
class Decision:
    fail: bool = False
    drop: bool = False
    delay: float = 0.0


SEND = Decision()


def _canonical(name: str) -> str:
    name = _ALIASES.get(name, name)
    MessageType.by_name(name)  # a clear error for a type that does not exist
    return name


@dataclass
class FaultPolicy:
    messages_to_fail: list[str] = field(default_factory=list)
    num_fail_sends: int = 0
    messages_to_delay: dict[str, float] = field(default_factory=dict)
    drop_fraction: float = 0.0
    seed: int | None = None
    fail_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("drop_fraction", "fail_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.num_fail_sends < 0:
            raise ValueError(f"num_fail_sends must be >= 0, got {self.num_fail_sends}")
        self._fail = {_canonical(n) for n in self.messages_to_fail}
        self._delay = {_canonical(n): float(s) for n, s in self.messages_to_delay.items()}
        self._failed: dict[str, int] = {}
        self._partitioned: set[str] = set()
        self._random = random.Random(self.seed)
        self._lock = threading.Lock()
        self.injected = {"failed": 0, "dropped": 0, "delayed": 0}

    @classmethod
    def from_env(cls, base: dict[str, Any] | None = None) -> "FaultPolicy | None":
        """The policy of ``base`` options updated from ``ZMQAUTOGRAD_FAULTS``; None when
        neither asks for any fault."""
        options = dict(base or {})
        raw = os.environ.get(ENVIRONMENT_VARIABLE)
        if raw:
            try:
                options.update(json.loads(raw))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{ENVIRONMENT_VARIABLE} is not a JSON object of fault options: {exc}") from None
        known = {"messages_to_fail", "num_fail_sends", "messages_to_delay", "drop_fraction", "seed", "fail_fraction"}
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown fault options {sorted(unknown)}; known: {sorted(known)}")
        if not any(options.get(k) for k in ("messages_to_fail", "messages_to_delay", "drop_fraction")):
            return None
        return cls(**options)

    def partition(self, peer: str) -> None:
        with self._lock:
            self._partitioned.add(peer)

    def heal(self, peer: str) -> None:
        with self._lock:
            self._partitioned.discard(peer)

    def is_partitioned(self, peer: str) -> bool:
        return peer in self._partitioned

    def on_send(self, peer: str, message_type: MessageType) -> Decision:
        """What happens to one message of ``message_type`` sent to ``peer``."""
        name = message_type.name
        with self._lock:
            if peer in self._partitioned:
                self.injected["dropped"] += 1
                return Decision(drop=True)
            if message_type in CONTROL_TYPES:  # transport control: never failed, dropped or delayed
                return SEND
            if name in self._fail:
                count = self._failed.get(name, 0)
                if count < self.num_fail_sends or (self.fail_fraction and self._random.random() < self.fail_fraction):
                    self._failed[name] = count + 1
                    self.injected["failed"] += 1
                    return Decision(fail=True)
            if self.drop_fraction and self._random.random() < self.drop_fraction:
                self.injected["dropped"] += 1
                return Decision(drop=True)
            delay = self._delay.get(name, 0.0)
            if delay > 0:
                self.injected["delayed"] += 1
                return Decision(delay=delay)
        return SEND


def apply(policy: "FaultPolicy | None", peer: str, message_type: MessageType, deliver: Any, sender: str,
          deliver_late: Any = None) -> None:
    """Hand a message over through ``deliver()`` as ``policy`` decides: now, later (through
    ``deliver_late``, default ``deliver``, on a timer thread), never (dropped), or not at all
    with ``InjectedFaultError`` raised here (a failed send)."""
    from .errors import InjectedFaultError

    decision = policy.on_send(peer, message_type) if policy is not None else SEND
    if decision.fail:
        raise InjectedFaultError(peer, f"{sender}: send of {message_type.name} to {peer!r} failed on purpose (fault injection)")
    if decision.drop:
        return  # lost on the way, as a network loses messages
    if decision.delay:
        timer = threading.Timer(decision.delay, deliver_late or deliver)
        timer.daemon = True
        timer.start()
        return
    deliver()
