"""Open-file room: an endpoint raises its process's soft limit on descriptors as its peers
grow, and errors that running out may have caused say so.

Running out is not a clean failure in libzmq: a listener that cannot accept a connection
(EMFILE) retries at once, forever, about 100,000 times a second on one core (measured), and
the peer that connects waits for its handshake until its timeout, which then names the
peer, not the cause. So the limit is raised before it is reached, as Go's runtime and the
JVM do for every process (the hard limit is what the administrator allows; the soft one is
a default kept low for programs that still use ``select()``, which Python refuses beyond
FD_SETSIZE with a clear error). Where even the hard limit is too low, a warning says what
to change."""

from __future__ import annotations

import errno
import logging
import os

try:
    import resource
except ImportError:  # (Windows: no such limit to raise)
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# Descriptors a peer on the same host takes: its TCP connection, a pidfd, and once messages
# flow (rings are made on first use) its doorbell socket and the mappings of two rings and
# its flags page (Python's mmap keeps a duplicate of the descriptor it maps): 6 measured;
# a peer on another host, 1. The room is for all peers talking at once.
PER_PEER = 8
# The rest of a process: torch, libzmq's sockets, waiting threads (two each), the user's.
BASE = 256
RUNNING_LOW = 16  # descriptors left at which an error names the limit

_warned_hard = False


def room_for(peers: int) -> int:
    """The open files an endpoint with ``peers`` peers may need."""
    return BASE + PER_PEER * peers


def make_room(peers: int) -> int:
    """Raise the soft limit on open files (never past the hard limit) to what an endpoint
    with ``peers`` peers may need; returns the soft limit then (a large number where there
    is none)."""
    global _warned_hard
    if resource is None:
        return 1 << 62
    needed = room_for(peers)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return 1 << 62 if soft == resource.RLIM_INFINITY else soft
    target = needed if hard == resource.RLIM_INFINITY else min(hard, max(needed, 2 * soft))
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d for %d peers: %s", soft, target, peers, exc)
            return soft
        log.info("raised the open-file limit from %d to %d descriptors for %d peers", soft, target, peers)
        soft = target
    if soft < needed and not _warned_hard:
        _warned_hard = True
        log.warning("this process may open at most %d files (its hard limit), and an endpoint with %d peer(s) "
                    "may need about %d (%d for each peer on this host): connections may fail; raise the limit "
                    "(ulimit -n, systemd's LimitNOFILE=, docker's --ulimit nofile=)", soft, peers, needed, PER_PEER)
    return soft


def explained(message: str) -> str:
    """``message``, an error that running out of descriptors may have caused, with a
    sentence on this process's descriptors where it has (nearly) none left."""
    short = shortage()
    return f"{message}; {short}" if short else message


def shortage() -> str | None:
    """A sentence on this process's descriptors where it has (nearly) none left, else None."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        used = len(os.listdir("/proc/self/fd")) - 1  # (less the listing's own)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            return f"this process is out of descriptors (its open-file limit is {soft}; ulimit -n raises it)"
        return None  # no /proc here
    if soft - used > RUNNING_LOW:
        return None
    return f"this process has {used} of its {soft} descriptors open (ulimit -n raises the limit)"
