"""A worker run inside a network namespace by tests/test_multihost.py (one per 'host')."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import zmqautograd.rpc as rpc
from zmqautograd.rpc import api


@dataclass
class Point:  # not msgpack-able: travels pickled
    x: int
    y: int


def whoami_and_address():
    return [rpc.get_worker_info().name, api._agent.endpoint.address]


def echo(value):
    return value


def main() -> None:
    rank, world_size, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    secret = sys.argv[4] if len(sys.argv) > 4 else None
    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://{master}", rpc_timeout=30, cluster_secret=secret)
    rpc.init_rpc(f"host{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {f"host{r}": rpc.rpc_sync(f"host{r}", whoami_and_address) for r in range(world_size)}
    # The pickle policy across hosts: refused from unauthenticated peers, accepted with a secret.
    try:
        rpc.rpc_sync(f"host{(rank + 1) % world_size}", echo, args=(Point(rank, 1),))
        pickle = "accepted"
    except RuntimeError as exc:
        pickle = f"refused: {exc}"
    rpc.shutdown()
    print(json.dumps({"seen": seen, "pickle": pickle}), flush=True)


if __name__ == "__main__":
    main()
