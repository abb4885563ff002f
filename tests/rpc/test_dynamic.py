"""Dynamic membership (rpc/membership.py): ``init_rpc`` without ``world_size`` joins a group
that runs; members see who joins and who leaves, calls work both ways, a departed or dead
member fails calls clearly and does not hold up those who join later. Real worker
processes; this process is w0, the worker whose rank hosts the store."""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import re
import queue
import signal

import pytest
import torch

import zmqautograd.autograd as dist_autograd  # (before any init_rpc: its hooks join every agent)
import zmqautograd.rpc as rpc
from zmqautograd.rpc import cluster_secret
from zmqautograd.rpc.rendezvous import _seal, _unseal
from zmqautograd.transport import shm

from tests import rpc_functions as f
from tests import security_functions as sf
from tests.conftest import poll_until
from tests.rpc_harness import free_port
from tests.transport.test_membership import _strangers
from tests.transport.test_shm import _mapped_rings

pytestmark = pytest.mark.timeout(180)

OPTIONS = {"rpc_timeout": 20, "heartbeat_interval": 0.2, "peer_timeout": 2.0}


def _member(rank: int, name: str, init_method: str, commands, results, secret: str | None = None) -> None:
    """A worker that joins, reports what it sees, then runs the test's commands."""
    faulthandler.dump_traceback_later(50)  # where it is, should joining take longer than the test waits
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, cluster_secret=secret, **OPTIONS)
        rpc.init_rpc(name, rank=rank, rpc_backend_options=options)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        results.put((name, "refused", f"{type(exc).__name__}: {exc}"))
        return
    finally:
        faulthandler.cancel_dump_traceback_later()
    results.put((name, "joined", _names()))
    while True:
        command = commands.get(timeout=120)
        if command == "leave":
            rpc.shutdown()
            results.put((name, "left"))
            return
        if command == "open a context":  # ... that reaches w0, and is never left
            context_id = dist_autograd.context().__enter__()
            rpc.rpc_sync("w0", torch.add, args=(torch.ones(2, requires_grad=True), 1))
            results.put((name, "opened", context_id))
            continue
        results.put((name, "called", rpc.rpc_sync(command, f.whoami)))


def _names() -> list[str]:
    return sorted(info.name for info in rpc._get_current_rpc_agent().get_worker_infos())


def _through_shared_memory(peer: str) -> bool:
    return rpc._get_current_rpc_agent().endpoint.through_shared_memory(peer)


class _Cluster:
    """Worker processes, each with queues of its own: a worker killed while it holds a
    queue's lock would leave that queue locked for every other process."""

    def __init__(self, secret: str | None = None) -> None:
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.context = mp.get_context("spawn")
        self.processes: dict[str, tuple] = {}
        self.replaced: list[tuple] = []  # earlier workers of a name that was joined again
        self.secret = secret

    def join(self, rank: int, name: str, secret: str | None = None) -> tuple:
        commands, results = self.context.Queue(), self.context.Queue()
        process = self.context.Process(target=_member, args=(rank, name, self.init_method, commands, results,
                                                             secret or self.secret))
        process.start()
        if name in self.processes:  # a second worker of that name (refused, or a restart)
            self.replaced.append(self.processes[name])
        self.processes[name] = (process, commands, results)
        return self.next(name)

    def next(self, name: str) -> tuple:
        process, _, results = self.processes[name]
        try:
            return results.get(timeout=60)
        except queue.Empty:
            raise AssertionError(f"no word from {name} in 60 s (alive: {process.is_alive()}, "
                                 f"exit code {process.exitcode})") from None

    def tell(self, name: str, command: str) -> tuple:
        self.processes[name][1].put(command)
        return self.next(name)

    def close(self) -> None:
        everyone = [*self.processes.values(), *self.replaced]
        for process, commands, _ in everyone:
            if process.is_alive():
                commands.put("leave")
        for process, _, _ in everyone:
            process.join(30)
            if process.is_alive():
                process.kill()


@pytest.fixture(params=[None], ids=["default secret"])
def cluster(request):
    c = _Cluster(request.param)
    options = rpc.ZmqRpcBackendOptions(init_method=c.init_method, cluster_secret=c.secret, **OPTIONS)
    rpc.init_rpc("w0", rank=0, rpc_backend_options=options)
    try:
        yield c
    finally:
        c.close()
        rpc.shutdown()


