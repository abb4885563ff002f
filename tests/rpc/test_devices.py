"""Device maps (zmqautograd/rpc/devices.py), with torch.distributed.rpc's semantics and messages.

The map logic and its validation at init_rpc run everywhere; moving CUDA tensors needs a GPU
and skips without one.
"""

from __future__ import annotations

import pytest
import torch

import zmqautograd.rpc as rpc
from zmqautograd.transport import DeviceMapError
from zmqautograd.transport.cuda_ipc import MIN_BYTES as CUDA_IPC_MIN_BYTES
from zmqautograd.rpc.devices import DevicePlacement, to_device_map, validate_device_maps

from tests.rpc_harness import free_port, spawn_and_collect

pytestmark = pytest.mark.timeout(120)

cuda = torch.device


def test_device_maps_are_normalised_and_must_be_one_to_one():
    assert to_device_map({0: 1, "cuda:2": torch.device("cuda:3")}) == {cuda("cuda:0"): cuda("cuda:1"), cuda("cuda:2"): cuda("cuda:3")}
    with pytest.raises(ValueError, match="only supports 1-to-1 mapping"):
        to_device_map({0: 1, 2: 1})
    with pytest.raises(ValueError, match="cpu and cuda"):
        to_device_map({"meta": 0})


def test_cuda_ipc_needs_the_same_host_detection_of_lending():
    with pytest.raises(ValueError, match="cuda_ipc needs lend_min > 0"):
        rpc.ZmqRpcBackendOptions(cuda_ipc=True, lend_min=0)
    assert rpc.ZmqRpcBackendOptions(cuda_ipc=True).cuda_ipc and not rpc.ZmqRpcBackendOptions().cuda_ipc


def test_set_device_map_adds_entries_and_refuses_conflicts():
    options = rpc.ZmqRpcBackendOptions(device_maps={"w1": {0: 1}})
    options.set_device_map("w1", {1: 0})
    assert options.device_maps == {"w1": {cuda("cuda:0"): cuda("cuda:1"), cuda("cuda:1"): cuda("cuda:0")}}
    with pytest.raises(ValueError, match="1-to-1"):
        options.set_device_map("w1", {0: 2})  # cuda:0 already goes to cuda:1
    with pytest.raises(ValueError, match="1-to-1"):
        options.set_device_map("w1", {2: 1})  # cuda:1 already taken as a target


def test_validation_catches_what_torch_catches():
    names = ["w0", "w1"]
    counts = {"w0": 2, "w1": 2}
    no_devices = {"w0": [], "w1": []}

    def check(maps):
        validate_device_maps(names, counts, {"w0": {}, "w1": {}, **maps}, no_devices)

    check({"w0": {"w1": {cuda("cuda:0"): cuda("cuda:1")}}})  # fine
    with pytest.raises(ValueError, match="invalid target node names"):
        check({"w0": {"w9": {cuda("cuda:0"): cuda("cuda:1")}}})
    with pytest.raises(ValueError, match="source devices with invalid indices"):
        check({"w0": {"w1": {cuda("cuda:2"): cuda("cuda:1")}}})
    with pytest.raises(ValueError, match="target devices with invalid indices"):
        check({"w0": {"w1": {cuda("cuda:0"): cuda("cuda:5")}}})
    with pytest.raises(ValueError, match="duplicated devices"):
        validate_device_maps(names, counts, {"w0": {}, "w1": {}}, {"w0": [cuda("cuda:0")] * 2, "w1": []})
    with pytest.raises(ValueError, match="unexpected source devices"):
        validate_device_maps(names, counts, {"w0": {"w1": {cuda("cuda:1"): cuda("cuda:0")}}, "w1": {}},
                             {"w0": [cuda("cuda:0")], "w1": []})


