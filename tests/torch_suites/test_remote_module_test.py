"""torch's ``remote_module_test.py`` (``RemoteModuleTest``, ``ThreeWorkersRemoteModuleTest``,
``CudaRemoteModuleTest``), verbatim, against zmqautograd (harness.py): torch's own
``torch.distributed.nn.RemoteModule`` over our RPC. The CUDA class skips without GPUs."""

from tests.torch_suites.harness import suites

from torch.testing._internal.distributed.nn.api.remote_module_test import (  # noqa: E402
    CudaRemoteModuleTest,
    RemoteModuleTest,
    ThreeWorkersRemoteModuleTest,
)

# Each scripts a RemoteModule (torch.jit.script, _module_interface_cls): TorchScript's RRef
# type and its rpc_async builtin are bound to torch's C++ agent, not reachable from Python.
_SCRIPTED = "scripts a RemoteModule: TorchScript's RRef type and rpc_async builtin run on torch's C++ agent"
NOT_APPLICABLE: dict[str, str] = {name: _SCRIPTED for name in (
    "test_forward_async", "test_forward_sync", "test_forward_async_script", "test_forward_sync_script",
    "test_remote_module_py_pickle_not_supported_script", "test_send_remote_module_over_the_wire_script_not_supported",
    "test_input_moved_to_cuda_device_script",
)}

globals().update(suites(__name__, [RemoteModuleTest, ThreeWorkersRemoteModuleTest, CudaRemoteModuleTest], NOT_APPLICABLE))
