"""torch's ``dist_optimizer_test.py`` (``DistOptimizerTest``), verbatim, against zmqautograd."""

from tests.torch_suites.harness import suites

from torch.testing._internal.distributed.rpc.dist_optimizer_test import DistOptimizerTest  # noqa: E402

globals().update(suites(__name__, [DistOptimizerTest], {}))
