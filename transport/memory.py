"""How much memory this process may still take, and how much its processes share: the
host's figures (``/proc/meminfo``), bounded by the limits of the memory cgroups it is in (v2
or v1; its own and their ancestors', as a container sees them). Shared memory must be
refused before it is taken (shm.py): it does not fail when memory runs out, the OOM killer
ends a process instead."""

from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"  # where cgroups are mounted (v1: a folder per controller)
SELF = "/proc/self/cgroup"  # which cgroups this process is in
_NO_LIMIT = 1 << 62  # v1 says "no limit" with the largest page multiple below 2**63

# The files of each version: the limit, the use, and in memory.stat the idle page cache,
# which the use counts and the kernel gives back under pressure (MemAvailable counts it
# available; so does Kubernetes' working set).
_V2 = ("memory.max", "memory.current", b"inactive_file ")
_V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", b"total_inactive_file ")


def figures() -> tuple[int | None, int | None]:
    """(available, total), read together. Available: bytes this process may still take,
    the kernel's estimate (MemAvailable), or less where a cgroup's limit less its use is
    lower. Total: the memory this process's processes share, the host's (MemTotal), or a
    cgroup's limit where lower. None where nothing can be read."""
    host = _meminfo()
    available, total = host.get(b"MemAvailable:"), host.get(b"MemTotal:")
    for limit, room in _limits():
        available = room if available is None else min(available, room)
        total = limit if total is None else min(total, limit)
    return available, total


def _meminfo() -> dict[bytes, int]:
    """MemAvailable and MemTotal from /proc/meminfo, in bytes (those it has)."""
    found = {}
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                key, value = line.split()[:2]
                if key in (b"MemAvailable:", b"MemTotal:"):
                    found[key] = int(value) * 1024
    except (OSError, ValueError):
        pass
    return found


def _limits() -> list[tuple[int, int]]:
    """(limit, limit - use + idle page cache) of each cgroup with a memory limit that this
    process is in, its own and its ancestors'."""
    found = []
    for folder, files in _cgroup_folders():
        limit = _number(os.path.join(folder, files[0]))
        use = _number(os.path.join(folder, files[1]))
        if limit is None or use is None or limit >= _NO_LIMIT:
            continue
        found.append((limit, limit - use + _stat(os.path.join(folder, "memory.stat"), files[2])))
    return found


def _cgroup_folders() -> list[tuple[str, tuple]]:
    """The folders of this process's memory cgroups and their ancestors, innermost first,
    with the files of their version. Where its path is not under the mount (a container
    that sees its own cgroup at the root, or the host's path bind-mounted), the mount's
    root is its cgroup."""
    try:
        with open(SELF) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        return []
    found = []
    for entry in entries:
        if len(entry) != 3:
            continue
        _hierarchy, controllers, path = entry
        if controllers == "":
            base, files = ROOT, _V2
        elif "memory" in controllers.split(","):
            base, files = os.path.join(ROOT, "memory"), _V1
        else:
            continue
        folder = os.path.normpath(os.path.join(base, path.lstrip("/")))
        if not folder.startswith(base) or not os.path.isdir(folder):
            folder = base
        while True:
            found.append((folder, files))
            if folder == base:
                break
            folder = os.path.dirname(folder)
    return found


def _number(path: str) -> int | None:
    """A cgroup file's number; None where it is missing or says "max" (no limit)."""
    try:
        with open(path, "rb") as number_file:
            return int(number_file.read())
    except (OSError, ValueError):
        return None


def _stat(path: str, key: bytes) -> int:
    try:
        with open(path, "rb") as stat_file:
            for line in stat_file:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
