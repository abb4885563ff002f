"""How calls, results and exceptions travel.

Functions go as references (module + qualified name) whenever the callee can import them;
arguments and results keep their structure through the transport codec (tuples stay tuples,
tensors go as tensor frames). Classes, module-level functions and torch's constants
(``torch.channels_last``) among the arguments and results go by reference too
(``DistributedOptimizer(torch.optim.SGD, ...)``): pickle would send nothing more than their
names, and a reference needs no pickle, so it also reaches workers that refuse pickled
payloads. Other objects msgpack cannot carry are pickled, with their tensors taken out of
band (they still travel as tensor frames, never inside the pickle); the pickle fallback
obeys ``allow_pickle``.

What a member may name to be run or built is decided by a :class:`CallablePolicy` (the
``allowed_functions`` option) before anything is imported; the protocol's own functions,
marked with :func:`protocol_function`, are always allowed.
"""

from __future__ import annotations

import copyreg
import importlib
import io
import logging
import pickle
import sys
import types
from typing import Any, Callable, TypeVar

import torch

from zmqautograd.transport.codec import Codec, Extension
from zmqautograd.transport.errors import PeerError

from .errors import RemoteException, SerializationError, as_operator_error, user_error
from .futures import traceback_text

log = logging.getLogger(__name__)

EXT_PICKLE = 16
EXT_FUNCTION = 17
EXT_GLOBAL = 19  # 18 is the agent's RRef

# What may go by reference as a value: objects that pickle itself sends by name.
_NAMED_KINDS = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodDescriptorType,
                types.WrapperDescriptorType, types.ClassMethodDescriptorType)
# torch's constants (torch.strided, torch.channels_last, torch.per_tensor_affine): attributes
# of ``torch`` named by their str, which pickle sends by name too.
_TORCH_CONSTANT_KINDS = (torch.layout, torch.memory_format, torch.qscheme)


# ------------------------------------------------------------------------ callable policy

# The functions zmqautograd itself asks peers to run (RRef protocol, autograd, optimizer,
# shutdown): allowed whatever the policy, and nothing else of zmqautograd is. Listed here,
# not collected from their modules, since a callee may not have imported those yet.
_PROTOCOL_FUNCTIONS = frozenset({
    ("zmqautograd.autograd.api", "_backward_request"),
    ("zmqautograd.autograd.cleanup", "cleanup_contexts"),
    ("zmqautograd.autograd.embed", "deliver_report"),
    ("zmqautograd.optim.optimizer", "_local_optimizer_step"),
    ("zmqautograd.optim.optimizer", "_new_local_optimizer"),
    ("zmqautograd.rpc.agent", "_arrive_at_shutdown"),
    ("zmqautograd.rpc.profiling", "_run_profiled"),
    *(("zmqautograd.nn", name) for name in ("_create_module", "_remote_forward", "_param_rrefs")),
    *(("zmqautograd.rpc.rref_owner", name) for name in (
        "_backward_on_owner", "_call_method", "_child_accept", "_delete_fork", "_fetch", "_fork_request",
        "_owned_count", "_run_remote", "_rref_typeof_on_owner")),
})


_F = TypeVar("_F", bound=Callable)


def is_protocol_function(function: Any) -> bool:
    """Whether ``function`` is one of zmqautograd's protocol functions."""
    key = (getattr(function, "__module__", None), getattr(function, "__qualname__", None))
    return key in _PROTOCOL_FUNCTIONS


def protocol_function(function: _F) -> _F:
    """Mark ``function`` as one that zmqautograd's own protocol calls on peers (it must be in
    ``_PROTOCOL_FUNCTIONS``)."""
    if (function.__module__, function.__qualname__) not in _PROTOCOL_FUNCTIONS:
        raise AssertionError(f"{function.__module__}.{function.__qualname__} is not listed as a protocol function")
    return function


