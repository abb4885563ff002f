"""Pools of host buffers, reused instead of allocated for every big message.

* Pinned buffers for CUDA tensors: a device-to-host copy only runs asynchronously into
  page-locked memory, and pinning memory is slow (it is a system call that locks pages).
* Plain buffers that lent tensors are read into (transport/lending.py): a fresh buffer
  faults in every page on first touch, ~1-2.5 us a page on the development VM, so a fresh
  16 MiB buffer costs 4-10 ms before a byte is copied, and glibc serves buffers of 32 MiB and
  more with a fresh mapping every time.

Sizes are rounded up to a power of two and a released buffer is reused by the next message
of that size class; idle buffers are bounded in bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

_MIN_CLASS = 1 << 16


def _allocate_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _allocate_plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _size_class(nbytes: int, smallest: int = _MIN_CLASS) -> int:
    size = smallest
    while size < nbytes:
        size <<= 1
    return size


@dataclass(eq=False)
class Block:
    """One host buffer (a flat uint8 tensor of ``capacity`` bytes) owned by a pool."""

    tensor: torch.Tensor
    capacity: int


class BufferPool:
    """A thread-safe pool of host buffers made by ``allocate(nbytes)``, bounded by
    ``max_cached_bytes`` of idle buffers (buffers in use are not bounded: a message needs what
    it needs); sizes are rounded up to powers of two from ``smallest``."""

    def __init__(self, allocate: Callable[[int], torch.Tensor], max_cached_bytes: int, smallest: int = _MIN_CLASS):
        self.max_cached_bytes = max_cached_bytes
        self._allocate = allocate
        self._smallest = smallest
        # Reentrant: release() runs from a weakref finalizer, which may fire on a thread that
        # is inside acquire() (a garbage collection there).
        self._lock = threading.RLock()
        self._free: dict[int, list[Block]] = {}
        self._cached_bytes = 0
        self.allocations = 0  # buffers allocated, for tests and tuning

    def acquire(self, nbytes: int) -> Block:
        capacity = _size_class(nbytes, self._smallest)
        with self._lock:
            blocks = self._free.get(capacity)
            if blocks:
                self._cached_bytes -= capacity
                return blocks.pop()
            self.allocations += 1
        return Block(self._allocate(capacity), capacity)

    def release(self, block: Block) -> None:
        with self._lock:
            if self._cached_bytes + block.capacity > self.max_cached_bytes:
                return  # drop it: the allocator frees its memory
            self._free.setdefault(block.capacity, []).append(block)
            self._cached_bytes += block.capacity

    def close(self) -> None:
        """Drop every idle buffer (their memory goes back to the allocator), and every buffer
        released from now on."""
        with self._lock:
            self.max_cached_bytes = 0
            self._free.clear()
            self._cached_bytes = 0

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes


class PinnedBufferPool(BufferPool):
    """Page-locked buffers, for staging CUDA tensors on the host."""

    def __init__(self, max_cached_bytes: int = 1 << 30, allocate: Callable[[int], torch.Tensor] | None = None):
        super().__init__(allocate or _allocate_pinned, max_cached_bytes)


def plain_pool(max_cached_bytes: int, smallest: int = _MIN_CLASS) -> BufferPool:
    """A pool of ordinary (pageable) buffers."""
    return BufferPool(_allocate_plain, max_cached_bytes, smallest)


_default_pool: PinnedBufferPool | None = None
_default_pool_lock = threading.Lock()


def default_pool() -> PinnedBufferPool:
    """The process-wide pool, created on first use (only CUDA senders ever touch it)."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = PinnedBufferPool()
        return _default_pool
