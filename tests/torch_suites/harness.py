"""torch's own RPC test suites, run verbatim against zmqautograd.

torch's classes (``RpcTest``, ``DistAutogradTest``, ...) are written against an abstract
fixture (``RpcAgentTestFixture``); ``suites()`` mixes each with ``ZmqAgentTestFixture`` and a
process starter, as torch's ``rpc_utils.generate_tests`` does for TensorPipe. zmqautograd is
installed under torch's names (``zmqautograd.install_as_torch_rpc``) before torch's test
modules are imported, in this process and in every worker. Each test runs in
``world_size`` worker processes (torch's ``MultiProcessTestCase``), started from a forkserver
that has imported every suite's test module already: a worker then starts in milliseconds
rather than the seconds a fresh interpreter takes to import torch (and ``init_rpc`` freezes
what it inherited rather than collecting it: rpc/api.py).

Tests that cannot apply to any backend but torch's own are listed in ``NOT_APPLICABLE`` of
the test module, each with its reason; they are reported as skipped. Differences from torch
not fixed yet are listed in ``KNOWN_GAPS``: they run as expected failures (a gap that closes
fails the run until it leaves the list), except those marked ``SLOW_GAPS``, which would only
wait for a timeout or fail only when a race goes one way, and are skipped with the gap as
their reason.
"""

from __future__ import annotations

import os
import unittest

# torch's per-test limit (read when its test module is imported): below pytest's 120 s, so
# that torch's harness reports a stuck worker with its stack.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "100")

import torch  # noqa: E402
import torch.multiprocessing  # noqa: E402

import zmqautograd  # noqa: E402

zmqautograd.install_as_torch_rpc()

import torch.distributed.rpc as rpc  # noqa: E402  (zmqautograd.rpc, by the alias)
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture  # noqa: E402

# What each worker's options are built with (torch's defaults otherwise).
OPTIONS: dict = {}


class ZmqAgentTestFixture(RpcAgentTestFixture):
    @property
    def rpc_backend(self):
        return rpc.BackendType.ZMQ

    @property
    def rpc_backend_options(self):
        return rpc.ZmqRpcBackendOptions(init_method=self.init_method, **OPTIONS)

    def get_shutdown_error_regex(self):
        # What a call to a worker that shut down or died fails with here.
        errors = ["lost peer", "closed its endpoint", "RPC is shutting down", "is shutting down", "not connected"]
        return "|".join(f"({error})" for error in errors)

    def get_timeout_error_regex(self):
        return "RPC ran for more than"


class ZmqFaultyAgentTestFixture(ZmqAgentTestFixture):
    """torch's faulty-agent fixture (``FaultyRpcAgentTestFixture``), with our options: the
    retryable messages fail their first three sends, calls are delayed 1.5 s, unless a test's
    ``dist_init`` names others."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.messages_to_fail = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"]
        self.messages_to_delay = {"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5}

    @property
    def rpc_backend_options(self):
        return rpc.ZmqRpcBackendOptions(
            init_method=self.init_method, num_worker_threads=8, num_fail_sends=3,
            messages_to_fail=self.messages_to_fail, messages_to_delay=self.messages_to_delay, **OPTIONS,
        )

    def setup_fault_injection(self, faulty_messages, messages_to_delay):
        if faulty_messages is not None:
            self.messages_to_fail = faulty_messages
        if messages_to_delay is not None:
            self.messages_to_delay = messages_to_delay


class ForkserverWorkers(MultiProcessTestCase):
    """torch's multi-process test case, its workers forked from a forkserver that imported
    the test module (torch's starts each by spawn)."""

    # Environment variables set in each worker before its test runs (a suite's settings).
    worker_environment: dict[str, str] = {}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @classmethod
    def _run(cls, rank: int, test_name: str, file_name: str, parent_pipe, **kwargs) -> None:
        os.environ.update(cls.worker_environment)
        super()._run(rank, test_name, file_name, parent_pipe, **kwargs)

    def _spawn_processes(self) -> None:
        if "Cuda" in type(self).__name__ and torch.cuda.is_available():
            # torch's test modules initialize CUDA when they are imported (common_utils), and
            # a process forked after that cannot use it: spawned, as torch's own. Without a
            # GPU, forked: their tests skip in the worker, and spawned workers would each
            # import torch first (12 tests, 150 s on 2 cores, for nothing).
            self._start_processes(torch.multiprocessing.get_context("spawn").Process)
            return
        self._start_processes(_preloaded_forkserver().Process)


# Every torch suite's test module, preloaded by the forkserver its workers fork from.
_SUITE_MODULES = sorted(f"{__package__}.{name[:-3]}" for name in os.listdir(os.path.dirname(__file__))
                        if name.startswith("test_") and name.endswith(".py"))
_our_forkserver: int | None = None  # the pid of the forkserver started with them


def _preloaded_forkserver():
    """The forkserver context, its server started with every suite's test module imported.
    A process has one forkserver, and a running one ignores later preloads: if another test
    of this pytest process started it, it is stopped and started again with ours (else each
    worker would import torch or the test module itself: 15 s a test instead of 1-2).
    Through multiprocessing's private ForkServer, as its own tests stop it."""
    global _our_forkserver
    from multiprocessing import forkserver

    server = forkserver._forkserver  # type: ignore[attr-defined]
    if server._forkserver_pid is not None and server._forkserver_pid != _our_forkserver:
        server._stop()
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_SUITE_MODULES)
    server.ensure_running()
    _our_forkserver = server._forkserver_pid
    return context


def suites(module_name: str, classes: list[type], not_applicable: dict[str, str],
           known_gaps: dict[str, str] | None = None, slow_gaps: frozenset[str] = frozenset(),
           fixture: type = ZmqAgentTestFixture, worker_environment: dict[str, str] | None = None) -> dict[str, type]:
    """One test class per torch class, named ``Zmq<name>``, for the test module's globals.
    ``not_applicable`` (name -> reason): skipped with their reason. ``known_gaps`` (name ->
    what differs): expected to fail; those also in ``slow_gaps`` skipped instead.
    ``worker_environment``: set in every worker of these classes before its test runs."""
    made = {}
    for test_class in classes:
        marked: dict = {"worker_environment": dict(worker_environment or {})}
        for name, reason in not_applicable.items():
            if hasattr(test_class, name):
                marked[name] = unittest.skip(f"not applicable: {reason}")(getattr(test_class, name))
        for name, gap in (known_gaps or {}).items():
            if hasattr(test_class, name):
                test = getattr(test_class, name)
                marked[name] = (unittest.skip(f"known gap (slow or racy): {gap}")(test) if name in slow_gaps
                                else unittest.expectedFailure(test))
        name = f"Zmq{test_class.__name__}"
        made_class = type(name, (test_class, fixture, ForkserverWorkers), marked)
        made_class.__module__ = module_name
        made[name] = made_class
    return made
