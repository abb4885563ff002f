"""The RPC layer against real worker processes (world size 4), ported from the behaviour of
torch's rpc_test.py. One group of worker processes serves every test of the module."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import re
import gc
from datetime import timedelta
import threading
import time
import weakref

import pytest
import torch

import zmqautograd.autograd as dist_autograd
import zmqautograd.rpc as rpc
from zmqautograd.transport.faults import FaultPolicy

from tests import rpc_functions as f
from tests.conftest import poll_until
from tests.rpc_harness import Group, free_port, spawn_and_collect

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=4, num_worker_threads=4, rpc_timeout=30)
    yield g
    g.shutdown()


def test_builtin_calls_to_every_worker_by_name_id_and_info(group):
    for rank, name in enumerate(group.names):
        expected = torch.ones(2, 2) + rank
        assert torch.equal(rpc.rpc_sync(name, torch.add, args=(torch.ones(2, 2), rank)), expected)
        assert torch.equal(rpc.rpc_sync(rank, torch.add, args=(torch.ones(2, 2), rank)), expected)
        info = rpc.get_worker_info(name)
        assert (info.name, info.id) == (name, rank) and repr(info) == f"WorkerInfo(id={rank}, name={name})"
        assert rpc.rpc_sync(info, f.whoami) == name
    assert rpc.get_worker_info() == rpc.get_worker_info("worker0")


def test_get_worker_infos(group):
    """torch's ``test_get_worker_infos``, and the agent's other lookups."""
    agent = rpc._get_current_rpc_agent()
    infos = agent.get_worker_infos()
    assert {info.name for info in infos} == set(group.names)
    assert [info.id for info in infos] == list(range(len(group.names)))
    assert agent.get_worker_info() == rpc.get_worker_info() and agent.get_worker_info("worker2").id == 2
    debug = agent.get_debug_info()
    assert debug["world_size"] == str(len(group.names)) and all(isinstance(v, str) for v in debug.values())
    assert debug["agent.thread_pool_size"] == "4"  # torch's key: the threads asked for
    assert rpc.is_available() and dist_autograd.is_available()


def test_big_tensors_between_workers_on_one_host_are_lent(group):
    """Tensors of 1 MiB and more are read from the sender's memory (docs/transport.md,
    "Lending"), here through a nested call: worker0 -> worker1 -> worker2 and back."""
    endpoint = rpc._get_current_rpc_agent().endpoint
    peer = str(rpc.get_worker_info("worker1").id)  # endpoints know peers by worker id
    before = endpoint.stats()[peer]
    big, wide = torch.randn(1 << 20), torch.randn(2048, 256).t()
    back, lent_on, borrowed_back = rpc.rpc_sync("worker1", f.pass_on_and_count_loans, args=((big, wide), "worker2"))
    assert torch.equal(back[0], big) and torch.equal(back[1], wide) and back[1].stride() == wide.stride()
    assert lent_on >= 2 and borrowed_back >= 2  # worker1 lent both on to worker2, which lent them back
    after = endpoint.stats()[peer]
    assert after.buffers_lent - before.buffers_lent == 2 and after.buffers_borrowed - before.buffers_borrowed == 2


def test_lending_under_concurrent_calls_keeps_every_byte_and_releases_every_loan(group):
    """Four threads send tensors around the lending threshold to three workers at once, some
    passed on to a fourth worker and back; every result is exact, and afterwards no worker
    holds a buffer on loan."""
    generator = torch.Generator().manual_seed(5)
    sizes = [(1 << 18) - 1, 1 << 18, 3 << 18, 1 << 20]  # floats: just under, at and over 1 MiB
    jobs = [(torch.randn(sizes[i % 4], generator=generator), f"worker{1 + i % 3}", i % 2 == 0) for i in range(48)]
    errors: list[BaseException] = []

    def run(part: list) -> None:
        try:
            futures = [
                rpc.rpc_async(to, f.double_and_pass_on, args=(x, "worker0" if to != "worker1" else "worker2"))
                if nested else rpc.rpc_async(to, torch.mul, args=(x, 2))
                for x, to, nested in part
            ]
            for (x, _, _), future in zip(part, futures):
                assert torch.equal(future.wait(), x * 2)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(jobs[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[0]
    # A reader releases a loan when it reads it, ahead of anything it sends the lender later:
    # once every worker has called every other, no worker holds anything on loan.
    for name in group.names:
        assert rpc.rpc_sync(name, f.call_each, args=(group.names,)) == group.names
    assert [rpc.rpc_sync(name, f.buffers_on_loan) for name in group.names] == [0] * len(group.names)


def test_a_function_whose_module_another_thread_is_importing_resolves_once_it_is_imported(tmp_path, monkeypatch):
    """The first calls of a burst run on several pool threads, which all resolve the function
    of a module nobody imported yet: the later ones must wait for the import, not find the
    half-initialised module in sys.modules and fail ('partially initialized module')."""
    import sys
    import types

    from zmqautograd.rpc.serialization import FunctionRef, resolve_function

    gate = types.ModuleType("za_import_gate")
    gate.started, gate.release = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, "za_import_gate", gate)
    (tmp_path / "za_slow_module.py").write_text(
        "import za_import_gate\nza_import_gate.started.set()\nza_import_gate.release.wait(30)\n"
        "def answer():\n    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "za_slow_module", raising=False)
    results: dict[str, object] = {}

    def resolve(key: str) -> None:
        try:
            results[key] = resolve_function(FunctionRef("za_slow_module", "answer"))()
        except Exception as exc:  # the bug: AttributeError wrapped in SerializationError
            results[key] = exc

    first = threading.Thread(target=resolve, args=("first",))
    first.start()
    assert gate.started.wait(30)  # the module is in sys.modules, its body not finished
    second = threading.Thread(target=resolve, args=("second",))
    second.start()
    # Let the import finish once the second thread waits for it (or has already failed).
    deadline = time.monotonic() + 30
    while second.is_alive() and time.monotonic() < deadline:
        frames = sys._current_frames().get(second.ident)
        names = set()
        while frames is not None:
            names.add(frames.f_code.co_name)
            frames = frames.f_back
        if "_find_and_load" in names:
            break
        time.sleep(0.001)
    gate.release.set()
    first.join(30)
    second.join(30)
    assert results == {"first": 42, "second": 42}
    monkeypatch.delitem(sys.modules, "za_slow_module", raising=False)


def test_wrong_types_and_invalid_names():
    """torch's test_wrong_types and test_invalid_names (no group needed: all fail before)."""
    with pytest.raises(TypeError, match="Argument backend must be a member of BackendType"):
        rpc.init_rpc("w0", rank=0, world_size=1, backend="TENSORPIPE")
    with pytest.raises(TypeError, match="Argument rpc_backend_options must be an instance of RpcBackendOptions"):
        rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options={"init_method": "tcp://127.0.0.1:1"})
    for name, message in (("abc*", "Worker name must match"), (" ", "Worker name must match"),
                          ("", "must be non-empty"), ("a" * 500, "shorter than 128")):
        with pytest.raises(RuntimeError, match=message):
            rpc.WorkerInfo(name, 0)
    with pytest.raises(RuntimeError, match="Worker name must match"):
        rpc.init_rpc("bad name", rank=0, world_size=1)
    # Ported code that names TensorPipe's options and backend gets ours.
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20)
    assert isinstance(options, rpc.ZmqRpcBackendOptions) and rpc.BackendType.TENSORPIPE is rpc.BackendType.ZMQ
    # torch's TensorPipe-only options are taken (they choose nothing here); a value of another
    # type does not construct the options, as torch's C++ class does not; another backend's
    # options are refused with torch's words.
    rpc.TensorPipeRpcBackendOptions(_transports=["uv"], _channels=["basic"])
    for bad in ({"rpc_timeout": timedelta(seconds=5)}, {"num_worker_threads": 2.5}, {"init_method": None}):
        with pytest.raises(TypeError, match="incompatible constructor arguments"):
            rpc.TensorPipeRpcBackendOptions(**bad)
    # Liveness bounds that the endpoint would refuse at init_rpc are refused at construction,
    # before any rank joins a rendezvous that the others would then wait in.
    for heartbeat_interval, peer_timeout in ((50, 10.0), (5.0, 5.0), (0, 10.0)):
        with pytest.raises(ValueError, match=rf"heartbeat_interval \({heartbeat_interval!r} s\) must be > 0 "
                                             rf"and below peer_timeout \({peer_timeout!r} s\)"):
            rpc.ZmqRpcBackendOptions(heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout)
    assert rpc.ZmqRpcBackendOptions(heartbeat_interval=50, peer_timeout=100).peer_timeout == 100
    with pytest.raises(ValueError, match="shm_ring must be 0 .off. or from 4096 to 1073741824 bytes"):
        rpc.ZmqRpcBackendOptions(shm_ring=1 << 40)  # (a ring that size made the OOM killer end its maker)
    for field, message in (("spin", "spin must be >= 0"), ("busy_poll", "busy_poll must be >= 0"),
                           ("lend_min", "lend_min and lend_cache must be >= 0")):
        with pytest.raises(ValueError, match=message):
            rpc.ZmqRpcBackendOptions(**{field: -1})

    class OtherBackendOptions(rpc.RpcBackendOptions):
        pass

    with pytest.raises(TypeError, match="`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`"):
        rpc.init_rpc("w0", rank=0, world_size=1, rpc_backend_options=OtherBackendOptions())


