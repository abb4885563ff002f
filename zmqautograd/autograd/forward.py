"""Recording the forward pass at RPC boundaries (the seeds' utils.cpp).

The RPC agent calls these around every call and answer. While an autograd context is current,
a call carries autograd metadata ``[context id, autograd message id, token]`` in its payload (and
travels as FORWARD_AUTOGRAD_REQ) when any of its tensors requires grad, and always for Python
functions, ``remote`` and ``to_here``: their answer may require grad even if the arguments
do not. The sender records a SendRpcBackward over the tensors that require grad; the receiver
joins the context and gives those tensors a RecvRpcBackward. Answers to such calls travel as
FORWARD_AUTOGRAD_RESP and are recorded the same way in reverse.

The token is a random number that the sender keeps with its send function: the gradients of
that send function are taken from the worker its tensors went to, or from a worker that shows
the token, which only the originator of a pass can give it, in a route (engine.py,
"Forwarding"; docs/security.md).
"""

from __future__ import annotations

import os
import struct
import threading
import types
from typing import Any

import torch

from zmqautograd.transport import MessageType

from .context import ContextContainer, DistAutogradContext
from .functions import attach_recv_node, make_send_node

# Calls that may carry autograd metadata; the RPC layer's own control messages never do.
RECORDED_CALLS = frozenset({MessageType.PYTHON_CALL, MessageType.PYTHON_REMOTE_CALL, MessageType.PYTHON_RREF_FETCH_CALL})
BUILTIN_TYPES = (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodDescriptorType,
                  types.WrapperDescriptorType, types.MethodWrapperType)


class _Tokens(threading.local):
    """Random 64-bit tokens, drawn from the OS 512 at a time (one syscall instead of one per
    recorded message), per thread."""

    def __init__(self) -> None:
        self.left: list[int] = []

    def take(self) -> int:
        left = self.left
        if not left:
            left.extend(struct.unpack("<512Q", os.urandom(8 * 512)))
        return left.pop()


_tokens = _Tokens()


def request_metadata(container: ContextContainer, message_type: MessageType, function: Any, args: Any, kwargs: Any) -> list | None:
    """The autograd metadata for a call about to be made, or None if it goes unrecorded."""
    context = container.current()
    if context is None or message_type not in RECORDED_CALLS:
        return None
    forced = message_type is not MessageType.PYTHON_CALL or not isinstance(function, BUILTIN_TYPES)
    if not forced and not _any_requires_grad(args) and not _any_requires_grad(kwargs):
        return None  # a builtin on tensors that need no grad: nothing to record
    return [context.context_id, container.new_message_id(), _tokens.take()]


def message_metadata(container: ContextContainer, context: DistAutogradContext) -> list:
    return [context.context_id, container.new_message_id(), _tokens.take()]


def record_send(container: ContextContainer, metadata: list, tensors: list, to: int) -> DistAutogradContext | None:
    """After encoding a recorded message: a send function over what requires grad in it.
    The context it went into; None when that was released here meanwhile."""
    context = container.get(metadata[0])
    if context is None:  # released meanwhile: nothing will run a backward pass in it
        return None
    context.add_known_worker(to)
    needing_grad = [t for t in tensors if t.requires_grad]
    if needing_grad:
        context.add_send_function(metadata[1], *make_send_node(needing_grad), to=to, token=metadata[2])
    return context


def record_recv(container: ContextContainer, metadata: Any, tensors: list, from_worker: int,
                response: bool = False) -> DistAutogradContext | None:
    """On receiving a recorded message: join its context and attach a recv function. A
    request joins (makes) the context; a response only records into a context that still
    exists here. None when the context was released here (the message is then served
    without recording)."""
    if type(metadata) is not list or len(metadata) != 3:
        raise ValueError(f"malformed autograd metadata {metadata!r:.80}")
    context_id, message_id, token = metadata
    if type(context_id) is not int or type(message_id) is not int or type(token) is not int:
        raise ValueError(f"malformed autograd metadata {metadata!r:.80}")
    if response:
        context = container.get(context_id)
        if context is None:
            return None
        context.add_known_worker(from_worker)
    else:
        context = container.get_or_create(context_id, from_worker)
        if context is None:
            return None
    needing_grad = [t for t in tensors if t.requires_grad]
    if needing_grad:
        context.add_recv_function(
            message_id, *attach_recv_node(needing_grad, context_id, message_id, from_worker, response, token)
        )
    return context


def _any_requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        for item in value:  # (a loop, not any() over a generator: this runs on every call)
            if _any_requires_grad(item):
                return True
        return False
    if isinstance(value, dict):
        for item in value.values():
            if _any_requires_grad(item):
                return True
    return False
