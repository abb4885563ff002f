"""How the layers above RPC plug into it: call hooks.

The RPC layer knows nothing of distributed autograd. A layer above installs a ``CallHooks``
factory (``install_call_hooks``); every agent that ``init_rpc`` starts makes its hooks from it
and calls them around each call and answer, as torch's ``rpc.init_rpc`` calls
``dist_autograd._init``. ``zmqautograd`` installs distributed autograd's hooks when the
package is imported (``zmqautograd/__init__.py``), so every worker has them.

What the hooks add travels in the call's payload (keys of their own; the agent's are "f", "a",
"k", "v", "n", "exc"), and a call or answer that carries it travels as the message type the
hook names (FORWARD_AUTOGRAD_REQ/RESP for distributed autograd).

The hooks run on the hot path of every call: an implementation returns None where it adds
nothing, and the agent then skips the rest of them for that call.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from zmqautograd.transport import Message, MessageType

from .errors import RpcError


class OutgoingCall:
    """What a hook adds to one call it sees leave: the message type it travels as, whether the
    hook needs the call's tensors (``collect_tensors``), and the hook's own ``state``."""

    __slots__ = ("message_type", "collect_tensors", "state")

    def __init__(self, message_type: MessageType, collect_tensors: bool, state: Any) -> None:
        self.message_type = message_type
        self.collect_tensors = collect_tensors
        self.state = state


class CallHooks(Protocol):
    """What the agent calls, in order, for a call this worker makes:
    ``call_leaving`` (may add to the payload) → encoding → ``call_recorded`` (with the tensors
    the encoder found) → sent; or ``call_not_sent`` when it never left. Its answer:
    ``answer_arrived`` when it travels as a hooked message type.

    For a call this worker serves: ``call_arrived`` → ``call_starts`` → the function →
    ``call_ends`` → ``answer_payload`` → ``answer_leaving`` → sent → ``answer_left`` →
    ``call_answered``; where ``call_arrived`` returned None only ``call_starts`` and
    ``call_ends`` are called. Peers lost and shutdown: ``peer_lost``, ``flush``."""

    # ------------------------------------------------------------------ calls we make

    def call_leaving(self, to: int, message_type: MessageType, function: Any, args: Any, kwargs: Any,
                     payload: dict, batching: bool) -> OutgoingCall | None:
        """Before a call to ``to`` is encoded; ``batching``: whether deferred work may ride on it."""
        ...

    def call_recorded(self, to: int, outgoing: OutgoingCall, tensors: list, sync: bool) -> None:
        """After encoding, only where ``outgoing.collect_tensors``: before it is sent (``sync``
        False), or while it travels (True)."""
        ...

    def call_not_sent(self, to: int, outgoing: OutgoingCall) -> None: ...

    def answer_arrived(self, sender: int, payload: dict, tensors: list) -> None:
        """An answer of a hooked type, before its value is handed to the caller."""
        ...

    def while_waiting(self) -> bool:
        """This thread waits for answers to calls it made (an ``rpc_async`` future's
        ``wait``) and has nothing else to do: one piece of the work deferred from those calls
        (it runs while their answers travel, instead of later on a critical path); whether
        more remains. Short; must not block or raise."""
        ...

    # ------------------------------------------------------------------ calls we serve

    def call_arrived(self, message: Message) -> Any:
        """Before the function is resolved: the hook's state for this call, or None. Raising
        answers the call with that error."""
        ...

    def call_starts(self, served: Any, function: Any) -> Any:
        """Just before the function runs, on its thread: a token for ``call_ends``."""
        ...

    def call_ends(self, token: Any) -> None: ...

    def answer_payload(self, served: Any, value: Any) -> tuple[MessageType, dict] | None:
        """The answer's type and payload when the hook adds to it, else None."""
        ...

    def answer_leaving(self, served: Any, payload: dict, to: int, loopback: bool, tensors: list) -> None:
        """The answer is encoded; a ``loopback`` one is delivered here next."""
        ...

    def answer_left(self, served: Any, payload: dict, to: int, tensors: list) -> None:
        """The answer was handed to the transport (or failed to be)."""
        ...

    def call_answered(self, served: Any) -> None:
        """After the answer left: deferred work of the call."""
        ...

    # ------------------------------------------------------------------ the group

    def joined(self, incarnation: int) -> None:
        """This worker joined a dynamic group with the ``incarnation``-th event of its log:
        ids it makes from now on must differ from any an earlier worker of its rank made."""
        ...

    def peer_lost(self, peer: int, error: BaseException) -> None: ...

    def flush(self) -> None:
        """Graceful shutdown: send what waits to ride on later calls."""
        ...

    def debug_info(self) -> dict[str, str]: ...

    def backward(self, context_id: int, roots: list, retain_graph: bool) -> None:
        """``RRef.backward`` within a context."""
        ...


class NoCallHooks:
    """The hooks of an agent when no layer above is installed: calls carry nothing more."""

    def call_leaving(self, to: int, message_type: MessageType, function: Any, args: Any, kwargs: Any,
                     payload: dict, batching: bool) -> OutgoingCall | None:
        return None

    def call_recorded(self, to: int, outgoing: OutgoingCall, tensors: list, sync: bool) -> None:
        pass

    def call_not_sent(self, to: int, outgoing: OutgoingCall) -> None:
        pass

    def answer_arrived(self, sender: int, payload: dict, tensors: list) -> None:
        pass

    def while_waiting(self) -> bool:
        return False

    def call_arrived(self, message: Message) -> Any:
        if message.type is MessageType.FORWARD_AUTOGRAD_REQ:
            raise RpcError("distributed autograd is not installed on this worker")
        return None

    def call_starts(self, served: Any, function: Any) -> Any:
        return None

    def call_ends(self, token: Any) -> None:
        pass

    def answer_payload(self, served: Any, value: Any) -> tuple[MessageType, dict] | None:
        return None

    def answer_leaving(self, served: Any, payload: dict, to: int, loopback: bool, tensors: list) -> None:
        pass

    def answer_left(self, served: Any, payload: dict, to: int, tensors: list) -> None:
        pass

    def call_answered(self, served: Any) -> None:
        pass

    def joined(self, incarnation: int) -> None:
        pass

    def peer_lost(self, peer: int, error: BaseException) -> None:
        pass

    def flush(self) -> None:
        pass

    def debug_info(self) -> dict[str, str]:
        return {}

    def backward(self, context_id: int, roots: list, retain_graph: bool) -> None:
        raise RpcError("distributed autograd is not installed on this worker")


HooksFactory = Callable[[Any], CallHooks]  # called with the agent being started
_factory: HooksFactory | None = None


def install_call_hooks(factory: HooksFactory | None) -> None:
    """Make every agent started from now on call the hooks ``factory(agent)`` returns (None:
    no hooks). One layer installs them; installing again replaces the factory."""
    global _factory
    _factory = factory


def make_call_hooks(agent: Any) -> CallHooks:
    return _factory(agent) if _factory is not None else NoCallHooks()
