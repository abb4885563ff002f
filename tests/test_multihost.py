"""Workers on separate 'hosts': network namespaces joined by a bridge (root needed; skipped
where namespaces cannot be made). Each host advertises the address of the interface that
routes to the master, never loopback, and calls cross the bridge."""

from __future__ import annotations

import json
import os

import pytest

from tests.netns import SUBNET, Unavailable, bridged_hosts, outputs_of, start_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = 3


@pytest.fixture
def hosts():
    try:
        with bridged_hosts(HOSTS) as names:
            yield names
    except Unavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("secret", [None, "a cluster secret of some length"])
def test_workers_on_separate_hosts_advertise_routable_addresses(hosts, secret):
    """Also the pickle policy across hosts: without a cluster secret, pickled payloads from
    another host are refused with a clear error; with one (all traffic CURVE-encrypted, peers
    authenticated) they are accepted."""
    master = f"{SUBNET}.1:29500"
    env = {**os.environ, "PYTHONPATH": ROOT}
    extra = [secret] if secret else []
    processes = [start_in(name, ["-m", "tests.netns_worker", str(rank), str(HOSTS), master, *extra], env, ROOT)
                 for rank, name in enumerate(hosts)]
    outputs = []
    for process, (out, err) in zip(processes, outputs_of(processes, timeout=100)):
        assert process.returncode == 0, err[-3000:]
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    for result in outputs:
        for rank in range(HOSTS):
            name, address = result["seen"][f"host{rank}"]
            assert name == f"host{rank}"
            assert address.startswith(f"tcp://{SUBNET}.{rank + 1}:"), address  # not loopback
        if secret:
            assert result["pickle"] == "accepted"
        else:
            assert result["pickle"].startswith("refused") and "only from authenticated peers" in result["pickle"]
