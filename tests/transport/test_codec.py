"""The pure codec: messages <-> frames, tensors of every kind, and hostile input."""

from __future__ import annotations

import ctypes
import random

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqautograd.transport import (
    PROTOCOL_VERSION,
    Codec,
    Extension,
    ExtensionNotDecoded,
    LocalProtocolError,
    Message,
    MessageTooLargeError,
    MessageType,
    ProtocolError,
    RemoteProtocolError,
)
from zmqautograd.transport.tensors import DTYPES_BY_NAME

CODEC = Codec()


def round_trip(payload, codec: Codec = CODEC):
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 42, "w0", payload)) if codec is CODEC else codec.encode(
        Message(MessageType.PYTHON_CALL, 42, "w0", payload)
    )
    # What arrives from a socket is bytes-like; exercise that path, not the sender's objects.
    message = codec.decode([bytes(memoryview(f)) for f in frames])
    assert (message.type, message.id, message.sender) == (MessageType.PYTHON_CALL, 42, "w0")
    return message.payload, frames


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.layout == want.layout
    assert got.requires_grad == want.requires_grad
    if want.is_sparse:
        assert got.is_coalesced() == want.is_coalesced()
        assert torch.equal(got._indices(), want._indices())
        assert_same_tensor(got._values().detach(), want._values().detach())
        return
    # Compare bit patterns: NaNs, and dtypes without comparison kernels, compare too.
    assert packed_bytes(got.detach()) == packed_bytes(want.detach())


def packed_bytes(tensor: torch.Tensor) -> bytes:
    packed = torch.empty(tensor.shape, dtype=tensor.dtype)  # fresh: standard strides
    if tensor.numel():
        packed.copy_(tensor)
    return ctypes.string_at(packed.data_ptr(), packed.numel() * packed.element_size())


def random_tensor(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)[: torch.Size(shape).numel()].reshape(shape)


# ------------------------------------------------------------------------------ structure


def test_structure_and_builtin_types_round_trip():
    payload = {
        "tuple": (1, 2.5, "s", None, True, b"raw"),
        "nested": [(1, [2, (3,)]), {"k": (4, 5)}],
        "size": torch.Size([2, 3]),
        "dtypes": [torch.float32, torch.bfloat16, torch.qint8, torch.complex64],
        "device": torch.device("cpu"),
        "int_keys": {1: "a", 2: "b"},
        "big": 2**63,
    }
    got, _ = round_trip(payload)
    assert got == payload
    assert type(got["tuple"]) is tuple and type(got["nested"][0]) is tuple
    assert type(got["size"]) is torch.Size


def test_message_fields_and_envelope_layout():
    frames = CODEC.encode(Message(MessageType.BACKWARD_AUTOGRAD_REQ, 2**64 - 1, 7, torch.ones(3)))
    assert len(frames) == 2  # envelope + one tensor frame
    envelope = msgpack.unpackb(frames[0])
    assert envelope[:4] == [PROTOCOL_VERSION, int(MessageType.BACKWARD_AUTOGRAD_REQ), 2**64 - 1, 7]
    message = CODEC.decode(frames)
    assert message.type is MessageType.BACKWARD_AUTOGRAD_REQ and message.sender == 7


def test_seed_message_type_names_exist():
    for name in (
        "FORWARD_AUTOGRAD_REQ", "FORWARD_AUTOGRAD_RESP", "BACKWARD_AUTOGRAD_REQ", "BACKWARD_AUTOGRAD_RESP",
        "CLEANUP_AUTOGRAD_CONTEXT_REQ", "CLEANUP_AUTOGRAD_CONTEXT_RESP", "RREF_USER_DELETE",
        "RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "EXCEPTION", "RUN_WITH_PROFILING_REQ",
    ):
        assert MessageType.by_name(name).name == name


def test_the_built_in_types_are_the_ones_named_for_type_checkers():
    """codec.py names each built-in type in MessageType's class body for mypy; the names and
    the registrations must agree (a type registered but not named would pass the checks
    here and fail a type check, one named but not registered the other way round)."""
    import typing

    named = {name for name, hint in typing.get_type_hints(MessageType).items() if name.isupper()}
    built_in = {t.name for t in MessageType.all() if int(t) < 64}  # custom ones use codes from 64 up
    assert named == built_in
    assert all(getattr(MessageType, name) is MessageType.by_name(name) for name in named)


def test_message_types_are_extensible_and_unique():
    custom = MessageType.register("TEST_CUSTOM_PING", 900)
    assert MessageType.register("TEST_CUSTOM_PING", 900) is custom
    with pytest.raises(ValueError):
        MessageType.register("TEST_OTHER", 900)
    with pytest.raises(ValueError):
        MessageType.register("TEST_CUSTOM_PING", 901)
    assert CODEC.decode(CODEC.encode(Message(custom, 1, "a", None))).type is custom


