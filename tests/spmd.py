"""Run SPMD test cases (every rank runs the same test body, as torch's dist_autograd_test.py
does) in real worker processes that stay up across tests.

The pytest process only coordinates: it starts ``world_size`` worker processes, each of which
joins a gloo process group (for ``dist.barrier()``) and the RPC group, then runs test bodies
on command and reports the outcome. After every test each worker checks that it holds no
autograd context any more (a leak fails the test). A test that kills workers or leaves
them hung runs in a group of its own that is torn down afterwards.

A test that hangs or crashes a worker fails with the Python stacks of every thread of the
workers that did not answer: each worker has faulthandler write them to a file of its own
(on a fatal signal, and a few seconds before the harness gives up on the test), which the
harness reads into the failure.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from typing import Any

from tools import ports

LEAK_WAIT = 10.0
_BARRIER_FAILED = "the harness's barrier after the test failed"
STACKS_AHEAD = 5.0  # seconds before the harness gives up on a test that its workers dump their stacks


_free_port = ports.free_port  # (tools/ports.py: one that no connect() takes meanwhile)


def _worker(rank: int, world_size: int, pg_port: int, rpc_port: int, module_name: str, options: dict, conn,
            setup_rpc: bool = True, stacks_path: str | None = None) -> None:
    stacks = open(stacks_path, "w") if stacks_path else None  # noqa: SIM115 - open for the process's life
    if stacks is not None:
        faulthandler.enable(stacks, all_threads=True)  # a crash (SIGSEGV, ...) leaves its stacks there
    import torch.distributed as dist

    import zmqautograd.autograd as dist_autograd
    import zmqautograd.rpc as rpc

    def rpc_options() -> Any:
        return rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{rpc_port}", **options)

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{pg_port}", rank=rank, world_size=world_size)
        if setup_rpc:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=rpc_options())
        module = importlib.import_module(module_name)
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))
        return
    default_timeout = rpc._get_rpc_timeout() if setup_rpc else None
    while True:
        command = conn.recv()
        if command is None:
            break
        class_name, test_name, destructive, timeout = command
        if stacks is not None:
            os.ftruncate(stacks.fileno(), 0)  # only this test's stacks
            os.lseek(stacks.fileno(), 0, os.SEEK_SET)
            if timeout > STACKS_AHEAD:
                faulthandler.dump_traceback_later(timeout - STACKS_AHEAD, file=stacks)
        module.reset_state()
        if setup_rpc:
            rpc._set_rpc_timeout(default_timeout)
        dist.barrier()  # nobody calls into a rank before it has reset its state for this test
        try:
            case = getattr(module, class_name)(rank, world_size)
            if not setup_rpc:  # what upstream tests that start RPC themselves use
                case.rpc_backend, case.rpc_backend_options = rpc.BackendType.ZMQ, rpc_options()
            getattr(case, test_name)()
            outcome = ("ok", None)
        except SystemExit as exc:  # upstream tests may end their process on purpose
            outcome = ("ok", None) if exc.code in (0, None) else ("error", traceback.format_exc())
        except BaseException:  # noqa: BLE001
            outcome = ("error", traceback.format_exc())
        if outcome[0] == "error" and not setup_rpc and not destructive:
            _shut_down_what_the_test_left_up(rpc)
        if destructive:  # torch's dist_init(clean_shutdown=False): leave without shutdown
            faulthandler.cancel_dump_traceback_later()
            conn.send(outcome)
            if rank == 0:  # it hosts the process group's store, which others may still read:
                conn.recv()  # it stays until the harness kills the group
            os._exit(0)
        if outcome[0] == "ok" and setup_rpc:  # (else the test shut its RPC down itself)
            container = dist_autograd.api._container()
            if not container.wait_released(None, LEAK_WAIT):
                outcome = ("error", f"rank {rank}: {container.count()} autograd context(s) left after the test")
        try:
            dist.barrier()
        except BaseException:  # noqa: BLE001 - another rank died: report what we have, then leave
            faulthandler.cancel_dump_traceback_later()
            detail = outcome[1] + "\n" if outcome[0] != "ok" else ""
            conn.send(("error", f"{detail}rank {rank}: {_BARRIER_FAILED} (this worker leaves):\n{traceback.format_exc()}"))
            os._exit(1)
        faulthandler.cancel_dump_traceback_later()  # (after the barrier: a rank stuck there is reported too)
        conn.send(outcome)
    if setup_rpc:
        rpc.shutdown()
    dist.destroy_process_group()
    del dist_autograd


def _shut_down_what_the_test_left_up(rpc: Any) -> None:
    """A test that starts RPC itself and fails before its ``rpc.shutdown()`` would leave the
    other ranks in theirs, waiting at the shutdown barrier for this one until the harness
    gives up on the test (minutes, and the failure's message only then): join them there."""
    try:
        rpc.api._current()
    except RuntimeError:
        return  # not started, or shut down already
    try:
        rpc.shutdown(timeout=30)
    except RuntimeError:
        pass  # the test's own error is the one to report


class _PortTaken(RuntimeError):
    """A worker could not bind a rendezvous port picked for the group."""


class SpmdGroup:
    def __init__(self, module_name: str, world_size: int = 4, setup_rpc: bool = True, **options: Any):
        self.world_size = world_size
        self.module_name = module_name
        for attempt in range(3):
            try:
                self._start(module_name, world_size, setup_rpc, options)
                return
            except _PortTaken:
                # The ports were free when picked; something bound one before rank 0 did
                # (another endpoint's ephemeral port): pick others.
                if attempt == 2:
                    raise

    def _start(self, module_name: str, world_size: int, setup_rpc: bool, options: dict) -> None:
        ctx = mp.get_context("spawn")
        pg_port, rpc_port = _free_port(), _free_port()
        self.conns = []
        self.processes = []
        self._stacks = tempfile.TemporaryDirectory(prefix="spmd-stacks-")
        self.stacks_paths = [os.path.join(self._stacks.name, f"rank{rank}") for rank in range(world_size)]
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_worker, args=(rank, world_size, pg_port, rpc_port, module_name, options, child,
                                                        setup_rpc, self.stacks_paths[rank]), daemon=True)
            process.start()
            self.conns.append(parent)
            self.processes.append(process)
        for rank, conn in enumerate(self.conns):
            status, detail = self._receive(rank, conn, 120)
            if status != "ready":
                self.kill()
                error = _PortTaken if "EADDRINUSE" in str(detail) else RuntimeError
                raise error(f"worker {rank} failed to start:\n{detail}")

    def _receive(self, rank: int, conn, timeout: float) -> tuple[str, Any]:
        if not conn.poll(max(timeout, 0.0)):
            alive = self.processes[rank].is_alive()
            return "error", (f"rank {rank}: no answer in time (process {'alive' if alive else 'dead'})"
                             + self._stacks_of(rank))
        try:
            return conn.recv()
        except EOFError:
            # Its end of the pipe closed: the process is exiting. A process that exits by an
            # exception may still take a while (threads joined, finalizers): wait for its
            # exit code no longer than the time left, plus a moment, so one slow exit does
            # not push the report past the test's deadline.
            process = self.processes[rank]
            process.join(min(5.0, max(timeout, 0.5)))
            how = f"exited (code {process.exitcode})" if process.exitcode is not None else "closed its pipe, still exiting"
            return "error", f"rank {rank}: process {how}" + self._stacks_of(rank)

    def _stacks_of(self, rank: int) -> str:
        """What faulthandler wrote for ``rank`` (see the module's docstring), if anything."""
        try:
            with open(self.stacks_paths[rank]) as f:
                text = f.read().strip()
        except OSError:
            return ""
        return f"\nits threads:\n{text}" if text else ""

    def run(self, class_name: str, test_name: str, timeout: float = 120, destructive: bool = False) -> None:
        """Run a test on every rank; all must answer within ``timeout`` seconds in all."""
        for conn in self.conns:
            conn.send((class_name, test_name, destructive, timeout))
        deadline = time.monotonic() + timeout
        failures = []
        for rank, conn in enumerate(self.conns):
            status, detail = self._receive(rank, conn, deadline - time.monotonic())
            if status != "ok":
                failures.append(f"--- rank {rank}:\n{detail}")
        if failures:
            raise AssertionError(f"{class_name}.{test_name} failed:\n" + "\n".join(failures))

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in self.processes:
            process.join(30)
        self.kill()

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
        self._stacks.cleanup()


