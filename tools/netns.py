"""Separate 'hosts' for multi-host tests and benchmarks: one network namespace each, joined by a bridge in a
namespace of its own (root needed). Addresses come from RFC 2544's benchmarking range, which
is only ever our own namespaces."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

SUBNET = "198.18.0"


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Unavailable(Exception):
    """Network namespaces cannot be made here (no root, no ``ip``)."""


@contextlib.contextmanager
def bridged_hosts(count: int, hostnames: list[str] | None = None) -> Iterator[list[str]]:
    """``count`` namespaces on one bridge, host ``i`` at ``SUBNET.(i+1)``; yields their names
    (for ``ip netns exec``). With ``hostnames``, each host's ``/etc/hosts`` maps those names
    to the hosts' addresses in order, as a container network's DNS maps service names
    (``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``)."""
    tag = f"zq{os.getpid() % 100000}"
    switch, names = f"{tag}sw", [f"{tag}h{i}" for i in range(count)]
    try:
        sh("ip", "netns", "add", switch)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as exc:
        raise Unavailable(f"network namespaces are not available here: {exc}") from exc
    try:
        sh("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", switch, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            sh("ip", "netns", "add", name)
            sh("ip", "-n", name, "link", "set", "lo", "up")
            # One end in the host (eth0), the other in the switch, on the bridge.
            sh("ip", "-n", switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            sh("ip", "-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            sh("ip", "-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            if hostnames:
                os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                with open(f"/etc/netns/{name}/hosts", "w") as hosts:
                    hosts.write("127.0.0.1 localhost\n")
                    hosts.writelines(f"{SUBNET}.{j + 1} {hostname}\n" for j, hostname in enumerate(hostnames))
        yield names
    finally:
        for name in [*names, switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