def test_workers_join_a_running_group_call_each_other_leave_and_come_back(cluster):
    assert _names() == ["w0"]
    assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1"])
    assert _names() == ["w0", "w1"]  # admitted before w1's init_rpc could finish
    assert rpc.rpc_sync("w1", f.whoami) == "w1"
    assert cluster.tell("w1", "w0") == ("w1", "called", "w0")
    assert cluster.join(5, "w5") == ("w5", "joined", ["w0", "w1", "w5"])  # ranks need not be dense
    assert cluster.tell("w5", "w1") == ("w5", "called", "w1")
    assert cluster.tell("w1", "w5") == ("w1", "called", "w5")
    assert torch.equal(rpc.rpc_sync(5, torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))

    # Members of one host talk through shared-memory rings once they have talked (w1 and
    # w0: a ring each way); one that leaves takes its rings along, one that comes back under
    # its name gets new ones.
    rings_here = shm.SUPPORTED  # (x86-64 Linux)
    if rings_here:
        poll_until(lambda: _through_shared_memory("1"), 30, "w0 writing to w1's ring")
    rings = _mapped_rings()
    assert cluster.tell("w1", "leave") == ("w1", "left")
    poll_until(lambda: _names() == ["w0", "w5"], 30, "w1 gone from the group")
    with pytest.raises(RuntimeError, match="'w1': it left the group"):
        rpc.rpc_sync("w1", f.whoami)
    assert cluster.tell("w5", "w0") == ("w5", "called", "w0")
    if rings_here:
        poll_until(lambda: _mapped_rings() == rings - 2, 30, "w1's rings released")

    # The same name and rank again, in a new process.
    assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1", "w5"])
    assert rpc.rpc_sync("w1", f.whoami) == "w1"
    assert cluster.tell("w5", "w1") == ("w5", "called", "w1")
    assert cluster.tell("w1", "w0") == ("w1", "called", "w0")
    if rings_here:
        poll_until(lambda: _through_shared_memory("1"), 30, "w0 writing to the new w1's ring")
        poll_until(lambda: _mapped_rings() == rings, 30, "the new w1's rings mapped")


def test_a_taken_name_or_rank_is_refused_and_the_group_goes_on(cluster):
    assert cluster.join(1, "w1")[1] == "joined"
    name, outcome, why = cluster.join(2, "w1")
    assert (name, outcome) == ("w1", "refused") and "is not unique" in why
    name, outcome, why = cluster.join(1, "other")
    assert outcome == "refused" and "rank 1 is taken by member 'w1'" in why
    assert _names() == ["w0", "w1"]
    assert cluster.join(2, "w2") == ("w2", "joined", ["w0", "w1", "w2"])


def test_a_stranger_at_a_members_port_does_not_hold_up_who_joins_next(cluster):
    """A dynamic group's members hold a connection whose credentials nobody knows yet (a
    joiner may connect before they read its record), until its deadline: rpc_timeout, 20 s
    here. A stranger who connects to w5 and stays does not hold up w1, who joins after it
    and connects to w5 (the lower name connects): with a ZAP handler that took no request
    while it held one, w1's connection waited for the stranger's deadline and its join
    failed."""
    assert cluster.join(5, "w5")[1] == "joined"
    address, key = rpc.rpc_sync("w5", sf.address), rpc.rpc_sync("w5", sf.credential)
    with _strangers(address, key.encode(), 1):
        poll_until(lambda: rpc.rpc_sync("w5", sf.held_connections) == 1, 10, "the stranger held at w5")
        assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1", "w5"])
        assert cluster.tell("w1", "w5") == ("w1", "called", "w5")
        # Still held (not refused at its deadline, when a stalled w1 would have got through).
        assert rpc.rpc_sync("w5", sf.held_connections) == 1


def test_a_member_that_dies_is_lost_and_does_not_hold_up_who_joins_next(cluster):
    assert cluster.join(1, "w1")[1] == "joined"
    process = cluster.processes["w1"][0]
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    # Lost (its connection closed) or, if w0 already read that from the group's log, gone.
    with pytest.raises(RuntimeError, match=r"lost peer '1'|it left the group \(lost\)"):
        rpc.rpc_sync("w1", f.sleep_and_return, args=(30,))
    poll_until(lambda: _names() == ["w0"], 30, "w1 gone from the group")
    assert cluster.join(2, "w2") == ("w2", "joined", ["w0", "w2"])
    assert rpc.rpc_sync("w2", f.whoami) == "w2"


def _contexts_here() -> int:
    return int(dist_autograd._get_debug_info()["num_autograd_contexts"])