# ------------------------------------------------------------------- pytest integration


def group_fixture(module_name: str, **options: Any):
    """A module-scoped pytest fixture: (get, broken) for one shared group, started lazily
    and replaced after a test left it unusable."""
    import pytest

    @pytest.fixture(scope="module")
    def shared_group():
        state: dict = {"group": None}

        def get() -> SpmdGroup:
            if state["group"] is None:
                state["group"] = SpmdGroup(module_name, 4, **options)
            return state["group"]

        def broken() -> None:
            if state["group"] is not None:
                state["group"].kill()
                state["group"] = None

        yield get, broken
        if state["group"] is not None:
            state["group"].close()

    return shared_group


def make_tests(cases_module: Any, classes: list[str], **options: Any) -> dict:
    """One pytest test per ``test_*`` method of ``classes``, named as the method. Methods
    marked ``_gpus`` skip without that many CUDA devices; ``_destructive`` ones, and those
    marked ``_setup_rpc = False`` (they start and stop RPC themselves, with the case's
    ``rpc_backend`` and ``rpc_backend_options``), get a group of their own."""
    tests = {}
    for class_name in classes:
        klass = getattr(cases_module, class_name)
        for name in dir(klass):
            if name.startswith("test_") and callable(getattr(klass, name)):
                assert name not in tests, f"duplicate test name {name}"
                tests[name] = _make_test(cases_module.__name__, class_name, name, getattr(klass, name), options)
    return tests


def _make_test(module_name: str, class_name: str, name: str, function: Any, options: dict):
    import pytest
    import torch

    gpus = getattr(function, "_gpus", 0)
    destructive = getattr(function, "_destructive", False)
    own_options = getattr(function, "_options", None)  # torch's dist_init(faulty_messages=...)
    setup_rpc = getattr(function, "_setup_rpc", True)  # False: the test starts RPC itself

    def test(shared_group):
        if gpus and (torch.cuda.device_count() if torch.cuda.is_available() else 0) < gpus:
            pytest.skip(f"needs {gpus} CUDA device(s)")
        if destructive or own_options is not None or not setup_rpc:
            group = SpmdGroup(module_name, 4, setup_rpc, **{**options, **(own_options or {})})
            try:
                group.run(class_name, name, destructive=destructive)
            finally:
                group.kill() if destructive else group.close()
            return
        get, broken = shared_group
        try:
            get().run(class_name, name)
        except AssertionError as exc:
            if any(sign in str(exc) for sign in ("no answer", "process exited", "closed its pipe", _BARRIER_FAILED)):
                broken()
            raise

    test.__name__ = test.__qualname__ = name
    test.__doc__ = f"{class_name}.{name}"
    return test
