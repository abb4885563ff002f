"""RPC profiling, as torch's.

While torch's legacy profiler (``torch.autograd.profiler_legacy.profile``) runs on a thread,
each RPC that thread makes (``rpc_sync``, ``rpc_async``, ``remote``) is an event named
``rpc_{sync|async|remote}#{function}({caller} -> {callee})``, and the callee runs the function
under the same profiler settings (``_run_profiled``) and sends its events back with the answer.
They join the caller's profile as remote events: named ``{key}#remote_op: {name}``,
``is_remote``, ``node_id`` the rank of the worker they ran on; a call the function makes in
turn folds its callee's events the same way, one level deeper. As in torch 2.x, the Kineto
profilers (``torch.profiler.profile``, ``torch.autograd.profiler.profile``) record no RPC
events. ``_server_process_global_profile`` profiles every call a worker serves.

torch's legacy profiler keeps its events in C++, and Python can add none to them: the RPC
events and the remote ones are kept here, per profile (a ``_Session``), and join what
``_disable_profiler_legacy`` returns when the profile ends. ``torch.autograd.profiler_legacy``
is wrapped for that (``_install``): its ``profile._start_trace``, to learn the settings of a
profile that starts, and its ``_disable_profiler_legacy``; both unchanged where no RPC was
profiled.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

import torch
from torch.autograd import ProfilerConfig, ProfilerState
from torch.autograd import _disable_profiler_legacy as _disable_legacy
from torch.autograd import _enable_profiler_legacy as _enable_legacy
from torch.autograd import profiler_legacy

from . import current
from .errors import RpcError
from .functions import answered_when_done, check_async_result, is_async_function
from .futures import Outcome, outcome_of
from .serialization import FunctionRef, encode_function, protocol_function, resolve_function, served_error


REMOTE_OP = "#remote_op: "  # torch's separator of a remote event's key and its own name

profiler_enabled = torch._C._autograd._profiler_enabled  # ~30 ns: every call asks
_profiler_type = torch._C._autograd._profiler_type
_LEGACY = torch._C._profiler.ActiveProfilerType.LEGACY

_local = threading.local()  # .session: the _Session of the legacy profile running on this thread
_handles = itertools.count(1 << 48)  # RPC events' handles, apart from the profiler's own


class _Session:
    """One legacy profile of one thread: its settings, which its RPCs send, and the events
    of those RPCs, added to the profile's own when it ends."""

    __slots__ = ("settings", "rpc_events", "remote", "_lock")

    def __init__(self, settings: list) -> None:
        self.settings = settings  # [use_cuda, record_shapes, profile_memory, with_stack, with_flops, with_modules]
        self.rpc_events: list[tuple[str, int, int, float, float]] = []  # (key, handle, node, start, end)
        self.remote: list[list[_Record]] = []  # one list per thread of a callee
        self._lock = threading.Lock()

    def add_rpc_event(self, event: tuple[str, int, int, float, float]) -> None:
        with self._lock:
            self.rpc_events.append(event)

    def add_remote(self, key: str, threads: list) -> None:
        prefix = key + REMOTE_OP
        received = [[_received(prefix, wire) for wire in thread] for thread in threads]
        with self._lock:
            self.remote.extend(received)

    def merged(self, records: list) -> list:
        """The profile's own records (a list per thread, as ``_disable_profiler_legacy``
        returns them) with this session's events added."""
        with self._lock:
            rpc_events, remote = list(self.rpc_events), list(self.remote)
        if not rpc_events and not remote:
            return records
        start = next((r for thread in records for r in thread if r.name() == "__start_profile"), None)
        if start is None:
            return records
        thread_id = start.thread_id()
        merged: list[list[Any]] = [[_StartMark(r) if r is start else r for r in thread] for thread in records]
        if rpc_events:
            # Ended by whichever thread completed the call, as torch's: asynchronous events.
            merged.append([record for key, handle, node, begun, ended in rpc_events for record in (
                _Record(key, "push", handle, node, thread_id, begun, is_async=True),
                _Record("", "pop", handle, node, thread_id, ended, is_async=True))])
        merged.extend(remote)
        return merged


