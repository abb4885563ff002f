"""torch's faulty-agent tests, ported (tests/faulty_agent_cases.py), on 4 real worker processes
with fault injection on: retryable control messages fail 3 times each, calls are delayed."""

import pytest

from tests import faulty_agent_cases
from tests.spmd import group_fixture, make_tests

OPTIONS = {**faulty_agent_cases.GROUP_OPTIONS, "rpc_timeout": 60, "retry_delay": 0.05}

pytestmark = pytest.mark.timeout(300)
shared_group = group_fixture("tests.faulty_agent_cases", **OPTIONS)
globals().update(make_tests(faulty_agent_cases, ["FaultyAgentRpcTest"], **OPTIONS))