def test_contexts_of_a_departed_member_go_quietly_those_of_a_lost_one_with_a_warning(cluster, caplog):
    """Contexts that reached us from a member that is gone can never be released by it: they
    are released here. A member that said goodbye is no fault (its releases may still travel
    down a chain when it leaves; they are not awaited, as in torch): no warning. One that
    vanished is: a warning names it."""
    caplog.set_level(logging.DEBUG, logger="zmqautograd.autograd.hooks")
    for rank, name in ((1, "w1"), (2, "w2")):
        assert cluster.join(rank, name)[1] == "joined"
        assert cluster.tell(name, "open a context")[1] == "opened"
    assert _contexts_here() == 2

    def reports(worker: int) -> list:
        return [r for r in caplog.records if re.search(rf"autograd context\(s\) of \w+ worker {worker}$", r.getMessage())]

    # (The report is logged after the release, on the thread that took the loss: wait for both.)
    assert cluster.tell("w1", "leave") == ("w1", "left")
    poll_until(lambda: _contexts_here() == 1 and reports(1), 30, "w1's context released here, and reported")
    assert [(r.levelno, "of departed worker 1" in r.getMessage()) for r in reports(1)] == [(logging.DEBUG, True)]

    process = cluster.processes["w2"][0]
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    poll_until(lambda: _contexts_here() == 0 and reports(2), 30, "w2's context released here, and reported")
    assert [(r.levelno, "of lost worker 2" in r.getMessage()) for r in reports(2)] == [(logging.WARNING, True)]


def test_a_late_word_that_a_restarted_member_was_lost_does_not_evict_it(cluster):
    """Every member that loses a worker says so in the group's log, some late: a worker
    restarted under its name and rank may have joined again meanwhile. A lost event names
    the incarnation it lost (the number of its join), so the new one stays."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    assert cluster.join(1, "w1")[1] == "joined"
    (rref_rank, first_rref), first_context = rpc.rpc_sync("w1", f.ids_made_here)
    process = cluster.processes["w1"][0]
    os.kill(process.pid, signal.SIGKILL)
    process.join(10)
    poll_until(lambda: _names() == ["w0"], 30, "w1 gone from the group")
    # Errors about its loss made now still name it (a pass it took part in, say).
    assert rpc._get_current_rpc_agent().name_of(1) == "w1"
    assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1"])
    # Ids the first w1 made may live on elsewhere: the second makes others (RRef ids count on
    # from where its join puts them; context ids are unguessable, and others).
    (rank_again, second_rref), second_context = rpc.rpc_sync("w1", f.ids_made_here)
    assert rref_rank == rank_again == 1 and second_rref > first_rref
    assert second_context >> 48 == first_context >> 48 == 1 and second_context != first_context
    store = dist.TCPStore("127.0.0.1", int(cluster.init_method.rsplit(":", 1)[1]), is_master=False,
                          timeout=timedelta(seconds=10), wait_for_workers=False, multi_tenant=True)
    secret = cluster_secret.user_cookie()  # (the group's: it runs on this host with no secret given)
    events = [_unseal(secret, f"zmqautograd/dynamic/event/{n}", store.get(f"zmqautograd/dynamic/event/{n}"))
              for n in range(1, 5)]
    first_join = next(n for n, e in enumerate(events, 1) if e["op"] == "join" and e["name"] == "w1")
    assert {"op": "lost", "rank": 1, "join": first_join, "group": events[0]["group"]} in events  # w0's word
    # Another member's word about the first w1, arriving after the second joined.
    late = _seal(secret, "zmqautograd/dynamic/event/5", json.dumps(
        {"op": "lost", "rank": 1, "join": first_join, "group": events[0]["group"]}))
    assert store.compare_set("zmqautograd/dynamic/event/5", "", late) == late.encode()
    # Whoever joins next reads it first, and so does every member before it admits the joiner.
    assert cluster.join(2, "w2") == ("w2", "joined", ["w0", "w1", "w2"])
    poll_until(lambda: "w2" in _names(), 30, "w2 admitted here")
    assert _names() == ["w0", "w1", "w2"]
    assert rpc.rpc_sync("w1", f.whoami) == "w1"
    assert cluster.tell("w2", "w1") == ("w2", "called", "w1")


def _static_join(init_method, results) -> None:  # (a queue of its own: see _Cluster)
    try:
        rpc.init_rpc("s", rank=1, world_size=2,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=5))
        results.put(("joined",))
    except Exception as exc:  # noqa: BLE001
        results.put((type(exc).__name__, str(exc)))


def test_a_static_worker_cannot_join_a_dynamic_group_and_init_rpc_needs_a_rank(cluster):
    results = cluster.context.Queue()
    process = cluster.context.Process(target=_static_join, args=(cluster.init_method, results))
    process.start()
    assert results.get(timeout=60) == (
        "RuntimeError", "RPC group mixes statically and dynamically initialized members which is not supported.")
    process.join(30)
    with pytest.raises(RuntimeError, match="already initialized"):
        rpc.init_rpc("again", rank=3, rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=cluster.init_method))


def test_init_rpc_without_world_size_needs_a_rank():
    with pytest.raises(ValueError, match="rank parameter missing"):
        rpc.init_rpc("w", rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}"))


SECRET = "a cluster secret of the test group"


@pytest.mark.parametrize("cluster", [SECRET], ids=["secret"], indirect=True)
def test_with_a_cluster_secret_a_forged_event_is_ignored_and_another_secret_cannot_join(cluster):
    """Every event is signed: a member that a stranger writes into the log is ignored by
    every member, and so is a worker with another secret, which sees none of them either (a
    group of its own, with a warning that says why); a forged event stops nobody joining."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1"])
    # A stranger who reaches the store writes a member of its own into the group's log.
    store = dist.TCPStore("127.0.0.1", int(cluster.init_method.rsplit(":", 1)[1]), is_master=False,
                          timeout=timedelta(seconds=10), wait_for_workers=False, multi_tenant=True)
    forged = {"op": "join", "name": "intruder", "rank": 9, "address": "tcp://127.0.0.1:1", "credential": "x",
              "mechanism": "curve"}
    assert store.compare_set("zmqautograd/dynamic/event/3", "", json.dumps(forged)) == json.dumps(forged).encode()
    assert cluster.tell("w1", "w0") == ("w1", "called", "w0")  # (the members read it meanwhile)
    assert _names() == ["w0", "w1"]
    assert cluster.join(2, "w2", secret="another secret, not the group's") == ("w2", "joined", ["w2"])
    assert cluster.join(3, "w3") == ("w3", "joined", ["w0", "w1", "w3"])  # the group's secret: it is ignored
    assert _names() == ["w0", "w1", "w3"]


