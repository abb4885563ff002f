"""torch's ``rpc_test.py`` (``RpcTest``), verbatim, against zmqautograd (harness.py)."""

from tests.torch_suites.harness import suites

from torch.testing._internal.distributed.rpc.rpc_test import RpcTest  # noqa: E402

_ALL_GATHER = "tests torch's private rpc.api._all_gather, which no other backend provides"
_BARRIER = "tests torch's private rpc.api._barrier"
_WAIT_ALL_WORKERS = "calls torch's private rpc.api._wait_all_workers"
_REGISTRY = "tests torch's backend_registry (registering and inferring backends); zmqautograd is one backend"

# Tests of torch-private helpers that no other backend could provide, each with its reason.
NOT_APPLICABLE: dict[str, str] = {
    "test_all_gather": _ALL_GATHER,
    "test_all_gather_timeout": _ALL_GATHER,
    "test_shutdown_errors": "patches rpc.api._broadcast_to_followers, part of torch's private _all_gather",
    "test_rpc_barrier_all": _BARRIER,
    "test_rpc_barrier_partial_subset": _BARRIER,
    "test_rpc_barrier_subset": _BARRIER,
    "test_wait_all_workers_timeout": _WAIT_ALL_WORKERS,
    "test_wait_all_workers_dense": _WAIT_ALL_WORKERS,
    "test_wait_all_workers_twice_dense": _WAIT_ALL_WORKERS,
    "test_use_rpc_pickler": "tests torch's private _use_rpc_pickler (its internal pickler)",
    "test_py_nested_pickle": "pickles through torch's private _internal_rpc_pickler",
    "test_register_rpc_backend_and_set_and_start_rpc_backend": _REGISTRY,
    "test_cannot_infer_backend_from_options": _REGISTRY,
    "test_duplicate_name": "starts an agent through torch's private rpc._init_rpc_backend (backend_registry)",
    "test_disable_gil_profiling": "TensorPipe's GIL wait-time metrics",
    # (its first part, to_here() after shutdown, is tests/rpc/test_rpc.py's lifecycle test)
    "test_use_rref_after_shutdown": "forks an RRef through torch's private rpc.internal.serialize",
}

globals().update(suites(__name__, [RpcTest], NOT_APPLICABLE))