def test_extension_and_fallback():
    class Point:
        def __init__(self, x, y):
            self.x, self.y = x, y

    point_ext = Extension(20, Point, lambda p: [p.x, p.y], lambda v: Point(*v))
    codec = Codec(extensions=[point_ext])
    got, frames = round_trip({"p": Point(torch.arange(3), (1, 2))}, codec)
    assert isinstance(got["p"], Point) and torch.equal(got["p"].x, torch.arange(3))
    assert got["p"].y == (1, 2) and len(frames) == 2  # the tensor inside went as a frame

    class Opaque:
        pass

    with pytest.raises(LocalProtocolError, match="cannot encode an object of type"):
        CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", Opaque()))
    fallback_ext = Extension(21, object, lambda o: None, lambda v: "rebuilt")
    codec = Codec(extensions=[fallback_ext], fallback=lambda obj: (fallback_ext, "state"))
    assert round_trip([Opaque()], codec)[0] == ["rebuilt"]


def test_cached_extensions_are_encoded_and_decoded_once_per_value():
    """Extension(cache=True), as function references use it: each value is encoded once and
    decoded once, whatever the number of messages; a value whose encoding holds a tensor is
    encoded every time (its tensor is a frame of each message)."""
    encoded, decoded = [], []

    class Name:
        def __init__(self, text, tensor=None):
            self.text, self.tensor = text, tensor

        def __eq__(self, other):
            return isinstance(other, Name) and other.text == self.text

        def __hash__(self):
            return hash(self.text)

    def encode(name):
        encoded.append(name.text)
        return [name.text] if name.tensor is None else [name.text, name.tensor]

    def decode(value):
        decoded.append(value[0])
        return Name(*value)

    codec = Codec(extensions=[Extension(24, Name, encode, decode, cache=True)])
    first = [codec.decode(codec.encode(Message(MessageType.PYTHON_CALL, i, "a", {"n": [Name("f"), Name("g")]}))).payload["n"]
             for i in range(5)]
    assert encoded == ["f", "g"] and decoded == ["f", "g"]
    assert all(names[0] is first[0][0] and names[0].text == "f" and names[1].text == "g" for names in first)
    for i in range(3):
        frames = codec.encode(Message(MessageType.PYTHON_CALL, i, "a", {"n": Name("t", torch.full((2,), float(i)))}))
        assert len(frames) == 2 and torch.equal(codec.decode(frames).payload["n"].tensor, torch.full((2,), float(i)))
    assert encoded.count("t") == 3


def test_an_extension_encoder_may_encode_another_message_and_fail_halfway():
    """Packers are reused per thread and nesting depth (codec._ThreadPackers): an extension's
    encoder that encodes a whole message of its own (as the RPC layer's RRef encoder may send
    one), or that fails halfway, must leave every message intact."""
    codec = Codec()
    inner_frames = []

    class Sends:
        def __init__(self, value):
            self.value = value

    def encode_sends(obj):
        inner_frames.append(codec.encode(Message(MessageType.RREF_FORK_REQUEST, 7, "x", {"w": (obj.value, [torch.ones(1)])})))
        return [obj.value, (obj.value,)]

    codec.add_extension(Extension(22, Sends, encode_sends, lambda v: ("sent", v[0], v[1])))
    payload = {"a": (1, Sends((2, torch.arange(2))), [torch.zeros(3)]), "b": torch.Size([4])}
    got = codec.decode(codec.encode(Message(MessageType.PYTHON_CALL, 1, "a", payload))).payload
    assert got["a"][0] == 1 and got["a"][1][0] == "sent" and got["b"] == torch.Size([4])
    assert torch.equal(got["a"][1][1][1], torch.arange(2)) and torch.equal(got["a"][2][0], torch.zeros(3))
    inner = codec.decode(inner_frames[0])
    assert inner.id == 7 and inner.payload["w"][0][0] == 2 and torch.equal(inner.payload["w"][1][0], torch.ones(1))

    def fail(obj):
        raise LocalProtocolError("refused halfway")

    failing = Codec(extensions=[Extension(23, Sends, fail, lambda v: v)])
    with pytest.raises(LocalProtocolError, match="refused halfway"):
        failing.encode(Message(MessageType.PYTHON_CALL, 2, "a", {"x": [(1, 2), Sends(0)]}))
    again = failing.decode(failing.encode(Message(MessageType.PYTHON_CALL, 3, "a", {"x": [(1, 2), 3]})))
    assert again.id == 3 and again.payload == {"x": [(1, 2), 3]}


