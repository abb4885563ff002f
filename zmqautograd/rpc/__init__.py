"""RPC with the API and semantics of ``torch.distributed.rpc``, over ZeroMQ.

Port code by changing ``import torch.distributed.rpc as rpc`` to
``import zmqautograd.rpc as rpc``.
"""

from . import constants, functions
from .agent import WorkerInfo
from .api import (
    _get_current_rpc_agent,
    _get_debug_info,
    _get_rpc_timeout,
    get_rpc_timeout,
    _is_current_rpc_agent_set,
    _is_initialized,
    _rref_context_get_debug_info,
    _set_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .errors import (
    NotEntitledError,
    OperatorArgumentsError,
    RemoteException,
    RendezvousError,
    RpcError,
    RpcNotInitializedError,
    RpcTimeoutError,
    ScriptFunctionError,
    SerializationError,
)
from .options import (
    DEFAULT_RPC_TIMEOUT_SEC,
    UNSET_RPC_TIMEOUT,
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    ZmqRpcBackendOptions,
)
from .profiling import _server_process_global_profile
from .rref import RRef

PyRRef = RRef  # torch's name for the RRef class its C++ agent makes (torch's RemoteModule uses it)

__all__ = [
    "constants", "functions", "WorkerInfo", "get_rpc_timeout", "RpcBackendOptions", "get_worker_info", "init_rpc", "remote", "RRef", "rpc_async", "rpc_sync", "shutdown",
    "_get_rpc_timeout", "_set_rpc_timeout", "_is_initialized", "_get_current_rpc_agent", "_is_current_rpc_agent_set", "is_available", "PyRRef",
    "_get_debug_info", "_rref_context_get_debug_info",
    "NotEntitledError", "OperatorArgumentsError", "RemoteException", "RendezvousError", "RpcError", "RpcNotInitializedError", "RpcTimeoutError",
    "ScriptFunctionError", "SerializationError", "ZmqRpcBackendOptions", "DEFAULT_RPC_TIMEOUT_SEC", "UNSET_RPC_TIMEOUT",
    "BackendType", "TensorPipeRpcBackendOptions", "_server_process_global_profile",
]
