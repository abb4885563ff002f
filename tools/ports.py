"""Free TCP ports on this host, for the rendezvous of the tests, benchmarks and tools.

The usual way, binding port 0 and closing the socket, hands out a port of the kernel's
*ephemeral* range and frees it at once. Until the rendezvous store binds it, any connect() on
the host may take that very port as its local port (connect() draws from the same range), and
the store then fails with EADDRINUSE: it happened to a benchmark run, whose groups start
processes that connect all over loopback while others are still choosing ports. A port
below the ephemeral range is never given to a connect(), so one found free there stays free
until somebody binds it on purpose; and this process hands no port out twice.
"""

from __future__ import annotations

import random
import socket
import threading

_LOWEST = 20000  # above the well-known and most registered services' ports
_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_lock = threading.Lock()
_given: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        with open(_RANGE_FILE) as file:
            return int(file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on ``host`` now and that no connect() will take meanwhile (see the
    module's docstring); one from the ephemeral range only where the range below it is too
    small or full."""
    start = ephemeral_start()
    if start - _LOWEST >= 1000:
        for _ in range(500):
            port = random.randrange(_LOWEST, start)
            with _lock:
                if port in _given:
                    continue
                _given.add(port)
            with socket.socket() as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue  # in use, or lingering: stays in _given, never tried again
            return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
