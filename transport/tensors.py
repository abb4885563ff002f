"""Tensors to and from wire frames.

A tensor becomes a *descriptor* (a small list that travels inside the msgpack header) plus raw
buffers that travel as frames of their own. Nothing here touches a socket.

Dense descriptor::

    ["dense", dtype, shape, strides | None, frame_index, nbytes, device, requires_grad]

``strides`` is set when the tensor is a dense permutation of its memory (a transpose, say):
those bytes go out as they lie, without a copy, and the receiver rebuilds the same strides.
It is also set for an expanded tensor (dims of stride 0): the memory it repeats goes, once,
and the receiver rebuilds the same expanded view. Any other non-contiguous view (one with
gaps, as ``narrow`` makes) keeps its strides as torch's RPC does: the memory from its first
element to its last travels, never the rest of its storage; except that, as torch's, a view
of a storage of 8 KiB or more that covers less than half of it is compacted first, so only
the bytes it covers travel, and arrives contiguous.

Sparse COO descriptor::

    ["sparse_coo", shape, indices_descriptor, values_descriptor, coalesced, requires_grad]

Decoding validates every field against the frames it was given and raises
:class:`RemoteProtocolError` for anything inconsistent, so a hostile or broken peer can never
make us build a tensor that reads outside its buffer.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch

from . import cuda_ipc
from .errors import DeviceMapError, LocalProtocolError, RemoteProtocolError
from .staging import PinnedBufferPool, default_pool

# Every dtype whose tensors are plain bytes in CPU memory (quantized dtypes carry scales and
# zero points, so they are not plain bytes and are refused). Looked up by name so that a torch
# without one of the newer dtypes still imports this module.
_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
)
DTYPES_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in _DTYPE_NAMES if hasattr(torch, name)
}
NAMES_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES_BY_NAME.items()}

MAX_DIMS = 64  # torch's own limit on tensor dimensions
DEFAULT_COPY_THRESHOLD = 1 << 16  # below this a buffer is copied into the frame (pyzmq's default)

DENSE = "dense"
SPARSE_COO = "sparse_coo"

DeviceMap = Union[None, Mapping[Any, Any], Callable[[torch.device], Any]]

Buffer = Union[bytes, bytearray, memoryview, "ctypes.Array[ctypes.c_ubyte]"]


_CPU = torch.device("cpu")
_STRIDED, _SPARSE_COO = torch.strided, torch.sparse_coo
_COMPLEX_NAMES = frozenset(name for name, dtype in DTYPES_BY_NAME.items() if dtype.is_complex)

# --------------------------------------------------------------------------------------- send


def _export_memory(address: int, nbytes: int, owner: object) -> ctypes.Array:
    """A buffer-protocol object over ``nbytes`` at ``address`` that keeps ``owner`` alive.

    torch tensors do not export the buffer protocol themselves; ctypes arrays do, and ZeroMQ's
    zero-copy send holds a reference to the object it sends until the bytes are gone.
    """
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    array._owner = owner  # type: ignore[attr-defined]  # ctypes arrays take attributes; this pins the owner
    return array


def adopt_torch_thread_settings() -> None:
    """Run first on a thread we start that may run torch ops (handlers, RPC calls).

    A thread started from Python keeps OpenMP's default (a thread per core) until torch
    initialises it from ``torch.set_num_threads``'s setting, which PyTorch's own threads do
    when they start (``at::init_num_threads``); ``torch.get_num_threads()`` runs that
    initialisation. Without it, after ``torch.set_num_threads(1)``, each op of a compute-bound
    RPC call forked a team of OpenMP threads competing for the cores: 15-18 ms a call against
    3.7-5.3 ms with it, on 2 vCPUs (TensorPipe's pool threads, which skip it: 15-17 ms)."""
    torch.get_num_threads()


def as_buffer(tensor: torch.Tensor) -> Buffer:
    """The bytes of a contiguous CPU tensor as a buffer-protocol object, without a copy (the
    object keeps the tensor alive). For hashing, writing to files, or handing to sockets."""
    if not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError("as_buffer needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    return _export_memory(tensor.data_ptr(), nbytes, tensor) if nbytes else b""


def _dense_span(tensor: torch.Tensor) -> int | None:
    """Element count of the memory span if ``tensor`` covers it densely without overlap (any
    permutation of dims), else None. Such tensors can be sent as they lie in memory."""
    dims = [(stride, size) for size, stride in zip(tensor.shape, tensor.stride()) if size != 1]
    dims.sort()
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return expected


def _unexpanded(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """An expanded tensor (some dims of stride 0, as ``expand`` makes them, and the gradient
    of a ``sum``) as the memory it repeats, dense, and the strides that repeat it: the
    receiver rebuilds the same expanded view over that memory, so ``ones(1).expand(n)``
    sends one element, not n."""
    shape, stride = tensor.shape, tensor.stride()
    if not any(stride):  # one element repeated (a full sum's gradient, every backward's first)
        return tensor.as_strided([1] * len(stride), stride), list(stride)
    repeated = tensor.as_strided([1 if step == 0 else size for size, step in zip(shape, stride)], stride)
    if _dense_span(repeated) is None:
        repeated = repeated.detach().contiguous()
    return repeated, [0 if step == 0 else kept for step, kept in zip(stride, repeated.stride())]


# torch's rule (rpc/utils.cpp) for a view that is not dense: it is copied compact (arriving
# contiguous) only when its storage is big and mostly not the view's; else its layout travels.
_MIN_RECOPY_BYTES = 8 * 1024
_MIN_RECOPY_MULTIPLE = 2


def _keeps_layout(view: torch.Tensor) -> bool:
    """Whether a view with gaps travels with its strides (see above), as torch's would."""
    storage = view.untyped_storage().nbytes()
    return storage < _MIN_RECOPY_BYTES or storage < view.nbytes * _MIN_RECOPY_MULTIPLE


def _memory(tensor: torch.Tensor) -> torch.Tensor:
    """The memory a dense tensor (contiguous, or a permutation of its memory: ``_dense_span``)
    lies in, as a flat tensor in address order: the bytes that go, whatever the device."""
    return tensor.as_strided((tensor.numel(),), (1,))


class TensorEncoder:
    """Collects the buffers of the tensors of one message, in frame order.

    ``add`` returns a descriptor and appends the tensor's bytes to ``buffers``. CUDA tensors are
    copied to pinned staging buffers without blocking; ``finish`` waits for those copies (their
    CUDA events) and returns the buffers ready to hand to ZeroMQ.
    """

    def __init__(
        self,
        first_frame_index: int = 0,
        copy_threshold: int = DEFAULT_COPY_THRESHOLD,
        pinned_pool: PinnedBufferPool | None = None,
        collected: list | None = None,
        placement: Callable[[torch.device], str] | None = None,
        cuda_ipc: bool = False,
    ):
        self.buffers: list[Buffer] = []
        # Whether the receiver opens CUDA tensors in our GPU memory (transport/cuda_ipc.py)
        # instead of receiving them staged through host memory.
        self._cuda_ipc = cuda_ipc
        # Where each CUDA tensor is to land at the receiver (a device map applied by the
        # sender); None: on the device of the same name.
        self._placement = placement
        # The message's tensors as given (the autograd layer needs them: which require grad).
        self.collected = collected
        self._first = first_frame_index
        self._copy_threshold = copy_threshold
        self._pinned_pool = pinned_pool
        self._pending_events: list[Any] = []

    def add(self, tensor: torch.Tensor) -> list:
        if self.collected is not None:
            self.collected.append(tensor)
        layout = tensor.layout
        if layout is _STRIDED:
            return self._add_dense(tensor)
        if layout is _SPARSE_COO:
            return [
                SPARSE_COO,
                list(tensor.shape),
                self._add_dense(tensor._indices()),
                self._add_dense(tensor._values()),
                bool(tensor.is_coalesced()),
                tensor.requires_grad,
            ]
        raise LocalProtocolError(f"cannot send a tensor with layout {layout}")

    def _add_dense(self, tensor: torch.Tensor) -> list:
        name = NAMES_BY_DTYPE.get(tensor.dtype)
        if name is None:
            raise LocalProtocolError(f"cannot send a tensor of dtype {tensor.dtype}")
        requires_grad = tensor.requires_grad
        data = tensor
        if name in _COMPLEX_NAMES and (data.is_conj() or data.is_neg()):
            data = data.detach().resolve_conj().resolve_neg()
        contiguous = data.is_contiguous()
        expanded = not contiguous and 0 in data.stride() and data.numel() > 1
        # Small CUDA tensors go staged (cuda_ipc.MIN_BYTES), and so does an expanded one (the
        # gradient of a sum), as the memory it repeats: a snapshot for CUDA IPC would be the
        # whole expansion, and arrive contiguous.
        if self._cuda_ipc and data.is_cuda and data.nbytes >= cuda_ipc.MIN_BYTES and not expanded:
            descriptor = cuda_ipc.share(data, name, self._cuda_target(data.device))
            if descriptor is not None:
                return descriptor
        shape = list(data.shape)  # the receiver's view; ``data`` becomes the memory that goes
        strides: list[int] | None = None
        if not contiguous:
            # The receiver rebuilds the same strides over the same memory, on CUDA too (as
            # TensorPipe does): a computation there sees the layout it would see here. An
            # expanded gradient that arrived compacted made cuBLAS sum in another order, and
            # distributed gradients differed from local autograd's in their last bits (H200).
            # Expanded first: _unexpanded keeps the layout of any of them (of a dense permutation
            # with a size-1 dim of stride 0 too), and most never have a dense span to look for.
            if expanded:
                if data.is_cpu and not any(data.stride()):
                    # One element repeated (a full sum's gradient, every backward's first): it
                    # goes from where it lies, with no view made over it (a torch op, which
                    # lets the GIL go: a hand-over when threads wait for it).
                    nbytes = data.element_size()
                    return self._entry(self._cpu_buffer(data, nbytes), name, shape, [0] * len(shape), nbytes, "cpu",
                                       requires_grad)
                data, strides = _unexpanded(data)
            elif _dense_span(data) is not None:
                strides = list(data.stride())  # sent as it lies in memory, no copy on CPU
            elif _keeps_layout(data):
                # A view with gaps (a narrow): the memory from its first element to its last
                # goes as it lies, and the receiver rebuilds the same strides over it.
                strides = list(data.stride())
                data = data.as_strided((_strided_span(shape, strides),), (1,))
            else:
                # Compacts (only the covered bytes are kept); CUDA tensors are compacted on
                # their device, so the staging copy is one flat device-to-host transfer.
                data = data.detach().contiguous()
        nbytes = data.nbytes
        if data.is_cpu:
            device = "cpu"
            buffer = self._cpu_buffer(data, nbytes)
        elif data.is_cuda:
            device = self._cuda_target(data.device)
            buffer = self._stage_cuda(data.detach(), nbytes)
        else:
            raise LocalProtocolError(f"cannot send a tensor on device {data.device}")
        return self._entry(buffer, name, shape, strides, nbytes, device, requires_grad)

    def _entry(self, buffer: Buffer, name: str, shape: list, strides: list | None, nbytes: int, device: str,
               requires_grad: bool) -> list:
        """The descriptor of a dense tensor whose memory goes as ``buffer`` (the next frame)."""
        index = self._first + len(self.buffers)
        self.buffers.append(buffer)
        return [DENSE, name, shape, strides, index, nbytes, device, requires_grad]

    def _cuda_target(self, device: torch.device) -> str:
        """Where a CUDA tensor on ``device`` is to land at the receiver."""
        return self._placement(device) if self._placement is not None else str(device)

    def _cpu_buffer(self, data: torch.Tensor, nbytes: int) -> Buffer:
        if nbytes < self._copy_threshold:
            # A snapshot: later writes to the tensor cannot reach the wire.
            return ctypes.string_at(data.data_ptr(), nbytes) if nbytes else b""
        return _export_memory(data.data_ptr(), nbytes, data)

    def _stage_cuda(self, data: torch.Tensor, nbytes: int) -> Buffer:
        if nbytes == 0:
            return b""
        pool = self._pinned_pool or default_pool()
        block = pool.acquire(nbytes)
        source = _memory(data).view(torch.uint8)
        with torch.cuda.device(data.device):
            block.tensor[:nbytes].copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending_events.append(event)
        view = _export_memory(block.tensor.data_ptr(), nbytes, block)
        # The block goes back to the pool when ZeroMQ drops its last reference to the frame.
        weakref.finalize(view, pool.release, block)
        return view

    def finish(self) -> list[Buffer]:
        if self._pending_events:
            for event in self._pending_events:
                event.synchronize()
            self._pending_events.clear()
        return self.buffers


# ------------------------------------------------------------------------------------ receive


def resolve_device(source: str, device_map: DeviceMap) -> torch.device:
    """Where a tensor that was on ``source`` at the sender goes here.

    Without a map, CPU stays on CPU and ``cuda:i`` goes to ``cuda:i`` when this process has it.
    """
    if source == "cpu" and device_map is None:
        return _CPU
    try:
        src = torch.device(source)
    except (RuntimeError, TypeError) as exc:
        raise RemoteProtocolError(f"invalid device {source!r} in tensor descriptor") from exc
    if src.type not in ("cpu", "cuda"):  # only these are ever sent: a corrupt descriptor
        raise RemoteProtocolError(f"tensor descriptor names device {source!r}: only cpu and cuda tensors travel")
    target: Any = src
    if callable(device_map):
        target = device_map(src)
    elif device_map is not None:
        for key in (src, str(src)):
            if key in device_map:
                target = device_map[key]
                break
    target = torch.device(target)
    if target.type == "cuda":
        index = target.index if target.index is not None else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise DeviceMapError(
                f"received a tensor for {target} (sent from {src}) but this process has "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices; "
                "set a device map that names a device this process has"
            )
    elif target.type != "cpu":
        raise DeviceMapError(f"cannot place a received tensor on {target}")
    return target


class TensorDecoder:
    """Rebuilds the tensors of one message from its buffer frames, checking every descriptor and
    that each frame is used exactly once."""

    def __init__(
        self, frames: Sequence[Any], first_frame_index: int = 0, device_map: DeviceMap = None,
        collected: list | None = None,
    ):
        self.collected = collected  # every tensor rebuilt, in order (see TensorEncoder)
        self._frames = frames
        self._first = first_frame_index
        self._used = [False] * len(frames)
        self._device_map = device_map
        self.taken = 0  # frames used so far

    def tensor(self, descriptor: Any) -> torch.Tensor:
        if not isinstance(descriptor, list) or not descriptor:
            raise RemoteProtocolError(f"tensor descriptor must be a non-empty list, got {descriptor!r:.80}")
        kind = descriptor[0]
        if kind == DENSE:
            tensor = self._dense(descriptor)
        elif kind == SPARSE_COO:
            tensor = self._sparse(descriptor)
        elif kind == cuda_ipc.CUDA_IPC:
            tensor = self._shared_cuda(descriptor)
        else:
            raise RemoteProtocolError(f"unknown tensor kind {kind!r:.40}")
        if self.collected is not None:
            self.collected.append(tensor)
        return tensor

    def check_all_used(self) -> None:
        if self.taken == len(self._frames):  # each frame is taken at most once (_take_frame)
            return
        unused = [self._first + i for i, used in enumerate(self._used) if not used]
        if unused:
            raise RemoteProtocolError(
                f"message has {len(unused)} buffer frame(s) no tensor descriptor refers to "
                f"(frames {unused[:8]})"
            )

    def _dense(self, d: list) -> torch.Tensor:
        return self.build_dense(parse_dense(d))

    def dense(self, spec: tuple) -> torch.Tensor:
        """The tensor of a dense descriptor :func:`parse_dense` checked (collected, as
        :meth:`tensor` does)."""
        tensor = self.build_dense(spec)
        if self.collected is not None:
            self.collected.append(tensor)
        return tensor

    def build_dense(self, spec: tuple) -> torch.Tensor:
        dtype, shape, strides, index, nbytes, device, requires_grad, itemsize, span = spec
        frame = self._take_frame(index)
        if type(frame) is memoryview:  # from a shared-memory ring
            buffer = frame
        else:
            buffer = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if buffer.nbytes != nbytes:
            raise RemoteProtocolError(f"frame {index} has {buffer.nbytes} bytes, descriptor says {nbytes}")
        target = _CPU if device == "cpu" and self._device_map is None else resolve_device(device, self._device_map)
        tensor = _tensor_from_buffer(buffer, dtype, itemsize, span)
        if target.type != "cpu":
            # The memory first, then the view over it there: ``to`` of a strided view would
            # compact it (an expanded one to its full size).
            tensor = tensor.to(target)
        # In place: a view would be a second tensor object over the first, each made and freed
        # through torch ops that let the GIL go several times (a hand-over when threads wait).
        if strides is not None:
            tensor.as_strided_(shape, strides)
        elif len(shape) != 1:
            tensor.resize_(shape)  # (as many elements: the memory stays as it is)
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _shared_cuda(self, d: list) -> torch.Tensor:
        dtype, shape, device, requires_grad, shared, uuid = parse_cuda_ipc(d)
        tensor = cuda_ipc.open_copy(dtype, shape, shared, uuid, resolve_device(device, self._device_map))
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _part(self, d: Any) -> torch.Tensor | None:
        """A sparse tensor's indices or values (a dense or CUDA IPC descriptor); None if not one."""
        if isinstance(d, list) and d[:1] == [DENSE]:
            return self._dense(d)
        if isinstance(d, list) and d[:1] == [cuda_ipc.CUDA_IPC]:
            return self._shared_cuda(d)
        return None

    def _sparse(self, d: list) -> torch.Tensor:
        if len(d) != 6:
            raise RemoteProtocolError(f"sparse tensor descriptor has {len(d)} fields, expected 6")
        _, shape, indices_d, values_d, coalesced, requires_grad = d
        shape = _check_dims("shape", shape)
        if not isinstance(coalesced, bool) or not isinstance(requires_grad, bool):
            raise RemoteProtocolError("sparse descriptor has malformed flags")
        indices, values = self._part(indices_d), self._part(values_d)
        if indices is None or values is None:
            raise RemoteProtocolError("sparse descriptor must hold dense indices and values descriptors")
        if indices.dtype != torch.int64 or indices.dim() != 2 or indices.requires_grad:
            raise RemoteProtocolError(f"sparse indices must be a 2-d int64 tensor, got {indices.dtype} {list(indices.shape)}")
        sparse_dims = indices.shape[0]
        nnz = indices.shape[1]
        if values.dim() < 1 or values.shape[0] != nnz or sparse_dims + values.dim() - 1 != len(shape):
            raise RemoteProtocolError(
                f"sparse values {list(values.shape)} and indices {list(indices.shape)} do not fit shape {shape}"
            )
        if list(values.shape[1:]) != shape[sparse_dims:]:
            raise RemoteProtocolError(f"sparse values {list(values.shape)} do not fit shape {shape}")
        try:
            # check_invariants makes torch verify every index is inside the shape (a bad index
            # would be an out-of-bounds read later) and that a "coalesced" flag is true (a false
            # one makes torch return wrong sums).
            tensor = torch.sparse_coo_tensor(
                indices, values.detach(), shape, is_coalesced=coalesced, check_invariants=True
            )
        except RuntimeError as exc:
            raise RemoteProtocolError(f"invalid sparse tensor: {exc}") from None
        if requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def _take_frame(self, index: Any):
        local = index - self._first if isinstance(index, int) else -1
        if not 0 <= local < len(self._frames):
            raise RemoteProtocolError(
                f"tensor descriptor refers to frame {index!r}, message has frames "
                f"{self._first}..{self._first + len(self._frames) - 1}"
            )
        if self._used[local]:
            raise RemoteProtocolError(f"frame {index} is referred to by more than one tensor descriptor")
        self._used[local] = True
        self.taken += 1
        return self._frames[local]


_ITEMSIZE: dict[torch.dtype, int] = {dtype: dtype.itemsize for dtype in DTYPES_BY_NAME.values()}


def parse_dense(d: Any) -> tuple:
    """Check a dense descriptor on its own (its frame is checked when the tensor is built):
    ``(dtype, shape, strides, frame index, nbytes, device, requires_grad, itemsize, span)``.
    It depends on nothing but the descriptor, so a decoder may keep it for descriptors that
    come again (the codec does, by their bytes)."""
    if type(d) is not list or len(d) != 8:
        raise RemoteProtocolError(f"dense tensor descriptor has {len(d) if type(d) is list else d!r:.40} fields, expected 8")
    _, name, shape, strides, index, nbytes, device, requires_grad = d
    dtype = _check_element(name, device, requires_grad)
    shape = _check_dims("shape", shape)
    numel = math.prod(shape)
    itemsize = _ITEMSIZE[dtype]
    if strides is None:
        span = numel
    else:
        strides = _check_dims("strides", strides)
        if len(strides) != len(shape):
            raise RemoteProtocolError(f"strides {strides} do not match shape {shape}")
        span = _strided_span(shape, strides)
    if not isinstance(nbytes, int) or nbytes != span * itemsize:
        raise RemoteProtocolError(
            f"tensor of dtype {name} shape {shape} needs {span * itemsize} bytes, descriptor says {nbytes!r}"
        )
    if type(index) is not int:
        raise RemoteProtocolError(f"tensor descriptor refers to frame {index!r:.40}")
    return dtype, shape, strides, index, nbytes, device, requires_grad, itemsize, span


def parse_cuda_ipc(d: Any) -> tuple:
    """Check a CUDA IPC descriptor (transport/cuda_ipc.py):
    ``(dtype, shape, device, requires_grad, shared, uuid)``."""
    if type(d) is not list or len(d) != 7:
        raise RemoteProtocolError(f"CUDA IPC tensor descriptor has {len(d) if type(d) is list else d!r:.40} fields, expected 7")
    _, name, shape, device, requires_grad, shared, uuid = d
    dtype = _check_element(name, device, requires_grad)
    shape = _check_dims("shape", shape)
    cuda_ipc.check_handle(shared, uuid, math.prod(shape) * _ITEMSIZE[dtype])
    return dtype, shape, device, requires_grad, shared, uuid


def _check_element(name: Any, device: Any, requires_grad: Any) -> torch.dtype:
    """The dtype a descriptor names, after the checks of its dtype, device and requires_grad
    fields that every kind of descriptor takes."""
    dtype = DTYPES_BY_NAME.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise RemoteProtocolError(f"unknown dtype {name!r:.40}")
    if not isinstance(requires_grad, bool) or not isinstance(device, str):
        raise RemoteProtocolError("tensor descriptor has a malformed device or requires_grad field")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise RemoteProtocolError(f"requires_grad set on a tensor of dtype {name}")
    return dtype


def _check_dims(what: str, dims: Any) -> list[int]:
    if not isinstance(dims, list) or len(dims) > MAX_DIMS:
        raise RemoteProtocolError(f"tensor {what} must be a list of at most {MAX_DIMS} ints, got {dims!r:.80}")
    for dim in dims:
        if type(dim) is not int or dim < 0 or dim > 1 << 62:
            raise RemoteProtocolError(f"tensor {what} holds an invalid value {dim!r:.40}")
    return dims


def _strided_span(shape: list[int], strides: list[int]) -> int:
    if 0 in shape:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))


def _tensor_from_buffer(buffer: memoryview, dtype: torch.dtype, itemsize: int, count: int) -> torch.Tensor:
    """A 1-d tensor of ``count`` items over ``buffer`` without copying when the memory is
    writable and aligned for the dtype; the tensor keeps the buffer (and its frame) alive."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    writable = bytearray(buffer) if buffer.readonly else buffer
    tensor = torch.frombuffer(writable, dtype=dtype)
    if itemsize > 1 and tensor.data_ptr() % itemsize:
        tensor = tensor.clone()  # ZeroMQ may hand small frames at any offset of its receive buffer
    return tensor
