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

# The master's init_process_group may return before a trainer's has (gloo's groups connect
# pairwise; registering the group comes after), and its next call, rpc.remote to that trainer,
# makes the trainer run dist.new_group() at once: "Default process group has not been
# initialized" (3 runs of 10 of DdpUnderDistAutogradTest here). TensorPipe's slower calls hide
# the race. torch's own switch for it: a barrier at the end of init_process_group, "to ensure
# that once we return from this method, all process groups ... are updated on all ranks".
WORKERS = {"TORCH_DIST_INIT_BARRIER": "1"}

globals().update(suites(__name__, [DdpUnderDistAutogradTest, DdpComparisonTest, CudaDdpComparisonTest], {},
                        worker_environment=WORKERS))
