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

What a member may name to be run or built (by a call, ``remote``, a value sent by
reference), and which methods of an RRef's value it may call, is decided by a
:class:`CallablePolicy` (the ``allowed_functions`` option): a name before anything is
imported, and what it resolved to after; the protocol's own functions, marked with
:func:`protocol_function`, are always allowed.
"""

from __future__ import annotations

import copyreg
import importlib
import inspect
import io
import logging
import pickle
import sys
import threading
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
        "_owned_count", "_run_remote", "_rref_typeof_on_owner", "_vouch_for")),
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
    """Which functions and classes a peer may name by reference (``allowed_functions``), and
    which methods of an RRef's value it may call through the RRef's proxies.

    ``allowed``: None (anything importable, as torch); entries, resolved here (this worker's
    own configuration: importing it is safe): a module (``"pkg.module"``: what is defined in
    it or its submodules, named by one public name) or an object (``"pkg.module.function"``,
    ``"torch.optim.SGD"``, ``"torch.Tensor.sum"``: that very object, by the names it goes
    by); or a callable ``(module, qualname) -> bool``, asked for the name a peer sent and,
    once resolved, for the object's own name. No name with a private or dunder part is
    allowed unless it is exactly an object entry's, and a method reached through a class only
    where it is an entry itself."""

    def __init__(self, allowed: Any = None):
        self.restricted = allowed is not None
        self._predicate: Callable[[str, str], bool] | None = None
        self._modules: tuple[str, ...] = ()  # module entries
        self._named: dict[tuple[str, str], Any] = {}  # object entries, by each name they go by
        self._objects: dict[int, Any] = {}  # object entries, by id (methods: check_method)
        if callable(allowed):
            self._predicate = allowed
        elif allowed is not None:
            entries = tuple(allowed) if not isinstance(allowed, str) else ()
            if isinstance(allowed, str) or not all(isinstance(e, str) and e for e in entries):
                raise TypeError("allowed_functions must be a list of dotted names or a callable (module, qualname) -> bool")
            modules = []
            for entry in entries:
                module, qualname, obj = _resolve_entry(entry)
                if not qualname:
                    modules.append(module)
                    continue
                self._objects[id(obj)] = obj
                for name in {(module, qualname), *_own_names(obj), function_reference(obj)}:
                    if name is not None and _names(name, obj):
                        self._named[name] = obj
            self._modules = tuple(modules)
        self._verdicts: dict[tuple[str, str], bool] = {}
        self._answers: dict[tuple[str, str], bool] = {}  # the predicate's

    def allows(self, module: str, qualname: str) -> bool:
        """Whether a peer may name ``module.qualname``, judged before anything is imported."""
        if not self.restricted or (module, qualname) in _PROTOCOL_FUNCTIONS:
            return True
        key = (module, qualname)
        verdict = self._verdicts.get(key)
        if verdict is None:
            verdict = key in self._named or self._by_name(module, qualname)
            _memo(self._verdicts, key, verdict)
        return verdict

    def _by_name(self, module: str, qualname: str) -> bool:
        """Whether this name, every part of it public, is allowed by the predicate, or by a
        module entry: one name in a listed module or in a submodule of one."""
        if not (_public_path(module) and _public_path(qualname)):
            return False
        if self._predicate is not None:
            return self._asks(module, qualname)
        return "." not in qualname and _within(module, self._modules)

    def _asks(self, module: str, qualname: str) -> bool:
        assert self._predicate is not None
        key = (module, qualname)
        answer = self._answers.get(key)
        if answer is None:
            answer = bool(self._predicate(module, qualname))
            _memo(self._answers, key, answer)
        return answer

    def allows_resolved(self, module: str, qualname: str, obj: Any) -> bool:
        """Whether what ``module.qualname`` resolved to is what the entries allow: that very
        object entry; for a module entry, an object defined in a listed module (not one it
        imported); for a predicate, an object whose own name it allows too."""
        if not self.restricted or (module, qualname) in _PROTOCOL_FUNCTIONS:
            return True
        if self._named.get((module, qualname), _MISSING) is obj:
            return True
        if not self._by_name(module, qualname):
            return False
        if self._predicate is not None:
            return any(self._asks(*name) for name in _own_names(obj))
        return _within(_defined_in(obj), self._modules)

    def check(self, module: str, qualname: str) -> None:
        """Raise unless a peer may name ``module.qualname`` (before anything is imported)."""
        if not self.allows(module, qualname):
            raise SerializationError(
                f"{module}.{qualname} may not be called or named here: it is not in this worker's allowed_functions")

    def resolve(self, module: str, qualname: str, what: str = "") -> Any:
        """What ``module.qualname`` names, where a peer may name it: checked, imported, and
        checked again for what it turned out to be (a listed module's ``system`` may be the
        ``os.system`` it imported). ``what``: the kind of thing, for the errors."""
        if not self.restricted:  # (every call resolves its function: the usual case first)
            return _import_named(module, qualname, what)
        self.check(module, qualname)
        obj = _import_named(module, qualname, what)
        if not self.allows_resolved(module, qualname, obj):
            raise SerializationError(f"{module}.{qualname} may not be called or named here: it is {_described(obj)}, "
                                     "which this worker's allowed_functions does not allow")
        return obj

    def check_method(self, cls: type, name: str) -> None:
        """Raise unless a peer may call method ``name`` of a value of type ``cls`` (RRef
        proxies): where restricted, only a listed method (an object entry that is
        ``getattr(cls, name)``, or one the predicate allows), never a private or dunder one."""
        if not self.restricted:
            return
        if isinstance(name, str) and _public_path(name) and "." not in name:
            if self._predicate is not None:
                allowed = self._asks(cls.__module__, f"{cls.__qualname__}.{name}")
            else:
                method = getattr(cls, name, _MISSING)
                allowed = method is not _MISSING and self._objects.get(id(method), _MISSING) is method
            if allowed:
                return
        raise SerializationError(f"method {name!r:.60} of {cls.__module__}.{cls.__qualname__} may not be called by "
                                 "peers here: it is not in this worker's allowed_functions")


_MISSING = object()


def _memo(table: dict, key: Any, value: Any) -> None:
    if len(table) < 4096:  # bounded: peers choose the names
        table[key] = value


def _public_path(dotted: str) -> bool:
    """Whether every part of ``dotted`` is an identifier that does not start with "_"."""
    return isinstance(dotted, str) and all(part.isidentifier() and not part.startswith("_") for part in dotted.split("."))


def _within(module: Any, modules: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``modules`` or a submodule of one."""
    return isinstance(module, str) and any(module == m or module.startswith(m + ".") for m in modules)


