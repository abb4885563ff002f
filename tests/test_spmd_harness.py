"""The SPMD harness (tests/spmd.py) reports a worker that hangs or crashes with its stacks,
within the test's time, instead of leaving a bare timeout."""

import time

import pytest

from .spmd import SpmdGroup

pytestmark = pytest.mark.timeout(120)


def test_a_hung_and_a_crashed_worker_are_reported_with_their_stacks_in_time():
    group = SpmdGroup("tests.spmd_harness_cases", 4, setup_rpc=False)
    try:
        start = time.monotonic()
        with pytest.raises(AssertionError) as failure:
            group.run("HarnessCases", "test_one_rank_hangs_and_one_crashes", timeout=10)
        elapsed = time.monotonic() - start
    finally:
        group.kill()
    report = str(failure.value)
    assert elapsed < 15, elapsed  # one deadline for all ranks, not one per rank
    hung = report[report.index("--- rank 1:"):report.index("--- rank 2:")]
    assert "no answer in time" in hung, hung
    assert "spmd_harness_cases.py" in hung and "test_one_rank_hangs_and_one_crashes" in hung, hung
    # A rank that finished the test body but waits in the harness's barrier is shown there.
    waiting = report[report.index("--- rank 0:"):report.index("--- rank 1:")]
    assert "in barrier" in waiting or "in wrapper" in waiting, waiting
    crashed = report[report.index("--- rank 2:"):report.index("--- rank 3:")]
    assert "process exited (code -11)" in crashed and "Segmentation fault" in crashed, crashed
    assert "test_one_rank_hangs_and_one_crashes" in crashed, crashed


def test_a_test_that_fails_before_its_own_rpc_shutdown_releases_the_other_ranks_at_once():
    """Tests that start RPC themselves: the harness shuts a failed rank's RPC down, so that the
    others leave the shutdown barrier and the failure is reported at once, not at the timeout."""
    group = SpmdGroup("tests.spmd_harness_cases", 4, setup_rpc=False)
    try:
        start = time.monotonic()
        with pytest.raises(AssertionError) as failure:
            group.run("HarnessCases", "test_rank_0_fails_before_its_rpc_shutdown", timeout=60)
        elapsed = time.monotonic() - start
        report = str(failure.value)
        assert "rank 0 failed before its shutdown" in report and "no answer in time" not in report, report
        assert "--- rank 1:" not in report, report  # the others passed
        assert elapsed < 30, elapsed
    finally:
        group.close()
