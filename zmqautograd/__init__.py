"""zmqautograd: distributed autograd and RPC for PyTorch over ZeroMQ.

Layers, each using only those below it: ``zmqautograd.transport`` (messages, tensors,
connections) ← ``zmqautograd.rpc`` (``torch.distributed.rpc``'s API) ← ``zmqautograd.autograd``
(``torch.distributed.autograd``'s) ← ``zmqautograd.optim`` (``DistributedOptimizer``). The
autograd layer plugs into RPC through the call hooks it installs (``rpc/hooks.py``); importing
the package installs them, so that every worker records the forward pass whichever module its
program imports.
"""

__version__ = "0.1.0"

from . import autograd as _autograd  # noqa: E402,F401  (installs distributed autograd's call hooks)
from .torch_alias import install_as_torch_rpc  # noqa: E402

__all__ = ["install_as_torch_rpc"]