def test_requests_follow_the_callers_map_and_responses_its_inverse():
    maps = {"w0": {"w1": {cuda("cuda:0"): cuda("cuda:1")}}, "w1": {}}
    caller, callee = DevicePlacement("w0", maps), DevicePlacement("w1", maps)
    assert caller.request("w1")(cuda("cuda:0")) == "cuda:1"
    assert callee.response("w0")(cuda("cuda:1")) == "cuda:0"
    with pytest.raises(DeviceMapError, match="only supports CPU tensors by default.*Request device mapping is not "
                       "available for destination w1"):
        caller.request("w1")(cuda("cuda:1"))  # not in the map
    with pytest.raises(DeviceMapError, match="Request device mapping is not available for destination w0"):
        callee.request("w0")(cuda("cuda:1"))  # w1 has no map to w0: its own requests carry CPU only
    with pytest.raises(DeviceMapError, match="Response device mapping is not available for destination w1"):
        caller.response("w1")(cuda("cuda:0"))


def test_the_devices_a_worker_sends_from_are_its_maps_sources_and_its_callers_targets():
    """What init_rpc prepares for CUDA IPC (transport/cuda_ipc.py, ``prepare``)."""
    maps = {"w0": {"w1": {cuda("cuda:1"): cuda("cuda:2")}}, "w1": {"w2": {cuda("cuda:0"): cuda("cuda:0")}},
            "w2": {"w1": {cuda("cuda:3"): cuda("cuda:5")}}, "w3": {"w1": {cuda("cuda:10"): cuda("cuda:11")}}}
    assert DevicePlacement("w0", maps).sending_devices() == [cuda("cuda:1")]  # requests only: nobody maps to w0
    assert DevicePlacement("w1", maps).sending_devices() == [cuda("cuda:0"), cuda("cuda:2"), cuda("cuda:5"), cuda("cuda:11")]
    assert DevicePlacement("w4", maps).sending_devices() == []  # CPU tensors only


