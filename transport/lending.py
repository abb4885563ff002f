"""Same-host single-copy transfer of big buffers: *lending*, with cross-memory attach.

A socket copies every byte twice, into the kernel and out of it, in chunks, with a system call
or more per chunk. Between processes of one host (and one pid namespace), Linux lets a process
read another's memory directly with ``process_vm_readv`` ("cross-memory attach", one copy by
the kernel, as TensorPipe's ``cma`` channel does). So for a big buffer to a peer on the same
host the sender *lends* it: the message carries the buffer's address and size instead of its
bytes, the receiver reads them straight into a tensor of its own, and says so (LEND_RELEASE);
the sender keeps the buffer alive until then, or until the peer is lost.

Measured on the 2-vCPU VM this project runs on: reading 16 MiB this way takes ~3 ms into
memory the allocator reuses; a 16 MiB ``rpc_sync`` round trip through a loopback socket took
18-20 ms, and 8-10 ms lent (docs/transport.md, "Lending").

Who may read whose memory is settled once per connection, with a challenge: each HELLO carries
the sender's host key, pid and 16 random bytes (the *challenge*). A peer on the same host puts
our challenge into a buffer of its own and tells us where (LEND_OFFER); we read it from the pid
its HELLO named and compare. Only the process that received the challenge can have put it
there, so a peer cannot make us read a third process's memory by naming that process's pid.
We then keep a pidfd of the peer: a pid can be reused once its process exits, and a read is
only trusted if the pidfd shows the process still alive after it. On success we answer
LEND_READY, and from then on the peer lends us its big buffers.

Nothing here touches a socket: the endpoint runs the protocol (transport/endpoint.py).

Wire: a message with lent buffers has one more frame in front of its envelope,
``b"\\xc1" + msgpack([[frame_index, transfer_id, address, nbytes], ...])``, and an empty frame
where each lent buffer would be (``frame_index`` counts the buffer frames after the envelope
from 1, as tensor descriptors do). 0xc1 is the one byte msgpack never uses, so no envelope can
start with it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import msgpack
import torch

from .codec import _frame_buffer
from .errors import RemoteProtocolError
from .staging import BufferPool
from .tensors import as_buffer

LENT_MARK = 0xC1
_MARK_BYTE = bytes((LENT_MARK,))
CHALLENGE_BYTES = 16
# Smaller buffers go through the socket. Measured (rpc_sync round trips, lent / sent):
# 256 KiB 1.0-1.2 / 0.7-0.8 ms, 512 KiB even, 1 MiB 1.1-1.5 / 1.8-2.0 ms.
DEFAULT_LEND_MIN = 1 << 20
# Idle buffers kept for reading lent tensors into (EndpointOptions.lend_cache): enough for a
# few messages of tens of MiB each way.
DEFAULT_LEND_CACHE = 256 << 20


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_process_vm_readv() -> Callable | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_ssize_t
    function.argtypes = [
        ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
    ]
    return function


_process_vm_readv = _load_process_vm_readv()


def host_identity() -> str | None:
    """What two processes share when a pid means the same process to both: the boot (the
    same kernel) and the pid namespace. None where this cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def host_key() -> str | None:
    """``host_identity``, where this process can also read a peer's memory (None elsewhere)."""
    if _process_vm_readv is None or not hasattr(os, "pidfd_open"):
        return None
    return host_identity()


def read_memory(pid: int, address: int, nbytes: int, into: int) -> None:
    """Copy ``nbytes`` at ``address`` in process ``pid`` to ``into`` in ours. Raises OSError
    (EFAULT for an address the process has not mapped, EPERM where reading is not allowed,
    ESRCH when the process is gone). ctypes releases the GIL for the call."""
    # One call copies at most ~2 GiB (the kernel's MAX_RW_COUNT), and stops early at an
    # unmapped page: the next call from there then fails with EFAULT.
    offset = 0
    while offset < nbytes:
        local = _IoVec(into + offset, nbytes - offset)
        remote = _IoVec(address + offset, nbytes - offset)
        done = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)  # type: ignore[misc]  # (only where loaded)
        if done <= 0:
            code = ctypes.get_errno() if done < 0 else errno.EFAULT
            raise OSError(code, os.strerror(code))
        offset += done


