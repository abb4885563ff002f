"""The floor of a same-host design that bypasses sockets: calls encoded with zmqautograd's codec
through a shared-memory ring, read by threads that spin instead of sleeping.

TensorPipe's same-host transport works this way (a ring in shared memory and a thread that
busy-polls). On this project's VM, a thread woken from a cross-process wait runs 3-5x slower
and every wake-up costs hundreds of microseconds (docs/performance.md, "Where the time
went"), so a design whose readers never sleep is what it takes to beat TensorPipe's
small-call latency by 2x. This measures what such a design cannot go below, with no RPC
layer at all: one thread on each side, spinning on a single-producer single-consumer ring
per direction (``sched_yield`` between polls), encoding and decoding exactly as
``tools/floor.py`` does over ZeroMQ.

Not part of the runtime: a measurement for the decision whether to build such a transport
(it costs a CPU per process while it spins). ``tools/bench.py`` runs it in its standalone
table, next to TensorPipe.
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing import shared_memory

from tools.floor import CallingSide, answer
from zmqautograd.rpc.serialization import RpcCodec

_RING_BYTES = 1 << 20  # data bytes of each direction's ring
_HEADER = 128  # head (read position) at 0, tail (write position) at 64: separate cache lines
_WRAP = 0xFFFFFFFF  # a record length that says: continue at the start of the ring
_U32 = struct.Struct("<I")
_yield = os.sched_yield


def _padded(size: int) -> int:
    return (size + 7) & ~7


class Ring:
    """One direction: a single writer appends length-prefixed records, a single reader takes
    them. Positions only grow; x86 keeps stores in order, so a reader that sees the new tail
    sees the record written before it (this is a measurement on x86, not portable code).
    Records take a multiple of 8 bytes, so a record never starts in the last 4 bytes of the
    ring, where its length (or the wrap mark) would not fit: unaligned, a wrap mark written
    there ran past the ring into the next one's head and corrupted it."""

    def __init__(self, buffer: memoryview, offset: int):
        self._buffer = buffer
        # The head and the tail, each loaded and stored in one 8-byte access (an item of a
        # "Q" view). ``struct.pack_into`` zeroes the bytes before it writes them: a reader
        # that loaded the tail in between saw 0, took it for a new record and read a length
        # of 0 (two bench runs ended so; transport/shm.py has the same fix and its test).
        self._words = buffer.cast("Q")
        self._head = offset >> 3
        self._tail = (offset + 64) >> 3
        self._data = offset + _HEADER

    def put(self, frames: list) -> None:
        parts = [_U32.pack(len(frames))]
        for frame in frames:
            raw = bytes(frame)
            parts += (_U32.pack(len(raw)), raw)
        record = b"".join(parts)
        size = _padded(4 + len(record))
        if size > _RING_BYTES // 2:
            raise ValueError("record too large for the ring")
        buffer = self._buffer
        tail = self._words[self._tail]
        at = tail % _RING_BYTES
        if at + size > _RING_BYTES:  # no room before the end: mark a wrap, start again at 0
            self._wait_room(tail, _RING_BYTES - at + size)
            _U32.pack_into(buffer, self._data + at, _WRAP)
            tail += _RING_BYTES - at
            at = 0
        else:
            self._wait_room(tail, size)
        _U32.pack_into(buffer, self._data + at, len(record))
        buffer[self._data + at + 4:self._data + at + 4 + len(record)] = record
        self._words[self._tail] = tail + size  # last: publishes the record

    def _wait_room(self, tail: int, size: int) -> None:
        while tail + size - self._words[self._head] > _RING_BYTES:
            _yield()

    def get(self) -> list[bytes]:
        buffer = self._buffer
        words = self._words
        head = words[self._head]
        while words[self._tail] == head:
            _yield()
        at = head % _RING_BYTES
        length = _U32.unpack_from(buffer, self._data + at)[0]
        if length == _WRAP:
            head += _RING_BYTES - at
            at = 0
            length = _U32.unpack_from(buffer, self._data)[0]
        if not 4 <= length <= _RING_BYTES // 2:
            self._impossible(head, at, length)
        record = bytes(buffer[self._data + at + 4:self._data + at + 4 + length])
        words[self._head] = head + _padded(4 + length)
        count = _U32.unpack_from(record, 0)[0]
        frames, position = [], 4
        for _ in range(count):
            size = _U32.unpack_from(record, position)[0]
            frames.append(record[position + 4:position + 4 + size])
            position += 4 + size
        return frames


    def _impossible(self, head: int, at: int, length: int) -> None:
        """A published record whose length no writer writes (every record holds at least its
        frame count): raise, saying whether the length showed up later (the writer's stores
        seen out of order) or never (the ring overwritten). Two bench runs read a length of 0
        before the tail was stored in one access (``__init__``); none since."""
        start = time.perf_counter()
        later = length
        while time.perf_counter() - start < 1.0 and later == length:
            later = _U32.unpack_from(self._buffer, self._data + at)[0]
        tail = self._words[self._tail]
        raise RuntimeError(
            f"shared-memory floor: record of {length} bytes at ring offset {at} (head {head}, tail {tail}); "
            + (f"{later} bytes {(time.perf_counter() - start) * 1e6:.0f} us later" if later != length
               else "still so 1 s later"))


def _rings(memory: shared_memory.SharedMemory) -> tuple[Ring, Ring]:
    """(requests, answers)."""
    span = _HEADER + _RING_BYTES
    return Ring(memory.buf, 0), Ring(memory.buf, span)


def create() -> shared_memory.SharedMemory:
    """The shared memory of both rings, zeroed; pass its ``name`` to ``serve`` and
    ``Client``, and ``close()`` and ``unlink()`` it when both are done."""
    memory = shared_memory.SharedMemory(create=True, size=2 * (_HEADER + _RING_BYTES))
    memory.buf[:] = bytes(memory.size)
    return memory


def serve(name: str) -> None:
    """Answer calls on the rings in shared memory ``name`` until told to stop."""
    memory = shared_memory.SharedMemory(name=name)
    requests, answers = _rings(memory)
    codec = RpcCodec(allow_pickle=False)
    try:
        stop = False
        while not stop:
            reply, stop = answer(codec, requests.get())
            answers.put(reply)
    finally:
        del requests, answers  # they hold views of the memory, which must go before close
        memory.close()


class Client(CallingSide):
    """The calling side over the rings (tools/floor.py's ``CallingSide``)."""

    def __init__(self, name: str):
        super().__init__()
        self._memory = shared_memory.SharedMemory(name=name)
        self._requests, self._answers = _rings(self._memory)

    def _put(self, frames: list) -> None:
        self._requests.put(frames)

    def _get(self) -> list:
        return self._answers.get()

    def close(self) -> None:
        self._stop()
        del self._requests, self._answers
        self._memory.close()
