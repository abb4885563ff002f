"""Run on the workers of tests/system/test_security.py and tests/rpc/test_bad_input.py."""

from __future__ import annotations

import os
import time

from zmqautograd.transport import Message, MessageType
from zmqautograd.rpc import api


def _agent():
    return api._current()


def address() -> str:
    return _agent().endpoint.address


def credential() -> str:
    """This worker's published credential (what the rendezvous store holds)."""
    return _agent().membership.own.published()


def admit(name: str, public: str) -> None:
    """Make ``name`` a member of this worker's group (an embedder's extra peer): the tests'
    intruders connect with it to send malformed messages as an authenticated member."""
    agent = _agent()
    agent.membership.admit(name, public)
    agent.endpoint.expect(name)
    agent.endpoint.members_changed()


def peers() -> dict:
    return _agent().endpoint.peers()


def refused_connections() -> int:
    return _agent().endpoint.refused_connections


def held_connections() -> int:
    """Connections whose credentials nobody admitted yet, held by the ZAP handler."""
    return len(_agent().endpoint._zap_held)


def protocol_errors(peer: str | None = None) -> int:
    stats = _agent().endpoint.stats()
    return sum(s.protocol_errors for name, s in stats.items() if peer is None or name == peer)


def misdirected_answers() -> int:
    return _agent().misdirected_answers


def resources() -> dict:
    """This process's resident memory (bytes) and open descriptors."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd"))}


def slow(seconds: float) -> str:
    time.sleep(seconds)
    return "real"


def forge_answers(to_rank: int, count: int) -> int:
    """Send worker ``to_rank`` answers (values and errors) for call ids 1..count that it never
    made to us: what a compromised member would try."""
    agent = _agent()
    sent = 0
    for message_id in range(1, count + 1):
        for kind, payload in ((MessageType.PYTHON_RET, {"v": "forged"}), (MessageType.EXCEPTION, {"exc": {
                "module": "builtins", "type": "ValueError", "message": "forged", "traceback": ""}})):
            agent.endpoint.send(str(to_rank), Message(kind, message_id, agent._me, payload))
            sent += 1
    return sent


def allowed(x):
    return x + 1


def not_allowed(x):
    return x - 1


_started = [0]


def counted_slow(seconds: float) -> None:
    """A slow call that counts itself as started."""
    _started[0] += 1
    time.sleep(seconds)


def started() -> int:
    return _started[0]


def is_lost(peer: str) -> bool:
    return _agent().endpoint.is_lost(peer)


def flood(worker: str, count: int, seconds: float) -> None:
    """Queue ``count`` slow calls on ``worker`` (not waited for: they keep its pool busy)."""
    from zmqautograd import rpc

    global _flood
    _flood = [rpc.rpc_async(worker, counted_slow, args=(seconds,)) for _ in range(count)]


_flood: list = []


def mechanism() -> str:
    return _agent().membership.mechanism
