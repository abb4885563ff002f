"""The rendezvous store is no back door (docs/security.md, zmqautograd/rpc/cluster_secret.py):
with the options a user gets by default, a process that can read or write the store gets no
code run on a member and none of its values used. A group on this host signs its records
with the user's cookie, one whose store other hosts reach needs a secret (or says the line to
add), and a record the group's secret did not sign is ignored while the group starts."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import stat
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import zmq

from zmqautograd import rpc
from zmqautograd.rpc import cluster_secret
from zmqautograd.rpc.cluster_secret import ClusterSecretError, resolve
from zmqautograd.rpc.rendezvous import _seal
from zmqautograd.transport import Codec, Message, MessageType
from zmqautograd.transport.security import ENVIRONMENT_VARIABLE as SECRET_VARIABLE
from zmqautograd.transport.security import Credentials, Membership

from tests import security_functions as sf
from tests import stranger
from tests.conftest import poll_until
from tests.rpc_harness import Group, free_port, worker_main

pytestmark = pytest.mark.timeout(120)
ELSEWHERE = "tcp://10.11.12.13:29500"  # a store other hosts reach (nothing needs to listen there)


@pytest.fixture
def no_secret_given(monkeypatch, tmp_path):
    """No secret in the environment, and a cookie folder of the test's own."""
    for variable in (SECRET_VARIABLE, cluster_secret.FILE_VARIABLE, cluster_secret.INSECURE_VARIABLE):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config" / "zmqautograd" / "cookie"


# --------------------------------------------------------------- the secret a group gets


def test_a_group_on_this_host_gets_the_users_cookie_made_once_for_its_owner_alone(no_secret_given):
    cookie = no_secret_given
    made: list = []
    threads = [threading.Thread(target=lambda: made.append(resolve(None, "tcp://127.0.0.1:29500"))) for _ in range(8)]
    for thread in threads:  # several workers starting at once make one cookie between them
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(made) == 8 and len(set(made)) == 1 and len(made[0]) == 64
    status = cookie.stat()
    assert stat.S_IMODE(status.st_mode) == 0o600 and status.st_uid == os.getuid()
    assert stat.S_IMODE(cookie.parent.stat().st_mode) == 0o700
    assert [p.name for p in cookie.parent.iterdir()] == ["cookie"]  # no temporary file left
    for init_method in ("tcp://localhost:1", "tcp://[::1]:1", f"file://{cookie.parent}/store"):
        assert resolve(None, init_method) == made[0]


def test_a_cookie_others_may_read_is_refused_with_the_fix(no_secret_given):
    resolve(None, "tcp://127.0.0.1:1")
    no_secret_given.chmod(0o644)
    with pytest.raises(ClusterSecretError, match=r"may be read by others .*chmod 600"):
        resolve(None, "tcp://127.0.0.1:1")


def test_a_cookie_in_a_folder_others_may_write_is_refused(no_secret_given):
    resolve(None, "tcp://127.0.0.1:1")
    no_secret_given.parent.chmod(0o777)
    with pytest.raises(ClusterSecretError, match=r"may be written by others .*chmod 700"):
        resolve(None, "tcp://127.0.0.1:1")


def test_a_store_other_hosts_reach_needs_a_secret_and_init_rpc_says_the_line_to_add(no_secret_given, monkeypatch):
    with pytest.raises(ClusterSecretError, match=r"reached from other hosts.*export ZMQAUTOGRAD_CLUSTER_SECRET=\$\("):
        resolve(None, ELSEWHERE)
    assert not no_secret_given.exists()  # no cookie for a group across hosts: they would differ
    # Refused before the rendezvous: nothing connects to the store, nobody waits for this rank.
    with pytest.raises(ClusterSecretError, match="whoever reaches the store could join the group"):
        rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=ELSEWHERE))
    monkeypatch.setenv("MASTER_ADDR", "10.11.12.13")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(ClusterSecretError, match="MASTER_ADDR=10.11.12.13"):
        rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method="env://"))
    assert not rpc.api._is_initialized()