def is_alive(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` still runs (a pidfd turns readable when it exits)."""
    poller = select.poll()  # not select(): descriptors above 1023 are common next to ZeroMQ
    poller.register(pidfd, select.POLLIN)
    return not poller.poll(0)


class Reader:
    """The right to read one peer's memory, won by the challenge (see the module's docstring).
    Its pidfd closes when the last reference goes. ``pool``: where the buffers it reads into
    come from and go back to (see ``read``); None: a new buffer for every read."""

    def __init__(self, pid: int, pidfd: int, pool: BufferPool | None = None):
        self.pid = pid
        self.pidfd = pidfd
        self.pool = pool

    @classmethod
    def verify(cls, pid: Any, address: Any, challenge: bytes, pool: BufferPool | None = None) -> "Reader":
        """Read the challenge at ``address`` in ``pid``; a Reader when it is there. Raises
        OSError or RemoteProtocolError with the reason otherwise."""
        if type(address) is not int or address <= 0:
            raise RemoteProtocolError(f"LEND_OFFER names address {address!r:.20}")
        pidfd = os.pidfd_open(pid)
        try:
            found = ctypes.create_string_buffer(len(challenge))
            read_memory(pid, address, len(challenge), ctypes.addressof(found))
            if found.raw != challenge or not is_alive(pidfd):
                raise RemoteProtocolError(f"the challenge is not where LEND_OFFER says (pid {pid}, address {address:#x})")
        except BaseException:
            os.close(pidfd)
            raise
        return cls(pid, pidfd, pool)

    def read(self, address: int, nbytes: int) -> memoryview:
        """A writable buffer holding the ``nbytes`` read at ``address`` in the peer.

        With a pool, the buffer is one of its blocks, which goes back to the pool when nothing
        refers to its memory any more (tensors decoded over it hold the returned memoryview,
        or views derived from it: a block is never reused while any of them lives). A reused
        block has its pages in memory already, where a fresh one faults each page in on first
        touch (see transport/staging.py): reads of the same size then cost the copy alone."""
        pool = self.pool
        if pool is None:
            data = torch.empty(nbytes, dtype=torch.uint8)
            self._read_into(address, nbytes, data)
            return memoryview(as_buffer(data))
        block = pool.acquire(nbytes)
        try:
            self._read_into(address, nbytes, block.tensor)
        except BaseException:
            pool.release(block)
            raise
        # The block goes back when the object that exports its memory goes: every memoryview
        # over it (slices and views of views too, whatever holds them) keeps that alive, where
        # a finalizer on one memoryview would fire while views derived from it still live.
        exporter = as_buffer(block.tensor)
        weakref.finalize(exporter, pool.release, block)
        return memoryview(exporter)[:nbytes]

    def _read_into(self, address: int, nbytes: int, data: torch.Tensor) -> None:
        read_memory(self.pid, address, nbytes, data.data_ptr())
        if not is_alive(self.pidfd):  # the pid may since name another process: trust nothing read
            raise OSError(errno.ESRCH, "the process exited")

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    # Not closed by the endpoint when the peer is lost: a frame being decoded may still read
    # through it, and a closed descriptor's number may be reused by then.
    __del__ = close


def encode_table(entries: list[list[int]]) -> bytes:
    """The frame that goes in front of the envelope of a message with lent buffers."""
    return _MARK_BYTE + msgpack.packb(entries)


def is_table(frame: Any) -> bool:
    """Whether a message's first frame is a lent-buffer table rather than an envelope."""
    # A received zmq.Frame keeps its bytes once made, and the envelope decoder wants them
    # anyway; other frames (from a shared-memory ring) are not copied for one byte.
    return _frame_buffer(frame)[:1] == _MARK_BYTE


def decode_table(frame: Any, buffer_frames: list) -> list[tuple[int, int, int | None, int]]:
    """``(frame_index, transfer_id, address, nbytes)`` of each lent buffer, checked against the
    message's buffer frames (those after the envelope); ``address`` is None for a buffer that
    comes over the bulk connection (transport/bulk.py: entries of three fields). Raises
    RemoteProtocolError."""
    try:
        entries = msgpack.unpackb(_frame_buffer(frame)[1:], use_list=True, raw=False)
    except Exception as exc:  # msgpack raises many types for garbage; all mean the same
        raise RemoteProtocolError(f"lent-buffer table is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(entries, list) or not entries:
        raise RemoteProtocolError("lent-buffer table must be a non-empty list")
    seen: set[int] = set()
    checked = []
    for entry in entries:
        if not isinstance(entry, list) or len(entry) not in (3, 4) or not all(type(v) is int and v >= 0 for v in entry):
            raise RemoteProtocolError(f"buffer table entry must be 3 or 4 non-negative ints, got {entry!r:.80}")
        if len(entry) == 3:
            index, transfer_id, nbytes = entry
            address: int | None = None
        else:
            index, transfer_id, address, nbytes = entry
        if not 1 <= index <= len(buffer_frames) or index in seen:
            raise RemoteProtocolError(f"lent-buffer entry names frame {index}, message has frames 1..{len(buffer_frames)}")
        if len(buffer_frames[index - 1]) != 0:
            raise RemoteProtocolError(f"frame {index} is lent but not empty")
        if nbytes == 0 or address == 0:
            raise RemoteProtocolError(f"lent buffer at {address or 0:#x} of {nbytes} bytes")
        seen.add(index)
        checked.append((index, transfer_id, address, nbytes))
    return checked


class LentFrame:
    """A received frame whose bytes are still in the sender's memory. Its ``buffer`` reads
    them (once, on the thread that decodes the message, never under the socket lock) and then
    calls ``done(transfer_id)`` so that the sender's buffer is released; a frame never read
    calls it when it is dropped. ``len()`` is the lent size, so message size limits count it."""

    __slots__ = ("_reader", "_address", "_nbytes", "_transfer_id", "_done", "_peer", "_view")

    def __init__(self, reader: Reader, address: int, nbytes: int, transfer_id: int, done: Callable[[int, bool], None],
                 peer: str):
        self._reader = reader
        self._address = address
        self._nbytes = nbytes
        self._transfer_id = transfer_id
        self._done: Callable[[int, bool], None] | None = done
        self._peer = peer
        self._view: memoryview | None = None

    def __len__(self) -> int:
        return self._nbytes

    @property
    def buffer(self) -> memoryview:
        if self._view is None:
            done, self._done = self._done, None
            if done is None:
                raise RemoteProtocolError(f"lent frame {self._transfer_id} from {self._peer!r} could not be read")
            try:
                view = self._reader.read(self._address, self._nbytes)
            except OSError as exc:
                raise RemoteProtocolError(
                    f"cannot read the {self._nbytes} bytes {self._peer!r} lent at {self._address:#x} "
                    f"(pid {self._reader.pid}): {exc.strerror}"
                ) from None
            finally:
                done(self._transfer_id, True)
            self._view = view
        return self._view

    def __del__(self) -> None:
        done = self._done
        if done is not None:
            self._done = None
            done(self._transfer_id, False)


def lendable(frame: Any, lend_min: int) -> bool:
    """Whether a frame can be lent: a ctypes array (how the codec exports a big tensor's
    memory without a copy; its address is fixed while it lives) of at least ``lend_min``."""
    return isinstance(frame, ctypes.Array) and ctypes.sizeof(frame) >= lend_min


def lend(frames: list, lend_min: int, transfer_ids: Iterable[int]) -> tuple[list, dict[int, Any]]:
    """The frames of a message with each lendable buffer replaced by an empty frame, behind
    the table that says where the peer reads them, and the lent buffers by transfer id (the
    sender keeps them until released). Unchanged frames and {} when nothing is lendable."""
    entries = []
    lent: dict[int, Any] = {}
    out = list(frames)
    ids = iter(transfer_ids)
    for index in range(1, len(frames)):  # frame 0 is the envelope
        frame = frames[index]
        if lendable(frame, lend_min):
            transfer_id = next(ids)
            lent[transfer_id] = frame
            entries.append([index, transfer_id, ctypes.addressof(frame), ctypes.sizeof(frame)])
            out[index] = b""
    if not entries:
        return frames, {}
    return [encode_table(entries), *out], lent


class Offer:
    """A peer's challenge, put in our memory for it to read (LEND_OFFER), and the pid its
    HELLO named: the process whose memory we read if it shows us our challenge in turn."""

    def __init__(self, challenge: bytes, peer_pid: int):
        self.buffer = ctypes.create_string_buffer(challenge, len(challenge))
        self.peer_pid = peer_pid

    @classmethod
    def from_hello(cls, payload: Any, host: str) -> "Offer | None":
        """The offer to make for a HELLO's payload; None when the peer is not on our host (or
        does not lend)."""
        info = payload.get("lend") if isinstance(payload, dict) else None
        if not isinstance(info, dict) or info.get("host") != host:
            return None
        challenge, pid = info.get("challenge"), info.get("pid")
        if not isinstance(challenge, bytes) or len(challenge) != CHALLENGE_BYTES or type(pid) is not int or pid <= 0:
            return None
        return cls(challenge, pid)

    def message(self) -> int:
        """LEND_OFFER's payload: where the challenge is (our pid went in our HELLO)."""
        return ctypes.addressof(self.buffer)


# Buffers lent to peers that were lost or closed: a peer may not know yet and still read them,
# so they live on for a while (the peer timeout) instead of going back to the allocator.
_retired: deque = deque()
_retired_lock = threading.Lock()


def retire(buffers: Iterable[Any], hold_for: float) -> None:
    """Keep ``buffers`` alive for ``hold_for`` seconds more; forget those whose time is up."""
    now = time.monotonic()
    buffers = list(buffers)
    with _retired_lock:
        while _retired and _retired[0][0] <= now:
            _retired.popleft()
        if buffers:
            _retired.append((now + hold_for, buffers))