def test_python_udf_kwargs_and_structures(group):
    assert rpc.rpc_sync("worker1", f.my_function, args=(1, 2, 3)) == 6
    assert rpc.rpc_sync("worker1", f.my_function, kwargs={"a": 1, "b": 2, "c": 3}) == 6
    x, y = torch.randn(3), torch.randn(3)
    assert torch.allclose(rpc.rpc_sync("worker2", f.add_tensors, args=(x, y), kwargs={"alpha": 2}), x + 2 * y)
    for value in [(1, (2, 3)), [1, [2]], {"a": (1, torch.ones(1))}, None, "text", 3.5, b"raw"]:
        got = rpc.rpc_sync("worker3", f.structure, args=(value,))
        assert got["type"] == type(value).__name__
        if isinstance(value, dict):
            assert type(got["value"]["a"]) is tuple and torch.equal(got["value"]["a"][1], torch.ones(1))
        else:
            assert got["value"] == value
    assert rpc.rpc_sync("worker1", f.echo, args=(f.Point(1, 2),)) == f.Point(1, 2)  # pickle fallback
    assert rpc.rpc_sync("worker1", torch.Tensor.add, args=(torch.ones(1), 2)).item() == 3


def test_self_call_sees_a_copy(group):
    x = torch.zeros(100_000)
    result = rpc.rpc_sync("worker0", torch.Tensor.add_, args=(x, 1))
    assert torch.equal(result, torch.ones(100_000))
    assert torch.equal(x, torch.zeros(100_000))  # the caller's tensor is untouched


def test_rpc_async_futures_and_wait_all(group):
    futures = [rpc.rpc_async(name, torch.mul, args=(torch.ones(4), i)) for i, name in enumerate(group.names * 8)]
    assert all(isinstance(fut, torch.futures.Future) for fut in futures)
    results = torch.futures.wait_all(futures)
    assert [int(r[0]) for r in results] == list(range(len(futures)))
    chained = rpc.rpc_async("worker2", f.my_function, args=(1, 1, 1)).then(lambda fut: fut.wait() * 10)
    assert chained.wait() == 30