class CallablePolicy:
    """Which functions and classes a peer may name by reference (``allowed_functions``).

    ``allowed``: None (anything importable, as torch), entries (``"pkg.module"``: it and all
    below it; ``"pkg.module.function"``: that one), or ``(module, qualname) -> bool``."""

    def __init__(self, allowed: Any = None):
        self.restricted = allowed is not None
        self._predicate: Callable[[str, str], bool] | None = None
        self._entries: tuple[str, ...] = ()
        if callable(allowed):
            self._predicate = allowed
        elif allowed is not None:
            if isinstance(allowed, str) or not all(isinstance(e, str) and e for e in allowed):
                raise TypeError("allowed_functions must be a list of dotted names or a callable (module, qualname) -> bool")
            # A function or class goes by the name of where it is defined (torch.optim.SGD as
            # torch.optim.sgd.SGD): each entry that names one here also allows that name.
            self._entries = tuple(allowed) + tuple(filter(None, map(_defined_name, allowed)))
        self._verdicts: dict[tuple[str, str], bool] = {}

    def allows(self, module: str, qualname: str) -> bool:
        if not self.restricted or (module, qualname) in _PROTOCOL_FUNCTIONS:
            return True
        key = (module, qualname)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if self._predicate is not None:
                verdict = bool(self._predicate(module, qualname))
            else:
                full = f"{module}.{qualname}"
                verdict = any(full == e or full.startswith(e + ".") for e in self._entries)
            if len(self._verdicts) < 4096:
                self._verdicts[key] = verdict
        return verdict

    def check(self, module: str, qualname: str) -> None:
        if not self.allows(module, qualname):
            raise SerializationError(
                f"{module}.{qualname} may not be called or named here: it is not in this worker's allowed_functions")


def _defined_name(entry: str) -> str | None:
    """Where the function or class ``entry`` names is defined, if that is another name (this
    worker's own configuration: importing it is safe)."""
    parts = entry.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = _resolve(".".join(parts[:split]), ".".join(parts[split:]))
        except (ImportError, AttributeError):
            continue
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if isinstance(module, str) and isinstance(qualname, str) and f"{module}.{qualname}" != entry:
            return f"{module}.{qualname}"
        return None
    return None


UNRESTRICTED = CallablePolicy()


