"""A live RPC worker bombarded with malformed and hostile messages stays up, answers what it
can address with an error, refuses oversize messages, and then serves valid calls."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from zmqautograd.transport import PROTOCOL_VERSION, Codec, Message, MessageType
from zmqautograd import rpc

from tests import bad_input_functions as bf
from tests.rpc_harness import Group, admitted_member, answers_to

pytestmark = pytest.mark.timeout(120)
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def group():
    g = Group(world_size=2, num_worker_threads=4, rpc_timeout=20, max_message_bytes=LIMIT)
    yield g
    g.shutdown()


def test_oversize_messages_are_refused_with_a_clear_error(group):
    with pytest.raises(RuntimeError, match=r"limit is 1048576"):
        rpc.rpc_sync("worker1", torch.add, args=(torch.zeros(LIMIT // 4 + 1), 1))
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(torch.zeros(100), 1)), torch.ones(100))


def test_bombarded_worker_stays_up_and_serves(group):
    errors_before = rpc.rpc_sync("worker1", bf.protocol_errors)
    codec = Codec()
    rng = random.Random(5)
    with admitted_member("intruder") as raw:
        valid = codec.encode(Message(MessageType.PYTHON_CALL, 9, "intruder", {"x": torch.ones(4)}))
        hostile = [
            [bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))] for _ in range(50)  # noise
        ] + [
            [msgpack.packb([PROTOCOL_VERSION + 7, 16, 1, "intruder", b""])],  # wrong version
            [msgpack.packb([PROTOCOL_VERSION, 99, 1, "intruder", b""])],  # unknown type
            [valid[0][: len(valid[0]) // 2]],  # truncated header
            [valid[0]],  # descriptor without its frame
            [valid[0], b"\0" * 3],  # frame of the wrong size
            [valid[0], valid[1], b"extra"],  # a frame too many
            [msgpack.packb([PROTOCOL_VERSION, 16, 2, "intruder", msgpack.packb({"f": 5, "a": 1})])],  # nonsense call
            [b"x"] * 100_000,  # absurd frame count
            [b"\0" * (LIMIT + 1)],  # oversize
        ]
        for frames in hostile:
            raw.send_multipart(frames)
        answers = 0
        while raw.poll(2000):
            answer = codec.decode(raw.recv_multipart())
            assert answer.type in (MessageType.PROTOCOL_ERROR, MessageType.EXCEPTION, MessageType.HEARTBEAT, MessageType.HELLO)
            answers += answer.type in (MessageType.PROTOCOL_ERROR, MessageType.EXCEPTION)
        assert answers >= 55  # every hostile message it could address was answered
        assert rpc.rpc_sync("worker1", bf.protocol_errors) - errors_before >= 50
        # Still up, and right.
        for i in range(20):
            assert torch.equal(rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(3), i)), torch.full((3,), float(i)))


def test_malformed_context_releases_riding_on_a_call_do_not_fail_it(group):
    """Context ids ride on calls ("rc", autograd/cleanup.py); ids that are no ids fail the
    release (logged), never the call: both a Python function's (released before it runs) and
    a builtin's (released after the answer)."""
    from zmqautograd.rpc.serialization import RpcCodec, encode_function

    codec = RpcCodec()
    with admitted_member("intruder2") as raw:
        calls = {21: (bf.protocol_errors, [], int), 22: (torch.add, [torch.ones(2), 1], torch.Tensor)}
        for message_id, (function, args, _) in calls.items():
            payload = {"f": encode_function(function), "a": args, "k": {}, "rc": [[1, 2], {"x": 1}]}
            raw.send_multipart(codec.encode(Message(MessageType.PYTHON_CALL, message_id, "intruder2", payload)))
        answered = {}
        while len(answered) < len(calls) and raw.poll(10_000):
            answer = codec.decode(raw.recv_multipart())
            if answer.type is MessageType.PYTHON_RET:
                answered[answer.id] = answer.payload["v"]
        assert set(answered) == set(calls)
        for message_id, (_, _, kind) in calls.items():
            assert isinstance(answered[message_id], kind)
        assert torch.equal(answered[22], torch.full((2,), 2.0))
        assert torch.equal(rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(3), 2)), torch.full((3,), 2.0))


def test_hostile_global_references_are_refused_with_clear_errors(group):
    """Classes and functions passed as values travel as [module, qualname] (serialization.py,
    EXT_GLOBAL). One that is malformed, unimportable, or reaches through a dunder attribute
    (an object's internals) fails its call with an error that says which; the worker serves on."""
    from zmqautograd.rpc.serialization import EXT_GLOBAL, RpcCodec, encode_function

    codec = RpcCodec()
    references = {
        31: ([1, 2], "malformed global reference"),
        32: (["no_such_module_zq", "f"], "cannot import no_such_module_zq.f"),
        33: (["os", "system.__globals__"], "through a special attribute: os.system.__globals__"),
        34: (["torch.optim", "SGD"], None),  # well-formed: the call runs
    }
    with admitted_member("intruder3") as raw:
        answered = answers_to(raw, codec, {
            message_id: Message(MessageType.PYTHON_CALL, message_id, "intruder3", {
                "f": encode_function(bf.type_name), "a": [msgpack.ExtType(EXT_GLOBAL, msgpack.packb(reference))], "k": {}})
            for message_id, (reference, _) in references.items()})
    assert set(answered) == set(references)
    for message_id, (_, error) in references.items():
        kind, payload = answered[message_id]
        if error is None:
            assert kind is MessageType.PYTHON_RET and payload["v"] == "torch.optim.sgd.SGD"
        else:
            assert kind is MessageType.PROTOCOL_ERROR and error in str(payload), payload
    assert torch.equal(rpc.rpc_sync("worker1", torch.mul, args=(torch.ones(3), 2)), torch.full((3,), 2.0))
