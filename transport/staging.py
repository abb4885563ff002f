"""Pinned host staging buffers for CUDA tensors.

A device-to-host copy only runs asynchronously into page-locked memory, and pinning memory is
slow (it is a system call that locks pages), so buffers are pooled: sizes are rounded up to a
power of two and a released buffer is reused by the next message of that size class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MIN_CLASS = 1 << 16


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _size_class(nbytes: int) -> int:
    size = _MIN_CLASS
    while size < nbytes:
        size <<= 1
    return size


@dataclass(eq=False)
class PinnedBlock:
    """One page-locked host buffer (a flat uint8 tensor) owned by a pool."""

    tensor: torch.Tensor
    capacity: int


class PinnedBufferPool:
    """A thread-safe pool of pinned host buffers, bounded by ``max_cached_bytes`` of idle
    buffers (buffers in use are not bounded: a message needs what it needs)."""

    def __init__(self, max_cached_bytes: int = 1 << 30, allocate: Callable[[int], torch.Tensor] | None = None):
        self.max_cached_bytes = max_cached_bytes
        self._allocate = allocate or _allocate_pinned
        # Reentrant: release() runs from a weakref finalizer, which may fire on a thread that
        # is inside acquire() (a garbage collection there).
        self._lock = threading.RLock()
        self._free: dict[int, list[PinnedBlock]] = {}
        self._cached_bytes = 0
        self.allocations = 0  # pinned allocations made, for tests and tuning

    def acquire(self, nbytes: int) -> PinnedBlock:
        capacity = _size_class(nbytes)
        with self._lock:
            blocks = self._free.get(capacity)
            if blocks:
                self._cached_bytes -= capacity
                return blocks.pop()
            self.allocations += 1
        return PinnedBlock(self._allocate(capacity), capacity)

    def release(self, block: PinnedBlock) -> None:
        with self._lock:
            if self._cached_bytes + block.capacity > self.max_cached_bytes:
                return  # drop it: the allocator frees the pinned memory
            self._free.setdefault(block.capacity, []).append(block)
            self._cached_bytes += block.capacity

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


_default_pool: PinnedBufferPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> PinnedBufferPool:
    """The process-wide pool, created on first use (only CUDA senders ever touch it)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = PinnedBufferPool()
        return _default_pool
