"""The SPMD harness (tests/spmd.py) reports a worker that hangs or crashes with its stacks,
within the test's time, instead of leaving a bare timeout."""

import time

import pytest

from tests.spmd import SpmdGroup

pytestmark = pytest.mark.timeout(120)


def _failed_run(case: str, timeout: float, end: str) -> tuple[str, float]:
    """Run a case of tests/spmd_harness_cases.py on 4 ranks that must fail: the harness's
    report, and how long it took to come; ``end``: how the group ends ("kill" or "close")."""
    group = SpmdGroup("tests.spmd_harness_cases", 4, setup_rpc=False)
    try:
        start = time.monotonic()
        with pytest.raises(AssertionError) as failure:
            group.run("HarnessCases", case, timeout=timeout)
        return str(failure.value), time.monotonic() - start
    finally:
        getattr(group, end)()


def test_a_hung_and_a_crashed_worker_are_reported_with_their_stacks_in_time():
    report, elapsed = _failed_run("test_one_rank_hangs_and_one_crashes", 10, "kill")
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
    report, elapsed = _failed_run("test_rank_0_fails_before_its_rpc_shutdown", 60, "close")
    assert "rank 0 failed before its shutdown" in report and "no answer in time" not in report, report
    assert "--- rank 1:" not in report, report  # the others passed
    assert elapsed < 30, elapsed