def test_plain_decoding_refuses_extensions_and_keeps_the_rest():
    codec = Codec()
    frames = codec.encode(Message(MessageType.PYTHON_RET, 1, "a", {"v": (torch.ones(2), torch.Size([2]))}))
    plain = codec.decode_payload(codec.decode_envelope(frames), plain=True)  # built-in extensions only
    assert type(plain["v"]) is tuple and torch.equal(plain["v"][0], torch.ones(2)) and plain["v"][1] == torch.Size([2])
    codec = Codec(extensions=[Extension(20, complex, lambda c: [c.real, c.imag], lambda v: complex(*v))])
    envelope = codec.decode_envelope(codec.encode(Message(MessageType.PYTHON_RET, 1, "a", {"v": [1j]})))
    with pytest.raises(ExtensionNotDecoded):
        codec.decode_payload(envelope, plain=True)
    assert codec.decode_payload(envelope) == {"v": [1j]}


def test_invalid_messages_are_refused_on_encode():
    with pytest.raises(LocalProtocolError):
        CODEC.encode(Message(MessageType.PYTHON_CALL, -1, "a"))
    with pytest.raises(LocalProtocolError):
        CODEC.encode(Message(12345, 1, "a"))
    with pytest.raises(LocalProtocolError):
        CODEC.encode(Message(MessageType.PYTHON_CALL, 1, 3.5))
    with pytest.raises(LocalProtocolError, match="dtype"):
        quantized = torch._empty_affine_quantized([2], scale=0.1, zero_point=0, dtype=torch.qint8)
        CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", quantized))
    with pytest.raises(LocalProtocolError, match="layout"):
        CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", torch.ones(2, 2).to_sparse_csc()))


# -------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("name", sorted(DTYPES_BY_NAME))
def test_every_dtype_round_trips(name):
    dtype = DTYPES_BY_NAME[name]
    for shape in ([], [0], [5], [3, 4], [2, 0, 3]):
        tensor = random_tensor(dtype, shape)
        got, _ = round_trip(tensor)
        assert_same_tensor(got, tensor)


def test_zero_dim_empty_and_requires_grad():
    tensors = [torch.tensor(3.5), torch.empty(0, 7), torch.ones(2, 2, requires_grad=True), torch.tensor(True)]
    got, _ = round_trip(tensors)
    for g, t in zip(got, tensors):
        assert_same_tensor(g, t)
    assert got[2].is_leaf and got[2].grad_fn is None


def test_parameters_stay_parameters_and_take_their_tensors_place():
    """An nn.Parameter arrives as one (torch's pickling keeps them), and the message's tensor
    list holds that Parameter, the object distributed autograd gives a grad_fn in place."""
    weight = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.arange(4).reshape(2, 2).t(), requires_grad=False)  # a dense permutation
    sparse = torch.nn.Parameter(torch.eye(2).to_sparse())
    payload = {"w": weight, "f": frozen, "s": sparse, "t": torch.ones(1, requires_grad=True)}
    message = CODEC.decode([bytes(memoryview(f)) for f in CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "w0", payload))])
    got = message.payload
    for key in ("w", "f", "s"):
        assert type(got[key]) is torch.nn.Parameter and got[key].is_leaf
        assert_same_tensor(got[key], payload[key])
    assert got["f"].stride() == frozen.stride()
    assert type(got["t"]) is torch.Tensor and got["t"].requires_grad
    assert [id(t) for t in message.tensors] == [id(got[key]) for key in ("w", "f", "s", "t")]


def test_views_send_only_the_bytes_they_cover():
    base = torch.randn(1000, 1000)
    views = {
        "row slice": base[10:12],  # contiguous, offset into a big storage
        "column slice": base[:, 3:5],  # strided, mostly gaps of a big storage: compacted
        "transpose": base[:4, :6].t(),  # compacted (not dense over its span)
        "step": base[0, ::7],
    }
    for what, view in views.items():
        got, frames = round_trip(view)
        assert torch.equal(got, view), what
        assert memoryview(frames[1]).nbytes == view.numel() * 4, what


def test_views_with_gaps_keep_their_strides_as_torchs_unless_mostly_gaps_of_a_big_storage():
    """torch's rule (rpc/utils.cpp): a view is copied compact only when its storage is 8 KiB
    or more and at least twice the view; otherwise its layout travels (torch's
    test_non_cont_tensors), and only the span from its first element to its last goes."""
    small = torch.rand(5, 5)
    wide = torch.randn(100, 100)
    cases = {  # view -> span that travels (elements)
        "narrow of a small storage": (small.narrow(1, 2, 2), 1 + 4 * 5 + 1),
        "most of a big storage": (wide[1:, :60], 1 + 98 * 100 + 59),
    }
    for what, (view, span) in cases.items():
        got, frames = round_trip(view)
        assert torch.equal(got, view) and got.stride() == view.stride() and not got.is_contiguous(), what
        assert memoryview(frames[1]).nbytes == span * 4, what
        got[0, 0] = -1.0  # a view of its own memory: nothing of the sender's changes
        assert view[0, 0] != -1.0