def test_answered_rpc_async_calls_leave_no_timeout_behind(group):
    """Each rpc_async's timeout (30 s here) waits until the call is answered, then goes: 5,000
    calls leave no more than a bounded number of timers and queued deadlines (before: all
    5,000 timers, each with its memory, until they came up a minute later)."""
    from zmqautograd import timers

    x = torch.zeros(2)
    for _ in range(5000 // 50):
        torch.futures.wait_all([rpc.rpc_async("worker1", torch.add, args=(x, 1)) for _ in range(50)])
    with timers._timers._lock:
        live = [entry for entry in timers._timers._heap if entry[2].call is not None]
        held = len(timers._timers._heap)
    assert len(live) < 100 and held < 500, (len(live), held)
    assert len(rpc._get_current_rpc_agent()._deadlines.queue) < 200


def test_calls_of_one_timeout_time_out_in_order_under_one_timer(group, monkeypatch):
    """Calls that share a timeout wait for it in one queue behind one timer (calls.py,
    _CallDeadlines): a slow call at the front times out, so does one behind the calls
    answered meanwhile, whose entries do not pile up; a call of another timeout gets a
    timer of its own and times out too."""
    from zmqautograd import timers

    armed = []
    call_later = timers.call_later
    monkeypatch.setattr(timers, "call_later", lambda *args: armed.append(args[1]) or call_later(*args))
    agent = rpc._get_current_rpc_agent()
    previous = rpc._get_rpc_timeout()
    rpc._set_rpc_timeout(1.5)
    try:
        first = rpc.rpc_async("worker1", f.sleep_and_return, args=(5,))
        x = torch.zeros(2)
        for _ in range(10):
            torch.futures.wait_all([rpc.rpc_async("worker2", torch.add, args=(x, 1)) for _ in range(50)])
        # Answered calls' entries are dropped before they outnumber twice the calls pending
        # at once (51 at most here) and 64.
        assert len(agent._deadlines.queue) <= 2 * 51 + 64 + 1
        last = rpc.rpc_async("worker3", f.sleep_and_return, args=(5,))
        other = rpc.rpc_async("worker3", f.sleep_and_return, args=(5,), timeout=0.5)
        assert len([callback for callback in armed if callback == agent._deadlines._expire_due]) == 1
        assert len([callback for callback in armed if callback == agent._expire]) == 1  # other's
        for fut, ms in ((first, 1500), (last, 1500), (other, 500)):
            with pytest.raises(RuntimeError, match=rf"RPC ran for more than set timeout \({ms} ms\)"):
                fut.wait()
    finally:
        rpc._set_rpc_timeout(previous)
    poll_until(lambda: not agent._deadlines.queue, 30, "the deadline queue emptied")
    assert rpc.rpc_sync("worker1", f.sleep_and_return, args=(0, "ok")) == "ok"


def test_rpc_async_answers_completed_by_the_io_thread_never_run_user_callbacks_there(group):
    # Answers to futures nobody registered a callback on are completed by the I/O thread;
    # a callback registered before or after the answer must still run elsewhere, and
    # answers that need the pool (pickled values, exceptions) must still arrive intact.
    threads: list[str] = []
    lock = threading.Lock()

    def note(fut):
        with lock:
            threads.append(threading.current_thread().name)

    before = [rpc.rpc_async("worker1", f.sleep_and_return, args=(0.05, i)) for i in range(4)]
    for fut in before:
        fut.add_done_callback(note)
    plain = [rpc.rpc_async("worker2", torch.add, args=(torch.ones(2), i)) for i in range(16)]
    assert [int(r[0]) for r in torch.futures.wait_all(plain)] == [i + 1 for i in range(16)]
    for fut in plain:  # complete by now: the callback runs here, at registration
        fut.add_done_callback(note)
    assert [fut.wait() for fut in before] == [0, 1, 2, 3]
    pickled = rpc.rpc_async("worker3", f.echo, args=(f.Point(3, 4),))
    failing = rpc.rpc_async("worker3", f.raise_value_error, args=("inline?",))
    assert pickled.wait() == f.Point(3, 4)
    with pytest.raises(ValueError, match="inline"):
        failing.wait()
    # collect_all's future completes from theirs: a callback on it runs off the I/O thread too.
    collected = torch.futures.collect_all([rpc.rpc_async("worker2", torch.add, args=(torch.ones(2), i)) for i in range(8)])
    noted = threading.Event()  # (a future's waiters may wake before its callbacks have run)
    collected.add_done_callback(lambda fut: (note(fut), noted.set()))
    assert len(collected.wait()) == 8 and noted.wait(30)
    with lock:
        seen = list(threads)
    assert len(seen) == 21 and not any(name.startswith("zmq-io") for name in seen), seen


def _open_gate_once_awaited(future, worker: str) -> threading.Thread:
    """A thread that opens ``worker``'s gate once a thread waits on ``future``."""

    def open_once_waiting():
        poll_until(lambda: future._taker is not None, 30, "the caller waits on its future")
        rpc.rpc_sync(worker, f.open_gate)

    opener = threading.Thread(target=open_once_waiting)
    opener.start()
    return opener


@pytest.mark.parametrize("wait", ["wait", "wait_all"])
def test_a_thread_waiting_on_rpc_async_futures_completes_their_answers_itself(group, wait):
    # wait() and wait_all receive as rpc_sync does: the answer is decoded on the waiting
    # thread, not handed to the pool and back (a pickled value, which the I/O thread never
    # decodes), and the other calls' answers arrive intact whoever takes them.
    gated = rpc.rpc_async("worker1", f.decoded_where_at_gate)
    others = [rpc.rpc_async(name, f.echo, args=(f.Point(i, i),)) for i, name in enumerate(group.names[1:] * 3)]
    opener = _open_gate_once_awaited(gated, "worker1")
    try:
        if wait == "wait":
            values = [gated.wait()] + [other.wait() for other in others]
        else:
            values = torch.futures.wait_all([gated, *others])
    finally:
        opener.join(30)
    assert values == [threading.current_thread().name] + [f.Point(i, i) for i in range(len(others))]
    assert not opener.is_alive() and gated._taker is None and not gated._waiters


def test_remote_exception_keeps_type_names_worker_and_carries_traceback(group):
    with pytest.raises(ValueError) as caught:
        rpc.rpc_sync("worker2", f.raise_value_error, args=("expected failure",))
    message = str(caught.value)
    assert message.startswith("On WorkerInfo(id=2, name=worker2):")
    assert "expected failure" in message and "Remote traceback" in message and "raise_value_error" in message
    with pytest.raises(rpc.RemoteException, match="NeedsTwoArguments.*cannot be rebuilt") as caught:
        rpc.rpc_sync("worker1", f.raise_unbuildable)
    # torch's wording (test_custom_exception_throw_during_reconstruction), and why.
    assert ("Original exception on remote side was tests.rpc_functions.NeedsTwoArguments, not rebuilt here: its "
            "constructor does not take a message") in str(caught.value)
    fut = rpc.rpc_async("worker3", f.raise_value_error, args=("async",))
    with pytest.raises(ValueError, match="async"):
        fut.wait()


def test_a_function_raising_system_exit_or_keyboard_interrupt_is_answered_and_its_worker_serves_on(group):
    """torch answers these with a RuntimeError ("SystemExit: 3"). They ended the pool thread
    that ran the call, which stayed unanswered until its timeout; re-raised as they are on
    the caller, they would end its thread, or its program."""
    for _ in range(8):  # twice the pool's threads: none may end
        with pytest.raises(rpc.RemoteException, match=r"builtins\.SystemExit: 3") as caught:
            rpc.rpc_sync("worker1", f.exit_with, args=(3,), timeout=10)
        assert "exit_with" in str(caught.value)  # the remote traceback
    with pytest.raises(rpc.RemoteException, match=r"builtins\.KeyboardInterrupt"):
        rpc.rpc_async("worker1", f.raise_keyboard_interrupt, timeout=10).wait()
    with pytest.raises(rpc.RemoteException, match=r"builtins\.SystemExit: 4"):
        rpc.remote("worker2", f.exit_with, args=(4,), timeout=10).to_here()
    calls = [rpc.rpc_async("worker1", f.sleep_and_return, args=(0.2, i), timeout=10) for i in range(4)]
    assert [call.wait() for call in calls] == [0, 1, 2, 3]


def test_parameters_arrive_as_parameters(group):
    """As torch's pickling keeps them: a parameter server's weights can be assigned to a
    module's parameters where they arrive (other tensor subclasses arrive as tensors)."""
    parameter = torch.nn.Parameter(torch.ones(2))
    assert rpc.rpc_sync("worker1", f.parameter_types, args=(parameter,)) == ("Parameter", True)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    assert rpc.rpc_sync("worker1", f.parameter_types, args=(frozen,)) == ("Parameter", False)
    assert rpc.rpc_sync("worker2", f.parameter_types, args=(torch.nn.Linear(2, 2),)) == [("Parameter", True)] * 2
    returned = rpc.rpc_sync("worker3", f.echo, args=(parameter,))
    assert type(returned) is torch.nn.Parameter and returned.requires_grad and torch.equal(returned, parameter)
    module = torch.nn.Linear(2, 2)
    module.weight = rpc.rpc_sync("worker1", f.echo, args=(torch.nn.Parameter(torch.zeros(2, 2)),))
    assert torch.equal(module(torch.ones(1, 2)), module.bias.detach().unsqueeze(0))
    # Recorded by distributed autograd, it arrives as a tensor on the graph: a gradient (here,
    # of the callee's doubling) reaches the sender's parameter.
    with dist_autograd.context() as context_id:
        seen, doubled = rpc.rpc_sync("worker2", f.parameter_and_double, args=(parameter,))
        dist_autograd.backward(context_id, [doubled.sum()])
        assert seen == "Tensor" and torch.equal(dist_autograd.get_gradients(context_id)[parameter], torch.full((2,), 2.0))


def test_timeouts(group):
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rpc.rpc_sync("worker1", f.sleep_and_return, args=(3,), timeout=0.3)
    fut = rpc.rpc_async("worker2", f.sleep_and_return, args=(3,), timeout=0.3)
    with pytest.raises(RuntimeError, match="RPC ran for more than set timeout \\(300 ms\\)"):
        fut.wait()
    previous = rpc._get_rpc_timeout()
    rpc._set_rpc_timeout(0.3)
    try:
        assert rpc._get_rpc_timeout() == 0.3
        with pytest.raises(RuntimeError, match="RPC ran for more than"):
            rpc.rpc_sync("worker3", f.sleep_and_return, args=(3,))
        assert rpc.rpc_sync("worker3", f.sleep_and_return, args=(0, "fast"), timeout=0) == "fast"  # 0: no timeout
    finally:
        rpc._set_rpc_timeout(previous)
    assert rpc.rpc_sync("worker1", f.sleep_and_return, args=(0.1, "ok")) == "ok"  # the worker still serves


def test_nested_calls_do_not_deadlock_when_every_pool_thread_waits(group):
    """Each worker has 4 pool threads; 16 chains of depth 6 hold every one of them in a wait."""
    futures = [rpc.rpc_async(name, f.nested_chain, args=(group.names, 6)) for name in group.names * 4]
    for fut, start in zip(futures, group.names * 4):
        chain = fut.wait()
        assert len(chain) == 7 and chain[0] == start
    # Waits the pool cannot see (Future.wait inside a UDF) are covered by its watchdog.
    futures = [rpc.rpc_async("worker1", f.nested_with_future_wait, args=("worker1",)) for _ in range(12)]
    assert [fut.wait() for fut in futures] == ["worker1"] * 12


def test_a_chain_of_nested_calls_deeper_than_the_pools_gets_threads_without_stalls(group):
    """Each worker has 4 pool threads; a chain of depth 48 through the 4 workers holds 12 of
    them on each, waiting on nested calls. Each call of the chain reaches a worker whose
    threads all wait so, and gets a thread at once: the watchdog, which would start one
    after a stall of ``stall_after`` (0.5 s a call: 20 s for this chain), starts none."""
    def stall_starts() -> list[int]:
        return [rpc.rpc_sync(name, f.pool_stall_starts) for name in group.names]

    before = stall_starts()
    chain = rpc.rpc_sync("worker1", f.nested_chain, args=(group.names, 48))
    assert chain == [group.names[(1 + i) % 4] for i in range(49)]
    assert stall_starts() == before


def test_errors_for_unknown_workers_and_bad_arguments(group):
    # torch's words ("could not find destination") and, for a worker that no name, id or
    # WorkerInfo names, torch's ValueError.
    with pytest.raises(RuntimeError, match="could not find destination worker 'nobody'"):
        rpc.rpc_sync("nobody", torch.add, args=(1, 2))
    with pytest.raises(RuntimeError, match="could not find destination worker id 99"):
        rpc.rpc_sync(99, torch.add, args=(1, 2))
    with pytest.raises(RuntimeError, match="could not find destination"):
        rpc.get_worker_info("nobody")
    for call in (rpc.rpc_sync, rpc.rpc_async, rpc.remote):
        with pytest.raises(ValueError, match="Cannot get WorkerInfo from name 1.5"):
            call(1.5, torch.add, args=(1, 2))
    with pytest.raises(TypeError):
        rpc.rpc_sync("worker1", torch.add, args=5)
    with pytest.raises(TypeError):
        rpc.rpc_sync("worker1", 42)
    with pytest.raises(rpc.SerializationError, match="could not be sent back"):
        rpc.rpc_sync("worker1", f.unpicklable_result)


def _fail_and_let_go(call) -> bool:
    """Make a call with a tensor argument, handle its error (ValueError) if it fails, and
    let go of both; whether the tensor is still alive 5 s later, with the cyclic garbage
    collector off: only a reference cycle (or a leak) can keep it then. (Not at once: the
    thread that completed the call may still be finishing the callback that did.)"""
    gc.disable()
    try:
        argument = torch.ones(3)
        released = threading.Event()
        weakref.finalize(argument, released.set)
        try:
            call(argument)
        except ValueError:
            pass
        del argument
        return not released.wait(5)
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["rpc_sync", "rpc_async"])
def test_a_failed_call_keeps_nothing_of_it_alive(group, kind):
    """The error of a failed call holds, in its traceback, the frames it passed through,
    and they hold the call's arguments (tensors, RRefs). rpc_sync's frame must not hold the
    error in turn (a cycle, freed only by the cyclic collector), nor may a future keep the
    error it raises from wait() (a cycle through the future's C++ side, never freed)."""
    def sync(x):
        rpc.rpc_sync("worker1", f.raise_value_error, args=(x,))

    def wait_async(x):
        future = rpc.rpc_async("worker1", f.raise_value_error, args=(x,))
        future.wait()

    assert not _fail_and_let_go(sync if kind == "rpc_sync" else wait_async)


