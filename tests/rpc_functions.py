"""Functions the RPC tests call on remote workers (importable by every worker process)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

import torch

import zmqautograd.rpc as rpc


def my_function(a, b, c):
    return a + b + c


def structure(value):
    return {"type": type(value).__name__, "value": value}


def raise_value_error(message):
    raise ValueError(message)


_captured_log: list[str] = []


class _LogCapture(logging.Handler):
    def emit(self, record):
        _captured_log.append(record.getMessage())


def capture_rpc_log():
    """From now on, keep what zmqautograd.rpc logs on this worker (captured_rpc_log)."""
    _captured_log.clear()
    logging.getLogger("zmqautograd.rpc").addHandler(_LogCapture())


def captured_rpc_log():
    return list(_captured_log)


class NeedsTwoArguments(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def raise_unbuildable():
    raise NeedsTwoArguments(7, "cannot be rebuilt from one message")


def exit_with(code):
    sys.exit(code)


def raise_keyboard_interrupt():
    raise KeyboardInterrupt


def parameter_types(value):
    """(type name, requires_grad) of what arrived: a tensor, or each parameter of a module."""
    if isinstance(value, torch.nn.Module):
        return [(type(p).__name__, p.requires_grad) for p in value._parameters.values()]
    return type(value).__name__, value.requires_grad


def parameter_and_double(value):
    return type(value).__name__, value * 2


def sleep_and_return(seconds, value=None):
    time.sleep(seconds)
    return value


def whoami():
    return rpc.get_worker_info().name


def ids_made_here() -> tuple[tuple, int]:
    """The id of an RRef and of a dist autograd context made on this worker now."""
    import zmqautograd.autograd as dist_autograd

    with dist_autograd.context() as context_id:
        return tuple(rpc.RRef(torch.zeros(1)).rref_id), context_id


def nested_chain(workers, depth):
    """Calls itself on the next worker ``depth`` times, synchronously (holds a pool thread)."""
    if depth == 0:
        return [rpc.get_worker_info().name]
    me = rpc.get_worker_info().name
    target = workers[(workers.index(me) + 1) % len(workers)]
    return [me] + rpc.rpc_sync(target, nested_chain, args=(workers, depth - 1))


def nested_with_future_wait(target):
    """Waits on an rpc_async future directly (a wait the pool cannot see)."""
    return rpc.rpc_async(target, whoami).wait()


def sum_of(x):
    return x.sum()


def add_tensors(x, y, alpha=1):
    return torch.add(x, y, alpha=alpha)


def unpicklable_result():
    return lambda: None  # cannot travel back


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def echo(value):
    return value


@rpc.functions.async_execution
def async_add_after(target, seconds, value):
    """Returns a future: the reply goes out when the nested call completes."""
    return rpc.rpc_async(target, sleep_and_return, args=(seconds, value)).then(lambda fut: fut.wait() + 1)


@rpc.functions.async_execution
def async_raises(target):
    return rpc.rpc_async(target, raise_value_error, args=("inside the future",))


class AsyncHolder:
    @staticmethod
    @rpc.functions.async_execution
    def static_async(value):
        future = torch.futures.Future()
        future.set_result(value * 3)
        return future


class AsyncExecutionClass:
    """torch's rpc_test.AsyncExecutionClass: async_execution static, class and bound methods."""

    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        result = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: result.set_result(fut.wait() + z))
        return result

    @rpc.functions.async_execution
    def bound_async_add(self, to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @rpc.functions.async_execution
    def not_a_future(self):
        return 42

    def plain(self, value):
        return value * 2


def pool_thread_count():
    from zmqautograd.rpc import api

    return api._agent.pool.thread_count


def pool_stall_starts():
    """Threads this worker's pool started only after a stall (its watchdog)."""
    from zmqautograd.rpc import api

    return api._agent.pool.stall_starts


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, by=1):
        self.value += by
        return self.value


def rref_to_here(rref):
    return rref.to_here()


def rref_owner_name_and_value(rref):
    return rref.owner_name(), rref.to_here(), rref.is_owner()


def rref_confirmed(rref):
    return rref.confirmed_by_owner()


def delay_sends(delays):
    """Hold back this worker's messages of the types in ``delays`` (type name -> seconds)."""
    from zmqautograd.transport.faults import FaultPolicy

    rpc.api._current().endpoint.faults = FaultPolicy(messages_to_delay=delays)


def make_rref_here(value):
    return rpc.RRef(value)


def forward_rref(rref, target):
    """A user passes its RRef on to a third worker."""
    return rpc.rpc_sync(target, rref_owner_name_and_value, args=(rref,))


def owned_rrefs():
    from zmqautograd.rpc.rref_owner import _owned_count

    return _owned_count()


def rref_debug_info():
    return {key: int(value) for key, value in rpc._rref_context_get_debug_info().items()}


_kept_rref = None


def keep_rref(rref):
    """Hold a user of ``rref`` here until clear_kept_rref (torch's set_global_rref)."""
    global _kept_rref
    _kept_rref = rref


def clear_kept_rref():
    global _kept_rref
    _kept_rref = None


