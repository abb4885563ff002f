"""``allowed_functions`` means exactly the listed names: a member may have a restricted
worker run or build only a listed function or class, or a public name defined in a listed
module (judged by the object's own module, never by a dotted path through what a module
imported), never a private or dunder name, never a method reached through a class unless
listed; the same for values sent by reference, ``remote``, profiled calls and RRef proxies.
The rules on CallablePolicy itself first (in-process), then every escape a member would try
against a real restricted worker."""

from __future__ import annotations

import os
import re
import sys
import types

import msgpack
import pytest
import torch
from torch.autograd.profiler_legacy import profile as legacy_profile

from zmqautograd import rpc
from zmqautograd.transport import Message, MessageType
from zmqautograd.rpc import rref_owner
from zmqautograd.rpc.errors import RemoteException, SerializationError
from zmqautograd.rpc.serialization import (
    EXT_GLOBAL,
    CallablePolicy,
    FunctionRef,
    RpcCodec,
    _load_global,
    decode_exception,
    resolve_function,
)

from tests import allowed_module as am
from tests import security_functions as sf
from tests import stranger
from tests.rpc_harness import Group, admitted_member, answers_to

AM = "tests.allowed_module"
LISTED = ["torch.add", "torch.ones", "torch.Tensor.sum", "torch.optim.SGD", AM, f"{AM}.Stage.forward",
          "tests.security_functions.allowed",
          # what admitted_member asks the worker (to admit a raw member)
          *(f"tests.security_functions.{name}" for name in ("mechanism", "admit", "credential", "address"))]

# (module, qualname) a member may try, with the arguments that would create the marker (its
# path given) if it ran: a listed module's imports, its private names, dunders, methods of an
# allowed class that are not listed, modules that are not listed. All are refused as not
# allowed, but a submodule of a listed module that does not exist: it is allowed by name and
# fails to import (nothing of it runs: it is not there).
REFUSED = "allowed_functions"
ESCAPES = [
    ((AM, "os.system"), lambda marker: (f"touch {marker}",), REFUSED),
    ((AM, "system"), lambda marker: (f"touch {marker}",), REFUSED),
    ((AM, "torch.os.system"), lambda marker: (f"touch {marker}",), REFUSED),
    ((f"{AM}.os", "system"), lambda marker: (f"touch {marker}",), "No module named 'tests.allowed_module.os'"),
    (("tests", "allowed_module.system"), lambda marker: (f"touch {marker}",), REFUSED),
    ((AM, "_private"), lambda marker: (marker,), REFUSED),
    ((AM, "Stage.touch"), lambda marker: (None, marker), REFUSED),
    ((AM, "Stage.__init__"), lambda marker: (None,), REFUSED),
    ((AM, "Stage.__init__.__globals__"), lambda marker: (), REFUSED),
    ((AM, "__builtins__"), lambda marker: (), REFUSED),
    ((AM, "Stage.__class__"), lambda marker: ("X", (), {}), REFUSED),
    ((AM, "Stage.__reduce__"), lambda marker: (), REFUSED),
    ((AM, "__loader__"), lambda marker: (), REFUSED),
    (("builtins", "exec"), lambda marker: (f"open({marker!r}, 'w').close()",), REFUSED),
    (("os", "system"), lambda marker: (f"touch {marker}",), REFUSED),
    (("posix", "system"), lambda marker: (f"touch {marker}",), REFUSED),
    (("torch", "save"), lambda marker: (torch.ones(1), marker), REFUSED),
    (("torch", "os.system"), lambda marker: (f"touch {marker}",), REFUSED),
    (("tests.security_functions", "not_allowed"), lambda marker: (1,), REFUSED),
]


def _global(module: str, qualname: str) -> msgpack.ExtType:
    """A value sent by reference, naming whatever a member likes (the codec sends only names
    that resolve back to the object; a member need not)."""
    return msgpack.ExtType(EXT_GLOBAL, msgpack.packb([module, qualname]))


# ------------------------------------------------------------------ the policy, in-process


