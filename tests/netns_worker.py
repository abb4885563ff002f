"""A worker run inside a network namespace by tests/test_multihost.py (one per 'host')."""

from __future__ import annotations

import json
import sys

import zmqautograd.rpc as rpc
from zmqautograd.rpc import api


def whoami_and_address():
    return [rpc.get_worker_info().name, api._agent.endpoint.address]


def main() -> None:
    rank, world_size, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://{master}", rpc_timeout=30)
    rpc.init_rpc(f"host{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {f"host{r}": rpc.rpc_sync(f"host{r}", whoami_and_address) for r in range(world_size)}
    rpc.shutdown()
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