def test_with_the_default_secret_a_forged_join_and_leave_are_ignored(cluster, caplog):
    """Default options (a group on this host signs its log with the user's cookie): whoever
    writes to the store publishes a member of its own (an address it listens on) and then
    that w1 left, unsigned, and replays a signed leave of w1 from another group's log.
    Nobody connects to it, w1 stays a member, and a worker joining after it sees the group as
    it is."""
    import json
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    caplog.set_level(logging.WARNING, "zmqautograd.rpc.membership")
    assert cluster.join(1, "w1") == ("w1", "joined", ["w0", "w1"])
    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    store = dist.TCPStore("127.0.0.1", int(cluster.init_method.rsplit(":", 1)[1]), is_master=False,
                          timeout=timedelta(seconds=10), wait_for_workers=False, multi_tenant=True)
    forged = [{"op": "join", "name": "intruder", "rank": 9, "address": f"tcp://127.0.0.1:{trap.getsockname()[1]}",
               "credential": "x" * 40, "mechanism": "curve", "group": "any"}, {"op": "leave", "rank": 1, "group": "any"}]
    for number, event in enumerate(forged, 3):
        assert store.compare_set(f"zmqautograd/dynamic/event/{number}", "", json.dumps(event)) == json.dumps(event).encode()
    # And a leave signed with the group's own secret, but another group's (replayed from the
    # log of an earlier group on this host, whose workers used the same cookie).
    key = "zmqautograd/dynamic/event/5"
    replayed = _seal(cluster_secret.user_cookie(), key, json.dumps({"op": "leave", "rank": 1, "group": "an earlier group"}))
    assert store.compare_set(key, "", replayed) == replayed.encode()
    assert cluster.join(2, "w2") == ("w2", "joined", ["w0", "w1", "w2"])  # (it read both: ignored)
    poll_until(lambda: "w2" in _names(), 30, "w2 admitted here")  # (our watcher read past both)
    assert _names() == ["w0", "w1", "w2"]
    assert rpc.rpc_sync("w1", f.whoami) == "w1" and cluster.tell("w1", "w2") == ("w1", "called", "w2")
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody took the forged member for one
    trap.close()
    ignored = [r.getMessage() for r in caplog.records if "zmqautograd/dynamic/event/" in r.getMessage()]
    assert any("event/3" in m for m in ignored) and any("event/4" in m for m in ignored), ignored
    assert any("event 5 of the log is another group's" in r.getMessage() for r in caplog.records)
