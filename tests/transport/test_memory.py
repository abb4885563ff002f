"""The memory a process may take (transport/memory.py), which bounds the shared-memory rings:
the host's figures bounded by its cgroups' limits. First on cgroup trees written here (v2,
v1, a container's view), then in a real v1 memory cgroup where this machine has one."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from zmqautograd.transport import Message, MessageType, memory, shm

from tests.transport.test_shm import _paired

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
HOST_TOTAL = memory._meminfo()[b"MemTotal:"]
HOST_AVAILABLE = 64 << 30  # (fixed, not read: the host's figure moves while a test runs)


def _tree(tmp_path, monkeypatch, self_lines: str, files: dict[str, str]) -> None:
    """A cgroup mount at ``tmp_path`` holding ``files`` (path: content), and this process
    in the cgroups ``self_lines`` name (/proc/self/cgroup's format)."""
    for path, content in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content)
    (tmp_path / "self").write_text(self_lines)
    monkeypatch.setattr(memory, "ROOT", str(tmp_path))
    monkeypatch.setattr(memory, "SELF", str(tmp_path / "self"))
    host = {**memory._meminfo(), b"MemAvailable:": HOST_AVAILABLE}
    monkeypatch.setattr(memory, "_meminfo", lambda: host)


def test_v2_limits_of_the_cgroup_and_its_ancestors_bound_what_is_available(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, "0::/jobs/job7\n", {
        "cgroup.controllers": "memory pids\n",
        "memory.max": "max\n",  # the root: no limit
        "jobs/memory.max": f"{1024 * MIB}\n",
        "jobs/memory.current": f"{900 * MIB}\n",
        "jobs/memory.stat": f"anon 1\ninactive_file {50 * MIB}\nactive_file 2\n",
        "jobs/job7/memory.max": f"{2048 * MIB}\n",
        "jobs/job7/memory.current": f"{300 * MIB}\n",
        "jobs/job7/memory.stat": "anon 1\n",
    })
    # The parent binds: 1024 MiB, of which 900 used less 50 of idle page cache.
    assert memory.figures() == (174 * MIB, min(HOST_TOTAL, 1024 * MIB))
    (tmp_path / "jobs/memory.max").write_text("max\n")
    assert memory.figures() == (1748 * MIB, min(HOST_TOTAL, 2048 * MIB))


def test_a_container_that_sees_its_own_cgroup_at_the_root_reads_it_there(tmp_path, monkeypatch):
    # With a cgroup namespace the path reads "/"; without, the host's path, which the
    # container's mount does not have: both mean the mount's root.
    files = {"memory.max": f"{512 * MIB}\n", "memory.current": f"{100 * MIB}\n",
             "memory.stat": f"inactive_file {10 * MIB}\n"}
    for path in ("/", "/kubepods/burstable/pod1234/abcdef"):
        _tree(tmp_path, monkeypatch, f"0::{path}\n", files)
        assert memory.figures() == (422 * MIB, min(HOST_TOTAL, 512 * MIB))


def test_v1_memory_limits_count_and_unlimited_ones_do_not(tmp_path, monkeypatch):
    unlimited = "9223372036854771712\n"  # what v1 writes for "no limit"
    _tree(tmp_path, monkeypatch, "12:pids:/x\n4:cpu,memory:/box/inner\n0::/\n", {
        "memory/memory.limit_in_bytes": unlimited,
        "memory/memory.usage_in_bytes": f"{5000 * MIB}\n",
        "memory/box/memory.limit_in_bytes": f"{256 * MIB}\n",
        "memory/box/memory.usage_in_bytes": f"{200 * MIB}\n",
        "memory/box/memory.stat": f"inactive_file {1 * MIB}\ntotal_inactive_file {8 * MIB}\n",
        "memory/box/inner/memory.limit_in_bytes": unlimited,
        "memory/box/inner/memory.usage_in_bytes": f"{150 * MIB}\n",
    })
    # Hierarchical: the box's idle cache, its children's included.
    assert memory.figures() == (64 * MIB, min(HOST_TOTAL, 256 * MIB))
    # And a ring that would take more than an eighth of that is refused.
    with pytest.raises(OSError, match="more than an eighth"):
        shm.Ring.create(8 * MIB)


def test_nothing_readable_means_the_hosts_figures(tmp_path, monkeypatch):
    _tree(tmp_path, monkeypatch, "garbage\n1:memory:/gone\n", {"memory/memory.limit_in_bytes": "not a number\n"})
    assert memory.figures() == (HOST_AVAILABLE, HOST_TOTAL)


# ------------------------------------------------------------- a real v1 memory cgroup


def _own_v1_memory_cgroup() -> str | None:
    """The folder of this process's v1 memory cgroup, where one may be made under it."""
    folder = next((folder for folder, files in memory._cgroup_folders() if files is memory._V1), None)
    return folder if folder is not None and os.access(folder, os.W_OK) else None


def _in_a_small_cgroup(cgroup: str, limit: int, ring: int, results) -> None:
    """In another process: move into ``cgroup`` (limit ``limit``), read the figures, then
    two endpoints whose rings of ``ring`` bytes the limit cannot hold talk both ways."""
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        available, total = memory.figures()
        found = {"total": total, "available": available}
        try:
            shm.Ring.create(ring).close()
            found["refused"] = None
        except OSError as exc:
            found["refused"] = str(exc)
        with _paired(rings=False, shm_ring=ring) as (a, b, _lost):
            for seq in range(50):
                a.send("b", Message(MessageType.PYTHON_CALL, seq + 1, "a", seq))
                b.send("a", Message(MessageType.PYTHON_RET, seq + 1, "b", -seq))
            found["b got"] = [b.recv(30).payload for _ in range(50)]
            found["a got"] = [a.recv(30).payload for _ in range(50)]
            found["rings"] = a.stats()["b"].shared_memory or b.stats()["a"].shared_memory
        results.put(found)
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc))


def test_in_a_real_memory_cgroup_rings_its_limit_cannot_hold_are_not_made():
    # As in a container limited to 256 MiB on a host with far more: rings of 160 MiB (one
    # each way) cannot both fit. Read from the host's figures alone they were made, and the
    # kernel's OOM killer ended the process (SIGKILL, checked). Now the limit is read, the
    # rings are refused, and the messages go by the socket.
    parent = _own_v1_memory_cgroup()
    if parent is None:
        pytest.skip("needs a v1 memory cgroup this test may make a child in")
    cgroup = os.path.join(parent, f"zmqautograd-test-{os.getpid()}")
    os.makedirs(cgroup, exist_ok=True)
    try:
        limit = 256 * MIB
        with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w") as limit_file:
            limit_file.write(str(limit))
        context = multiprocessing.get_context("spawn")
        results = context.SimpleQueue()
        process = context.Process(target=_in_a_small_cgroup, args=(cgroup, limit, 160 * MIB, results))
        process.start()
        process.join(90)
        assert process.exitcode == 0, f"the process in the cgroup ended with {process.exitcode}"
        found = results.get()
        assert isinstance(found, dict), found
        assert found["total"] == limit
        assert 0 < found["available"] <= limit
        assert found["refused"] is not None and "more than an eighth" in found["refused"]
        assert found["b got"] == list(range(50)) and found["a got"] == [-seq for seq in range(50)]
        assert not found["rings"]
    finally:
        os.rmdir(cgroup)