@pytest.mark.parametrize("fails", [False, True], ids=["answered", "failed"])
def test_a_retried_control_call_keeps_nothing_of_it_alive(group, fails):
    """``Agent.call_retrying`` (the RRef protocol's messages, context releases): its tries
    once were closures that called each other, cycles that only the cyclic collector freed,
    with the call's arguments in them."""
    from zmqautograd.transport import MessageType

    agent = rpc.api._current()

    def retried(x):
        function = f.raise_value_error if fails else f.echo
        agent.call_retrying("worker1", function, (x,), MessageType.RREF_USER_DELETE).wait()

    assert not _fail_and_let_go(retried)


def test_builtin_operators_with_arguments_they_do_not_take_raise_as_torchs_do(group):
    """torch's test_op_with_invalid_args: RuntimeError, "failed to match any schema" (a
    TypeError too, which Python's own argument parser would raise); by rpc_async and remote()
    as well. A Python function's TypeError stays a TypeError only (test_py_function_exception)."""
    schema = "Overloaded torch operator invoked from Python failed to match any schema: aten::add"
    for call in (lambda: rpc.rpc_sync("worker1", torch.add, args=()),
                 lambda: rpc.rpc_async("worker1", torch.add, args=("a", 1)).wait(),
                 lambda: rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1), kwargs={"bogus": 1}),
                 lambda: rpc.remote("worker1", torch.add, args=()).to_here()):
        with pytest.raises(RuntimeError, match=schema) as raised:
            call()
        assert isinstance(raised.value, TypeError) and "On WorkerInfo(id=1, name=worker1)" in str(raised.value)
    # An operator's own runtime error is no argument mismatch.
    with pytest.raises(RuntimeError, match="must match the size") as raised:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), torch.ones(3)))
    assert not isinstance(raised.value, TypeError)
    with pytest.raises(TypeError) as raised:
        rpc.rpc_sync("worker1", f.my_function, args=(1,))  # a Python function, missing arguments
    assert type(raised.value) is TypeError


def test_a_function_the_callee_cannot_import_is_a_clear_error(group):
    from zmqautograd.rpc.serialization import FunctionRef

    with pytest.raises(rpc.SerializationError, match="cannot import function no_such_module.fn.*RPC pickler does not serialize"):
        rpc.rpc_sync("worker2", FunctionRef("no_such_module", "fn"))


def test_a_users_function_that_raises_is_logged_on_the_callee_too(group):
    rpc.rpc_sync("worker1", f.capture_rpc_log)
    with pytest.raises(ValueError, match="logged there"):
        rpc.rpc_sync("worker1", f.raise_value_error, args=("logged there",))
    logged = rpc.rpc_sync("worker1", f.captured_rpc_log)
    assert any(line.startswith("On WorkerInfo(id=1, name=worker1):\nValueError('logged there')") and "Traceback" in line
               for line in logged), logged


# ------------------------------------------------------------------ lifecycle, fresh groups


def _lifecycle_worker(rank, init_method, results):
    try:
        for round_number in range(2):
            options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20)
            rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
            results.put((rank, round_number, rpc.rpc_sync(f"w{1 - rank}", f.whoami)))
            rref = rpc.remote(f"w{1 - rank}", f.whoami)
            rref.to_here()
            rpc.shutdown()
        try:
            rpc.rpc_sync("w0", f.whoami)
        except RuntimeError as exc:
            results.put((rank, "after", str(exc)))
        try:  # torch's test_use_rref_after_shutdown
            rref.to_here()
        except RuntimeError as exc:
            results.put((rank, "after rref", str(exc)))
    except BaseException as exc:
        results.put((rank, "error", repr(exc)))


def _run_pair(target, expected_results: int, start_method: str = "spawn") -> list:
    """Run ``target(rank, init_method, results)`` in two fresh processes; their results."""
    ctx = mp.get_context(start_method)
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [ctx.Process(target=target, args=(rank, init_method, results)) for rank in range(2)]
    for p in processes:
        p.start()
    try:
        return [results.get(timeout=90) for _ in range(expected_results)]
    finally:
        for p in processes:
            p.join(60)
            if p.is_alive():
                p.kill()


def _leaves_before_its_peer_finished_joining(rank, init_method, results):
    try:
        from zmqautograd.transport.endpoint import Endpoint

        if rank == 1:  # finishes joining only once w0 has left: the race of torch's test_local_shutdown
            original = Endpoint.wait_for_peer

            def late(self, peer, timeout=None):
                if peer == "0":
                    from tests.conftest import poll_until
                    poll_until(lambda: self.is_lost("0"), 30, "w0 gone")
                return original(self, peer, timeout)

            Endpoint.wait_for_peer = late
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        if rank == 1:
            try:
                rpc.rpc_sync("w0", f.whoami)
            except RuntimeError as exc:
                results.put((rank, type(exc).__name__, str(exc)))
        rpc.shutdown(graceful=False)
        results.put((rank, "shut down"))
    except BaseException as exc:
        results.put((rank, "error", repr(exc)))


def test_a_worker_that_leaves_before_another_finished_joining_is_a_departed_member():
    got = sorted(_run_pair(_leaves_before_its_peer_finished_joining, 3), key=str)
    assert got[:2] == [(0, "shut down"), (1, "shut down")] or (0, "shut down") in got, got
    (departed,) = [g for g in got if g[0] == 1 and g[1] != "shut down"]
    assert departed[1] == "PeerDepartedError" and "closed its endpoint" in departed[2], got


def test_shutdown_and_init_again_in_the_same_processes():
    got = sorted(_run_pair(_lifecycle_worker, 8), key=str)
    assert [g for g in got if g[1] == "error"] == []
    assert sorted(g for g in got if g[1] in (0, 1)) == [(0, 0, "w1"), (0, 1, "w1"), (1, 0, "w0"), (1, 1, "w0")]
    assert all("RPC has not been initialized" in g[2] for g in got if g[1] == "after")
    assert [g[0] for g in got if g[1] == "after rref" and "Cannot call to_here() on it after deletion" in g[2]] == [0, 1]


def _leak_worker(rank, init_method, results):
    from unittest import mock

    import zmqautograd.rpc.api as api

    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        rref = rpc.remote(f"w{1 - rank}", torch.add, args=(torch.ones(2), 1))
        rref.to_here()
        api._ignore_rref_leak = False  # (torch's default is to ignore leaks; its tests do not)
        if rank == 0:  # kept from deleting its user RRefs, as torch's test_rref_leak does
            with mock.patch.object(api, "_delete_all_user_and_unforked_owner_rrefs"):
                try:
                    rpc.shutdown()
                except RuntimeError as exc:
                    results.put((rank, str(exc)))
                else:
                    results.put((rank, "no error"))
        else:
            rpc.shutdown()
            results.put((rank, "clean"))
    except BaseException as exc:
        results.put((rank, "error", repr(exc)))