def test_insecure_store_starts_without_a_secret_and_says_what_it_risks(no_secret_given, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, "zmqautograd.rpc.cluster_secret")
    assert resolve(None, ELSEWHERE, insecure_store=True) is None
    monkeypatch.setenv(cluster_secret.INSECURE_VARIABLE, "1")
    assert resolve(None, ELSEWHERE) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("can join it and run code on its members" in w for w in warnings), warnings


def test_encrypt_false_needs_a_secret(no_secret_given):
    with pytest.raises(ClusterSecretError, match="encrypt=False without a cluster secret"):
        resolve(None, ELSEWHERE, encrypt=False, insecure_store=True)
    assert resolve("a secret of sixteen+", ELSEWHERE, encrypt=False) == b"a secret of sixteen+"
    assert len(resolve(None, "tcp://127.0.0.1:1", encrypt=False)) == 64  # the cookie is a secret


def test_a_secret_given_wins_and_a_secret_file_must_be_private(no_secret_given, monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_text("from a file, 32 bytes long......\n")
    path.chmod(0o600)
    monkeypatch.setenv(cluster_secret.FILE_VARIABLE, str(path))
    assert resolve(None, ELSEWHERE) == b"from a file, 32 bytes long......"
    monkeypatch.setenv(SECRET_VARIABLE, "from the environment, 16+")
    assert resolve(None, ELSEWHERE) == b"from the environment, 16+"
    assert resolve("from the options, 16 bytes", ELSEWHERE) == b"from the options, 16 bytes"
    monkeypatch.delenv(SECRET_VARIABLE)
    path.chmod(0o640)
    with pytest.raises(ClusterSecretError, match="may be read by others"):
        resolve(None, ELSEWHERE)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        resolve("short", ELSEWHERE)


def test_launchers_give_the_group_they_start_a_secret_of_its_own():
    from zmqautograd.run import _spans_hosts

    environment: dict[str, str] = {}
    assert cluster_secret.for_children(environment) and len(environment[SECRET_VARIABLE]) == 64
    assert not cluster_secret.for_children(environment)  # one given already is kept
    assert not cluster_secret.for_children({cluster_secret.FILE_VARIABLE: "/a/file"})
    assert not _spans_hosts(["train.py"])
    assert not _spans_hosts(["-m", "torch.distributed.run", "--nproc-per-node", "4", "train.py"])
    assert not _spans_hosts(["-m", "torch.distributed.run", "--nnodes=1", "train.py"])
    assert _spans_hosts(["-m", "torch.distributed.run", "--nnodes", "2", "train.py"])
    assert _spans_hosts(["-m", "torch.distributed.run", "--nnodes=1:4", "train.py"])


# ------------------------------------------------------------- forged records, real workers


def _store_client(port: int) -> dist.Store:
    deadline = time.monotonic() + 30
    while True:
        try:
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                 wait_for_workers=False, multi_tenant=True)
        except RuntimeError:
            assert time.monotonic() < deadline, "the store did not come up"
            time.sleep(0.05)  # (rank 0 is starting it: nothing to wait on)


@pytest.mark.parametrize(("secret", "forger"), [(None, None), (None, b"the forger's own secret, 32 bytes"),
                                                ("the group's own secret, 32 bytes", None)],
                         ids=["default-unsigned", "default-another-secret", "explicit-unsigned"])