def _defined_in(obj: Any) -> str | None:
    """The module that defined ``obj`` (a module object itself has none)."""
    module = None if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", None)
    return module if isinstance(module, str) else None


def _own_names(obj: Any) -> list[tuple[str, str]]:
    """The names ``obj`` goes by where it is defined, without importing anything: its module
    and qualified name (a method descriptor's through its class: torch.Tensor.sum is
    torch._C.TensorBase.sum), and its module and plain name where that module holds it so
    (torch.add, whose qualified name is _VariableFunctionsClass.add)."""
    module, qualname = _defined_in(obj), getattr(obj, "__qualname__", None)
    owner = getattr(obj, "__objclass__", None)
    if module is None and isinstance(owner, type) and isinstance(getattr(obj, "__name__", None), str):
        module, qualname = owner.__module__, f"{owner.__qualname__}.{obj.__name__}"
    if module is None or not isinstance(qualname, str):
        return []
    names = [(module, qualname)]
    name, holder = getattr(obj, "__name__", None), sys.modules.get(module)
    if isinstance(name, str) and name != qualname and holder is not None and vars(holder).get(name) is obj:
        names.append((module, name))
    return names


def _described(obj: Any) -> str:
    """What ``obj`` is, for an error: where it is defined."""
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    names = _own_names(obj)
    if names:
        return " or ".join(".".join(name) for name in names)
    module = _defined_in(obj)
    return f"a {type(obj).__qualname__}" + (f" of {module}" if module else " of no module")


def _names(name: tuple[str, str], obj: Any) -> bool:
    """Whether ``name`` resolves to ``obj`` (an entry's own names only: importing them is safe)."""
    try:
        return _resolve(*name) is obj
    except (ImportError, AttributeError):
        return False