# ------------------------------------------------------------------------- function refs


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module)
    if obj is None or getattr(getattr(obj, "__spec__", None), "_initializing", False):
        # Not imported yet, or another thread is importing it right now (the first calls of a
        # burst, on several pool threads): import_module waits for that import to finish, where
        # the module in sys.modules would still lack what its body has not defined yet.
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _import_named(module: str, qualname: str, what: str) -> Any:
    """``_resolve``, with a failure to import raised as the SerializationError that says
    ``cannot import <what><module>.<qualname>``."""
    try:
        return _resolve(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise SerializationError(f"cannot import {what}{module}.{qualname}: {exc}") from exc


# function -> its reference, for functions called before: finding a reference tries several
# candidate names (~5 us a call); checking a known one is one lookup. Bounded: only
# module-level objects get here, and a program has a limited number of those.
_known_references: dict[Any, tuple[str, str]] = {}
_KNOWN_REFERENCES_MAX = 4096


def function_reference(function: Callable) -> tuple[str, str] | None:
    """(module, qualified name) that resolves back to ``function`` on an importing process,
    or None when there is none (lambdas, closures, bound methods of objects)."""
    try:
        known = _known_references.get(function)
    except TypeError:  # unhashable callable
        known = None
    if known is not None:
        try:
            if _resolve(*known) is function:  # still what that name means
                return known
        except (ImportError, AttributeError):
            pass
    reference = _find_reference(function)
    if reference is not None and len(_known_references) < _KNOWN_REFERENCES_MAX:
        try:
            _known_references[function] = reference
        except TypeError:
            pass
    return reference


def _find_reference(function: Callable) -> tuple[str, str] | None:
    candidates: list[tuple[str, str]] = []
    module = getattr(function, "__module__", None)
    for name in (getattr(function, "__qualname__", None), getattr(function, "__name__", None)):
        if module and name:
            candidates.append((module, name))
    scripted = getattr(function, "qualified_name", None)  # torch.jit.script functions
    if isinstance(scripted, str) and scripted.startswith("__torch__.") and "." in scripted[10:]:
        scripted_module, scripted_name = scripted[10:].rsplit(".", 1)
        candidates.append((scripted_module, scripted_name))
    owner = getattr(function, "__objclass__", None)  # method descriptors such as torch.Tensor.add
    if owner is not None and getattr(function, "__name__", None):
        candidates.append((owner.__module__, f"{owner.__qualname__}.{function.__name__}"))
    for module, name in candidates:
        if "<" in name:  # <lambda>, <locals>
            continue
        try:
            if _resolve(module, name) is function:
                return module, name
        except (ImportError, AttributeError):
            continue
    return None


# --------------------------------------------------------------------------- pickle path


class _OutOfBandPickler(pickle.Pickler):
    """Tensors out of band (by index into ``tensors``); objects of the types in ``carried``
    (RRefs) as that extension's encoding, so they travel with their protocol (an RRef is
    forked for the receiver) wherever they are nested; the class reducers registered with
    torch's RPC pickler (``_internal_rpc_pickler._register_reducer``: torch's RemoteModule)
    apply, as they do in torch's."""

    def __init__(self, stream: io.BytesIO, tensors: list, carried: dict[type, Extension]):
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.carried = carried
        reducers = _class_reducers_now()
        if reducers:
            self.dispatch_table = {**copyreg.dispatch_table, **reducers}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        extension = self.carried.get(type(obj)) if self.carried else None
        if extension is not None:
            return (extension.code, extension.encode(obj))
        return None


_class_reducers: dict[type, Callable] = {}


def register_reducer(cls: type, reducer: Callable) -> None:
    """Pickle objects of exactly ``cls`` with ``reducer`` (as ``copyreg``) when they travel in
    RPC arguments and results, not elsewhere (torch's ``_internal_rpc_pickler._register_reducer``)."""
    _class_reducers[cls] = reducer


def _class_reducers_now() -> dict:
    """Ours and those registered with torch's RPC pickler (torch's RemoteModule's)."""
    internal = sys.modules.get("torch.distributed.rpc.internal")
    pickler = getattr(internal, "_internal_rpc_pickler", None)
    torch_reducers = getattr(pickler, "_class_reducer_dict", None)
    if isinstance(torch_reducers, dict) and torch_reducers:
        return {**torch_reducers, **_class_reducers}
    return _class_reducers


class _OutOfBandUnpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, tensors: list, carried: dict[int, Extension]):
        super().__init__(stream)
        self.tensors = tensors
        self.carried = carried

    def persistent_load(self, pid: Any) -> Any:
        if type(pid) is tuple and len(pid) == 2 and pid[0] in self.carried:
            return self.carried[pid[0]].decode(pid[1])
        if type(pid) is not int or not 0 <= pid < len(self.tensors):
            raise pickle.UnpicklingError(f"invalid persistent reference {pid!r:.80}")
        return self.tensors[pid]


def pickle_out_of_band(obj: Any, carried: dict[type, Extension] | None = None) -> list:
    tensors: list = []
    stream = io.BytesIO()
    try:
        _OutOfBandPickler(stream, tensors, carried or {}).dump(obj)
    except Exception as exc:
        raise SerializationError(f"cannot serialize {type(obj).__qualname__}: {exc}") from exc
    return [stream.getvalue(), tensors]


def unpickle_out_of_band(value: Any, carried: dict[int, Extension] | None = None) -> Any:
    data, tensors = value
    return _OutOfBandUnpickler(io.BytesIO(data), tensors, carried or {}).load()