@pytest.mark.timeout(60)
def test_entries_are_resolved_into_modules_and_objects_with_their_names():
    policy = CallablePolicy(LISTED)
    assert policy.restricted
    for module, qualname in (("torch", "add"),  # function_reference(torch.add)
                             ("torch.optim", "SGD"), ("torch.optim.sgd", "SGD"),  # the entry, where defined
                             ("torch", "Tensor.sum"), ("torch._C", "TensorBase.sum"),  # a method descriptor's
                             (AM, "Stage.forward"), ("tests.security_functions", "allowed")):
        assert policy.allows(module, qualname), (module, qualname)
    assert policy.resolve("torch._C", "TensorBase.sum") is torch.Tensor.sum
    assert policy.resolve("torch.optim.sgd", "SGD") is torch.optim.SGD
    # A definition name that does not resolve back (torch.add is defined as
    # _VariableFunctionsClass.add) is no name it may be named by.
    assert not policy.allows("torch", "_VariableFunctionsClass.add")
    # An object entry is that object only, not a prefix.
    assert not policy.allows("torch", "add.__self__")
    assert not policy.allows("torch.optim", "SGD.step")
    assert not policy.allows("torch", "Tensor")


@pytest.mark.timeout(60)
def test_entries_that_name_nothing_or_a_module_through_an_import_are_refused_at_construction():
    for entry, words in ((f"{AM}.no_such_name", "names nothing"), ("no_such_module_zq", "neither a module"),
                         (f"{AM}.os", "list 'os' itself"), ("torch..add", "not a dotted name")):
        with pytest.raises(ValueError, match=words) as raised:
            CallablePolicy([entry])
        assert repr(entry) in str(raised.value)
    for bad in ("torch.add", [1], [""]):
        with pytest.raises(TypeError, match="allowed_functions"):
            CallablePolicy(bad)


@pytest.mark.timeout(60)
def test_a_listed_module_allows_one_public_name_defined_in_it_or_below_it():
    policy = CallablePolicy([AM, "torch.nn"])
    assert policy.resolve(AM, "double") is am.double
    assert policy.resolve(AM, "Stage") is am.Stage
    assert policy.resolve("torch.nn.modules.linear", "Linear") is torch.nn.Linear  # a submodule
    assert policy.resolve("torch.nn", "Linear") is torch.nn.Linear  # defined below the listed module
    for module, qualname in ((AM, "Stage.forward"), (AM, "Stage.touch"), (AM, "os.system"), (AM, "torch.os.system"),
                             (AM, "_private"), (AM, "__builtins__"), (AM, "Stage.__init__"), (AM, "__loader__"),
                             ("tests", "allowed_module"), (f"{AM}._x", "double"), (AM, ""), (AM, "double "),
                             (AM, "Stage..forward"), ("torch", "add"), ("torch.nn._reduction", "get_enum")):
        assert not policy.allows(module, qualname), (module, qualname)
        with pytest.raises(SerializationError, match="allowed_functions"):
            policy.resolve(module, qualname)


@pytest.mark.timeout(60)
def test_what_a_listed_module_imported_is_refused_by_its_own_module():
    """``from os import system`` in a listed module: the name is one public identifier of a
    listed module, but os.system is defined in posix; a module object has no module."""
    policy = CallablePolicy([AM])
    assert policy.allows(AM, "system")  # by its name alone
    for qualname, words in (("system", "it is posix.system"), ("os", "it is module os"), ("torch", "it is module torch")):
        with pytest.raises(SerializationError, match="allowed_functions") as raised:
            policy.resolve(AM, qualname)
        assert words in str(raised.value)


@pytest.mark.timeout(60)
def test_an_object_entry_allows_that_very_object_only(monkeypatch):
    policy = CallablePolicy([f"{AM}.double"])
    assert policy.resolve(AM, "double") is am.double
    monkeypatch.setattr(am, "double", am.pid)  # the name now means another object
    with pytest.raises(SerializationError, match="allowed_functions"):
        policy.resolve(AM, "double")
    assert not policy.allows(AM, "pid")