_gate = threading.Event()


def wait_at_gate(value):
    """Return ``value`` once open_gate is called (then close it again for the next use)."""
    if not _gate.wait(60):
        raise TimeoutError("the gate was never opened")
    _gate.clear()
    return value


def open_gate():
    _gate.set()


def _decoding_thread() -> str:
    return threading.current_thread().name


class DecodedWhere:
    """Decodes (unpickles) as the name of the thread that decodes it."""

    def __reduce__(self):
        return (_decoding_thread, ())


def decoded_where_at_gate():
    return wait_at_gate(DecodedWhere())


def settle():
    """Wait until every call this worker made (RRef deletions included) has been answered."""
    import gc

    from zmqautograd.rpc import api

    gc.collect()
    return api._current().wait_outstanding(30)


def openmp_max_threads():
    """OpenMP's thread count for teams this thread would fork, read from the OpenMP runtime
    torch loaded, without going through torch (which would initialise it); None when torch
    uses no GNU or Intel OpenMP runtime."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            libraries = sorted({line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line})
    except OSError:
        return None
    return ctypes.CDLL(libraries[0]).omp_get_max_threads() if libraries else None


def nested_openmp_max_threads(back):
    """``openmp_max_threads`` on a pool thread of ``back``, asked from inside a call."""
    return rpc.rpc_sync(back, openmp_max_threads)


def pass_on_and_count_loans(value, target):
    """Send ``value`` on to ``target`` and back; this worker's lending counters for it."""
    import zmqautograd.rpc as rpc

    back = rpc.rpc_sync(target, echo, args=(value,))
    stats = rpc._get_current_rpc_agent().endpoint.stats()[str(rpc.get_worker_info(target).id)]
    return back, stats.buffers_lent, stats.buffers_borrowed


def double_and_pass_on(value, target):
    """``value * 2`` from ``target`` (a nested call that lends both ways when big)."""
    import zmqautograd.rpc as rpc

    return rpc.rpc_sync(target, torch.mul, args=(value, 2))


def buffers_on_loan():
    """This worker's count of buffers lent and not yet released, over all its peers."""
    import zmqautograd.rpc as rpc

    return sum(stats.buffers_on_loan for stats in rpc._get_current_rpc_agent().endpoint.stats().values())


def call_each(names):
    """A call from this worker to each of ``names``: it travels behind every message this
    worker sent them before (its releases of lent buffers among them)."""
    import zmqautograd.rpc as rpc

    return [rpc.rpc_sync(name, whoami) for name in names]


def ops_in_a_block(x):
    """A few operators inside a record_function block (the profiling tests)."""
    with torch.autograd.profiler.record_function("##block##"):
        return torch.relu(torch.mul(x, 2) + 1)


@rpc.functions.async_execution
def async_add_on(target, x, y):
    """Answered when an add on ``target`` is (the profiling tests: a nested profiled call)."""
    return rpc.rpc_async(target, torch.add, args=(x, y))


def profiled_events_of(profile_rref):
    """The names of the top-level events of each call a server-wide profile saw."""
    names = []
    for events in profile_rref.local_value().process_global_function_events:
        end = 0.0
        for event in events:
            if event.time_range.start > end:
                names.append(event.name)
                end = event.time_range.end
    return sorted(names)


def value_of_serialized_rref(data):
    """The value of the RRef ``RRef._serialize`` made ``data`` of, fetched from its owner."""
    return rpc.RRef._deserialize(data).to_here()


@torch.jit.script
def raise_in_script(message: str) -> torch.Tensor:
    raise ValueError(message)


def raise_error_of(kind, args):
    """Raise ``kind(*args)`` (a class, sent by reference)."""
    raise kind(*args)


# ------------------------------------------------------------- RRefs nested in objects


@dataclasses.dataclass
class Holder:
    """A user object that holds RRefs (pickled, with them inside)."""

    name: str
    refs: dict


class Box:
    def __init__(self, inner):
        self.inner = inner


def values_of_nested(holder):
    """Resolve every RRef nested in ``holder`` (a Holder of a Box of a list of RRefs)."""
    return {key: [(r.owner_name(), r.is_owner(), r.to_here()) for r in box.inner] for key, box in holder.refs.items()}


def nested_rrefs_of_own_values(count):
    """A result holding RRefs to values this worker owns (made here, forked to the caller)."""
    return Holder("made", {"box": Box([rpc.RRef(torch.full((2,), float(i))) for i in range(count)])})


def pass_nested_on(holder, target):
    """Send what arrived on to a third worker, still nested."""
    return rpc.rpc_sync(target, values_of_nested, args=(holder,))


def remote_module_forward(remote_module, x):
    """A RemoteModule that arrived in a call, used here."""
    return remote_module.forward(x)


class NotAModule:
    def __init__(self, *args, **kwargs):
        pass


def _raise_on_load():
    raise ValueError("cannot be loaded here")


class FailsToUnpickle:
    """Pickles, but fails to unpickle at the receiver."""

    def __reduce__(self):
        return (_raise_on_load, ())