def _resolve_entry(entry: str) -> tuple[str, str, Any]:
    """(module, qualname, object) for an ``allowed_functions`` entry, imported here: the
    longest part of it that imports as a module, and the object the rest names in it
    (qualname "" for a module entry). ValueError when it names neither."""
    parts = entry.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ValueError(f"allowed_functions entry {entry!r} is not a dotted name")
    for split in range(len(parts), 0, -1):
        module = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
                continue  # no such module: a shorter part may be one
            raise ValueError(f"allowed_functions entry {entry!r}: cannot import {module}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a module whose import fails
            raise ValueError(f"allowed_functions entry {entry!r}: cannot import {module}: {exc}") from exc
        qualname = ".".join(parts[split:])
        try:
            for part in parts[split:]:
                obj = getattr(obj, part)
        except AttributeError as exc:
            raise ValueError(f"allowed_functions entry {entry!r} names nothing: {exc}") from exc
        if qualname and isinstance(obj, types.ModuleType):
            # A module another one imported: its functions would be named through the import.
            raise ValueError(f"allowed_functions entry {entry!r} is module {obj.__name__} as {module} imported it: "
                             f"list {obj.__name__!r} itself")
        return module, qualname, obj
    raise ValueError(f"allowed_functions entry {entry!r} is neither a module nor an object in one")


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


class _NotImportable(SerializationError):
    """A name that a peer may name but that does not import here."""


def _import_named(module: str, qualname: str, what: str) -> Any:
    """``_resolve``, with a failure to import raised as the SerializationError that says
    ``cannot import <what><module>.<qualname>``."""
    try:
        return _resolve(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise _NotImportable(f"cannot import {what}{module}.{qualname}: {exc}") from exc


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
        self._decoding = threading.local()  # .sender: of the payload this thread decodes now

    def decode_payload(self, envelope: Any, tensors: list | None = None, plain: bool = False) -> Any:
        """As the codec's; while it runs, ``decoding_sender()`` is the sender of the message on
        this thread (its connection's member: the transport checked the envelope's sender
        field against it), for the decoders of types that must know who sent them (RRefs)."""
        if plain:  # (no registered type is decoded)
            return super().decode_payload(envelope, tensors, plain)
        decoding = self._decoding
        outer = getattr(decoding, "sender", None)
        decoding.sender = envelope.sender
        try:
            return super().decode_payload(envelope, tensors, plain)
        finally:
            decoding.sender = outer

    def decoding_sender(self) -> str | None:
        """The sender of the message this thread decodes now (None: none is being decoded)."""
        return getattr(self._decoding, "sender", None)

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
    if module == "torch":
        # A constant (torch.channels_last) runs nothing: allowed whatever the policy. Looked up
        # in torch's namespace only (its module __getattr__ would import what it names).
        constant = vars(torch).get(qualname)
        if type(constant) in _TORCH_CONSTANT_KINDS:
            return constant
    policy.check(module, qualname)  # first, so that a restricted worker's refusal names allowed_functions
    if _names_a_special_attribute(qualname):
        raise SerializationError(f"refused a global reference through a special attribute: {module}.{qualname}")
    return policy.resolve(module, qualname)


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
    """The callable a request names; raises SerializationError if the policy refuses it (its
    name before anything is imported, or what the name resolved to) or it cannot be imported
    here."""
    if isinstance(function, FunctionRef):
        try:
            return policy.resolve(function.module, function.qualname, "function ")
        except _NotImportable as exc:
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


def decode_exception(info: dict, where: str, policy: CallablePolicy = UNRESTRICTED) -> BaseException:
    """The remote exception rebuilt with its own type where that type can be imported and
    built from a message (where ``policy`` is restricted, found without importing: see
    ``_exception_type``); else a RemoteException. The message names the worker and carries
    the remote traceback."""
    where_and_what = f"On {where}:\n{info['message']}"
    remote_traceback = f"\n\nRemote traceback:\n{info['traceback']}"
    try:
        kind = _exception_type(info["module"], info["type"], policy)
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


def _exception_type(module: str, qualname: str, policy: CallablePolicy) -> Any:
    """The class an answer's error names. Where ``policy`` is restricted, the peer that
    answered may not make this worker import or run anything: only a class of a module loaded
    already, looked up without running code (no import, no module ``__getattr__``, no
    descriptor) and never through a dunder."""
    if not policy.restricted:
        return _resolve(module, qualname)
    parts = [*module.split("."), *qualname.split(".")]
    if not all(part.isidentifier() and not (part.startswith("__") and part.endswith("__")) for part in parts):
        raise SerializationError(f"refused an exception type through a special name: {module}.{qualname}")
    obj: Any = sys.modules[module]
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part)
    return obj
