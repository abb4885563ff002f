"""torch's ``rpc_test.py`` ``TensorPipeAgentRpcTest`` (sparse tensors, options, dynamic
membership), verbatim, against zmqautograd (harness.py)."""

from tests.torch_suites.harness import suites

from torch.testing._internal.distributed.rpc.rpc_test import TensorPipeAgentRpcTest  # noqa: E402

# Tests of torch-private helpers or of TensorPipe itself, each with its reason.
NOT_APPLICABLE: dict[str, str] = {
    "test_infer_backend_from_options": "checks that the agent is torch's TensorPipeAgent class",
    "test_wait_all_workers_sparse": "calls torch's private rpc.api._wait_all_workers",
    "test_wait_all_workers_twice_sparse": "calls torch's private rpc.api._wait_all_workers",
}

globals().update(suites(__name__, [TensorPipeAgentRpcTest], NOT_APPLICABLE))
