"""Ping-pong: two worker processes exchange tensors over the zmqautograd transport on loopback.

A worker process runs an endpoint that answers every tensor with the tensor scaled by 2; this
driver process sends tensors from 8 bytes to 64 MiB, checks every answer, and prints the
round-trip latency and throughput.

    python tools/pingpong.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torch warns at import when numpy is absent; nothing here uses numpy.
warnings.filterwarnings("ignore", "Failed to initialize NumPy")

import torch  # noqa: E402

from zmqautograd.transport import Message, MessageType  # noqa: E402
from zmqautograd.transport.endpoint import Endpoint  # noqa: E402


def worker(address_queue) -> None:
    stop = threading.Event()

    def double(message: Message) -> None:
        if message.payload is None:
            stop.set()
            return
        endpoint.send(message.sender, Message(MessageType.PYTHON_RET, message.id, "worker", message.payload * 2))

    endpoint = Endpoint("worker", on_message=double)
    address_queue.put(endpoint.address)
    stop.wait()
    endpoint.close()


def main() -> None:
    torch.manual_seed(0)
    ctx = mp.get_context("spawn")
    address_queue = ctx.Queue()
    process = ctx.Process(target=worker, args=(address_queue,), daemon=True)
    process.start()
    driver = Endpoint("driver")
    driver.connect("worker", address_queue.get(timeout=60))
    driver.wait_for_peer("worker", 30)
    print(f"driver {driver.address} <-> worker {driver.peers()}: tensors out, doubled tensors back\n")
    print(f"{'tensor':>10} {'round trips':>12} {'median RTT':>12} {'round trips/s':>14} {'throughput':>14}")
    message_id = 0
    for nbytes, count in ((8, 2000), (1 << 10, 2000), (1 << 20, 50), (16 << 20, 10), (64 << 20, 5)):
        tensor = torch.randn(nbytes // 4)
        times = []
        for _ in range(count):
            message_id += 1
            start = time.perf_counter()
            driver.send("worker", Message(MessageType.PYTHON_CALL, message_id, "driver", tensor))
            reply = driver.recv(60)
            times.append(time.perf_counter() - start)
            assert reply.id == message_id and torch.equal(reply.payload, tensor * 2), "wrong answer"
        rtt = statistics.median(times)
        label = f"{nbytes} B" if nbytes < 1024 else f"{nbytes >> 10} KiB" if nbytes < 1 << 20 else f"{nbytes >> 20} MiB"
        rate = 2 * nbytes / rtt / 1e6
        print(f"{label:>10} {count:>12} {rtt * 1e6:>9.0f} us {1 / rtt:>14.0f} {rate:>10.1f} MB/s", flush=True)
    stats = driver.stats()["worker"]
    print(f"\nall answers checked; driver sent {stats.messages_sent} messages ({stats.bytes_sent / 1e6:.1f} MB), "
          f"received {stats.messages_received} ({stats.bytes_received / 1e6:.1f} MB)")
    message_id += 1
    driver.send("worker", Message(MessageType.PYTHON_CALL, message_id, "driver", None))
    process.join(30)
    driver.close()


if __name__ == "__main__":
    main()
