"""torch's ``dist_autograd_test.py`` (``DistAutogradTest``, its sparse and CUDA variants;
``FaultyAgentDistAutogradTest`` with torch's faulty-agent settings), verbatim, against
zmqautograd (harness.py). The CUDA variants skip without GPUs, as torch's."""

from tests.torch_suites.harness import ZmqFaultyAgentTestFixture, suites

from torch.testing._internal.distributed.rpc.dist_autograd_test import (  # noqa: E402
    CudaDistAutogradTest,
    DistAutogradTest,
    FaultyAgentDistAutogradTest,
    TensorPipeAgentDistAutogradTest,
    TensorPipeCudaDistAutogradTest,
)

NOT_APPLICABLE: dict[str, str] = {
    "test_verify_backend_options": "checks for torch's backend_registry.BackendType.FAULTY_TENSORPIPE",
    "test_trainer_ps_torchscript_functions": "calls a TorchScript function that takes an RRef (TorchScript RRef types)",
}

globals().update(suites(__name__, [DistAutogradTest, TensorPipeAgentDistAutogradTest, CudaDistAutogradTest,
                                   TensorPipeCudaDistAutogradTest], NOT_APPLICABLE))
globals().update(suites(__name__, [FaultyAgentDistAutogradTest], NOT_APPLICABLE, fixture=ZmqFaultyAgentTestFixture))