class _Record:
    """An event record as torch's ``LegacyEvent`` reads to ``_parse_legacy_records``: a
    remote one, or an RPC event of this worker."""

    __slots__ = ("_name", "_kind", "_handle", "_node", "_thread", "_us", "_shapes", "_cpu_memory",
                 "_cuda_memory", "_async", "_sequence", "_forward_thread", "_scope", "_flops", "_stack",
                 "_remote")

    def __init__(self, name: str, kind: str, handle: int, node: int, thread: int, us: float,
                 shapes: list | None = None, cpu_memory: int = 0, cuda_memory: int = 0, is_async: bool = False,
                 sequence: int = -1, forward_thread: int = 0, scope: int = 0, flops: int = 0,
                 stack: list | None = None, remote: bool = False) -> None:
        self._name, self._kind, self._handle, self._node, self._thread = name, kind, handle, node, thread
        self._us, self._shapes, self._cpu_memory, self._cuda_memory = us, shapes or [], cpu_memory, cuda_memory
        self._async, self._sequence, self._forward_thread = is_async, sequence, forward_thread
        self._scope, self._flops, self._stack, self._remote = scope, flops, stack or [], remote

    def name(self) -> str: return self._name
    def kind(self) -> str: return self._kind
    def handle(self) -> int: return self._handle
    def node_id(self) -> int: return self._node
    def thread_id(self) -> int: return self._thread
    def fwd_thread_id(self) -> int: return self._forward_thread
    def start_us(self) -> float: return self._us
    def shapes(self) -> list: return self._shapes
    def cpu_memory_usage(self) -> int: return self._cpu_memory
    def cuda_memory_usage(self) -> int: return self._cuda_memory
    def is_async(self) -> bool: return self._async
    def is_remote(self) -> bool: return self._remote
    def sequence_nr(self) -> int: return self._sequence
    def scope(self) -> int: return self._scope
    def flops(self) -> int: return self._flops
    def stack(self) -> list: return self._stack
    def has_cuda(self) -> bool: return False  # (CUDA timings stay on the worker that made them)
    def device(self) -> int: return -1
    def correlation_id(self) -> int: return 0
    def cpu_elapsed_us(self, other: Any) -> float: return other.start_us() - self._us
    def cuda_elapsed_us(self, other: Any) -> float: return 0.0


class _StartMark:
    """The profile's ``__start_profile`` record, which times every record from it: of either
    kind (torch's own takes only its own kind)."""

    def __init__(self, record: Any) -> None:
        self._record = record

    def __getattr__(self, name: str) -> Any:
        return getattr(self._record, name)

    def cpu_elapsed_us(self, other: Any) -> float:
        return other.start_us() - self._record.start_us()


_WIRE_FIELDS = 15


def _wire(threads: list) -> list:
    """Records (a list per thread) as they travel back to a caller; marks stay here."""
    return [[[r.name(), r.kind(), r.handle(), r.node_id(), r.thread_id(), r.start_us(), r.shapes(),
              r.cpu_memory_usage(), r.cuda_memory_usage(), r.is_async(), r.sequence_nr(), r.fwd_thread_id(),
              r.scope(), r.flops(), r.stack()]
             for r in thread if r.kind() != "mark"] for thread in threads]


def set_profiler_node_id(rank: int) -> None:
    """Make the events this process's profiler records carry ``rank`` as their ``node_id``,
    as torch's ``init_rpc`` does (in builds without torch's RPC they keep -1)."""
    setter = getattr(torch._C, "_distributed_rpc", None)
    if setter is not None and hasattr(setter, "_set_profiler_node_id"):
        setter._set_profiler_node_id(rank)


def _received(prefix: str, wire: Any) -> _Record:
    """A remote record as ``_wire`` sent it; a malformed one fails the call it came with."""
    if type(wire) is not list or len(wire) != _WIRE_FIELDS or type(wire[0]) is not str or type(wire[1]) is not str:
        raise RpcError(f"malformed profiler event in the answer: {wire!r:.200}")
    name, kind, handle, node, thread, us, shapes, cpu_memory, cuda_memory, is_async, sequence, forward, scope, flops, \
        stack = wire
    return _Record(prefix + name, kind, handle, node, thread, us, shapes, cpu_memory, cuda_memory, is_async, sequence,
                   forward, scope, flops, stack, remote=True)