def _fork_then_delete_worker(rank, init_method, results):
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=10)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=options)
        if rank == 0:
            rpc.rpc_sync("w2", f.delay_sends, args=({"RREF_FORK_REQUEST": 1.0},))
            rref = rpc.remote("w1", torch.add, args=(torch.ones(2), 1))
            rref.to_here()
            fetched = rpc.rpc_async("w2", f.rref_to_here, args=(rref,))  # w2's fork of it
            del rref
            rpc.api._delete_all_user_and_unforked_owner_rrefs()
            results.put((rank, fetched.wait().tolist()))
        else:
            results.put((rank, "joined"))
        rpc.shutdown()
    except BaseException as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def test_user_rrefs_are_deleted_once_the_children_they_were_forked_to_accepted():
    """Deleting the user RRefs (a graceful shutdown does, and torch's tests) waits, as torch's,
    until the children they were forked to have registered with the owner. Before, w0's
    delete reached the owner w1 ahead of w2's fork request (held back here; failed sends did
    it in torch's test_check_failed_messages): the owner let the value go, and w2's fetch
    waited for it until its timeout."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    got = sorted(spawn_and_collect(_fork_then_delete_worker, [(rank, init_method) for rank in range(3)]), key=str)
    assert got == [(0, [2.0, 2.0]), (1, "joined"), (2, "joined")], got


def test_a_graceful_shutdown_deletes_user_rrefs_and_reports_those_it_could_not():
    got = sorted(_run_pair(_leak_worker, 2), key=str)
    assert got[1] == (1, "clean"), got
    assert got[0][0] == 0 and got[0][1].startswith("Leaking RRef: 1 user RRef(s) of WorkerInfo(id=0, name=w0)"), got


def _full_collections_worker(rank, init_method, results):
    try:
        if rank == 0:
            gc.disable()  # the user turned the collector off: init_rpc leaves it alone
        before = gc.get_stats()[2]["collections"]
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20))
        results.put((rank, gc.get_stats()[2]["collections"] - before, gc.isenabled(), gc.get_freeze_count() > 0))
        rpc.shutdown()
    except BaseException as exc:
        results.put((rank, "error", repr(exc)))


def test_init_rpc_runs_the_first_full_garbage_collection_unless_the_collector_is_off():
    """A fresh interpreter's first full collection traverses everything torch's import made
    (~90 ms on the development VMs); init_rpc runs it, so that it does not stall the first
    calls of every worker of a pipeline (docs/performance.md)."""
    got = sorted(_run_pair(_full_collections_worker, 2), key=str)
    assert got == [(0, 0, False, False), (1, 1, True, False)]


def _forkserver_pair(results):
    results.put(_run_pair(_full_collections_worker, 2, "forkserver"))


def test_init_rpc_in_a_forked_worker_freezes_what_it_inherited_instead():
    """A worker forked from a forkserver shares what the forkserver imported until it writes
    to it, and a collection writes to every object it traverses (42 MB copied per worker,
    measured in rpc/api.py): it freezes them instead, and collects nothing. (The forkserver
    is a spawned process's: one started here would serve the rest of the session, without
    the preloads that tests/torch_suites asks of its own.)"""
    (got,) = spawn_and_collect(_forkserver_pair, [()])
    assert sorted(got, key=str) == [(0, 0, False, False), (1, 0, True, True)]


def _join(rank, name, world_size, init_method, timeout, results):
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=timeout)
        rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
        rpc.shutdown()
        results.put((rank, "ok"))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _intra_op_worker(rank, init_method, results):
    try:
        count = 1 if torch.get_num_threads() > 1 else 2  # anything but this process's default
        torch.set_num_threads(count)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20))
        # What the other worker's pool threads use, for a call and for a nested call.
        other = f"w{1 - rank}"
        results.put((rank, count, rpc.rpc_sync(other, f.openmp_max_threads),
                     rpc.rpc_sync(other, f.nested_openmp_max_threads, args=(f"w{rank}",))))
        rpc.shutdown()
    except BaseException as exc:
        results.put((rank, "error", repr(exc), None))


def test_pool_threads_use_the_intra_op_thread_count_set_before_init_rpc():
    """torch.set_num_threads holds for the calls a worker serves, nested ones included: a
    thread started from Python would otherwise keep OpenMP's default (one per core) until
    torch initialises it, and the ops of a compute-bound call fork teams of threads
    (measured in zmqautograd/rpc/agent.py)."""
    got = _run_pair(_intra_op_worker, 2)
    assert all(count != "error" for _, count, _, _ in got), got
    if any(served is None for _, _, served, _ in got):
        pytest.skip("torch uses no GNU or Intel OpenMP runtime here")
    for _rank, count, served, nested in got:
        assert served == count and nested == count, got


def test_a_call_with_rrefs_from_a_peer_that_finished_init_rpc_first_waits_for_ours():
    """A peer whose init_rpc returns first may call us before ours has published the agent.
    A call holding torch's RemoteModule (whose unpickling deserializes its RRef through the
    current agent: ``RRef._deserialize``) then waits for it instead of failing with "Current
    RPC agent is not set" (seen in CI with examples/hybrid_parallel.py). Worker 1 is held
    between connecting and publishing until the call arrived (decoded, or waiting to be)."""
    got = dict((rank, outcome) for rank, outcome in _run_pair(_early_caller_or_late_callee, 2))
    assert got == {0: ("ok", [[2.0, 2.0]], [1.0, 1.0]), 1: ("ok", None, None)}, got


def _early_caller_or_late_callee(rank, init_method, results):
    try:
        from zmqautograd.torch_alias import install_as_torch_rpc

        install_as_torch_rpc()  # torch's RemoteModule, on our RPC
        from torch.distributed.nn import RemoteModule

        if rank == 1:
            _hold_publishing_until_a_call_arrives()
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=30))
        outcome = ("ok", None, None)
        if rank == 0:
            remote_module = RemoteModule("w0/cpu", torch.nn.Identity)
            forward = rpc.rpc_async("w1", f.remote_module_forward, args=(remote_module, torch.full((1, 2), 2.0)))
            direct = rpc.rpc_async("w1", f.rref_to_here, args=(rpc.RRef(torch.ones(2)),))
            outcome = ("ok", forward.wait().tolist(), direct.wait().tolist())
            del remote_module
        rpc.shutdown()
        results.put((rank, outcome))
    except BaseException as exc:
        results.put((rank, ("error", repr(exc), None)))


def _hold_publishing_until_a_call_arrives():
    from zmqautograd.rpc.agent import Agent
    from zmqautograd.transport.codec import Codec, MessageType

    arrived = threading.Event()

    class SignallingEvent(threading.Event):
        def wait(self, timeout=None):
            arrived.set()  # a call waits for this agent to be published
            return super().wait(timeout)

    decode, set_members = Codec.decode_payload, Agent._set_members

    def decode_payload(self, envelope, *args, **kwargs):
        try:
            return decode(self, envelope, *args, **kwargs)
        finally:
            if envelope.type is MessageType.PYTHON_CALL:
                arrived.set()  # a call was decoded (or failed to be)

    def held_set_members(self, members):
        self._serving = SignallingEvent()
        set_members(self, members)
        assert arrived.wait(30), "the early call never arrived"

    Codec.decode_payload, Agent._set_members = decode_payload, held_set_members


def _run_group(specs, timeout=20):
    init_method = f"tcp://127.0.0.1:{free_port()}"
    return dict(spawn_and_collect(_join, [(*spec, init_method, timeout) for spec in specs]))


def test_duplicate_worker_names_are_refused():
    outcome = _run_group([(0, "same", 2), (1, "same", 2)])
    assert all("worker name 'same' is not unique" in outcome[r] for r in (0, 1)), outcome  # torch's words


def test_a_peer_that_never_shows_up_is_a_clear_error_within_the_timeout():
    started = time.monotonic()
    outcome = _run_group([(0, "a", 3), (1, "b", 3)], timeout=3)  # rank 2 never comes
    assert "RendezvousError" in outcome[0] and "rank(s) 2 did not join" in outcome[0], outcome
    # Rank 1 may find the store gone (rank 0 gave up first): still a clear, typed error.
    assert "RendezvousError" in outcome[1] and "did not join within 3 s" in outcome[1], outcome
    assert time.monotonic() - started < 60


def test_calling_before_init_rpc_is_a_clear_error():
    ctx = mp.get_context("spawn")  # a fresh process: this one may have the module's group up
    results = ctx.Queue()
    process = ctx.Process(target=_call_uninitialized, args=(results,))
    process.start()
    message, lower = results.get(timeout=60)
    process.join(30)
    assert message.startswith("RPC has not been initialized")
    # RRefs and dist autograd say it in the words of torch's C++ layers.
    assert lower == ["Current RPC agent is not set! Did you initialize the RPC framework (e.g. by calling `rpc.init_rpc`)?"] * 2


def _call_uninitialized(results):
    import zmqautograd.autograd as dist_autograd

    messages, lower = [], []
    for call in (lambda: rpc.rpc_sync("w1", f.whoami), rpc._get_current_rpc_agent):
        try:
            call()
        except RuntimeError as exc:
            messages.append(str(exc))
    for call in (lambda: rpc.RRef(torch.ones(1)), lambda: dist_autograd.backward(0, [torch.ones(1, requires_grad=True).sum()])):
        try:
            call()
        except RuntimeError as exc:
            lower.append(str(exc))
    refused = messages[0] if len(messages) == 2 and messages[0] == messages[1] else f"not both refused: {messages}"
    results.put((refused, lower))


def test_pickle_can_be_refused():
    """allow_pickle=False on both: objects msgpack cannot carry are refused with a clear error;
    functions, classes and torch's constants, called or passed, go by reference and arrive as
    themselves."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=_no_pickle_group, args=(f"tcp://127.0.0.1:{free_port()}", results))
    process.start()
    by_reference, message = results.get(timeout=90)
    process.join(30)
    assert by_reference == "same objects"
    assert "allow_pickle is False" in message and "Point" in message


