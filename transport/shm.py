"""Same-host channels: a byte ring in shared memory per direction, and a doorbell per process.

Pure mechanics, no sockets and no threads: the endpoint (transport/endpoint.py, its
"shared-memory rings" methods) decides when a peer's messages go this way and which thread reads.

Why: between two processes on one host, a message through ZeroMQ wakes four sleeping threads
(libzmq's I/O thread on each side, then the receiver's own thread) and crosses the kernel
twice. On the development VM each wake-up costs tens to hundreds of microseconds, more than
the Python work of a call (README, "Figures"). Through a ring, the sender copies
the message into memory the receiver maps; a receiver that is spinning sees it at once, one
that sleeps is woken by one byte on its doorbell. This is how TensorPipe's ``shm`` transport
works, except that its reactor spins all the time and ours only while a thread waits for
something (``EndpointOptions.spin``).

**Ring.** One writer process, one reader process. A header of counters, each on its own
cache line, then ``capacity`` data bytes used as a byte stream:

* ``head``: bytes the reader has consumed (only the reader stores it);
* ``tail``: bytes the writer has published (only the writer stores it); data is written
  before the tail that publishes it;
* ``writer_waiting``: the writer has bytes the ring had no room for; the reader rings the
  writer's doorbell once it has made room.

**Flags.** One page per receiving process, mapped by all its writers (:class:`Flags`):
``spinning`` (a thread of the reader spins, so writers need not ring) and ``pending`` (a
writer published since the spinner last looked), so that a spinning thread looks at one word,
not at every peer's ring; and a byte per ring, its writer's *mark* ("published since the
reader last took the marks"), so that a look reads the marked rings only.

Positions only grow (64 bits never wrap); the data offset is ``position % capacity``. A
message can be larger than the ring: the writer keeps what did not fit and writes it as room
appears, the reader reassembles (:class:`StreamDecoder`).

**Memory order.** The ring is used only on x86-64 (``SUPPORTED``), whose stores become
visible in program order and whose loads are not reordered with older loads: so a reader
that sees a tail sees the bytes written before it, and a writer that sees a head may reuse
the bytes before it. The one reordering x86 allows, a load passing an older store, matters
for the flag handshakes ("I stop spinning, then look whether data is pending" against "I
publish data and mark it pending, then look whether the reader spins"; likewise for
``writer_waiting``): both sides put :func:`fence`
between the store and the load, a locked instruction, which x86 orders with everything.
Each shared word is loaded and stored in a single access (``_Shared._words``).

**Doorbell.** A datagram socket per process in Linux's abstract namespace: writers send a
byte to wake a sleeping reader; the reader's sleeping threads poll it. Level-triggered:
whoever wakes empties it (:meth:`Bell.drain`) before it reads the rings.

**Nothing left behind.** Rings are ``memfd`` memory, which the writer maps through
``/proc/<pid>/fd``; doorbells have no file either. A process that dies leaves nothing in
``/dev/shm``.

**Wire format** of a message in the stream: ``u32 frame count``, ``u32 0``, one ``u64``
length per frame, then the frames, each padded to 8 bytes (so tensors decoded in place are
aligned for their dtype).
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import select
import socket
import stat
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

from . import memory, syscalls
from .errors import RemoteProtocolError

DEFAULT_RING_BYTES = 1 << 20
DEFAULT_SPIN = 0.02  # seconds: the longest a waiting thread spins (EndpointOptions.spin)
# Seconds the I/O thread spins after traffic (at most ``spin``). It learns nothing (a waiting
# thread's spin is learnt per kind of wait), so it stays short: with no waiting thread
# awake, it is what catches answers that no thread waits for in the endpoint.
IO_SPIN = 0.002
SUPPORTED = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")

# The header's words, as indices into a "Q" view of it (``_Shared._words``): byte offsets 0,
# 64 and 192, each on a cache line of its own.
_HEAD, _TAIL, _WRITER_WAITING = 0, 8, 24
_DATA = 256  # a ring's data bytes start here (after the header's cache lines)
_MAGIC = b"zmqautograd-ring\0"  # at _DATA - 32: memory that is not one of our rings is refused
_FLAGS_MAGIC = b"zmqautograd-flags\0"
_BELL_BYTE = b"\0"
_BELL_PREFIX = "zmqautograd-bell-"
_ZEROS = bytes(8)
_SHARE_MAX = 1 << 18  # chunks bigger than this are not kept alive by small messages' frames
# Frames this big are copied into the ring on their own, not joined first. Below it, joining
# (one more copy) costs less than a ring write of its own (measured, micro: a message with an
# 8 KiB tensor 3.6 -> 2.3 us, 64 KiB 3.9 -> 3.1 us; 128 KiB breaks even, 256 KiB loses).
_JOIN_MAX = 1 << 16
_HEADERS = [struct.Struct(f"<II{count}Q") for count in range(9)]  # message headers by frame count
_LENGTHS = [struct.Struct(f"<{count}Q") for count in range(9)]  # their frame lengths
_U32 = struct.Struct("<I")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; Python 3.10+

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: taking and releasing a lock is a locked instruction on x86 (see
    the module's docstring). About 0.1 us."""
    _fence_lock.acquire()
    _fence_lock.release()