def _config(settings: list) -> ProfilerConfig:
    use_cuda, record_shapes, profile_memory, with_stack, with_flops, with_modules = (bool(s) for s in settings[:6])
    state = ProfilerState.CUDA if use_cuda and torch.cuda.is_available() else ProfilerState.CPU
    return ProfilerConfig(state, record_shapes, profile_memory, with_stack, with_flops, with_modules,
                          torch._C._profiler._ExperimentalConfig())


def _settings_of(profile: Any) -> list:
    return [profile.profiler_kind == ProfilerState.CUDA, bool(profile.record_shapes), bool(profile.profile_memory),
            bool(profile.with_stack), bool(profile.with_flops), bool(profile.with_modules)]


# ----------------------------------------------------------------------------- the caller


def session() -> _Session | None:
    """The session this thread's RPCs are profiled in (only call where ``profiler_enabled()``):
    None when no legacy profile of ours runs here."""
    if _profiler_type() != _LEGACY:
        return None
    return getattr(_local, "session", None)


class ProfiledCall:
    """One RPC made under a profile: the request that runs it profiled on the callee, and
    its event here, from the call to its answer."""

    __slots__ = ("session", "key", "node", "handle", "begun")

    def __init__(self, session: _Session, mode: str, function: Any, caller: Any, callee: Any) -> None:
        self.session = session
        self.key = f"rpc_{mode}#{_profiled_name(function)}({caller.name} -> {callee.name})"
        self.node = caller.id
        self.handle = next(_handles)
        self.begun = time.time_ns() / 1000  # the profiler's clock (microseconds of the epoch)

    def arguments(self, function: Any, args: Any, kwargs: Any) -> tuple:
        """The arguments of ``_run_profiled`` for ``function(*args, **kwargs)``."""
        if args is not None and not isinstance(args, (tuple, list)):
            raise TypeError(f"args must be a tuple or list, got {type(args).__qualname__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"kwargs must be a dict, got {type(kwargs).__qualname__}")
        return (self.session.settings, encode_function(function), list(args or ()), dict(kwargs or {}))

    def answered(self, answer: Any) -> Any:
        """The value of ``_run_profiled``'s answer; the callee's events join the profile."""
        value, events = answer
        if events:
            self.session.add_remote(self.key, events)
        return value

    def end(self) -> None:
        self.session.add_rpc_event((self.key, self.handle, self.node, self.begun, time.time_ns() / 1000))

    def settle(self, target: Any, done: Any) -> None:
        """Complete ``target`` as the call ``done`` completed, the event ended first."""
        value, error = outcome_of(done)
        if error is None:
            try:
                value = self.answered(value)
            except Exception as exc:  # noqa: BLE001 - a malformed answer: the call's error
                error = exc
        self.end()
        if error is not None:
            target.set_exception(error)
        else:
            target.set_result(value)


def _profiled_name(function: Any) -> str:
    """The function's name in the event, as torch's: an operator's (``aten::add``), a
    TorchScript function's qualified name, a Python function's ``__qualname__``."""
    if isinstance(function, torch.jit.ScriptFunction):
        return torch._jit_internal._qualified_name(function)
    if isinstance(function, FunctionRef):
        return function.qualname
    builtin = torch.jit._builtins._find_builtin(function)
    if builtin is not None:
        return builtin
    return getattr(function, "__qualname__", type(function).__qualname__)


# ----------------------------------------------------------------------------- the callee


@protocol_function
@answered_when_done
def _run_profiled(settings: list, function: Any, args: list, kwargs: dict) -> Outcome:
    """On the callee of a profiled call: run ``function`` under the caller's profiler
    settings; answer ``(value, events)``. The events of an ``async_execution`` function are
    those of its own run and of the calls it made meanwhile (they end before its future)."""
    function = resolve_function(function, current.agent().codec.policy)
    events: Callable[[], list]
    if profiler_enabled():  # a profile of this whole worker runs (_server_process_global_profile)
        value, events = _call(function, args, kwargs), list
    else:
        session, outer = _Session(settings), getattr(_local, "session", None)
        _enable_legacy(_config(settings))
        _local.session = session  # the function's own RPCs fold into it
        try:
            value = _call(function, args, kwargs)
        finally:
            _local.session = outer
            own = _disable_legacy()
        events = lambda: _wire(session.merged(own))  # noqa: E731
    answer = Outcome()
    if not is_async_function(function):
        answer.set_result((value, events()))
        return answer
    check_async_result(function, value)
    value.add_done_callback(lambda done: _answer(answer, done, events))
    return answer


def _call(function: Callable, args: list, kwargs: dict) -> Any:
    try:
        return function(*args, **kwargs)
    except BaseException as exc:  # as the agent serves a call's error (serving.py)
        raise served_error(function, exc, current.agent().info) from None


def _answer(answer: Outcome, done: Any, events: Callable[[], list]) -> None:
    value, error = outcome_of(done)
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result((value, events()))


# ------------------------------------------------------------ every call a worker serves

# The _server_process_global_profile profiles open in this process, innermost last: every call
# served is profiled with the innermost's settings, and its events go to them all.
server_profiles: list["_server_process_global_profile"] = []
_server_lock = threading.Lock()


def run_server_profiled(function: Callable, args: list, kwargs: dict) -> Any:
    """Serve a call while a ``_server_process_global_profile`` is open (serving.py)."""
    with _server_lock:
        profiles = list(server_profiles)
    if not profiles or profiler_enabled():
        return function(*args, **kwargs)
    _enable_legacy(_config(profiles[-1].settings))
    try:
        return function(*args, **kwargs)
    finally:
        records = _disable_legacy()
        for profile in profiles:
            profile._add(records)


class _server_process_global_profile(profiler_legacy.profile):
    """torch's ``rpc._server_process_global_profile``: a legacy profile, with its arguments,
    of every call this worker serves while it is open (nested ones each see theirs).
    ``function_events`` holds them all, ``process_global_function_events`` a list per call."""

    def __enter__(self) -> Any:
        if not self.enabled:
            return None
        if self.entered:
            raise RuntimeError("autograd profiler traces are not reentrant")
        self.entered = True
        self.settings = _settings_of(self)
        self._served: list = []
        with _server_lock:
            server_profiles.append(self)
        return self

    def _add(self, records: list) -> None:
        self._served.append(records)

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Any) -> bool:
        if not self.enabled:
            return False
        with _server_lock:
            server_profiles.remove(self)
        per_call = []
        for records in list(self._served):
            events = profiler_legacy._parse_legacy_records(records)
            events.sort(key=lambda event: [event.time_range.start, -event.time_range.end])
            per_call.append(events)
        self.function_events = torch.autograd.profiler_util.EventList(
            list(itertools.chain.from_iterable(per_call)), use_device="cuda" if self.use_cuda else None,
            profile_memory=self.profile_memory)
        self.function_events._build_tree()
        self.process_global_function_events = per_call
        return False


# ------------------------------------------------------------------------ torch's profiler


def _install() -> None:
    """Wrap ``torch.autograd.profiler_legacy`` (see the module's doc); once per process."""
    profile = profiler_legacy.profile
    if getattr(profile._start_trace, "_zmqautograd", False):
        return
    start_trace, disable = profile._start_trace, profiler_legacy._disable_profiler_legacy

    def _start_trace(self: Any) -> None:
        start_trace(self)
        _local.session = _Session(_settings_of(self))

    def _disable_profiler_legacy(*args: Any, **kwargs: Any) -> Any:
        records = disable(*args, **kwargs)
        open_session = getattr(_local, "session", None)
        if open_session is None:
            return records
        _local.session = None
        return open_session.merged(records)

    _start_trace._zmqautograd = True  # type: ignore[attr-defined]
    profile._start_trace = _start_trace  # type: ignore[method-assign]
    profiler_legacy._disable_profiler_legacy = _disable_profiler_legacy


_install()