def _join_with_map(rank, init_method, device_map, results):
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=20)
        if device_map:
            options.set_device_map("w1" if rank == 0 else "w0", device_map)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        results.put((rank, "ok"))
        rpc.shutdown()
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def test_a_map_to_devices_nobody_has_fails_init_rpc_on_every_worker():
    """Rank 0 maps cuda:<count> (one past its last device) to the peer: both workers' init_rpc
    fail with torch's message, instead of a call failing later."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    bad = {torch.cuda.device_count() if torch.cuda.is_available() else 0: 0}
    outcome = dict(spawn_and_collect(_join_with_map, [(0, init_method, bad), (1, init_method, None)]))
    assert all("ValueError" in outcome[r] and "Node w0 has source devices with invalid indices" in outcome[r]
               for r in (0, 1)), outcome


# ------------------------------------------------------------------------------ with CUDA


def _cuda_pair(rank, init_method, results):
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=30)
        if rank == 0:
            options.set_device_map("w1", {0: 0})
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        if rank == 0:
            x = torch.arange(4.0, device="cuda:0")
            y = rpc.rpc_sync("w1", torch.add, args=(x, 1))  # there on cuda:0, back on cuda:0
            results.put(("mapped", str(y.device), y.cpu().tolist()))
        else:
            try:  # w1 has no map to w0: CUDA tensors cannot go there
                rpc.rpc_sync("w0", torch.add, args=(torch.ones(2, device="cuda:0"), 1), timeout=10)
                results.put(("unmapped", "sent", ""))
            except RuntimeError as exc:
                results.put(("unmapped", type(exc).__name__, str(exc)))
        rpc.shutdown()
    except Exception as exc:  # noqa: BLE001
        results.put(("error", type(exc).__name__, str(exc)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_follow_the_map_there_and_its_inverse_back():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    got = spawn_and_collect(_cuda_pair, [(0, init_method), (1, init_method)])
    assert ("mapped", "cuda:0", [1.0, 2.0, 3.0, 4.0]) in got, got
    unmapped = [g for g in got if g[0] == "unmapped"]
    assert unmapped and "only supports CPU tensors by default" in unmapped[0][2], got


def _echo(value):
    return value


def _dense_cpu(tensor):
    return (tensor.to_dense() if tensor.is_sparse else tensor).cpu()


def _ipc_pair(rank, init_method, cuda_ipc, results):
    """Rank 0 sends CUDA tensors of every kind to rank 1 and gets them back; reports what
    came back and how many bytes went over the transport to rank 1."""
    try:
        options = rpc.ZmqRpcBackendOptions(init_method=init_method, rpc_timeout=30, cuda_ipc=cuda_ipc)
        options.set_device_map(f"w{1 - rank}", {0: 0})
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=options)
        if rank == 0:
            torch.manual_seed(0)
            big = torch.randn(1 << 20, device="cuda:0")  # 4 MiB
            sent = {
                "big": big,
                "strided": torch.randn(64, 48, device="cuda:0").t()[::2],
                "view into a big storage": big[1000:1010],
                "complex conj": torch.randn(5, dtype=torch.complex64, device="cuda:0").conj(),
                "half": torch.randn(7, device="cuda:0").half(),
                "sparse": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), device="cuda:0"),
                "empty": torch.empty(0, 3, device="cuda:0"),
            }
            endpoint = rpc.api._current().endpoint
            before = endpoint.stats()["1"]
            back = rpc.rpc_sync("w1", _echo, args=(sent,))
            after = endpoint.stats()["1"]
            # Bytes through the socket or ring, and buffers the peer read from our memory.
            moved = (after.bytes_sent - before.bytes_sent, after.buffers_lent - before.buffers_lent)
            same = {name: (str(back[name].device), bool(torch.equal(_dense_cpu(back[name]), _dense_cpu(tensor))))
                    for name, tensor in sent.items()}
            # What the callee gets is the tensor as it was when sent: written after, not before.
            x = torch.zeros(1 << 18, device="cuda:0")
            future = rpc.rpc_async("w1", _echo, args=(x,))
            x.add_(1)
            snapshot = bool(torch.equal(future.wait().cpu(), torch.zeros(1 << 18)))
            # Many at once: the callee's pool threads answer (share CUDA memory) concurrently,
            # which crashed a worker before cuda_ipc.share took a lock (a SIGSEGV in torch).
            # (Tensors of cuda_ipc's least size: smaller ones go staged.)
            futures = [rpc.rpc_async("w1", _echo, args=(torch.full((CUDA_IPC_MIN_BYTES // 4,), float(i), device="cuda:0"),))
                       for i in range(300)]
            concurrent = all(bool((f.wait() == i).all()) for i, f in enumerate(futures))
            results.put(("sent", same, moved, snapshot and concurrent))
        rpc.shutdown()
        if rank == 1:
            results.put(("served",))
    except Exception as exc:  # noqa: BLE001
        results.put(("error", type(exc).__name__, str(exc)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_ipc", [True, False])
def test_cuda_tensors_to_a_worker_on_this_host_go_by_ipc_unless_told_not_to(cuda_ipc):
    init_method = f"tcp://127.0.0.1:{free_port()}"
    got = spawn_and_collect(_ipc_pair, [(0, init_method, cuda_ipc), (1, init_method, cuda_ipc)])
    reports = [g for g in got if g[0] != "served"]
    assert len(reports) == 1 and reports[0][0] == "sent", got
    (report,) = reports
    _, same, (sent_bytes, lent), snapshot = report
    assert same == {name: ("cuda:0", True) for name in same}, same
    assert snapshot
    if cuda_ipc:  # handles only: the 4 MiB stay on the GPU
        assert sent_bytes < 64 << 10 and lent == 0, (sent_bytes, lent)
    else:  # staged: the bytes go through the transport (sent, or lent from the staging buffer)
        assert sent_bytes > 4 << 20 or lent >= 1, (sent_bytes, lent)