def test_expanded_tensors_send_the_memory_they_repeat_once():
    """Dims of stride 0 (``expand``, the gradient of a ``sum``) stay expanded: the receiver
    gets the same view over the repeated memory, which travels once."""
    base = torch.randn(6, 8)
    cases = {  # tensor -> the bytes that must travel
        "scalar to a matrix": (torch.ones(()).expand(32, 64), 4),
        "a column repeated": (torch.arange(3.0).unsqueeze(1).expand(3, 100), 3 * 4),
        "a strided slice repeated": (base[:, 2:4].unsqueeze(0).expand(5, 6, 2), 6 * 2 * 4),
        "a transpose repeated": (base.t().unsqueeze(2).expand(8, 6, 3), 6 * 8 * 4),
        "a sliced expansion": (torch.arange(4.0).expand(3, 4)[:, 1:3], 2 * 4),
        "requiring grad": (torch.ones(1, requires_grad=True).expand(7), 4),
        "an element inside its storage": (torch.arange(10.0)[7].expand(4, 5), 4),
        "a double": (torch.tensor(2.5, dtype=torch.float64).expand(3), 8),
    }
    for what, (tensor, nbytes) in cases.items():
        got, frames = round_trip(tensor)
        assert torch.equal(got, tensor.detach()) and got.requires_grad == tensor.requires_grad, what
        assert [got.stride(d) == 0 for d in range(got.dim()) if got.size(d) > 1] == [
            tensor.stride(d) == 0 for d in range(tensor.dim()) if tensor.size(d) > 1], what
        assert memoryview(frames[1]).nbytes == nbytes, what
    empty, _ = round_trip(torch.ones(1).expand(0, 4))
    assert empty.shape == (0, 4)


def test_dense_permutations_keep_their_strides_without_copy():
    base = torch.randn(64, 128, 32)
    view = base.permute(2, 0, 1)  # dense over the whole storage, not contiguous
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", view))
    assert ctypes.addressof(frames[1]) == base.data_ptr()  # sent from the tensor's own memory
    got = CODEC.decode(frames).payload
    assert torch.equal(got, view) and got.stride() == view.stride()
    # A size-1 dim of stride 0 (as ``expand`` leaves one) on a dense permutation: no copy either.
    flat = torch.randn(512, 256)
    view = flat.t().as_strided((1, 256, 512), (0, 1, 256))
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", view))
    assert ctypes.addressof(frames[1]) == flat.data_ptr() and memoryview(frames[1]).nbytes == flat.nbytes
    got = CODEC.decode(frames).payload
    assert torch.equal(got, view) and got.stride() == view.stride()


def test_conjugate_and_negative_views_are_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    got, _ = round_trip([z.conj(), torch._neg_view(z)])
    assert torch.equal(got[0], z.conj().resolve_conj())
    assert torch.equal(got[1], -z)


def test_large_frames_are_zero_copy_and_received_tensors_writable():
    tensor = torch.randn(1 << 16)  # 256 KiB, above the copy threshold
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", tensor))
    assert ctypes.addressof(frames[1]) == tensor.data_ptr()
    received = bytearray(memoryview(frames[1]))  # what a socket hands over: a writable buffer
    got = CODEC.decode([frames[0], received]).payload
    assert ctypes.addressof(ctypes.c_char.from_buffer(received)) == got.data_ptr()  # no copy
    got.add_(1)  # writable, and it owns (keeps alive) the frame memory
    del received
    assert torch.allclose(got, tensor + 1)


def test_small_frames_are_snapshots():
    tensor = torch.zeros(4)
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", tensor))
    tensor.add_(1)  # after encode: must not change what is sent
    assert torch.equal(CODEC.decode(frames).payload, torch.zeros(4))


def test_misaligned_frames_are_realigned():
    tensor = torch.arange(16, dtype=torch.float64)
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", tensor))
    backing = bytearray(len(memoryview(frames[1])) + 1)
    shifted = memoryview(backing)[1:]
    shifted[:] = memoryview(frames[1]).cast("B")
    got = CODEC.decode([frames[0], shifted]).payload
    assert got.data_ptr() % 8 == 0 and torch.equal(got, tensor)


@pytest.mark.parametrize("coalesce", [True, False])
def test_sparse_coo_round_trips(coalesce):
    indices = torch.tensor([[0, 2, 0, 1], [1, 0, 1, 3]])
    values = torch.randn(4, 2)  # hybrid: one dense dim
    sparse = torch.sparse_coo_tensor(indices, values, (3, 4, 2))
    if coalesce:
        sparse = sparse.coalesce()
    got, frames = round_trip(sparse)
    assert len(frames) == 3  # envelope, indices, values
    assert_same_tensor(got, sparse)
    assert torch.equal(got.to_dense(), sparse.to_dense())