def _no_pickle_group(init_method, results):
    ctx = mp.get_context("spawn")
    peer = ctx.Process(target=_join_no_pickle, args=(init_method,))
    peer.start()
    rpc.init_rpc("w0", rank=0, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(
        init_method=init_method, allow_pickle=False, rpc_timeout=20))
    try:
        assert rpc.rpc_sync("w1", f.my_function, args=(1, 2, 3)) == 6  # by reference, msgpack args: fine
        # Classes and functions as values go by reference too, both ways.
        named = [torch.optim.SGD, f.my_function, torch.add, torch.Tensor.add, len, f.Point,
                 torch.strided, torch.channels_last, torch.per_channel_affine]
        echoed = rpc.rpc_sync("w1", f.echo, args=(named,))
        by_reference = "same objects" if all(a is b for a, b in zip(echoed, named, strict=True)) else repr(echoed)
        try:
            rpc.rpc_sync("w1", f.echo, args=(f.Point(1, 2),))
            results.put((by_reference, "no error"))
        except RuntimeError as exc:
            results.put((by_reference, str(exc)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put((f"failed: {exc!r}", ""))
    finally:
        rpc.shutdown()
        peer.join(30)


def _join_no_pickle(init_method):
    rpc.init_rpc("w1", rank=1, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(
        init_method=init_method, allow_pickle=False, rpc_timeout=20))
    rpc.shutdown()


def _init_method_worker(rank, init_method, env, results):
    os.environ.update(env)
    try:
        kwargs = {} if init_method == "env://" else {"rank": rank, "world_size": 2}
        rpc.init_rpc(f"w{rank}", rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20), **kwargs)
        results.put((rank, rpc.rpc_sync(f"w{1 - rank}", f.whoami)))
        rpc.shutdown()
    except BaseException as exc:
        results.put((rank, repr(exc)))


@pytest.mark.parametrize("scheme", ["env", "file"])
def test_env_and_file_init_methods(scheme, tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = []
    for rank in range(2):
        if scheme == "env":  # as torchrun sets them
            env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
            init_method = "env://"
        else:
            env, init_method = {}, f"file://{tmp_path}/rendezvous"
        processes.append(ctx.Process(target=_init_method_worker, args=(rank, init_method, env, results)))
    for p in processes:
        p.start()
    got = dict(results.get(timeout=90) for _ in processes)
    for p in processes:
        p.join(30)
    assert got == {0: "w1", 1: "w0"}


def test_advertised_address_follows_the_route_to_the_master():
    from zmqautograd.rpc.rendezvous import advertise_address

    assert advertise_address("127.0.0.1") == "127.0.0.1"
    assert advertise_address("127.0.0.1", override="10.1.2.3") == "10.1.2.3"
    os.environ["ZMQAUTOGRAD_ADVERTISE_ADDRESS"] = "192.0.2.7"
    try:
        assert advertise_address("127.0.0.1") == "192.0.2.7"
    finally:
        del os.environ["ZMQAUTOGRAD_ADVERTISE_ADDRESS"]


def test_async_execution_holds_no_thread_while_waiting(group):
    before = rpc.rpc_sync("worker1", f.pool_thread_count)
    futures = [rpc.rpc_async("worker1", f.async_add_after, args=("worker2", 0.5, i)) for i in range(16)]
    assert [fut.wait() for fut in futures] == [i + 1 for i in range(16)]
    # 16 calls waited at once on worker1 with 4 pool threads, and none of them held one.
    assert rpc.rpc_sync("worker1", f.pool_thread_count) <= max(before, 4)
    with pytest.raises(ValueError, match="inside the future"):
        rpc.rpc_sync("worker1", f.async_raises, args=("worker3",))
    assert rpc.rpc_sync("worker2", f.AsyncHolder.static_async, args=(5,)) == 15


def test_remote_of_async_functions_keeps_what_their_future_completes_with(group):
    """torch's test_async_function_*_remote: the RRef's value is the future's result, and no
    thread waits for it on the owner; a failure inside the future reaches to_here."""
    rref = rpc.remote("worker1", f.async_add_after, args=("worker2", 0.2, 5))
    assert rref.to_here() == 6
    x, y = torch.ones(2, 2), torch.ones(2, 2) + 1
    assert torch.equal(rpc.remote("worker2", f.AsyncExecutionClass.static_async_add, args=("worker3", x, x, y)).to_here(), 4 * x)
    with pytest.raises(ValueError, match="inside the future"):
        rpc.remote("worker1", f.async_raises, args=("worker3",)).to_here()
    # torch's message and type (RuntimeError), still a TypeError too.
    with pytest.raises(RuntimeError, match=r"must return a torch\.futures\.Future object, but got <class 'int'>") as caught:
        rpc.remote("worker3", f.AsyncExecutionClass().not_a_future).to_here()
    assert isinstance(caught.value, TypeError)


def test_async_methods_through_rref_proxies(group):
    """torch's test_async_class_rref_proxy (sync, async and remote): a proxy to a method marked
    async_execution is answered when the method's future completes."""
    rref = rpc.remote("worker1", f.AsyncExecutionClass)
    x, y = torch.ones(2, 2), torch.ones(2, 2) + 1
    for proxy, get in ((rref.rpc_sync, lambda r: r), (rref.rpc_async, lambda r: r.wait()),
                       (rref.remote, lambda r: r.to_here())):
        total = get(proxy().static_async_add("worker2", x, x, y))
        total = total + get(proxy().class_async_add("worker2", x, x, y))
        total = total + get(proxy().bound_async_add("worker2", x, x, y))
        assert torch.equal(total, 3 * 4 * x)
        assert get(proxy().plain(21)) == 42  # plain methods as before
    with pytest.raises(TypeError, match=r"Functions decorated with @rpc\.async_function must return a torch\.futures\.Future"):
        rref.rpc_sync().not_a_future()


# ----------------------------------------------------------------------------------- RRef


def test_remote_and_rref_basics(group):
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 3))
    assert torch.equal(rref.to_here(), torch.full((2,), 4.0))
    assert rref.owner() == rpc.get_worker_info("worker1") and rref.owner_name() == "worker1"
    assert not rref.is_owner() and rref.confirmed_by_owner()
    # torch's message (test_local_value_not_on_owner).
    with pytest.raises(RuntimeError, match=(
        r"For UserRRef\(rref_id=GloballyUniqueId\(created_on=0, local_id=\d+\), fork_id=GloballyUniqueId\(created_on=0, "
        r"local_id=\d+\)\), can't call localValue\(\) on user WorkerInfo\(id=0, name=worker0\)\. "
        r"Call it on owner WorkerInfo\(id=1, name=worker1\)")):
        rref.local_value()
    with pytest.raises(RuntimeError, match="Can not pickle rref in python pickler"):  # test_rref_py_pickle_not_supported
        pickle.dumps(rref)
    local = rpc.RRef(torch.ones(3))
    assert local.is_owner() and local.confirmed_by_owner() and torch.equal(local.local_value(), torch.ones(3))
    assert torch.equal(local.to_here(), torch.ones(3))
    own = rpc.remote("worker0", f.my_function, args=(1, 2, 3))  # remote to ourselves: we own it
    assert own.is_owner() and own.to_here() == 6
    # torch's test_rref_str format (the local ids depend on what this worker made before).
    unique_id = r"GloballyUniqueId\(created_on=0, local_id=\d+\)"
    assert re.fullmatch(rf"OwnerRRef\({unique_id}\)", str(local))
    assert re.fullmatch(rf"UserRRef\(RRefId = {unique_id}, ForkId = {unique_id}\)", str(rref))


@pytest.mark.parametrize("blocking", [True, False])
def test_rref_get_type(group, blocking):
    """torch's test_rref_type_{blocking,non_blocking}, _with_error, _owner, _slow_init and
    test_rref_get_type_timeout_*: the owner is asked once, and the answer kept."""
    def get_type(rref, **kwargs):
        got = rref._get_type(blocking=blocking, **kwargs)
        return got if blocking else got.wait()

    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
    assert get_type(rref) is torch.Tensor
    if not blocking:  # every later ask returns the first answer's future: no new call
        first = rref._get_type(blocking=False)
        assert all(rref._get_type(blocking=False) is first for _ in range(10))
    assert get_type(rpc.remote("worker2", f.Counter, args=(0,))) is f.Counter
    failed = rpc.remote("worker2", f.raise_value_error, args=("Expected error",))
    with pytest.raises(ValueError, match="Expected error"):
        get_type(failed)
    assert get_type(rpc.RRef(torch.ones(2) + 1)) is torch.Tensor and get_type(rpc.RRef(f.Counter(0))) is f.Counter
    slow = rpc.remote("worker3", f.sleep_and_return, args=(1.0, torch.ones(2)))
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        get_type(slow, timeout=0.2)
    assert get_type(slow) is torch.Tensor  # a failed ask is not kept: this one waits for the value


def test_remote_exception_raises_on_to_here(group):
    rref = rpc.remote("worker2", f.raise_value_error, args=("stored failure",))
    with pytest.raises(ValueError, match="stored failure"):
        rref.to_here()


def test_rref_proxies_run_methods_on_the_owner(group):
    counter = rpc.remote("worker3", f.Counter, args=(10,))
    assert counter.rpc_sync().increment(5) == 15
    assert counter.rpc_async().increment().wait() == 16
    assert counter.remote().increment().to_here() == 17
    assert counter.to_here().value == 17
    # A method the value does not have (torch's test_rref_proxy_non_exist): remote() looks at
    # the type first and raises at once; the others fail with the owner's AttributeError.
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        counter.remote().non_exist()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        counter.rpc_sync().non_exist()
    with pytest.raises(AttributeError, match="has no attribute 'non_exist'"):
        counter.rpc_async().non_exist().wait()


