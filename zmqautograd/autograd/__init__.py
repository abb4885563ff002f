"""Distributed autograd with the API and semantics of ``torch.distributed.autograd``.

Port code by changing ``import torch.distributed.autograd as dist_autograd`` to
``import zmqautograd.autograd as dist_autograd``.
"""

from ..rpc.hooks import install_call_hooks
from .api import (
    _current_context,
    _get_debug_info,
    _get_max_id,
    _is_valid_context,
    _new_context,
    _release_context,
    _retrieve_context,
    backward,
    context,
    get_gradients,
)
from . import ddp
from .context import DistAutogradContext
from .hooks import AutogradHooks

# Every agent started from now on records into distributed autograd (as torch's
# dist_autograd._init when RPC starts).
install_call_hooks(AutogradHooks)
# DistributedDataParallel's reducer averages the gradients of a pass over its parameters.
ddp.install()


def is_available() -> bool:
    """Whether distributed autograd can be used in this build (always: it is pure Python)."""
    return True


__all__ = [
    "context", "backward", "get_gradients", "DistAutogradContext", "is_available",
    "_new_context", "_release_context", "_retrieve_context", "_current_context", "_is_valid_context",
    "_get_max_id", "_get_debug_info",
]
