"""The seed's FaultyAgentDistAutogradTest, ported (tests/faulty_agent_cases.py): context
cleanup succeeds on every worker while cleanup messages fail 3 times each."""

import pytest

from tests import faulty_agent_cases
from tests.spmd import group_fixture, make_tests

OPTIONS = {**faulty_agent_cases.GROUP_OPTIONS, "rpc_timeout": 60, "retry_delay": 0.05}

pytestmark = pytest.mark.timeout(300)
shared_group = group_fixture("tests.faulty_agent_cases", **OPTIONS)
globals().update(make_tests(faulty_agent_cases, ["FaultyAgentDistAutogradTest"], **OPTIONS))
