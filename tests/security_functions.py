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


# ------------------------------------------------------------------ a member's attacks
# Run on a worker of the group (tests/system/test_members.py): what a compromised member
# sends through its own authenticated connection, encoded by the project's codec: the
# protocol's own functions and messages, with ids it guessed or was told.


def _outcome(future) -> str:
    try:
        future.wait()
    except Exception as exc:  # noqa: BLE001 - what the victim answered is the point
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def send_gradients(to: int, context_id: int, message_ids: list, pass_id: int, value: float,
                   token: int | None = None) -> list[str]:
    """Gradients (``value`` everywhere, 2 elements) for send functions ``message_ids`` of
    context ``context_id`` on worker ``to``: as calls (what each came back with), one-way,
    and one-way under a ticket with ``token`` (as if routed through us)."""
    import torch

    from zmqautograd.autograd.api import _backward_request

    agent = _agent()
    outcomes = []
    for message_id in message_ids:
        grads = [torch.full((2,), float(value))]
        args = (context_id, message_id, pass_id, False, grads, agent.rank)
        outcomes.append(_outcome(agent.call(to, _backward_request, args, None, 10,
                                            message_type=MessageType.BACKWARD_AUTOGRAD_REQ)))
        agent.notify(to, _backward_request, (*args[:5], -1), MessageType.BACKWARD_AUTOGRAD_REQ)
        agent.notify(to, _backward_request, (*args[:5], -1, 1 << 40, None, None, None, token),
                     MessageType.BACKWARD_AUTOGRAD_REQ)
    return outcomes


def release_contexts(to: int, context_ids: list) -> list[str]:
    """Release ``context_ids`` on worker ``to``: a cleanup request, and the same riding on a
    call (``"rc"`` in its payload, as cleanup.py sends them)."""
    import torch

    from zmqautograd.autograd.cleanup import cleanup_contexts
    from zmqautograd.rpc.serialization import encode_function

    agent = _agent()
    outcome = _outcome(agent.call(to, cleanup_contexts, (list(context_ids),), None, 10,
                                  message_type=MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ))
    riding = {"f": encode_function(torch.add), "a": [1, 2], "k": {}, "n": 1, "rc": list(context_ids)}
    agent.endpoint.send(str(to), Message(MessageType.PYTHON_CALL, next(agent._ids), agent._me, riding))
    return [outcome]


def rref_protocol(to: int, function_name: str, args: list) -> str:
    """One of the RRef protocol's functions (``_delete_fork``, ``_fork_request``,
    ``_child_accept``, ``_fetch``, ``_backward_on_owner``) on worker ``to``, with ids we were
    told or guessed."""
    from zmqautograd.rpc import rref_owner

    kinds = {"_delete_fork": MessageType.RREF_USER_DELETE, "_fork_request": MessageType.RREF_FORK_REQUEST,
             "_child_accept": MessageType.RREF_CHILD_ACCEPT, "_fetch": MessageType.PYTHON_RREF_FETCH_CALL,
             "_backward_on_owner": MessageType.RREF_BACKWARD_REQ}
    agent = _agent()
    return _outcome(agent.call(to, getattr(rref_owner, function_name), tuple(args), None, 10,
                               message_type=kinds[function_name]))


_reporting: dict = {}


def start_reporting(to: int, first_sink: int, count: int, context_id: int) -> None:
    """Until ``stop_reporting``, send reports to sinks ``first_sink..+count`` of worker
    ``to`` (the ids of its calls: a sink's id is one of them): an error that would fail the
    pass there, and the settling of tickets it may wait for."""
    import threading

    agent = _agent()
    stop = threading.Event()

    def report() -> None:
        sent = 0
        while not stop.is_set():
            for sink in range(first_sink, first_sink + count):
                for pass_id in range(to << 48, (to << 48) + 64, 8):
                    forged = [context_id, pass_id, [[pass_id + k, []] for k in range(8)], None,
                              "Error on Node 3: a forged report"]
                    try:
                        agent.report(to, sink, forged)
                    except Exception:  # noqa: BLE001 - the attack goes on
                        continue
                    sent += 1
            stop.wait(0.002)
        _reporting["sent"] = sent

    thread = threading.Thread(target=report, daemon=True)
    _reporting.update(stop=stop, thread=thread)
    thread.start()


def stop_reporting() -> int:
    _reporting["stop"].set()
    _reporting["thread"].join(30)
    return _reporting["sent"]


def refusals(peer: int | None = None) -> int:
    """This worker's refusals so far (distributed autograd's and the RRefs'), of ``peer`` or all."""
    agent = _agent()
    return agent.hooks.refusals.count(peer) + agent.rrefs.refusals.count(peer)


def scale(x):
    return x * 3


def threads() -> int:
    import threading

    return threading.active_count()


def value_of(rref):
    return rref.to_here()


class _SlowBackward:
    """x -> x whose backward takes ``seconds``: a window in which a pass waits for it."""

    seconds = 0.3


def slow_backward_scale(x):
    import time

    import torch

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, value):
            return value.clone()

        @staticmethod
        def backward(ctx, grad):
            time.sleep(_SlowBackward.seconds)  # (the test's window: the pass waits meanwhile)
            return grad

    return Slow.apply(x) * 3


def call_with_forged_rref(to: int, encoded: list) -> str:
    """Call ``value_of`` on worker ``to`` with an RRef whose encoding we wrote ourselves
    (``[rref id, owner, fork id, parent, type name]``: the parent is who forked it, we claim)."""
    import msgpack

    agent = _agent()
    forged = msgpack.ExtType(18, msgpack.packb(encoded))  # (the agent's EXT_RREF)
    return _outcome(agent.call(to, value_of, (forged,), None, 10))