def _map(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: the page-table entries are made now, not by a fault per page on the
    # message path (the pages themselves exist already: _create_memfd allocates them).
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)


def _check_room(size: int) -> None:
    """Refuse (OSError ENOMEM) shared memory that would crowd the host: more than an eighth
    of the memory still available (one big ring), or what would leave less than an eighth
    of the total available (many rings: each is small, their sum is not)."""
    available, total = memory.figures()
    if available is None:
        return
    if size > available // 8:
        raise OSError(errno.ENOMEM, f"{size} bytes of shared memory would take more than an eighth of "
                                    f"the {available} bytes still available")
    if total is not None and available - size < total // 8:
        raise OSError(errno.ENOMEM, f"{size} bytes of shared memory would leave less than an eighth of the "
                                    f"memory ({total} bytes) available ({available} bytes are)")


def _create_memfd(name: str, size: int, magic: bytes) -> tuple[mmap.mmap, int]:
    """Zeroed anonymous shared memory (``memfd``: no file to leave behind) with ``magic`` at
    ``_DATA - 32``; peers map it through ``/proc/<our pid>/fd/<fd>`` (:func:`_map_peer_memfd`).

    Its pages are allocated now, as TensorPipe's shared-memory segments are (``fallocate``).
    Left to first touch, every page of a ring faulted on the message path until the ring had
    wrapped once, in the writer (allocating and zeroing it) and then in the reader: 1-5 us a
    fault on the development VMs, two of each per 8 KiB message, for the first 1 MiB sent
    to each peer (docs/performance.md). The price: a ring's memory is taken when it is made,
    not as traffic reaches it (``shm_ring`` bytes per direction and same-host peer).

    Refused (OSError ENOMEM) where it would crowd memory (``_check_room``): shared memory
    does not fail its allocation when memory runs out, the kernel's OOM killer ends a
    process instead (a 1 TiB ring killed its maker). The caller goes without a ring."""
    _check_room(size)
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise  # no memory for it: the caller goes without a ring
            # A kernel that cannot: the pages come on first touch, as before.
        mapping = _map(fd, size)
    except BaseException:
        os.close(fd)
        raise
    mapping[_DATA - 32:_DATA - 32 + len(magic)] = magic
    return mapping, fd


def _map_peer_memfd(pid: int, fd: int, size: int, magic: bytes, what: str) -> mmap.mmap:
    """Map the shared memory process ``pid`` made (its descriptor ``fd``). Raises OSError, or
    ValueError for anything that is not such memory of that size, made by this module."""
    local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        info = os.fstat(local)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            raise ValueError(f"descriptor {fd} of pid {pid} is not {what}")
        mapping = _map(local, size)
    finally:
        os.close(local)
    if mapping[_DATA - 32:_DATA - 32 + len(magic)] != magic:
        mapping.close()
        raise ValueError(f"descriptor {fd} of pid {pid} is not {what}")
    return mapping


