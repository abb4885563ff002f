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

globals().update(suites(__name__, [DdpUnderDistAutogradTest, DdpComparisonTest, CudaDdpComparisonTest], {}))
