"""``DistributedOptimizer``: one local optimizer per worker that owns parameters, each
stepping with the gradients of the given autograd context on its own worker, as
``torch.distributed.optim.DistributedOptimizer`` does."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

from .. import autograd as dist_autograd
from .. import rpc
from ..rpc.serialization import protocol_function


class _LocalOptimizer:
    """Lives on a parameter owner; created there by ``rpc.remote``."""

    # Optimizers of one worker may share parameters: steps run one at a time (as torch's).
    global_lock = threading.Lock()

    def __init__(self, optimizer_class: type, param_rrefs: list, *args: Any, **kwargs: Any):
        self._params = [rref.local_value() for rref in param_rrefs]
        self.optim = optimizer_class(self._params, *args, **kwargs)

    def step(self, autograd_context_id: int) -> None:
        grads = dist_autograd.get_gradients(autograd_context_id)
        with _LocalOptimizer.global_lock:
            for param in self._params:
                # Parameters this pass did not reach keep no gradient, so the optimizer
                # skips them (as after a local backward that did not reach them).
                param.grad = grads.get(param)
            self.optim.step()


@protocol_function
def _new_local_optimizer(optimizer_class: type, param_rrefs: list, args: tuple, kwargs: dict) -> Any:
    return rpc.RRef(_LocalOptimizer(optimizer_class, param_rrefs, *args, **kwargs))


@protocol_function
def _local_optimizer_step(optimizer_rref: Any, autograd_context_id: int) -> None:
    optimizer_rref.local_value().step(autograd_context_id)


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)``.

    ``params_rref``: RRefs to the parameters, on any workers. A local ``optimizer_class``
    is made on each owner over its parameters (construction errors are raised here).
    ``step(context_id)`` steps them all with that context's gradients, concurrently.
    """

    def __init__(self, optimizer_class: type, params_rref: list, *args: Any, **kwargs: Any):
        by_owner: dict[Any, list] = defaultdict(list)
        for param in params_rref:
            by_owner[param.owner()].append(param)
        futures = [
            rpc.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, params, args, kwargs))
            for owner, params in by_owner.items()
        ]
        # Waiting raises a constructor's error here, as torch's does.
        self.remote_optimizers = [future.wait() for future in futures]

    def step(self, context_id: int) -> None:
        dist_autograd._retrieve_context(context_id)  # a clear error for an unknown context
        futures = [
            rpc.rpc_async(optimizer.owner(), _local_optimizer_step, args=(optimizer, context_id))
            for optimizer in self.remote_optimizers
        ]
        errors = []
        for future in futures:
            try:
                future.wait()
            except Exception as exc:  # noqa: BLE001 - every worker steps; the first error is raised
                errors.append(exc)
        if errors:
            raise errors[0]