def test_a_call_runs_once_the_owner_confirmed_the_user_rrefs_it_carries(group):
    """torch's test_user_rrefs_confirmed(_remote): a user RRef that a call brings to a third
    worker is registered with its owner before the function runs there."""
    for _ in range(5):  # (a race without the wait: each round may lose it)
        rref = rpc.remote("worker2", torch.add, args=(torch.zeros(2, 2), 1))
        assert rpc.rpc_sync("worker1", f.rref_confirmed, args=(rref,)) is True
        assert rpc.remote("worker1", f.rref_confirmed, args=(rref,)).to_here() is True


def test_rrefs_passed_to_owners_users_and_third_workers(group):
    rref = rpc.remote("worker1", torch.mul, args=(torch.ones(2), 7))
    # To its owner: arrives as the owner's own RRef.
    assert rpc.rpc_sync("worker1", f.rref_owner_name_and_value, args=(rref,))[2] is True
    # To a third worker (a fork through the owner), and from there on to a fourth.
    name, value, is_owner = rpc.rpc_sync("worker2", f.rref_owner_name_and_value, args=(rref,))
    assert (name, is_owner) == ("worker1", False) and torch.equal(value, torch.full((2,), 7.0))
    name, value, is_owner = rpc.rpc_sync("worker2", f.forward_rref, args=(rref, "worker3"))
    assert (name, is_owner) == ("worker1", False) and torch.equal(value, torch.full((2,), 7.0))
    # An RRef created on a worker comes back to us as a user RRef.
    back = rpc.rpc_sync("worker3", f.make_rref_here, args=("made on worker3",))
    assert not back.is_owner() and back.owner_name() == "worker3" and back.to_here() == "made on worker3"


def test_owner_rref_backward(group):
    """``RRef.backward`` on an owner RRef: a local pass without a context id, a distributed
    one with it (ported from torch's rpc_test.py, errors included)."""
    t1 = torch.rand(10, 10, requires_grad=True)
    rref = rpc.RRef(t1.sum() + t1.sum())
    rref.backward()
    expected = torch.ones_like(t1) * 2
    torch.testing.assert_close(t1.grad, expected)
    with dist_autograd.context() as context_id:
        t2 = rpc.rpc_sync("worker1", torch.add, args=(t1, t1))
        rpc.RRef(t2.sum()).backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], expected)
    with dist_autograd.context() as context_id:  # two passes accumulate in the context
        t2 = rpc.rpc_sync("worker1", torch.add, args=(t1, t1))
        rref = rpc.RRef(t2.sum())
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t1], expected * 2)
    torch.testing.assert_close(t1.grad, expected)  # distributed passes never touch .grad

    with pytest.raises(RuntimeError, match="tensors does not require grad and does not have a grad_fn"):
        rpc.RRef(torch.rand(10)).backward()
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        rpc.RRef(torch.rand(10, requires_grad=True)).backward()
    with pytest.raises(RuntimeError, match="Could not find autograd context with id: 100"):
        rpc.RRef(torch.rand(10, requires_grad=True).sum()).backward(100)
    with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for .backward\(\)"):
        rpc.RRef("foo").backward()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        rpc.RRef(torch.rand(1, requires_grad=True).sum()).backward("1")


def test_user_rref_backward(group):
    """``RRef.backward`` on a user RRef runs the pass on the owner, which originates it; the
    gradients reach the caller's context (ported from torch's rpc_test.py)."""
    t = torch.rand(10, requires_grad=True)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker2", f.sum_of, args=(t,))
        rref.backward(context_id, retain_graph=True)
        rref.backward(context_id)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[t], torch.ones_like(t) * 2)
    with dist_autograd.context() as context_id:
        rref = rpc.remote("worker2", f.echo, args=("foo",))
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for .backward\(\)"):
            rref.backward(context_id)
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id' to be specified"):
            rref.backward()
    with dist_autograd.context() as context_id:  # a remote() that failed: its error, from the owner
        rref = rpc.remote("worker3", f.raise_value_error, args=("no value to differentiate",))
        with pytest.raises(ValueError, match="no value to differentiate"):
            rref.backward(context_id)


def _settle_everyone(group) -> None:
    """Every worker's calls (RRef deletions and forks included) answered. We settle here: a
    call to ourselves would wait on itself."""
    assert f.settle()
    for name in group.names[1:]:
        assert rpc.rpc_sync(name, f.settle)


def test_dropped_rrefs_leave_nothing_on_the_owner(group):
    _settle_everyone(group)
    baseline = rpc.rpc_sync("worker2", f.owned_rrefs)
    rrefs = [rpc.remote("worker2", f.my_function, args=(i, 0, 0)) for i in range(1000)]
    assert [r.to_here() for r in rrefs[::100]] == list(range(0, 1000, 100))
    _settle_everyone(group)
    assert rpc.rpc_sync("worker2", f.owned_rrefs) == baseline + 1000
    del rrefs
    _settle_everyone(group)
    assert rpc.rpc_sync("worker2", f.owned_rrefs) == baseline


def test_rrefs_in_a_call_its_receiver_refused_undecoded_are_not_kept_for_it(group):
    """A call refused undecoded, or not sent, never reached its receiver: the RRefs it carried
    are not kept for a child that will never accept them, and the owner's value goes once we
    drop ours.
    (They were kept for ever: the value leaked, and a graceful shutdown, which waits for
    children to accept, waited 5 minutes.)"""
    _settle_everyone(group)
    baseline = rpc.rpc_sync("worker1", f.owned_rrefs)
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 1))
    rref.to_here()
    try:
        rpc.rpc_sync("worker2", f.echo, args=(f.FailsToUnpickle(), rref))
    except RuntimeError as exc:
        assert "cannot be loaded here" in str(exc)
        exc.__traceback__ = None  # (logged too: pytest keeps the record, and these frames hold our RRef)
    else:
        pytest.fail("the call was not refused")
    assert rpc.api._current().rrefs._pending_children == {}
    endpoint = rpc.api._current().endpoint
    endpoint.faults = FaultPolicy(messages_to_fail=["PYTHON_CALL"], num_fail_sends=1)
    try:  # and one whose send failed
        with pytest.raises(RuntimeError, match="failed on purpose"):
            rpc.rpc_sync("worker2", f.echo, args=(rref,))
    finally:
        endpoint.faults = None
    assert rpc.api._current().rrefs._pending_children == {}
    del rref
    _settle_everyone(group)
    assert rpc.rpc_sync("worker1", f.owned_rrefs) == baseline


def test_an_rref_dropped_while_its_remote_still_runs_leaves_nothing_on_the_owner(group):
    """The remote() times out here while the owner still makes the value; the user drops
    the RRef, whose delete the owner serves before the value is made. Once it is, nothing
    references it any more."""
    _settle_everyone(group)
    baseline = rpc.rpc_sync("worker2", f.owned_rrefs)
    rref = rpc.remote("worker2", f.wait_at_gate, args=(5,), timeout=0.5)
    with pytest.raises(RuntimeError, match="RPC ran for more than"):
        rref._get_future().wait()  # (to_here() would wait for the value, to the call timeout)
    del rref
    assert f.settle()  # our delete was answered: worker2 has it, its remote() still waits
    rpc.rpc_sync("worker2", f.open_gate)
    assert f.settle()  # the remote() was answered: it has run to its end
    assert rpc.rpc_sync("worker2", f.owned_rrefs) == baseline


def test_rref_context_debug_info(group):
    """torch's test_rref_context_debug_info, from the driver: a local RRef is counted as
    owned once shared, not before; a remote() value on its owner; a user RRef as pending
    until its owner confirms it; nothing pending once every worker settled."""
    _settle_everyone(group)
    base = f.rref_debug_info()
    assert set(base) == {"num_owner_rrefs", "num_pending_futures", "num_pending_users", "num_forks"}
    assert base["num_pending_futures"] == 0 and base["num_pending_users"] == 0
    local = rpc.RRef(torch.ones(2))
    assert f.rref_debug_info() == base  # not shared yet
    rpc.rpc_sync("worker1", f.keep_rref, args=(local,))
    _settle_everyone(group)
    info = f.rref_debug_info()
    assert info["num_owner_rrefs"] == base["num_owner_rrefs"] + 1
    assert info["num_forks"] == base["num_forks"] + 1
    assert info["num_pending_users"] == info["num_pending_futures"] == 0
    rpc.rpc_sync("worker1", f.clear_kept_rref)
    _settle_everyone(group)  # worker1's delete is answered: the fork is gone
    assert f.rref_debug_info() == base
    # remote(): owned on worker1; pending here until worker1 confirms it.
    base1 = rpc.rpc_sync("worker1", f.rref_debug_info)
    gated = rpc.remote("worker1", f.wait_at_gate, args=(7,))
    try:
        assert f.rref_debug_info()["num_pending_users"] == 1  # worker1 answers once the function returns
    finally:
        rpc.rpc_sync("worker1", f.open_gate)
    other = rpc.remote("worker1", torch.add, args=(torch.ones(2, 2), 1))
    assert gated.to_here() == 7 and torch.equal(other.to_here(), torch.full((2, 2), 2.0))
    _settle_everyone(group)
    assert f.rref_debug_info()["num_pending_users"] == 0
    info1 = rpc.rpc_sync("worker1", f.rref_debug_info)
    assert info1["num_owner_rrefs"] == base1["num_owner_rrefs"] + 2
    assert info1["num_forks"] == base1["num_forks"] + 2
    assert info1["num_pending_futures"] == info1["num_pending_users"] == 0
    del gated, other
    _settle_everyone(group)
    assert rpc.rpc_sync("worker1", f.rref_debug_info) == base1


