"""Workers whose soft limit on open files is too low for their group (a real limit, set in
each worker before init_rpc): each raises it toward its hard limit as peers are added
(transport/descriptors.py) and the group works. Without that, libzmq could not accept
connections (it retries at once, forever) and init_rpc waited out its timeout."""

from __future__ import annotations

import logging
import resource

import pytest
import torch

from zmqautograd import rpc
from zmqautograd.transport import descriptors

from ..rpc_harness import free_port, spawn_and_collect

WORLD = 8
SOFT = 48  # less than 7 peers on this host take (6 each), with torch and libzmq


def _worker(rank: int, init_method: str, results) -> None:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger(descriptors.__name__).addHandler(Keep())
    logging.getLogger(descriptors.__name__).setLevel(logging.INFO)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=60))
        answers = [rpc.rpc_sync(f"worker{peer}", torch.add, args=(torch.ones(2), peer)).tolist()
                   for peer in range(WORLD) if peer != rank]
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        rpc.shutdown()
        results.put((rank, answers, soft, records))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}", None, records))


@pytest.mark.timeout(240)
def test_workers_whose_open_file_limit_is_too_low_raise_it_and_the_group_works():
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < descriptors.room_for(WORLD):
        pytest.skip("the hard open-file limit here is too low to raise the soft one to")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    results = sorted(spawn_and_collect(_worker, [(rank, init_method) for rank in range(WORLD)], timeout=180))
    for rank, answers, soft, records in results:
        assert answers == [[1.0 + peer] * 2 for peer in range(WORLD) if peer != rank], (rank, answers, records)
        assert soft >= descriptors.room_for(WORLD - 1)
        assert any(r.startswith("INFO raised the open-file limit from 48") for r in records), records
        assert not any(r.startswith("WARNING") for r in records), records
