"""CUDA tensors between processes of one host through CUDA IPC: the receiver copies the
bytes straight out of the sender's GPU memory, with no trip through host memory.

The other way, staging (transport/tensors.py), copies a tensor to a pinned host buffer, sends
those bytes and copies them to the GPU again on the receiver: three copies, two of them
over PCIe, and a wait for the first before the message can leave. Measured on an H100 with
torch 2.11, 64 MiB round trips took 49 ms that way against 2.1 ms for TensorPipe's CUDA IPC
channel (tools/bench_cuda.py).

The mechanism is torch.multiprocessing's (``UntypedStorage._share_cuda_`` and
``_new_shared_cuda``), carried in a tensor descriptor instead of a pickle:

* The sender snapshots the tensor into a fresh allocation (a device-to-device copy, ~1 TB/s)
  and shares that: later in-place writes to the tensor cannot reach the receiver, and the
  allocation is shared once (sharing wraps a storage's memory in a new reference-counted
  record every time; a parameter sent every step would pile them up). The sender drops the
  snapshot at once; PyTorch's allocator keeps its memory until the receiver's reference count
  says it is done with it. Sharing records an event on the sender's current stream, after the
  copy, so the sender never waits for the GPU.
* The receiver opens the allocation (its stream waits for the sender's event), copies the
  tensor onto the device it is mapped to, and drops the shared storage: its deleter waits for
  the copy and gives the memory back to the sender.

Only for peers on this host (the endpoint knows which: they read each other's memory,
transport/lending.py) and never within one process (CUDA cannot open its own handles). The
descriptor names the GPU by its UUID as well as by the sender's index: processes whose
CUDA_VISIBLE_DEVICES differ number the same GPU differently, and the receiver opens the
handle on its own index of that GPU.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

import torch

from .errors import DeviceMapError, RemoteProtocolError

CUDA_IPC = "cuda_ipc"

# Smaller CUDA tensors go staged even to a peer that could open our memory. Each tensor sent
# by IPC costs the receiver a handle to open and close and the sender an event: measured on an
# H200 (tools/bench_cuda.py, torch 2.11), a 4 KiB round trip took 1,282 us by IPC against 787
# staged, a one-hop forward+backward of 2-element tensors 3,995 against 2,964; staging costs
# about 270 us more per MiB each way (1 MiB: 1,336 staged, 1,238 by IPC): they cross near 1 MiB.
MIN_BYTES = 1 << 20

# torch's bookkeeping behind ``_share_cuda_`` (the files of reference counters) is not
# thread-safe: two pool threads sharing at once crashed a worker (SIGSEGV in ``_share_cuda_``,
# H100, torch 2.11). Sharing, and freeing what was shared, happen under this lock.
_share_lock = threading.Lock()

# The lock cannot cover the other thread that touches that bookkeeping: any thread whose CUDA
# allocation finds no cached block runs the allocator's free-memory callbacks, torch's
# CudaIPCCollect among them, and that one drops the current file of counters when its "limbo"
# (shared blocks freed by the sender but still open on a receiver) is empty and no counter of
# the file is in use, while ``_share_cuda_`` on another thread may be using the file between
# taking it under torch's mutex and counting its offset as used (torch/csrc/CudaIPCTypes.cpp,
# GetNewRefCountedSentData): a null dereference. It crashed a worker of
# test_dist_autograd_sync_streams_on_one_gpu_cuda_ipc (H200, torch 2.11; main thread
# allocating, a pool thread sharing an answer). So the limbo is never empty: a one-element
# block is shared and dropped, and as no receiver ever opens it, its counter stays 1 and it
# stays in the limbo. Its own share is exposed to the same race (the first share of a process
# makes the file), so it is made while nothing else runs, if the user lets us: ``prepare``, at
# init_rpc for workers whose device maps send CUDA tensors; else before the first share
# (there it crashed 5 runs of 5 of that test). Its counter is released at exit, which lets
# torch free it and keeps its "terminated before all shared CUDA tensors released" warning
# away. Left: torch counts a file's offsets in use without atomics (a share on one thread, a
# block freed on another), a race we cannot reach from here.
_limbo_anchor: tuple | None = None


def share(data: torch.Tensor, name: str, device: str) -> list | None:
    """The descriptor of CUDA tensor ``data`` (dtype ``name``) for a receiver in another
    process of this host, to land on ``device`` there; None when it cannot be shared (memory
    PyTorch's caching allocator did not make), so the caller stages it instead."""
    snapshot = data.detach().clone(memory_format=torch.contiguous_format)
    shape = list(snapshot.shape)
    with _share_lock:
        _anchor_the_limbo(snapshot)
        try:
            shared = snapshot.untyped_storage()._share_cuda_()
        except (RuntimeError, AttributeError):
            return None
        finally:
            del snapshot  # (under the lock: freeing it updates the same bookkeeping)
    (index, handle, storage_bytes, offset_bytes, counter_handle, counter_offset, event_handle, event_sync) = shared
    return [CUDA_IPC, name, shape, device, data.requires_grad,
            [index, handle, storage_bytes, offset_bytes, counter_handle, counter_offset, event_handle, bool(event_sync)],
            _device_uuid(index)]


def prepare(device: torch.device) -> None:
    """Make the block that keeps torch's limbo occupied now (``_limbo_anchor``), on CUDA
    ``device``: for a process about to share CUDA tensors, while its other threads do not yet
    allocate CUDA memory. Initializes CUDA. Idempotent."""
    with _share_lock:
        _anchor_the_limbo(torch.empty(0, device=device))


def _anchor_the_limbo(like: torch.Tensor) -> None:
    """Put a block that no receiver will open into torch's limbo of shared blocks, for the
    process's life (see ``_limbo_anchor``), unless one is there; the caller holds
    ``_share_lock``."""
    global _limbo_anchor
    if _limbo_anchor is not None:
        return
    block = like.new_empty((1,))
    try:
        shared = block.untyped_storage()._share_cuda_()
    except (RuntimeError, AttributeError):
        return  # memory torch cannot share: the share that follows fails the same way
    finally:
        del block  # freed with its counter at 1: into the limbo
    _limbo_anchor = (shared[4], shared[5])
    atexit.register(_release_limbo_anchor)


def _release_limbo_anchor() -> None:
    """At exit: give the anchor's counter back, so that torch frees the block."""
    global _limbo_anchor
    if _limbo_anchor is not None:
        counter_handle, counter_offset = _limbo_anchor
        _limbo_anchor = None
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(counter_handle, counter_offset)
        except RuntimeError:
            pass  # torch only warns at exit about what it could not free


_uuids: dict[int, str | None] = {}
_local_indices: dict[str | None, int] | None = None


def _device_uuid(index: int) -> str | None:
    """The UUID of this process's cuda:``index`` (None where torch does not tell it)."""
    if index not in _uuids:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        _uuids[index] = str(uuid) if uuid is not None else None
    return _uuids[index]


def _local_index(uuid: str | None, index: int) -> int:
    """This process's index of the GPU that the sender calls cuda:``index``."""
    global _local_indices
    if not torch.cuda.is_available():
        raise DeviceMapError(f"received a CUDA IPC handle of the sender's cuda:{index}, but this process has no CUDA device")
    if uuid is None:  # the sender could not tell: trust the index
        if index >= torch.cuda.device_count():
            raise DeviceMapError(f"received a CUDA IPC handle of cuda:{index}, which this process does not have")
        return index
    if _local_indices is None:
        _local_indices = {_device_uuid(i): i for i in range(torch.cuda.device_count())}
    local = _local_indices.get(uuid)
    if local is None:
        raise DeviceMapError(f"received a CUDA IPC handle of the sender's cuda:{index} ({uuid}), a GPU this process does not see")
    return local


def check_handle(shared: Any, uuid: Any, nbytes: int) -> None:
    """Check the handle part of a CUDA IPC descriptor (the rest is checked with the other
    descriptors, transport/tensors.py) for a tensor of ``nbytes``."""
    kinds: tuple[type | tuple[type, ...], ...] = (int, bytes, int, int, bytes, int, (bytes, type(None)), bool)
    if type(shared) is not list or len(shared) != len(kinds) or not all(isinstance(v, k) for v, k in zip(shared, kinds)):
        raise RemoteProtocolError(f"malformed CUDA IPC handle in tensor descriptor: {shared!r:.120}")
    if not 0 < nbytes <= shared[2] or shared[3] < 0:
        raise RemoteProtocolError(f"CUDA IPC tensor of {nbytes} bytes in a shared allocation of {shared[2]} bytes")
    if uuid is not None and not isinstance(uuid, str):
        raise RemoteProtocolError(f"malformed GPU UUID in CUDA IPC tensor descriptor: {uuid!r:.60}")


def open_copy(dtype: torch.dtype, shape: list, shared: list, uuid: str | None, target: torch.device) -> torch.Tensor:
    """The shared tensor, copied onto ``target``; the sender's memory is released after."""
    index = _local_index(uuid, shared[0])
    with torch.cuda.device(index):
        try:
            storage = torch.UntypedStorage._new_shared_cuda(index, *shared[1:])
        except RuntimeError as exc:
            raise DeviceMapError(
                f"cannot open the sender's CUDA memory here ({exc}); give both workers cuda_ipc=False "
                "where processes of one host cannot share GPU memory"
            ) from exc
        source = torch.empty(0, dtype=dtype, device=torch.device("cuda", index)).set_(storage, 0, shape)  # type: ignore[call-overload]  # (stubs lack this form)
        tensor = source.to(target, copy=True)  # on this thread's current stream, after the sender's event
        del source, storage  # the deleter waits for that stream, then gives the memory back
    return tensor
