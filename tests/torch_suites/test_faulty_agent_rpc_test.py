"""torch's ``faulty_agent_rpc_test.py`` (``FaultyAgentRpcTest``), verbatim, against zmqautograd
with torch's faulty-agent settings (harness.py, ``ZmqFaultyAgentTestFixture``)."""

from tests.torch_suites.harness import ZmqFaultyAgentTestFixture, suites

from torch.testing._internal.distributed.rpc.faulty_agent_rpc_test import FaultyAgentRpcTest  # noqa: E402

NOT_APPLICABLE: dict[str, str] = {
    "test_verify_backend_options": "checks for torch's backend_registry.BackendType.FAULTY_TENSORPIPE",
}

globals().update(suites(__name__, [FaultyAgentRpcTest], NOT_APPLICABLE, fixture=ZmqFaultyAgentTestFixture))
