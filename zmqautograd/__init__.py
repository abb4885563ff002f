"""zmqautograd: distributed autograd and RPC for PyTorch over ZeroMQ.

The RPC layer (``zmqautograd.rpc``) and the distributed autograd engine
(``zmqautograd.autograd``) stand on the generic transport in the top-level ``transport``
package.
"""

__version__ = "0.1.0"