def test_sparse_gradient_from_embedding_bag_round_trips():
    bag = torch.nn.EmbeddingBag(10, 3, sparse=True)
    bag(torch.tensor([1, 2, 4, 5, 4]), torch.tensor([0, 2])).sum().backward()
    got, _ = round_trip(bag.weight.grad)
    assert torch.equal(got.to_dense(), bag.weight.grad.to_dense())


# ------------------------------------------------------------------- property: round trip


@st.composite
def tensors(draw):
    dtype = DTYPES_BY_NAME[draw(st.sampled_from(sorted(DTYPES_BY_NAME)))]
    shape = draw(st.lists(st.integers(0, 6), min_size=0, max_size=4))
    tensor = random_tensor(dtype, shape)
    kind = draw(st.sampled_from(["plain", "slice", "transpose", "sparse"]))
    if kind == "slice" and tensor.dim() and tensor.shape[0] > 1:
        tensor = tensor[draw(st.integers(0, tensor.shape[0] - 1)) :: draw(st.integers(1, 3))]
    elif kind == "transpose" and tensor.dim() >= 2:
        tensor = tensor.transpose(0, tensor.dim() - 1)
    elif kind == "sparse" and tensor.dim() and dtype in (torch.float32, torch.float64, torch.int64, torch.complex64):
        tensor = tensor.to_sparse(draw(st.integers(1, tensor.dim())))
        if draw(st.booleans()):
            tensor = tensor.coalesce()
    if draw(st.booleans()) and (dtype.is_floating_point or dtype.is_complex) and not tensor.is_sparse:
        tensor = tensor.detach().requires_grad_(dtype in (torch.float32, torch.float64, torch.complex64))
    return tensor


payloads = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | tensors(),
    lambda children: st.lists(children, max_size=3)
    | st.lists(children, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


def assert_same_payload(got, want):
    assert type(got) is type(want) or (isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor))
    if isinstance(want, torch.Tensor):
        assert_same_tensor(got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_payload(g, w)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert_same_payload(got[key], want[key])
    else:
        assert got == want


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payloads)
def test_property_any_payload_round_trips(payload):
    got, _ = round_trip(payload)
    assert_same_payload(got, payload)


# ----------------------------------------------------------------------- hostile input


def valid_frames() -> list[bytes]:
    payload = {"t": torch.randn(3, 4), "s": torch.randn(4, 4).to_sparse(), "x": (1, "a")}
    return [bytes(memoryview(f)) for f in CODEC.encode(Message(MessageType.PYTHON_CALL, 9, "w1", payload))]


def decode_or_protocol_error(frames) -> None:
    try:
        CODEC.decode(frames)
    except ProtocolError:
        pass  # the only acceptable failure


@settings(max_examples=400, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_property_random_bytes_only_raise_protocol_errors(frames):
    decode_or_protocol_error(frames)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_property_truncated_and_corrupted_messages_only_raise_protocol_errors(data):
    frames = valid_frames()
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    action = data.draw(st.sampled_from(["truncate", "flip", "drop", "duplicate"]))
    if action == "truncate":
        frames[index] = bytes(frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))])
    elif action == "flip" and frame:
        for _ in range(data.draw(st.integers(1, 4))):
            position = data.draw(st.integers(0, len(frame) - 1))
            frame[position] = data.draw(st.integers(0, 255))
        frames[index] = bytes(frame)
    elif action == "drop":
        del frames[index]
    else:
        frames.insert(index, frames[index])
    decode_or_protocol_error(frames)


def forge(envelope=None, payload=None, buffers=()):
    """Frames with a hand-made envelope or payload (tensor descriptors as ext type 1)."""
    if envelope is None:
        envelope = [PROTOCOL_VERSION, int(MessageType.PYTHON_CALL), 1, "w", msgpack.packb(payload, use_bin_type=True)]
    return [msgpack.packb(envelope, use_bin_type=True), *buffers]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def tensor_ext(descriptor):
    return msgpack.ExtType(1, msgpack.packb(descriptor))


