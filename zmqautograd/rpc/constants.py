"""torch's ``torch.distributed.rpc.constants``: the defaults, under torch's names."""

from datetime import timedelta

DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
UNSET_RPC_TIMEOUT: float = -1.0  # "use the agent's default", as in torch
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_NUM_WORKER_THREADS: int = 16
DEFAULT_SHUTDOWN_TIMEOUT: float = 0  # seconds a graceful shutdown waits (0: no limit)
# torch's default for the process group its agents make; ours make none (kept for code that reads it).
DEFAULT_PROCESS_GROUP_TIMEOUT: timedelta = timedelta(milliseconds=2**31 - 1)

# torch's private spellings of the same.
_DEFAULT_RPC_TIMEOUT_SEC = DEFAULT_RPC_TIMEOUT_SEC
_UNSET_RPC_TIMEOUT = UNSET_RPC_TIMEOUT
_DEFAULT_INIT_METHOD = DEFAULT_INIT_METHOD
_DEFAULT_NUM_WORKER_THREADS = DEFAULT_NUM_WORKER_THREADS
