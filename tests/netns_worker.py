"""A worker run inside a network namespace by tests/system/test_multihost.py (one per 'host')."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

import torch

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
    secret = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    encrypt = sys.argv[5] != "0" if len(sys.argv) > 5 else True
    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://{master}", rpc_timeout=30, cluster_secret=secret,
                                       encrypt=encrypt)
    rpc.init_rpc(f"host{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    seen = {f"host{r}": rpc.rpc_sync(f"host{r}", whoami_and_address) for r in range(world_size)}
    # Pickles across hosts: every connection is a member's, so accepted (as torch does).
    try:
        rpc.rpc_sync(f"host{(rank + 1) % world_size}", echo, args=(Point(rank, 1),))
        pickle = "accepted"
    except RuntimeError as exc:
        pickle = f"refused: {exc}"
    # A big tensor each way, over the bulk connection where the group encrypts (sealed by
    # us, not CurveZMQ: transport/bulk.py), else through the socket.
    big = torch.randn(1 << 19)
    big_back = rpc.rpc_sync(f"host{(rank + 1) % world_size}", echo, args=(big,))
    big_ok = bool(torch.equal(big_back, big))
    hold = os.environ.get("ZQ_SERVE_UNTIL")  # serve until the test says (a stranger attacks)
    deadline = time.monotonic() + 90
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)  # (a file another process makes: nothing to wait on)
    seen["still"] = rpc.rpc_sync(f"host{(rank + 1) % world_size}", whoami_and_address)
    stats = api._agent.endpoint.stats().values()
    paths = {"bulk": sum(s.buffers_bulk for s in stats), "lent": sum(s.buffers_lent for s in stats),
             "rings": sum(s.shared_memory for s in stats)}
    rpc.shutdown()
    print(json.dumps({"seen": seen, "pickle": pickle, "big": big_ok, "paths": paths}), flush=True)


if __name__ == "__main__":
    main()