class RpcCodec(Codec):
    """The transport codec plus the RPC layer's types: function references and the pickle
    fallback (refused both ways when ``allow_pickle`` is False)."""

    def __init__(self, allow_pickle: bool = True, accept_pickle: bool | None = None, refusal: str = "",
                 policy: CallablePolicy = UNRESTRICTED, **kwargs: Any):
        self.allow_pickle = allow_pickle  # may we send pickled payloads
        # may we unpickle what peers send (default: as allow_pickle); ``refusal`` says why not
        self.accept_pickle = allow_pickle if accept_pickle is None else accept_pickle
        self.refusal = refusal or "allow_pickle is False on this worker"
        self.policy = policy  # what peers may name by reference
        pickled = Extension(EXT_PICKLE, _Pickled, lambda p: p.value, self._load_pickle)
        # Cached both ways (transport/codec.py, Extension.cache): a reference travels with every
        # call, always the same few.
        functions = Extension(EXT_FUNCTION, FunctionRef, lambda f: [f.module, f.qualname], self._load_function, cache=True)
        # Reached only through the fallback (its type matches nothing), so never cached: a
        # name may be rebound, and resolving one is a dict lookup and a getattr.
        named = Extension(EXT_GLOBAL, _Named, lambda n: n.reference, self._load_global)
        super().__init__(extensions=[pickled, functions, named], fallback=self._fallback, **kwargs)
        # Extension types that pickled objects may hold too (RRefs): by type and by code.
        self._carried_types: dict[type, Extension] = {}
        self._carried_codes: dict[int, Extension] = {}

    def add_extension(self, ext: Extension, in_pickles: bool = False) -> None:
        """As the codec's; ``in_pickles``: objects of ``ext.type`` nested in a pickled
        object travel as this extension's encoding too (not through their own pickling)."""
        super().add_extension(ext)
        if in_pickles:
            self._carried_types[ext.type] = ext
            self._carried_codes[ext.code] = ext

    def _fallback(self, obj: Any) -> tuple[Extension, Any]:
        if type(obj) in _TORCH_CONSTANT_KINDS:
            return self._by_code[EXT_GLOBAL], ["torch", str(obj).removeprefix("torch.")]
        if isinstance(obj, _NAMED_KINDS):
            reference = function_reference(obj)
            if reference is not None and not _names_a_special_attribute(reference[1]):
                return self._by_code[EXT_GLOBAL], list(reference)
        if not self.allow_pickle:
            raise SerializationError(
                f"cannot send an object of type {type(obj).__qualname__} without pickle, and allow_pickle is False"
            )
        return self._by_code[EXT_PICKLE], pickle_out_of_band(obj, self._carried_types)

    def _load_pickle(self, value: Any) -> Any:
        if not self.accept_pickle:
            raise SerializationError(f"refused a pickled payload: {self.refusal}")
        return unpickle_out_of_band(value, self._carried_codes)

    def _load_global(self, value: Any) -> Any:
        return _load_global(value, self.policy)

    @staticmethod
    def _load_function(value: Any) -> "FunctionRef":
        # Resolved by the callee when it runs the call, so an import failure becomes the
        # call's exception (with the callee's traceback), not an undecodable message.
        module, qualname = value
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise SerializationError("malformed function reference")
        return FunctionRef(module, qualname)


class _Pickled:
    def __init__(self, value: Any):
        self.value = value


class _Named:
    """Never made: the type of the global-reference extension, which only the fallback uses."""

    reference: list


def _names_a_special_attribute(qualname: str) -> bool:
    """Whether a qualified name goes through a dunder attribute (``f.__globals__``): such a
    reference could hand out an object's internals, so none is sent or accepted as a value
    (the rare method like ``Foo.__call__`` goes the pickle way)."""
    return any(part.startswith("__") and part.endswith("__") for part in qualname.split("."))


def _load_global(value: Any, policy: CallablePolicy = UNRESTRICTED) -> Any:
    """The class or function a received global reference names, imported here if need be."""
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(part, str) for part in value)):
        raise SerializationError("malformed global reference")
    module, qualname = value
    if _names_a_special_attribute(qualname):
        raise SerializationError(f"refused a global reference through a special attribute: {module}.{qualname}")
    if module == "torch" and policy.restricted and type(getattr(sys.modules["torch"], qualname, None)) in _TORCH_CONSTANT_KINDS:
        return getattr(sys.modules["torch"], qualname)  # a constant (torch.channels_last) runs nothing
    policy.check(module, qualname)
    return _import_named(module, qualname, "")


