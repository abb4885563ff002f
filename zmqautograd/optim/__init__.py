"""Optimizers over parameters that live on other workers (``torch.distributed.optim``)."""

from .optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