@pytest.mark.timeout(60)
def test_nothing_is_imported_before_the_name_is_judged(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "za_not_listed_zq.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    policy = CallablePolicy([AM])
    for name in (("za_not_listed_zq", "f"), (f"{AM}", "za_not_listed_zq.f")):
        with pytest.raises(SerializationError, match="allowed_functions"):
            policy.resolve(*name)
        with pytest.raises(SerializationError, match="allowed_functions"):
            resolve_function(FunctionRef(*name), policy)
        with pytest.raises(SerializationError, match="allowed_functions"):
            _load_global(list(name), policy)
    assert "za_not_listed_zq" not in sys.modules and not marker.exists()


@pytest.mark.timeout(60)
def test_protocol_functions_are_always_allowed_and_nothing_else_of_zmqautograd():
    policy = CallablePolicy([AM])
    assert resolve_function(FunctionRef("zmqautograd.rpc.rref_owner", "_call_method"), policy) is rref_owner._call_method
    for name in (("zmqautograd.rpc.rref_owner", "_context"), ("zmqautograd.rpc.api", "rpc_sync"),
                 ("zmqautograd.rpc.serialization", "CallablePolicy")):
        assert not policy.allows(*name)


@pytest.mark.timeout(60)
def test_a_predicate_is_asked_for_the_name_sent_and_for_the_objects_own_name():
    asked: list[tuple[str, str]] = []

    def predicate(module: str, qualname: str) -> bool:
        asked.append((module, qualname))
        return module == AM or (module, qualname) in {("torch", "add"), ("torch.optim.sgd", "SGD")}

    policy = CallablePolicy(predicate)
    assert policy.resolve(AM, "double") is am.double
    assert policy.resolve("torch", "add") is torch.add  # its own name: torch.add, defined as _VariableFunctionsClass.add
    with pytest.raises(SerializationError, match="it is posix.system"):
        policy.resolve(AM, "system")  # allowed by name, not by what it is
    assert (AM, "system") in asked and ("posix", "system") in asked
    asked.clear()
    for name in ((AM, "_private"), (AM, "Stage.__init__"), (AM, "__builtins__"), ("os", "system")):
        with pytest.raises(SerializationError, match="allowed_functions"):
            policy.resolve(*name)
    assert asked == [("os", "system")]  # private and dunder names refused without asking
    assert policy.resolve(AM, "Stage.touch") is am.Stage.touch  # the predicate's choice: it allows all of AM
    policy.check_method(am.Stage, "touch")
    with pytest.raises(SerializationError, match="allowed_functions"):
        policy.check_method(torch.Tensor, "sum")
    with pytest.raises(SerializationError, match="allowed_functions"):
        policy.check_method(am.Stage, "__init__")


@pytest.mark.timeout(60)
def test_values_by_reference_follow_the_same_rules():
    policy = CallablePolicy(LISTED)
    assert _load_global(["torch", "channels_last"], policy) is torch.channels_last  # a constant runs nothing
    assert _load_global(["torch", "strided"], policy) is torch.strided
    assert _load_global(["torch.optim.sgd", "SGD"], policy) is torch.optim.SGD
    assert _load_global([AM, "Stage"], policy) is am.Stage
    for (module, qualname), _, refusal in ESCAPES:
        with pytest.raises(SerializationError, match=refusal):
            _load_global([module, qualname], policy)
    with pytest.raises(SerializationError, match="malformed"):
        _load_global([AM, 1], policy)


@pytest.mark.timeout(60)
def test_a_method_through_a_proxy_must_be_listed():
    policy = CallablePolicy(LISTED)
    policy.check_method(torch.Tensor, "sum")
    policy.check_method(torch.nn.Parameter, "sum")  # the same method, inherited
    policy.check_method(am.Stage, "forward")
    for cls, name in ((torch.Tensor, "add"), (torch.Tensor, "_version"), (torch.Tensor, "__reduce_ex__"),
                      (am.Stage, "touch"), (am.Stage, "scaled"), (am.Stage, "__init__"), (am.Stage, "__class__"),
                      (am.Stage, "no_such"), (am.Stage, "forward.__globals__"), (am.Stage, 3)):
        with pytest.raises(SerializationError, match="allowed_functions"):
            policy.check_method(cls, name)
    CallablePolicy().check_method(am.Stage, "__init__")  # unrestricted: as torch


@pytest.mark.timeout(60)
def test_a_restricted_worker_rebuilds_errors_only_from_loaded_modules(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "za_error_zq.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Boom(Exception):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lazy = types.ModuleType("za_lazy_zq")
    lazy.__getattr__ = lambda name: open(str(marker), "w").close()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "za_lazy_zq", lazy)
    restricted = CallablePolicy([AM])

    def decoded(module: str, kind: str, policy: CallablePolicy = restricted) -> BaseException:
        return decode_exception({"module": module, "type": kind, "message": "m", "traceback": ""}, "w1", policy)

    assert type(decoded("builtins", "ValueError")) is ValueError
    assert type(decoded("zmqautograd.rpc.errors", "SerializationError")) is SerializationError
    for module, kind in (("za_error_zq", "Boom"), ("za_lazy_zq", "Boom"), ("builtins", "ValueError.__subclasses__"),
                         ("builtins", "__import__"), ("__main__", "Anything"), (1, "ValueError")):
        assert type(decoded(module, kind)) is RemoteException, (module, kind)
    assert "za_error_zq" not in sys.modules and not marker.exists()
    assert type(decoded("za_error_zq", "Boom", CallablePolicy())).__name__ == "Boom"  # unrestricted: imported, as before


# ------------------------------------------------------------------ a real restricted worker


@pytest.fixture(scope="module")
def group():
    group = Group(world_size=2, num_worker_threads=4, rpc_timeout=30, allowed_functions=LISTED)
    try:
        yield group
    finally:
        group.shutdown()


def _still_serves() -> None:
    assert rpc.rpc_sync("worker1", am.double, args=(21,)) == 42
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)), torch.full((2,), 2.0))