class _Shared:
    """Memory shared with a peer: the mapping, and the creator's descriptor, which it keeps
    while peers may still map the memory."""

    def __init__(self, mapping: mmap.mmap, fd: int | None):
        self.fd = fd
        self._map = mapping
        self._buffer = memoryview(mapping)
        # The shared words (positions and flags), each loaded and stored in one 8-byte
        # access: an item of a "Q" view is copied with one fixed-size memcpy, one aligned
        # move on x86-64. Not ``struct.pack_into``: it zeroes the bytes before it writes
        # them, and a peer that loaded between the two saw a position go back to 0 (the
        # reader a tail of 0, the writer a head of 0: a full ring where it was empty) or a
        # flag unset (tests/transport/test_shm.py, "went back").
        self._words = self._buffer[:_DATA].cast("Q")

    def close_descriptor(self) -> None:
        """No peer maps it any more (or none will): the creator's descriptor goes."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.close_descriptor()
        self._words.release()
        self._buffer.release()
        self._map.close()

    def _load(self, word: int) -> int:
        return self._words[word]

    def _store(self, word: int, value: int) -> None:
        self._words[word] = value

    def _take(self, word: int) -> bool:
        """Whether the flag in word ``word`` is set; clears it (only its one reader does)."""
        words = self._words
        if words[word]:
            words[word] = 0
            return True
        return False


class Flags(_Shared):
    """A receiving process's flags, in a page every peer that writes to it maps:

    * ``spinning``: a thread of ours spins on our rings, so writers need not ring;
    * ``pending``: a writer published data since the spinner last looked. The spinner looks
      at this one word instead of at every ring (a process may have dozens of peers);
    * a *mark* per ring (one byte, at the ring's *slot*, which the reader gives each writer
      with its ring): its writer published data since the reader last took the marks. A
      look at the rings reads only the marked ones (:meth:`take_marks`), one copy of the
      marks instead of a look at every ring: what a look costs does not grow with peers
      that have nothing to say.
    """

    # Words (byte offsets 0, 64 and 128: cache lines of their own). ``marked``: some ring was
    # marked since the reader last took the marks (a look at one word when none was).
    _SPINNING, _PENDING, _MARKED = 0, 8, 16
    SIZE = 4096
    SLOTS = SIZE - _DATA  # rings with a mark (the bytes after the words and the magic)

    def __init__(self, mapping: mmap.mmap, fd: int | None, slot: int | None = None):
        super().__init__(mapping, fd)
        self._marks = self._buffer[_DATA:]
        # (A writer's mapping) the mark of the ring it writes; -1 on the reader's own, which
        # never marks through mark_pending.
        self.slot: int = -1 if slot is None else slot

    @classmethod
    def create(cls) -> "Flags":
        mapping, fd = _create_memfd("zmqautograd-flags", cls.SIZE, _FLAGS_MAGIC)
        return cls(mapping, fd)

    @classmethod
    def open(cls, pid: int, fd: int, slot: int) -> "Flags":
        """A writer's mapping of the flags process ``pid`` made (its descriptor ``fd``),
        marking slot ``slot``. Raises OSError, or ValueError for anything else."""
        if not 0 <= slot < cls.SLOTS:
            raise ValueError(f"ring slot {slot} is out of range (0-{cls.SLOTS - 1})")
        return cls(_map_peer_memfd(pid, fd, cls.SIZE, _FLAGS_MAGIC, "a flags page"), None, slot)

    def close(self) -> None:
        self._marks.release()  # (before the buffer it was cut from)
        super().close()

    # (Each a single access to the page: these run on every message and every look.)

    def set_spinning(self, spinning: bool) -> None:
        self._words[self._SPINNING] = int(spinning)

    def spinning(self) -> bool:
        """(A writer's look, after :func:`fence`.)"""
        return self._words[self._SPINNING] != 0

    def mark_pending(self) -> None:
        """(A writer, after it published data.) Its ring's mark, then the pending word."""
        self._marks[self.slot] = 1
        words = self._words
        words[self._MARKED] = 1
        words[self._PENDING] = 1

    def pending(self) -> bool:
        return self._words[self._PENDING] != 0

    def take_pending(self) -> bool:
        """Whether data was published since the last take; clears the flag. The caller must
        :func:`fence` before it reads the rings (a writer's mark may land between our load
        and our clear: its data is then published already, and the fence lets us see it)."""
        return self._take(self._PENDING)

    def take_marks(self, count: int) -> list[int] | tuple[()]:
        """The slots below ``count`` marked since the last take, in order; clears their marks.
        The caller must :func:`fence` before it reads those rings (as for take_pending); a
        mark that lands after our copy stays for the next take."""
        words = self._words
        if not words[self._MARKED]:
            return ()
        words[self._MARKED] = 0
        fence()  # cleared before the copy: a writer that marks after the copy sets it again
        marks = self._map[_DATA:_DATA + count]  # one copy, then searched in C
        slot = marks.find(1)
        if slot < 0:
            return ()
        view = self._marks
        taken = []
        while slot >= 0:
            view[slot] = 0
            taken.append(slot)
            slot = marks.find(1, slot + 1)
        return taken

    def mark(self, slot: int) -> None:
        """(The reader.) Read the ring at ``slot`` on the next take: data is left in it."""
        self._marks[slot] = 1
        self._words[self._MARKED] = 1


class Ring(_Shared):
    """One direction's ring. The reader creates it and tells the writer where to find it;
    both map it. The creator's descriptor goes once the writer has mapped it."""

    def __init__(self, mapping: mmap.mmap, capacity: int, fd: int | None = None):
        super().__init__(mapping, fd)
        self.capacity = capacity
        self._data = self._buffer[_DATA:_DATA + capacity]
        # Each side's own position, kept here too: only the writer stores the tail and only
        # the reader the head, so each reads only the other's from shared memory.
        self._tail = self._load(_TAIL)  # (the writer's)
        self._head = self._load(_HEAD)  # (the reader's)

    @classmethod
    def create(cls, capacity: int) -> "Ring":
        """A new, zeroed ring in anonymous shared memory (``memfd``: no file to leave behind).
        The writer maps it through ``/proc/<our pid>/fd/<fd>`` (:meth:`open`)."""
        mapping, fd = _create_memfd("zmqautograd-ring", _DATA + capacity, _MAGIC)
        return cls(mapping, capacity, fd)

    @classmethod
    def open(cls, pid: int, fd: int, capacity: int) -> "Ring":
        """Map the ring process ``pid`` created (its descriptor ``fd``). Raises OSError, or
        ValueError for anything that is not such a ring of that size."""
        return cls(_map_peer_memfd(pid, fd, _DATA + capacity, _MAGIC, f"a ring of {capacity} bytes"), capacity)

    def close(self) -> None:
        self._data.release()
        super().close()

    # ------------------------------------------------------------------ the writer's side

    def write(self, data: memoryview) -> int:
        """Append as much of ``data`` (a byte memoryview) as there is room for and publish it;
        the number of bytes taken."""
        capacity = self.capacity
        tail = self._tail
        length = len(data)
        size = min(length, capacity - (tail - self._words[_HEAD]))
        if size <= 0:
            return 0
        at = tail % capacity
        first = min(size, capacity - at)
        self._data[at:at + first] = data if first == length else data[:first]
        if size > first:  # wrapped around
            self._data[:size - first] = data[first:size]
        self._tail = tail = tail + size
        self._words[_TAIL] = tail  # after the data: publishes it
        return size

    def set_writer_waiting(self, waiting: bool) -> None:
        self._store(_WRITER_WAITING, int(waiting))

    # ------------------------------------------------------------------ the reader's side

    def has_data(self) -> bool:
        return self._words[_TAIL] != self._head

    def read(self, limit: int) -> bytearray | None:
        """Up to ``limit`` published bytes (writable, so tensors can be decoded in place), or
        None when there are none."""
        head = self._head
        size = min(self._words[_TAIL] - head, limit)
        if size <= 0:
            return None
        capacity = self.capacity
        at = head % capacity
        first = min(size, capacity - at)
        chunk = bytearray(self._data[at:at + first])
        if size > first:
            chunk += self._data[:size - first]
        self._head = head = head + size
        self._words[_HEAD] = head  # after the copy: the writer may now reuse the bytes
        return chunk

    def take_writer_waiting(self) -> bool:
        """Whether the writer waits for room (call after :func:`fence`); clears the flag."""
        return self._take(_WRITER_WAITING)


def encode(frames: Sequence[Any]) -> list:
    """A message's frames as the byte pieces to append to a ring, in order: small parts are
    joined (one copy into the ring for a small message), big frames go as they are. Never an
    empty piece: a writer takes 0 bytes of one and waits for room that never comes."""
    sizes = [len(frame) if type(frame) is bytes else memoryview(frame).nbytes for frame in frames]
    count = len(sizes)
    header = (_HEADERS[count] if count < len(_HEADERS) else struct.Struct(f"<II{count}Q")).pack(count, 0, *sizes)
    if sizes and max(sizes) < _JOIN_MAX:  # the usual small message: one piece, in one join
        parts: list = [header]
        for frame, size in zip(frames, sizes):
            parts.append(frame)
            if size & 7:
                parts.append(_ZEROS[:-size & 7])
        return [memoryview(b"".join(parts))]
    views = [memoryview(frame).cast("B") for frame in frames]
    small: list = [header]
    pieces: list = []

    def flush_small() -> None:
        joined = b"".join(small)
        if joined:
            pieces.append(memoryview(joined))
        small.clear()

    for view in views:
        if view.nbytes >= _JOIN_MAX:
            flush_small()
            pieces.append(view)
        else:
            small.append(view)
        pad = -view.nbytes & 7
        if pad:
            small.append(_ZEROS[:pad])
    flush_small()
    return pieces


class StreamDecoder:
    """Reassembles the messages of one ring's byte stream (:func:`encode`'s format).

    ``feed`` takes the bytes :meth:`Ring.read` returned and gives back the complete messages
    among them, each a list of frames (memoryviews of the fed bytes, writable). A malformed
    stream raises RemoteProtocolError: the stream cannot be resynchronised, so the caller
    must stop reading it."""

    def __init__(self, max_frames: int, max_message_bytes: int):
        self._max_frames = max_frames
        self._max_bytes = max_message_bytes
        self._pending = bytearray()
        self._need = 0  # bytes the message at the front of _pending needs, once known

    def feed(self, chunk: bytearray) -> list[list[bytes | memoryview]]:
        if self._pending:
            self._pending += chunk
            if len(self._pending) < self._need:
                return []
            data, self._pending, self._need = self._pending, bytearray(), 0
        else:
            data = chunk
        view = memoryview(data)
        messages = []
        position, end = 0, len(data)
        while position < end:
            frames, size = self._parse(view, position, end)
            if frames is None:
                self._pending = bytearray(view[position:end]) if position else data
                self._need = size
                break
            messages.append(frames)
            position += size
        return messages

    def _parse(self, view: memoryview, position: int, end: int) -> tuple[list | None, int]:
        """The message at ``position`` and its size; (None, bytes needed, 0 when not known
        yet) when it is not complete."""
        if end - position < 8:
            return None, 0
        count = _U32.unpack_from(view, position)[0]
        if not 0 < count <= self._max_frames:
            raise RemoteProtocolError(f"shared-memory stream: message with {count} frames (limit {self._max_frames})")
        header = 8 + 8 * count
        if end - position < header:
            return None, 0
        lengths = (_LENGTHS[count] if count < len(_LENGTHS) else struct.Struct(f"<{count}Q")).unpack_from(view, position + 8)
        total = sum(lengths)
        if total > self._max_bytes:
            raise RemoteProtocolError(f"shared-memory stream: message of {total} bytes (limit {self._max_bytes})")
        size = header + total
        for length in lengths:
            size += -length & 7  # each frame padded to 8 bytes (the module docstring)
        if end - position < size:
            return None, size
        if len(view) > _SHARE_MAX and size < len(view) // 4:
            # A small message in a big chunk gets its own copy: its frames (tensors decoded in
            # place) must not keep the whole chunk alive.
            view, position = memoryview(bytearray(view[position:position + size])), 0
        frames = []
        at = position + header
        for length in lengths:
            frames.append(view[at:at + length])
            at += length + (-length & 7)
        return frames, size


class Bell:
    """This process's doorbell: a datagram socket in Linux's abstract namespace (nothing in
    the file system, gone with the process). ``fd`` is for pollers; ``address`` for peers."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        self.address = _BELL_PREFIX + os.urandom(12).hex()
        self._socket.bind("\0" + self.address)
        self.fd = self._socket.fileno()
        self._readable = select.poll()
        self._readable.register(self.fd, select.POLLIN)

    def ring(self) -> None:
        """Ring our own doorbell: for data a thread leaves for whoever sleeps."""
        try:
            self._socket.sendto(_BELL_BYTE, "\0" + self.address)
        except OSError:
            pass  # a full queue: it is ringing already

    def drain(self) -> None:
        """Empty it, before reading the rings (a call that comes after is for data that comes
        after): one system call for all the writers that rang, which keeps the GIL
        (transport/syscalls.py). Most looks find it empty: a poll says so in less time than
        a receive that fails (0.7 against 1.5 us; the poll lets the GIL go, but only for the
        look)."""
        if self._readable.poll(0):
            syscalls.drain_datagrams(self._socket.fileno())

    def close(self) -> None:
        self._socket.close()


def open_bell(address: str) -> socket.socket:
    """A socket that rings the doorbell at ``address`` (a peer's :attr:`Bell.address`).
    Raises OSError where it cannot be reached (another network namespace), ValueError for an
    address that is not a doorbell's."""
    if not address.startswith(_BELL_PREFIX) or len(address) > 100:
        raise ValueError(f"{address!r:.120} is not a doorbell address")
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        bell.connect("\0" + address)
    except OSError:
        bell.close()
        raise
    return bell


def ring_bell(bell: socket.socket) -> None:
    """Wake the peer's sleeping reader. A full queue already wakes it; a gone peer is found
    out by the connection monitor."""
    syscalls.send_byte(bell, _BELL_BYTE)
