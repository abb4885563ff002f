"""Workers on separate 'hosts': network namespaces joined by a bridge (root needed; skipped
where namespaces cannot be made). Each host advertises the address of the interface that
routes to the master, never loopback, and calls cross the bridge. A stranger on a fourth
host reads the store and attacks every worker: it gets nothing run."""

from __future__ import annotations

import json
import os

import pytest

from tests.netns import SUBNET, Unavailable, bridged_hosts, outputs_of, start_in

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTS = 3


@pytest.fixture
def hosts():
    try:
        with bridged_hosts(HOSTS + 1) as names:  # the last one is the stranger's
            yield names
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("secret", "encrypt"), [("a cluster secret of some length", True),
                                                 ("a cluster secret of some length", False), (None, True)],
                         ids=["secret", "secret-authenticated-only", "insecure-store"])
def test_workers_on_separate_hosts_and_a_stranger_on_another(hosts, tmp_path, secret, encrypt):
    """Routable addresses, calls and pickles between members across hosts; a stranger on a
    fourth host that reads the workers' addresses (and public keys) from the store tries
    HELLO + calls by reference, a pickle, forged answers and control messages on each worker
    (tests/stranger.py): refused in the handshake every time, nothing runs (the marker file
    never appears), and the workers serve on and shut down cleanly. Across hosts a group
    needs a cluster secret; without one (``ZMQAUTOGRAD_INSECURE_STORE=1``, opted out of it)
    strangers are still refused, though whoever could write the store could join. Each
    worker runs in a pid namespace of its own, as on separate machines."""
    master = f"{SUBNET}.1:29500"
    marker, serve_until = tmp_path / "marker", tmp_path / "serve-until"
    env = {**os.environ, "PYTHONPATH": ROOT, "ZQ_SERVE_UNTIL": str(serve_until)}
    env.pop("ZMQAUTOGRAD_CLUSTER_SECRET", None)
    if secret is None:
        env["ZMQAUTOGRAD_INSECURE_STORE"] = "1"
    extra = [secret or "-", "1" if encrypt else "0"]
    processes = [start_in(name, ["-m", "tests.netns_worker", str(rank), str(HOSTS), master, *extra], env, ROOT,
                          own_pid_namespace=True)
                 for rank, name in enumerate(hosts[:HOSTS])]
    stranger = start_in(hosts[HOSTS], ["-m", "tests.stranger", str(marker), master, str(HOSTS)], env, ROOT,
                        own_pid_namespace=True)
    try:
        (attack, attack_err), = outputs_of([stranger], timeout=120)
    finally:
        serve_until.touch()
    assert stranger.returncode == 0, attack_err[-3000:]
    report = json.loads(attack.strip().splitlines()[-1])
    assert report["store_records"] == HOSTS
    for address, received in report["reports"].items():
        assert received == {"null": 0, "plain": 0, "curve": 0}, (address, received)
    outputs = []
    for process, (out, err) in zip(processes, outputs_of(processes, timeout=100)):
        assert process.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    for result in outputs:
        for rank in range(HOSTS):
            name, address = result["seen"][f"host{rank}"]
            assert name == f"host{rank}"
            assert address.startswith(f"tcp://{SUBNET}.{rank + 1}:"), address  # not loopback
        assert result["pickle"] == "accepted"
        assert result["seen"]["still"][0].startswith("host")  # served on after the attack
        # Hosts apart (own pid namespaces): no lending, no rings; big tensors went sealed on
        # the bulk connection where the group encrypts, through CurveZMQ's socket nowhere.
        assert result["big"] and result["paths"]["lent"] == 0 and result["paths"]["rings"] == 0, result
        assert (result["paths"]["bulk"] > 0) == encrypt, result
    assert not marker.exists()