@pytest.mark.timeout(120)
def test_calls_by_reference_outside_the_list_are_refused(group, tmp_path):
    marker = tmp_path / "marker"
    for (module, qualname), args, refusal in ESCAPES:
        with pytest.raises(SerializationError, match=refusal):
            rpc.rpc_sync("worker1", FunctionRef(module, qualname), args=args(str(marker)))
        with pytest.raises(SerializationError, match=refusal):
            rpc.rpc_async("worker1", FunctionRef(module, qualname), args=args(str(marker))).wait()
    assert not marker.exists()
    _still_serves()
    assert rpc.rpc_sync("worker1", FunctionRef("torch._C", "TensorBase.sum"), args=(torch.ones(3),)).item() == 3.0
    assert rpc.rpc_sync("worker1", sf.allowed, args=(1,)) == 2
    with pytest.raises(SerializationError, match="allowed_functions"):
        rpc.rpc_sync("worker1", sf.not_allowed, args=(1,))


@pytest.mark.timeout(120)
def test_values_by_reference_outside_the_list_are_refused(group, tmp_path):
    """A listed function that calls what it is given (am.call) gets nothing unlisted."""
    marker = tmp_path / "marker"
    for value, args in ((os.system, (f"touch {marker}",)), (am.Stage.touch, (None, str(marker))),
                        (am._private, (str(marker),)), (exec, (f"open({str(marker)!r}, 'w').close()",))):
        with pytest.raises(RuntimeError, match="allowed_functions"):
            rpc.rpc_sync("worker1", am.call, args=(value, *args))
    for (module, qualname), args, refusal in ESCAPES:
        with pytest.raises(RuntimeError, match=refusal):
            rpc.rpc_sync("worker1", am.call, args=(_global(module, qualname), *args(str(marker))))
    assert not marker.exists()
    assert rpc.rpc_sync("worker1", am.call, args=(am.double, 4)) == 8
    assert rpc.rpc_sync("worker1", am.call, args=(torch.ones, 2)).tolist() == [1.0, 1.0]
    _still_serves()


@pytest.mark.timeout(120)
def test_remote_outside_the_list_is_refused(group, tmp_path):
    marker = tmp_path / "marker"
    for (module, qualname), args, refusal in ESCAPES:
        rref = rpc.remote("worker1", FunctionRef(module, qualname), args=args(str(marker)))
        with pytest.raises(SerializationError, match=refusal):
            rref.to_here()
    for value, args in ((os.system, (f"touch {marker}",)), (am.Stage.touch, (None, str(marker)))):
        # The worker cannot decode the call: remote() fails (its RRef's creation error).
        rref = rpc.remote("worker1", am.call, args=(value, *args))
        with pytest.raises(RuntimeError, match="allowed_functions"):
            rref._get_future().wait()
        with pytest.raises(RuntimeError, match="allowed_functions"):
            rref.to_here()
    assert not marker.exists()
    stage = rpc.remote("worker1", am.Stage, args=(3.0,))
    assert torch.equal(stage.rpc_sync().forward(torch.ones(2)), torch.full((2,), 3.0))
    _still_serves()


@pytest.mark.timeout(120)
def test_profiled_calls_are_checked_too(group, tmp_path):
    marker = tmp_path / "marker"
    with legacy_profile():
        for (module, qualname), args, refusal in ESCAPES[:6]:
            with pytest.raises(SerializationError, match=refusal):
                rpc.rpc_sync("worker1", FunctionRef(module, qualname), args=args(str(marker)))
            with pytest.raises(SerializationError, match=refusal):
                rpc.remote("worker1", FunctionRef(module, qualname), args=args(str(marker))).to_here()
        assert rpc.rpc_sync("worker1", am.double, args=(2,)) == 4
    assert not marker.exists()


