"""torch's DistributedOptimizer tests (dist_optimizer_test.py), ported: one pytest test per
upstream test, run by 4 real worker processes (tests/spmd.py)."""

import pytest

from tests import dist_optimizer_cases
from tests.spmd import group_fixture, make_tests

OPTIONS = {"num_worker_threads": 8, "rpc_timeout": 60}

pytestmark = pytest.mark.timeout(300)
shared_group = group_fixture("tests.dist_optimizer_cases", **OPTIONS)
globals().update(make_tests(dist_optimizer_cases, ["DistOptimizerTest"], **OPTIONS))
