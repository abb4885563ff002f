"""transport/cuda_ipc.py without a GPU: what the sender puts in a descriptor, with a stand-in
for the CUDA tensor, and the lock around torch's sharing (the CUDA runs are in
test_devices.py and need a GPU)."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch

from zmqautograd.transport import cuda_ipc
from zmqautograd.transport.tensors import parse_cuda_ipc

SHARED = (0, b"handle", 4096, 512, b"/torch_counters", 3, b"event", 1)


class _FakeStorage:
    def __init__(self, owner):
        self.owner = owner

    def _share_cuda_(self):
        # torch's bookkeeping must not be touched by two threads at once, nor while a
        # shared snapshot is freed: record whether the lock was held here.
        self.owner.log.append(("share", cuda_ipc._share_lock.locked()))
        return SHARED


class _FakeCudaTensor:
    """Stands in for a CUDA tensor: clone() makes the snapshot that gets shared, whose
    storage is a ``storage`` (a _FakeStorage class)."""

    def __init__(self, log, shape=(4, 8), requires_grad=True, storage=_FakeStorage):
        self.log, self.shape, self.requires_grad, self.storage = log, torch.Size(shape), requires_grad, storage
        self.snapshots = []

    def detach(self):
        return self

    def clone(self, memory_format=None):
        return self._made(self.shape)

    def new_empty(self, shape):
        return self._made(shape)

    def _made(self, shape):
        """A new fake CUDA tensor whose freeing is logged, with whether the lock was held."""
        made = _FakeCudaTensor(self.log, shape, False, self.storage)
        self.snapshots.append(weakref.ref(made, lambda _: self.log.append(("freed", cuda_ipc._share_lock.locked()))))
        return made

    def untyped_storage(self):
        return self.storage(self)


@pytest.fixture(autouse=True)
def _gpu_uuids(monkeypatch):
    """No GPU here: the sender's GPU is named by a made-up UUID; torch's limbo has its anchor
    already (the test of the anchor takes it away)."""
    monkeypatch.setattr(cuda_ipc, "_device_uuid", lambda index: f"GPU-{index}")
    monkeypatch.setattr(cuda_ipc, "_limbo_anchor", (b"/torch_anchor", 0))


def test_the_first_share_leaves_a_block_in_torchs_limbo_for_the_process_life(monkeypatch):
    """torch's CudaIPCCollect, run by any thread's allocation, drops the file of counters that
    a share on another thread is using, but only while its limbo is empty: the first share
    puts a block there that no receiver opens (its counter stays 1), under the lock, and
    gives its counter back at exit."""
    monkeypatch.setattr(cuda_ipc, "_limbo_anchor", None)
    at_exit, released = [], []
    monkeypatch.setattr(cuda_ipc.atexit, "register", at_exit.append)
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda handle, offset: released.append((handle, offset)), raising=False)
    log = []
    for _ in range(2):
        assert cuda_ipc.share(_FakeCudaTensor(log), "float32", "cuda:0")[0] == "cuda_ipc"
    # The anchor's share and free, then each snapshot's: all under the lock, the anchor once.
    assert log == [("share", True), ("freed", True)] * 3
    assert cuda_ipc._limbo_anchor == (b"/torch_counters", 3) and at_exit == [cuda_ipc._release_limbo_anchor]
    at_exit[0]()
    assert released == [(b"/torch_counters", 3)] and cuda_ipc._limbo_anchor is None


def test_a_shared_snapshot_makes_a_descriptor_the_receiver_accepts_and_is_freed_under_the_lock():
    log = []
    tensor = _FakeCudaTensor(log)
    descriptor = cuda_ipc.share(tensor, "float32", "cuda:0")
    assert descriptor == ["cuda_ipc", "float32", [4, 8], "cuda:0", True,
                          [0, b"handle", 4096, 512, b"/torch_counters", 3, b"event", True], "GPU-0"]
    # Shared and freed (the sender keeps nothing), both while holding the lock.
    assert log == [("share", True), ("freed", True)]
    assert not cuda_ipc._share_lock.locked()
    parsed = parse_cuda_ipc(descriptor)
    assert parsed == (torch.float32, [4, 8], "cuda:0", True, descriptor[5], "GPU-0")


def test_the_receiver_opens_a_handle_on_its_own_index_of_the_senders_gpu(monkeypatch):
    """Processes with different CUDA_VISIBLE_DEVICES number one GPU differently."""
    from zmqautograd.transport import DeviceMapError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_ipc, "_device_uuid", lambda index: ["GPU-b", "GPU-a"][index])  # ours, reversed
    monkeypatch.setattr(cuda_ipc, "_local_indices", None)
    assert cuda_ipc._local_index("GPU-a", 0) == 1 and cuda_ipc._local_index("GPU-b", 1) == 0
    assert cuda_ipc._local_index(None, 1) == 1  # a sender that could not tell: its index
    with pytest.raises(DeviceMapError, match="does not see"):
        cuda_ipc._local_index("GPU-c", 0)
    with pytest.raises(DeviceMapError, match="does not have"):
        cuda_ipc._local_index(None, 2)


def test_memory_torch_cannot_share_is_staged_instead():
    class Unshareable(_FakeStorage):
        def _share_cuda_(self):
            raise RuntimeError("not from the caching allocator")

    tensor = _FakeCudaTensor([], storage=Unshareable)
    assert cuda_ipc.share(tensor, "float32", "cuda:0") is None
    assert not cuda_ipc._share_lock.locked()


def test_threads_share_one_at_a_time():
    inside, most = [0], [0]
    guard = threading.Lock()

    class Slow(_FakeStorage):
        def _share_cuda_(self):
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            threading.Event().wait(0.002)  # long enough for the other threads to arrive
            with guard:
                inside[0] -= 1
            return SHARED

    def share_many():
        for _ in range(20):
            tensor = _FakeCudaTensor([], storage=Slow)
            assert cuda_ipc.share(tensor, "float32", "cuda:0")[0] == "cuda_ipc"

    threads = [threading.Thread(target=share_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)
    assert most[0] == 1