@pytest.mark.timeout(120)
def test_rref_proxies_reach_only_listed_methods(group, tmp_path):
    marker = tmp_path / "marker"
    stage = rpc.remote("worker1", am.Stage, args=(2.0,))
    tensor = rpc.remote("worker1", torch.ones, args=(2,))
    assert torch.equal(stage.rpc_sync().forward(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(stage.rpc_async().forward(torch.ones(2)).wait(), torch.full((2,), 2.0))
    assert tensor.rpc_sync().sum().item() == 2.0
    for proxy_call in (lambda: stage.rpc_sync().touch(str(marker)), lambda: stage.rpc_sync().scaled(torch.ones(1)),
                       lambda: stage.rpc_async().touch(str(marker)).wait(), lambda: tensor.rpc_sync().add(1),
                       lambda: tensor.rpc_sync()._version(), lambda: stage.remote().touch(str(marker)).to_here()):
        with pytest.raises(SerializationError, match="allowed_functions"):
            proxy_call()
    # Names the proxy object itself would answer (dunders), sent as the proxy would.
    for rref, name, args in ((stage, "__init__", (5.0,)), (stage, "__class__", ()), (stage, "__reduce__", ()),
                             (stage, "__setattr__", ("scale", 5.0)), (tensor, "__reduce_ex__", (2,)),
                             (stage, "forward.__globals__", ())):
        with pytest.raises(SerializationError, match="allowed_functions"):
            rpc.rpc_sync("worker1", rref_owner._call_method, args=(name, rref, args, {}))
    assert not marker.exists()
    assert torch.equal(stage.rpc_sync().forward(torch.ones(2)), torch.full((2,), 2.0))  # scale unchanged


@pytest.mark.timeout(120)
def test_pickles_are_refused(group, tmp_path):
    marker = tmp_path / "marker"
    with pytest.raises(RuntimeError, match="pickle"):
        rpc.rpc_sync("worker1", am.call, args=(stranger._RunsACommand(f"touch {marker}"),))
    with pytest.raises(RuntimeError, match="pickle"):
        rpc.rpc_sync("worker1", lambda: os.system(f"touch {marker}"))
    assert not marker.exists()
    _still_serves()


@pytest.mark.timeout(120)
def test_remote_autograd_and_optimizer_work_over_what_is_listed(group):
    """remote(), a proxy's listed method, dist autograd and DistributedOptimizer with a
    restricted worker, where their functions and classes are listed (torch.ones, torch.add,
    torch.Tensor.sum, torch.optim.SGD)."""
    import zmqautograd.autograd as dist_autograd
    from zmqautograd.optim import DistributedOptimizer

    rref = rpc.remote("worker1", torch.ones, args=(2,), kwargs={"requires_grad": True})
    assert rref.rpc_sync().sum().item() == 2.0
    with dist_autograd.context() as context_id:
        loss = rpc.rpc_sync("worker1", torch.add, args=(rref.to_here(), 1.0)).sum()
        dist_autograd.backward(context_id, [loss])
        optimizer = DistributedOptimizer(torch.optim.SGD, [rref], lr=0.5)
        optimizer.step(context_id)
    assert torch.equal(rref.to_here(), torch.full((2,), 0.5))
    with pytest.raises(RuntimeError, match="allowed_functions"):
        DistributedOptimizer(torch.optim.Adam, [rref], lr=0.5)


@pytest.mark.timeout(120)
def test_a_raw_member_naming_the_function_as_a_value_is_refused(group, tmp_path):
    """What no rpc_sync sends: the function of a call as a value by reference (EXT_GLOBAL,
    resolved while the call is decoded), straight on the wire by an admitted member; each
    answered with the refusal, nothing run."""
    marker = tmp_path / "marker"
    codec = RpcCodec()
    calls = {100 + i: ({"f": _global(*name), "a": list(args(str(marker))), "k": {}}, refusal)
             for i, (name, args, refusal) in enumerate(ESCAPES)}
    with admitted_member("intruder") as raw:
        answered = answers_to(raw, codec, {message_id: Message(MessageType.PYTHON_CALL, message_id, "intruder", payload)
                                           for message_id, (payload, _) in calls.items()})
    assert set(answered) == set(calls)
    for message_id, (_, refusal) in calls.items():
        kind, payload = answered[message_id]
        assert kind in (MessageType.PROTOCOL_ERROR, MessageType.EXCEPTION) and re.search(refusal, str(payload)), payload
    assert not marker.exists()
    _still_serves()
