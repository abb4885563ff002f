"""Which message types are requests, which answer them, and which may be retried."""

from __future__ import annotations

from zmqautograd.transport import MessageType

# Each request type and the type of its answer (the seeds' names). All requests carry a
# function reference and arguments and run the same way; the types tell them apart on the wire
# (fault injection and retries select by type).
REQUEST_TYPES = {
    MessageType.PYTHON_CALL: MessageType.PYTHON_RET,
    MessageType.PYTHON_REMOTE_CALL: MessageType.REMOTE_RET,
    MessageType.PYTHON_RREF_FETCH_CALL: MessageType.PYTHON_RREF_FETCH_RET,
    MessageType.RREF_FORK_REQUEST: MessageType.RREF_ACK,
    MessageType.RREF_CHILD_ACCEPT: MessageType.RREF_ACK,
    MessageType.RREF_USER_DELETE: MessageType.RREF_ACK,
    MessageType.FORWARD_AUTOGRAD_REQ: MessageType.FORWARD_AUTOGRAD_RESP,
    MessageType.BACKWARD_AUTOGRAD_REQ: MessageType.BACKWARD_AUTOGRAD_RESP,
    MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ: MessageType.CLEANUP_AUTOGRAD_CONTEXT_RESP,
    MessageType.RREF_BACKWARD_REQ: MessageType.RREF_BACKWARD_RESP,
}

RESPONSE_TYPES = frozenset({*REQUEST_TYPES.values(), MessageType.EXCEPTION})

# Control messages whose receivers are idempotent: retried with backoff when they fail.
RETRYABLE_TYPES = frozenset({
    MessageType.RREF_FORK_REQUEST, MessageType.RREF_CHILD_ACCEPT, MessageType.RREF_USER_DELETE,
    MessageType.CLEANUP_AUTOGRAD_CONTEXT_REQ,
})