def test_debug_info_is_the_union_of_rref_agent_and_autograd_info(group):
    """torch's test_debug_info: the three sources share no key, and _get_debug_info has all."""
    rref_info = rpc._rref_context_get_debug_info()
    agent_info = rpc._get_current_rpc_agent().get_debug_info()
    autograd_info = dist_autograd._get_debug_info()
    assert not rref_info.keys() & agent_info.keys() & autograd_info.keys()
    assert not (rref_info.keys() & agent_info.keys()) and not (agent_info.keys() & autograd_info.keys())
    assert rpc._get_debug_info().keys() == rref_info.keys() | agent_info.keys() | autograd_info.keys()


def test_an_rref_dropped_while_the_socket_lock_is_held_does_not_deadlock(group):
    """``RRef.__del__`` runs wherever the last reference goes or the garbage collector runs,
    even on the endpoint's I/O thread in the middle of a receive, which holds the socket lock
    and may hold the RRef context's lock: releasing must not send or lock from there. (A
    fresh-clone CI run caught the I/O thread deadlocked on its own socket lock this way.)"""
    import gc

    from zmqautograd.rpc import api

    _settle_everyone(group)
    baseline = rpc.rpc_sync("worker2", f.owned_rrefs)
    holder = [rpc.remote("worker2", f.my_function, args=(7, 0, 0))]
    assert holder[0].to_here() == 7
    agent = api._current()
    dropped = threading.Event()

    def drop_the_last_reference_holding_both_locks() -> None:
        with agent.endpoint._socket_lock, agent.rrefs._lock:
            holder.clear()
            gc.collect()  # __del__ runs here, on this thread (the RRef sits in a cycle)
        dropped.set()

    threading.Thread(target=drop_the_last_reference_holding_both_locks, daemon=True).start()
    assert dropped.wait(10), "RRef.__del__ deadlocked on a lock its thread holds"
    _settle_everyone(group)
    assert rpc.rpc_sync("worker2", f.owned_rrefs) == baseline  # the delete still reached the owner


def test_workers_that_disagree_on_world_size_get_a_clear_error():
    outcome = _run_group([(0, "a", 2), (1, "b", 3)], timeout=5)
    assert "workers disagree on world_size: [2, 3]" in outcome[0], outcome
    assert "RendezvousError" in outcome[1], outcome  # rank 1 waits for a rank 2 that never comes


def _ungraceful_worker(rank, init_method, results):
    try:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2,
                     rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=30))
        if rank == 0:
            pending = rpc.rpc_async("w1", f.sleep_and_return, args=(20, "late"))
            started = time.monotonic()
            rpc.shutdown(graceful=False)  # returns at once, failing what is pending
            elapsed = time.monotonic() - started
            try:
                pending.wait()
                results.put((0, "pending call succeeded"))
            except RuntimeError as exc:
                results.put((0, elapsed, str(exc)))
        else:
            try:
                rpc.shutdown()  # graceful: rank 0 is gone, so this must fail clearly, not hang
                results.put((1, "graceful shutdown succeeded"))
            except RuntimeError as exc:
                results.put((1, str(exc)))
    except BaseException as exc:
        results.put((rank, "error", repr(exc)))


def test_ungraceful_shutdown_returns_at_once_and_the_peer_fails_clearly():
    got = {item[0]: item[1:] for item in _run_pair(_ungraceful_worker, 2)}
    elapsed, message = got[0]
    assert elapsed < 3.0 and "abandoned" in message, got
    # Rank 1's graceful shutdown: rank 0 left without waiting, so it fails, naming rank 0 and
    # why (its barrier call found rank 0 shutting down, or rank 0's connection closed).
    message = got[1][0]
    assert "was not graceful" in message and "w0" in message, got
    assert "RPC is shutting down on WorkerInfo(id=0, name=w0)" in message or "lost peer '0'" in message, got


def test_an_rref_serialized_as_data_is_a_fork_wherever_it_is_deserialized(group):
    """torch's private ``RRef._serialize`` / ``_deserialize``: the data is a fork, counted by
    the owner until its receiver lets go of it (a plain tuple carries it, not the RRef)."""
    rref = rpc.remote("worker1", torch.add, args=(torch.ones(2), 2))
    data = rref._serialize()
    assert type(data) is tuple
    assert torch.equal(rpc.rpc_sync("worker2", f.value_of_serialized_rref, args=(data,)), torch.full((2,), 3.0))
    assert torch.equal(rpc.RRef._deserialize(rref._serialize()).to_here(), torch.full((2,), 3.0))
    owned = rpc.RRef(torch.zeros(1))
    assert torch.equal(rpc.rpc_sync("worker1", f.value_of_serialized_rref, args=(owned._serialize(),)), torch.zeros(1))


def test_wait_all_raises_the_first_remote_error_while_another_call_still_runs(group):
    """torch's test_wait_all_exit_early_*: the error of a failed call ends the wait at once,
    with its type; a TorchScript function's error is a RuntimeError, as torch's."""
    blocked = rpc.rpc_async("worker1", f.wait_at_gate, args=(7,))
    try:
        failing = rpc.rpc_async("worker1", f.raise_value_error, args=("early",))
        with pytest.raises(ValueError, match="early"):
            torch.futures.wait_all([blocked, failing])
        assert not blocked.done()
        scripted = rpc.rpc_async("worker2", f.raise_in_script, args=("scripted",))
        with pytest.raises(rpc.ScriptFunctionError, match="scripted") as caught:
            torch.futures.wait_all([blocked, scripted])
        assert isinstance(caught.value, RuntimeError)
    finally:
        rpc.rpc_sync("worker1", f.open_gate)
    assert blocked.wait() == 7


def test_every_error_type_of_ours_raised_remotely_is_rebuilt_with_its_type_and_message(group):
    from zmqautograd.transport import errors as transport_errors

    cases = [(cls, ("3", f"{cls.__name__} text")) for cls in (
        transport_errors.PeerLostError, transport_errors.PeerDepartedError, transport_errors.UnknownPeerError,
        transport_errors.InjectedFaultError)]
    cases += [(cls, (f"{cls.__name__} text",)) for cls in (
        transport_errors.TransportError, transport_errors.LocalProtocolError, transport_errors.RemoteProtocolError,
        transport_errors.MessageTooLargeError, transport_errors.EndpointClosedError, transport_errors.DeviceMapError,
        rpc.RpcError, rpc.RpcTimeoutError, rpc.SerializationError, rpc.RendezvousError, rpc.OperatorArgumentsError,
        rpc.ScriptFunctionError)]
    for cls, args in cases:
        with pytest.raises(cls) as caught:
            rpc.rpc_sync("worker1", f.raise_error_of, args=(cls, args))
        assert type(caught.value) is cls and f"{cls.__name__} text" in str(caught.value)
        assert "On WorkerInfo(id=1, name=worker1)" in str(caught.value)
        if len(args) == 2:
            assert caught.value.peer == "3"


def _wait_without_limit(rank: int, init_method: str, results) -> None:
    """A worker whose timeouts are longer than any wait of the OS (epoll and lock waits
    refuse more than about 24.8 days, thread waits more than 292 years)."""
    try:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(
            init_method=init_method, rpc_timeout=float("inf")))
        got = []
        if rank == 0:
            # Answered after the caller went to sleep: the sleep itself is what refused.
            got.append(rpc.rpc_sync("worker1", f.sleep_and_return, args=(0.2, 1)))
            for timeout in (1e12, float("inf")):
                got.append(rpc.rpc_sync("worker1", f.sleep_and_return, args=(0.2, 2), timeout=timeout))
                got.append(rpc.rpc_async("worker1", f.sleep_and_return, args=(0.2, 3), timeout=timeout).wait())
                got.append(rpc.remote("worker1", f.sleep_and_return, args=(0.2, 4), timeout=timeout).to_here(timeout))
        rpc.shutdown(timeout=float("inf"))
        results.put((rank, got))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def test_timeouts_longer_than_any_wait_mean_no_limit():
    """rpc_timeout, call timeouts and shutdown's timeout of inf or 1e12 s raised
    OverflowError from a sleep, at init_rpc, in calls and in shutdown."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    outcome = dict(spawn_and_collect(_wait_without_limit, [(rank, init_method) for rank in (0, 1)]))
    assert outcome == {0: [1, 2, 3, 4, 2, 3, 4], 1: []}, outcome