class FunctionRef:
    """A function named by module and qualified name (immutable: the codec shares them)."""

    __slots__ = ("module", "qualname", "_key")

    def __init__(self, module: str, qualname: str):
        self.module, self.qualname = module, qualname
        self._key = (module, qualname)

    def __eq__(self, other: object) -> bool:
        return type(other) is FunctionRef and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"{self.module}.{self.qualname}"


def encode_function(function: Callable) -> Any:
    """What goes on the wire for ``function``: a reference when it resolves, else the object
    itself, left to the codec's pickle fallback (lambdas and closures, where pickle is allowed)."""
    if isinstance(function, FunctionRef):
        return function  # called by name: the callee imports it, we need not
    if not callable(function):
        raise TypeError(f"function should be callable, got {type(function).__qualname__}")
    reference = function_reference(function)
    return FunctionRef(*reference) if reference else function


def resolve_function(function: Any, policy: CallablePolicy = UNRESTRICTED) -> Callable:
    """The callable a request names; raises SerializationError if the policy refuses it (before
    anything is imported) or it cannot be imported here."""
    if isinstance(function, FunctionRef):
        policy.check(function.module, function.qualname)
        try:
            return _import_named(function.module, function.qualname, "function ")
        except SerializationError as exc:
            # torch's words, for what the cause usually is.
            raise SerializationError(f"{exc}. RPC pickler does not serialize function code: ensure that UDFs "
                                     "are defined on both caller and callee modules") from exc.__cause__
    return function


# ----------------------------------------------------------------------------- exceptions


def served_error(function: Callable, exc: BaseException, where: object) -> Exception:
    """What ``function``, called for a peer, raised, as its caller is to get it (errors.py:
    ``user_error``, ``as_operator_error``); logged here too, as torch does, unless the function
    is one of our protocol functions."""
    error = as_operator_error(function, user_error(exc))
    if not is_protocol_function(function):
        log.warning("On %s:\n%r\n%s", where, error, traceback_text(error))
    return error


def encode_exception(exc: BaseException) -> dict:
    kind = type(exc)
    info = {
        "module": kind.__module__,
        "type": kind.__qualname__,
        "message": str(exc),
        "traceback": traceback_text(exc),
    }
    peer = getattr(exc, "peer", None)
    if isinstance(exc, PeerError) and isinstance(peer, str):
        info["peer"] = peer  # (our peer errors are built from the peer and a message)
    return info


def decode_exception(info: dict, where: str) -> BaseException:
    """The remote exception rebuilt with its own type where that type can be imported and
    built from a message; else a RemoteException. The message names the worker and carries
    the remote traceback."""
    where_and_what = f"On {where}:\n{info['message']}"
    remote_traceback = f"\n\nRemote traceback:\n{info['traceback']}"
    try:
        kind = _resolve(info["module"], info["type"])
    except Exception:  # noqa: BLE001 - unimportable here
        reason = "its type cannot be imported here"
    else:
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                peer = info.get("peer")
                if issubclass(kind, PeerError) and isinstance(peer, str):
                    return kind(peer, where_and_what + remote_traceback)
                return kind(where_and_what + remote_traceback)
            except Exception as exc:  # noqa: BLE001 - its constructor wants other arguments
                reason = f"its constructor does not take a message ({exc})"
        else:
            reason = "it is not an Exception"
    qualified = f"{info['module']}.{info['type']}"
    # torch's wording for this case ("Original exception on remote side was"), which tests grep.
    return RemoteException(f"{qualified}: {where_and_what}\n\nOriginal exception on remote side was {qualified}, "
                           f"not rebuilt here: {reason}.{remote_traceback}")