def test_a_member_record_forged_in_the_store_is_ignored_and_the_group_starts(secret, forger, caplog):
    """Whoever can write the store publishes rank 1's record first, with its own CURVE key
    and an address it listens on (what ran code on the driver before). The group starts all
    the same, with the real rank 1; nothing ever connects to the forger; the record is named
    in a warning."""
    caplog.set_level(logging.WARNING, "zmqautograd.rpc.rendezvous")
    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    options = {"rpc_timeout": 30, "cluster_secret": secret}
    failures: list = []

    def rank0() -> None:
        try:
            rpc.init_rpc("worker0", rank=0, world_size=2,
                         rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            failures.append(exc)

    trap = socket.create_server(("127.0.0.1", 0))
    trap.setblocking(False)
    driver = threading.Thread(target=rank0)
    driver.start()
    store = _store_client(port)
    key = "zmqautograd/1/member/1"
    forged = json.dumps({"name": "worker1", "rank": 1, "address": f"tcp://127.0.0.1:{trap.getsockname()[1]}",
                         "world_size": 2, "devices": {}, "credential": zmq.curve_keypair()[0].decode(),
                         "mechanism": "curve"})
    store.set(f"{key}/1", _seal(forger, key, forged))  # before rank 1 is even started
    context = mp.get_context("spawn")
    errors = context.Queue()
    worker = context.Process(target=worker_main, args=(1, 2, init_method, options, errors), daemon=True)
    worker.start()
    try:
        driver.join(60)
        assert not driver.is_alive() and failures == [], failures
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))
        assert rpc.rpc_sync("worker1", sf.address) != f"tcp://127.0.0.1:{trap.getsockname()[1]}"
        with pytest.raises(BlockingIOError):
            trap.accept()  # nobody took the forged record for rank 1's
        assert any(f"{key}/1" in r.getMessage() and "ignored" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        if rpc.api._is_initialized():
            rpc.shutdown()
        worker.join(30)
        trap.close()
    assert worker.exitcode == 0 and errors.empty()


@pytest.mark.timeout(180)
def test_a_store_reader_cannot_connect_as_a_member_over_plain(tmp_path):
    """``encrypt=False`` (ZMTP PLAIN): whoever reads the store learns each member's address and
    token, but the credentials are keyed by the cluster secret (here the user's cookie, this
    group being on this host): a reader that connects to worker1 as rank 0 with what the
    store told it is refused in the handshake, nothing it sends runs, and the real rank 0 is
    served on."""
    marker = tmp_path / "marker"
    group = Group(world_size=2, num_worker_threads=4, rpc_timeout=30, encrypt=False)
    try:
        store = _store_client(int(group.init_method.rsplit(":", 1)[1]))
        records = {}
        for rank in (0, 1):
            key = f"zmqautograd/1/member/{rank}"
            sealed = json.loads(store.get(f"{key}/1"))
            records[rank] = json.loads(sealed["record"])  # (readable: only its signature needs the secret)
        assert records[1]["mechanism"] == "plain"
        refused = rpc.rpc_sync("worker1", sf.refused_connections)
        thief = Membership("0", Credentials("plain", records[0]["credential"].encode()))  # no secret: a reader's
        thief.admit("1", records[1]["credential"])
        zmq_context = zmq.Context()
        dealer = zmq_context.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.ROUTING_ID, b"0")
            thief.configure_connect(dealer, "1")
            dealer.connect(records[1]["address"])
            codec = Codec()
            for message in [Message(MessageType.HELLO, 0, "0", {"identity": "0"}),
                            *(Message(kind, 7 + i, "0", payload) for i, (kind, payload)
                              in enumerate(stranger._payloads(str(marker))))]:
                try:
                    dealer.send_multipart(codec.encode(message), flags=zmq.NOBLOCK)
                except zmq.Again:
                    break  # its handshake never completed
            poll_until(lambda: rpc.rpc_sync("worker1", sf.refused_connections) > refused, 30, "the thief refused")
            assert dealer.poll(200) == 0  # nothing came back
        finally:
            dealer.close()
            zmq_context.term()
        assert not marker.exists()
        assert rpc.rpc_sync("worker1", sf.peers) == {"0": "ready"}
        assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))
    finally:
        group.shutdown()
    assert not marker.exists()


def test_a_forged_record_is_named_when_the_group_cannot_start():
    """The records a worker ignored are named in its error when the group does not start
    (a rank with another secret: its record looks forged to the others)."""
    port = free_port()
    init_method = f"tcp://127.0.0.1:{port}"
    failures: list = []

    def rank0() -> None:
        try:
            rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(
                init_method=init_method, rpc_timeout=5, cluster_secret="the group's own secret, 32 bytes"))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            failures.append(exc)

    driver = threading.Thread(target=rank0)
    driver.start()
    store = _store_client(port)
    key = "zmqautograd/1/member/1"
    store.set(f"{key}/1", _seal(b"another secret, not the group's", key, json.dumps({"name": "worker1", "rank": 1})))
    driver.join(60)
    assert len(failures) == 1 and isinstance(failures[0], rpc.RendezvousError), failures
    message = str(failures[0])
    assert "rank(s) 1 did not join" in message and "not signed with this worker's cluster secret" in message
    assert f"{key}/1" in message