MALFORMED = {
    "wrong version": (forge([99, 16, 1, "w", b""]), "unsupported protocol version 99"),
    "version as float": (forge([1.0, 16, 1, "w", b""]), "protocol version"),
    "unknown type": (forge([PROTOCOL_VERSION, 9999, 1, "w", b""]), "unknown message type 9999"),
    "short envelope": (forge([PROTOCOL_VERSION, 16]), "fields"),
    "envelope not a list": ([msgpack.packb({"a": 1})], "must be a list"),
    "negative id": (forge([PROTOCOL_VERSION, 16, -1, "w", b""]), "message id"),
    "sender is a list": (forge([PROTOCOL_VERSION, 16, 1, [1], b""]), "sender"),
    "payload not bytes": (forge([PROTOCOL_VERSION, 16, 1, "w", "str"]), "payload must be bytes"),
    "frame count mismatch": (forge(payload=[tensor_ext(["dense", "float32", [2], None, 1, 8, "cpu", False])]), "refers to frame 1"),
    "unreferenced frame": (forge(payload=None, buffers=[b"xxxx"]), "no tensor descriptor refers"),
    "frame used twice": (
        forge(payload=[tensor_ext(["dense", "uint8", [4], None, 1, 4, "cpu", False])] * 2, buffers=[b"abcd"]),
        "more than one",
    ),
    "size mismatch": (forge(payload=tensor_ext(["dense", "float32", [3], None, 1, 12, "cpu", False]), buffers=[b"x" * 8]), "has 8 bytes"),
    "nbytes lies": (forge(payload=tensor_ext(["dense", "float32", [3], None, 1, 8, "cpu", False]), buffers=[b"x" * 8]), "needs 12 bytes"),
    "unknown dtype": (forge(payload=tensor_ext(["dense", "float99", [1], None, 1, 4, "cpu", False]), buffers=[b"x" * 4]), "unknown dtype"),
    "absurd shape": (
        forge(payload=tensor_ext(["dense", "float32", [2**40, 2**40], None, 1, 4, "cpu", False]), buffers=[b"x" * 4]),
        "needs",
    ),
    "negative dim": (forge(payload=tensor_ext(["dense", "uint8", [-1], None, 1, 0, "cpu", False])), "invalid value"),
    "too many dims": (forge(payload=tensor_ext(["dense", "uint8", [1] * 65, None, 1, 1, "cpu", False]), buffers=[b"x"]), "at most 64"),
    "strides past buffer": (
        forge(payload=tensor_ext(["dense", "uint8", [4, 4], [100, 1], 1, 4, "cpu", False]), buffers=[b"x" * 4]),
        "needs",
    ),
    "bad device": (forge(payload=tensor_ext(["dense", "uint8", [1], None, 1, 1, "tpu:9", False]), buffers=[b"x"]), "device"),
    "grad on ints": (forge(payload=tensor_ext(["dense", "int64", [1], None, 1, 8, "cpu", True]), buffers=[b"x" * 8]), "requires_grad"),
    "sparse index out of range": (
        forge(
            payload=tensor_ext(["sparse_coo", [2, 2], ["dense", "int64", [2, 1], None, 1, 16, "cpu", False],
                                ["dense", "float32", [1], None, 2, 4, "cpu", False], False, False]),
            buffers=[tensor_bytes(torch.tensor([[5], [0]])), b"\0\0\x80?"],
        ),
        "invalid sparse tensor",
    ),
    "sparse falsely coalesced": (
        forge(
            payload=tensor_ext(["sparse_coo", [3], ["dense", "int64", [1, 2], None, 1, 16, "cpu", False],
                                ["dense", "float32", [2], None, 2, 8, "cpu", False], True, False]),
            buffers=[tensor_bytes(torch.tensor([[1, 1]])), b"\0" * 8],
        ),
        "uncoalesced",
    ),
    "cuda ipc short": (forge(payload=tensor_ext(["cuda_ipc", "float32", [2], "cuda:0", False])), "expected 7"),
    "cuda ipc bad handle": (
        forge(payload=tensor_ext(["cuda_ipc", "float32", [2], "cuda:0", False, [0, "h", 8, 0, b"r", 0, None, False], None])),
        "malformed CUDA IPC handle",
    ),
    "cuda ipc past its allocation": (
        forge(payload=tensor_ext(["cuda_ipc", "float32", [4], "cuda:0", False, [0, b"h", 8, 0, b"r", 0, None, False], None])),
        "16 bytes in a shared allocation of 8",
    ),
    "cuda ipc grad on ints": (
        forge(payload=tensor_ext(["cuda_ipc", "int64", [1], "cuda:0", True, [0, b"h", 8, 0, b"r", 0, None, False], None])),
        "requires_grad",
    ),
    "cuda ipc uuid not a string": (
        forge(payload=tensor_ext(["cuda_ipc", "float32", [2], "cuda:0", False, [0, b"h", 8, 0, b"r", 0, None, False], 7])),
        "malformed GPU UUID",
    ),
    "unknown extension": (forge(payload=msgpack.ExtType(99, b"")), "unknown extension type 99"),
    "unknown tensor kind": (forge(payload=tensor_ext(["weird"])), "unknown tensor kind"),
    "garbage payload": (forge([PROTOCOL_VERSION, 16, 1, "w", b"\xc1\xc1"]), "cannot decode the PYTHON_CALL payload"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_messages_raise_remote_protocol_error(case):
    frames, match = MALFORMED[case]
    with pytest.raises(RemoteProtocolError, match=match):
        CODEC.decode(frames)


def test_a_descriptor_seen_before_is_checked_once_and_its_frame_every_time(monkeypatch):
    """Dense descriptors are checked once per distinct encoding (the codec keeps the result),
    but what depends on the message, its frames, is checked at every decode."""
    from zmqautograd.transport import codec as codec_module

    parsed = []
    real_parse = codec_module.parse_dense
    monkeypatch.setattr(codec_module, "parse_dense", lambda d: (parsed.append(d), real_parse(d))[1])
    monkeypatch.setattr(codec_module, "_dense_specs", {})
    descriptor = ["dense", "float32", [2], None, 1, 8, "cpu", False]
    good = forge(payload=[tensor_ext(descriptor)], buffers=[tensor_bytes(torch.tensor([1.0, 2.0]))])
    for _ in range(3):
        assert torch.equal(CODEC.decode(good).payload[0], torch.tensor([1.0, 2.0]))
    assert len(parsed) == 1
    for frames, match in (
        (forge(payload=[tensor_ext(descriptor)], buffers=[b"x" * 4]), "has 4 bytes"),
        (forge(payload=[tensor_ext(descriptor)]), "refers to frame 1"),
        (forge(payload=[tensor_ext(descriptor)] * 2, buffers=[b"x" * 8]), "more than one"),
        (forge(payload=[tensor_ext(descriptor)], buffers=[b"x" * 8, b"y" * 8]), "no tensor descriptor refers to"),
    ):
        with pytest.raises(RemoteProtocolError, match=match):
            CODEC.decode(frames)
    assert len(parsed) == 1


def test_size_and_frame_count_limits():
    codec = Codec(max_message_bytes=1000, max_frames=3)
    big = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", torch.zeros(1000)))
    with pytest.raises(MessageTooLargeError, match="limit is 1000"):
        codec.decode(big)
    many = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", [torch.zeros(1)] * 5))
    with pytest.raises(MessageTooLargeError, match="frames"):
        codec.decode(many)


def test_fuzz_deterministic_mutations_of_every_byte():
    """Every single-byte change of a valid envelope decodes or raises a protocol error."""
    frames = valid_frames()
    rng = random.Random(1234)
    for position in range(len(frames[0])):
        mutated = bytearray(frames[0])
        mutated[position] = rng.randrange(256)
        decode_or_protocol_error([bytes(mutated), *frames[1:]])


# ------------------------------------------------------------------------------- devices


def test_pinned_pool_reuses_buffers_by_size_class_and_stays_bounded():
    from zmqautograd.transport.staging import PinnedBufferPool

    pool = PinnedBufferPool(max_cached_bytes=1 << 20, allocate=lambda n: torch.empty(n, dtype=torch.uint8))
    first = pool.acquire(100_000)
    assert first.capacity == 1 << 17 and pool.allocations == 1
    pool.release(first)
    assert pool.acquire(70_000) is first and pool.allocations == 1  # same size class: reused
    big = pool.acquire(3 << 20)
    pool.release(big)  # over the cache bound: dropped, not kept
    assert pool.cached_bytes == 0
    pool.release(first)
    assert pool.cached_bytes == first.capacity


def test_cuda_descriptor_on_a_host_without_that_device_is_a_clear_error():
    from zmqautograd.transport import DeviceMapError

    frames = forge(payload=tensor_ext(["dense", "float32", [2], None, 1, 8, "cuda:7", False]), buffers=[b"\0" * 8])
    if torch.cuda.device_count() <= 7:
        with pytest.raises(DeviceMapError, match="cuda:7"):
            CODEC.decode(frames)
    mapped = Codec(device_map={"cuda:7": "cpu"}).decode(frames).payload
    assert mapped.device.type == "cpu" and torch.equal(mapped, torch.zeros(2))
    by_function = Codec(device_map=lambda device: torch.device("cpu")).decode(frames).payload
    assert by_function.device.type == "cpu"


def test_a_cuda_ipc_handle_on_a_host_without_that_device_is_a_clear_error():
    from zmqautograd.transport import DeviceMapError

    for uuid in (None, "GPU-not-here"):
        frames = forge(payload=tensor_ext(["cuda_ipc", "float32", [2], "cpu", False, [7, b"h", 8, 0, b"r", 0, None, False], uuid]))
        if torch.cuda.device_count() <= 7:
            with pytest.raises(DeviceMapError, match="cuda:7"):
                CODEC.decode(frames)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stage_through_pinned_buffers_and_land_on_the_mapped_device():
    from zmqautograd.transport.staging import PinnedBufferPool

    pool = PinnedBufferPool()
    codec = Codec(pinned_pool=pool)
    tensors = [torch.randn(1000, 300, device="cuda"), torch.randn(64, 32, device="cuda").t(), torch.tensor(3.0, device="cuda")]
    allocations_after_first = None
    for _ in range(3):
        frames = codec.encode(Message(MessageType.PYTHON_CALL, 1, "a", tensors))
        allocations_after_first = allocations_after_first or pool.allocations
        received = [bytearray(memoryview(f)) for f in frames]
        del frames  # releases the staging buffers back to the pool
        got = codec.decode(received).payload
        for g, t in zip(got, tensors):
            assert g.device == t.device and torch.equal(g, t)
        on_cpu = Codec(device_map={"cuda:0": "cpu"}).decode(received).payload
        assert all(g.device.type == "cpu" and torch.equal(g, t.cpu()) for g, t in zip(on_cpu, tensors))
    assert pool.allocations == allocations_after_first  # later messages reuse the pinned buffers


def test_the_memory_staged_from_a_cuda_tensor_is_what_a_cpu_tensor_of_that_layout_sends():
    """Without a GPU: the staging copy takes ``_memory(data)`` where the CPU path sends the
    ``nbytes`` at ``data_ptr``; for every layout the encoder sends as it lies (dense
    permutations, views at an offset, the memory an expansion repeats) they are the same bytes,
    so the receiver's strides fit CUDA tensors as they fit CPU ones."""
    from zmqautograd.transport.tensors import _dense_span, _memory, _unexpanded, as_buffer

    base = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32)
    dense = [
        base.view(6, 20).t(),
        base.view(2, 3, 4, 5).permute(2, 0, 3, 1),
        base[20:80].view(3, 20).t(),  # at an offset in its storage
        base.view(4, 30)[1:2].t(),  # size-1 dims, whatever their strides
    ]
    expanded = [base[:5].view(5, 1).expand(5, 7), base.view(6, 20)[:, :1].expand(6, 9).t(), torch.tensor(3.0).expand(4, 4)]
    for tensor in dense + [_unexpanded(e)[0] for e in expanded]:
        assert _dense_span(tensor) is not None
        sent = bytes(memoryview(as_buffer(_memory(tensor))))  # (no numpy: the test extras have none)
        assert sent == ctypes.string_at(tensor.data_ptr(), tensor.nbytes)
        # The receiver: that memory, then the view over it.
        rebuilt = torch.frombuffer(bytearray(sent), dtype=tensor.dtype).as_strided(tensor.shape, tensor.stride())
        assert torch.equal(rebuilt, tensor)


def test_a_received_view_is_rebuilt_on_its_target_device_over_the_memory_moved_there(monkeypatch):
    """Without a GPU, the meta device stands in for the target: the receiver moves the memory
    and then rebuilds the view (``to`` of an expanded view would make it contiguous, at its
    full size)."""
    from zmqautograd.transport import tensors

    monkeypatch.setattr(tensors, "resolve_device", lambda source, device_map: torch.device("meta"))
    sent = [torch.tensor(3.0).expand(500, 200), torch.arange(12.0).view(3, 4).t()]
    frames = CODEC.encode(Message(MessageType.PYTHON_CALL, 1, "a", sent))
    got = Codec(device_map={"cpu": "cpu"}).decode([bytearray(memoryview(f)) for f in frames]).payload
    assert [(g.device.type, g.shape, g.stride()) for g in got] == [("meta", t.shape, t.stride()) for t in sent]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_ipc", [False, True])
def test_cuda_views_arrive_with_their_layout_and_expanded_ones_send_what_they_repeat(cuda_ipc):
    """As TensorPipe's do: a computation at the receiver sees the layout it would see at the
    sender (an expanded gradient that arrived compacted made cuBLAS sum in another order).
    With ``cuda_ipc``, the expanded tensor still goes staged: the memory it repeats is 4 bytes."""
    codec = Codec()
    expanded = torch.ones(1, device="cuda").expand(5000, 2000)  # the gradient of a sum
    transposed = torch.randn(64, 32, device="cuda").t()
    frames = codec.encode(Message(MessageType.PYTHON_CALL, 1, "a", [expanded]), cuda_ipc=cuda_ipc)
    assert sum(memoryview(f).nbytes for f in frames[1:]) == 4
    got = codec.decode([bytearray(memoryview(f)) for f in frames]).payload[0]
    assert got.device.type == "cuda" and got.stride() == (0, 0) and torch.equal(got, expanded)
    frames = codec.encode(Message(MessageType.PYTHON_CALL, 2, "a", [transposed]))  # staged (not to ourselves)
    got = codec.decode([bytearray(memoryview(f)) for f in frames]).payload[0]
    assert got.device.type == "cuda" and got.stride() == transposed.stride() and torch.equal(got, transposed)


def test_as_buffer_is_zero_copy_and_refuses_what_it_cannot_export():
    from zmqautograd.transport.tensors import as_buffer

    tensor = torch.arange(10, dtype=torch.int32)
    buffer = as_buffer(tensor)
    assert ctypes.addressof(buffer) == tensor.data_ptr() and memoryview(buffer).nbytes == 40
    assert as_buffer(torch.empty(0)) == b""
    with pytest.raises(ValueError):
        as_buffer(torch.ones(4, 4).t())
