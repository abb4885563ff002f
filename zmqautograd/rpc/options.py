"""Backend options, mirroring ``torch.distributed.rpc.TensorPipeRpcBackendOptions``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from zmqautograd.transport.lending import DEFAULT_LEND_CACHE, DEFAULT_LEND_MIN
from zmqautograd.transport.endpoint import EndpointOptions
from zmqautograd.transport.shm import DEFAULT_RING_BYTES as DEFAULT_SHM_RING
from zmqautograd.transport.shm import DEFAULT_SPIN

from .constants import DEFAULT_INIT_METHOD, DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT_SEC, UNSET_RPC_TIMEOUT
from .devices import to_device, to_device_map

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "UNSET_RPC_TIMEOUT", "DEFAULT_INIT_METHOD", "BackendType",
           "RpcBackendOptions", "ZmqRpcBackendOptions", "TensorPipeRpcBackendOptions"]


class BackendType(enum.Enum):
    """torch's ``rpc.BackendType``, so that ported code runs unchanged: zmqautograd has one
    backend, and ``BackendType.TENSORPIPE`` names it too."""

    ZMQ = "ZMQ"
    TENSORPIPE = "ZMQ"  # an alias of ZMQ


class RpcBackendOptions:
    """torch's ``rpc.RpcBackendOptions``: the base class of every backend's options (here
    only ``ZmqRpcBackendOptions``); ``init_rpc`` takes an instance of it."""

    rpc_timeout: float
    init_method: str


@dataclass
class ZmqRpcBackendOptions(RpcBackendOptions):
    """Options of the ZeroMQ RPC backend.

    Args:
        init_method: rendezvous URL: ``env://`` (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
            ``tcp://host:port`` or ``file:///path``.
        num_worker_threads: threads that run incoming calls (more are added while calls
            block in nested RPCs, so nested calls never deadlock).
        rpc_timeout: default timeout of a call, in seconds (0: none).
        device_maps: ``{peer: {this worker's device: peer's device}}``, where CUDA tensors
            sent to each peer land (responses follow the inverse); see ``set_device_map``.
            Without a map only CPU tensors travel, as with TensorPipe.
        devices: the CUDA devices this worker uses (checked against the device maps).
        advertise_address: the IP this worker tells its peers (default: the interface that
            routes to MASTER_ADDR; env ZMQAUTOGRAD_ADVERTISE_ADDRESS overrides).
        allow_pickle: send and accept pickled payloads (objects msgpack cannot carry). Only
            members of the group can connect at all (every connection is authenticated), so
            None (the default) sends them and accepts them from members, as torch does, unless
            ``allowed_functions`` restricts what members may run (then refused: a pickle runs
            whatever it names); False: refused both ways; True: accepted from members always
            (not with ``allowed_functions``).
        allowed_functions: None (the default, as torch): a member may call any function the
            callee can import. Else what members may name to be run or built by reference:
            entries ``"package.module"`` (all of it, submodules included) or
            ``"package.module.function"``; or a callable ``(module, qualname) -> bool``.
            Checked before anything is imported. zmqautograd's own protocol functions are
            always allowed. See the README, "Security".
        max_message_bytes: messages larger than this (all frames) are refused: a sender
            checks the limit its peer announced and fails the call with a clear error, and
            libzmq refuses any frame beyond it as it arrives (closing that connection).
        max_queued_bytes: a peer that does not read what this worker sends it is dropped
            (lost, with an error that says so) once this many bytes of big messages wait for
            it (0: no bound; also at most 65,536 messages wait for any peer).
        max_queued_calls: calls from one peer that may wait here for a pool thread; beyond
            that, its calls are refused at once, without being run or kept, and fail on its
            side with ``PeerOverloadedError`` naming this worker (0: no bound). A peer that
            floods this worker gets errors instead of this worker's memory; calls from other
            peers are served in turn meanwhile (the pool takes work round-robin by peer).
        cluster_secret: signs every record of the rendezvous: a record it did not sign (a
            forgery by whoever can write to the store) is ignored. At least 16 bytes; the
            same on every worker. Default: env ZMQAUTOGRAD_CLUSTER_SECRET, or the file env
            ZMQAUTOGRAD_CLUSTER_SECRET_FILE names, or, for a group confined to this host
            (loopback store address, file:// store), the user's cookie
            (~/.config/zmqautograd/cookie, made on first use). With none of them, init_rpc
            refuses to start (docs/security.md).
        insecure_store: start without a cluster secret where there is none (env
            ZMQAUTOGRAD_INSECURE_STORE=1): whoever can write to the store can then join the
            group and run code on its members (torch's trust in its store). Logged.
        encrypt: True (the default): every worker has a CURVE key pair of its own, made at
            init; only the public keys go to the store, and traffic between workers is
            encrypted (CurveZMQ). False: authenticated, not encrypted (ZMTP PLAIN with an
            HMAC of a per-worker token, keyed by the cluster secret, which it needs): no
            cost on big tensors that cross a network. Between workers of one host messages
            go through shared memory either way (docs/transport.md, "Security").
        heartbeat_interval / peer_timeout: peer-loss detection bounds, in seconds.
        busy_poll: opt-in, seconds. After traffic, the endpoint's I/O thread keeps polling for
            this long instead of sleeping: lower latency on machines where waking a sleeping
            thread is slow (VMs), for the price of a busy CPU while the traffic lasts.
            TensorPipe's same-host transport busy-polls all the time (docs/transport.md).
        lend_min: tensors of at least this many bytes to a worker on the same host are read
            by it straight from this process's memory, one copy instead of a socket's two
            (docs/transport.md, "Lending"); 0 turns that off.
        lend_cache: bytes. The buffers such tensors are read into are reused once the tensors
            are gone (no page faults on reuse); idle ones are kept up to this many bytes. 0:
            a new buffer for every tensor.
        cuda_ipc: opt-in. CUDA tensors to a worker on the same host (one that reads this
            worker's memory: ``lend_min`` > 0) are copied by the receiver straight out of
            this worker's GPU memory (CUDA IPC, transport/cuda_ipc.py) instead of being
            staged through pinned host memory: 64 MiB round trips 0.70-0.73x TensorPipe's
            time instead of 26-28x (docs/performance.md). Off by default until the fix of
            a crash it caused under concurrent sends has run on a GPU.
        shm_ring: messages to a worker on the same host go through a ring of this many bytes
            in shared memory instead of a socket (docs/transport.md, "Shared-memory rings");
            0 turns that off; at most 1 GiB (messages of any size stream through a ring).
        spin: seconds. With such workers, a thread that waits (for an answer, or idle for
            work) first spins on the rings for up to this long, yielding its CPU between
            looks, before it sleeps (less, down to not at all, where its waits have lasted
            longer: docs/transport.md, "Spinning waiters"); default 20 ms. The I/O thread
            spins after traffic for 2 ms, or this if shorter (``busy_poll`` if longer). 0:
            no waiting thread spins, and the I/O thread only for ``busy_poll``.
        messages_to_fail / num_fail_sends / messages_to_delay / drop_fraction / fail_fraction /
        fault_seed:
            fault injection, as torch's faulty agent options (``zmqautograd.transport.faults``; also
            from the environment variable ZMQAUTOGRAD_FAULTS).
        _transports / _channels: TensorPipe's choice of transports and channels, taken so
            that programs that pass them run unchanged; they choose nothing over ZeroMQ.
        max_retries / retry_delay / retry_backoff: how the retryable control messages
            (RREF_FORK_REQUEST, RREF_CHILD_ACCEPT, RREF_USER_DELETE,
            CLEANUP_AUTOGRAD_CONTEXT_REQ) are retried: up to ``max_retries`` more tries,
            waiting ``retry_delay`` seconds, then ``retry_backoff`` times longer each time.
    """

    init_method: str = DEFAULT_INIT_METHOD
    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC
    device_maps: dict[str, dict[Any, Any]] | None = None
    devices: list[Any] | None = None
    advertise_address: str | None = None
    allow_pickle: bool | None = None
    max_message_bytes: int = 1 << 34
    max_queued_bytes: int = 1 << 32
    max_queued_calls: int = 1 << 16
    cluster_secret: str | None = field(default=None, repr=False)
    insecure_store: bool = False
    encrypt: bool = True
    allowed_functions: Any = None
    heartbeat_interval: float = 1.0
    peer_timeout: float = 10.0
    busy_poll: float = 0.0
    lend_min: int = DEFAULT_LEND_MIN
    lend_cache: int = DEFAULT_LEND_CACHE
    cuda_ipc: bool = False
    shm_ring: int = DEFAULT_SHM_RING
    spin: float = DEFAULT_SPIN
    messages_to_fail: list[str] = field(default_factory=list)
    num_fail_sends: int = 0
    messages_to_delay: dict[str, float] = field(default_factory=dict)
    drop_fraction: float = 0.0
    fail_fraction: float = 0.0
    fault_seed: int | None = None
    max_retries: int = 5
    retry_delay: float = 0.1
    retry_backoff: float = 2.0
    _transports: list[str] | None = field(default=None, repr=False)
    _channels: list[str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # torch's options are a C++ class: a value of another type does not construct it.
        for name, kinds in (("rpc_timeout", (int, float)), ("num_worker_threads", (int,)), ("init_method", (str,))):
            value = getattr(self, name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise TypeError(f"__init__(): incompatible constructor arguments: {name} must be "
                                f"{' or '.join(k.__name__ for k in kinds)}, got {type(value).__qualname__}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {self.num_worker_threads}")
        # What the endpoint would refuse at init_rpc, after the rendezvous began (where the
        # others would then wait for this rank until their timeout), is refused now.
        self.endpoint_options(DEFAULT_RPC_TIMEOUT_SEC)
        if self.allow_pickle and self.allowed_functions is not None:
            raise ValueError("allow_pickle=True accepts pickles from members, and a pickle can run anything: it cannot "
                             "be combined with allowed_functions, which restricts what members may run")
        if self.max_queued_calls < 0:
            raise ValueError(f"max_queued_calls must be >= 0 (0: no bound), got {self.max_queued_calls}")
        if self.cuda_ipc and not self.lend_min:
            # Which workers share this host is what lending finds out (transport/lending.py).
            raise ValueError("cuda_ipc needs lend_min > 0: lending is how workers learn they share a host")
        maps, self.device_maps = self.device_maps or {}, {}
        for to, device_map in maps.items():
            self.set_device_map(to, device_map)
        self.devices = [to_device(d) for d in (self.devices or [])]

    def endpoint_options(self, connect_timeout: float) -> EndpointOptions:
        """The options of this worker's endpoint (ValueError for values it refuses)."""
        return EndpointOptions(
            heartbeat_interval=self.heartbeat_interval, peer_timeout=self.peer_timeout,
            connect_timeout=connect_timeout, busy_poll=self.busy_poll, lend_min=self.lend_min,
            lend_cache=self.lend_cache, shm_ring=self.shm_ring, spin=self.spin,
            max_queued_bytes=self.max_queued_bytes,
        )

    def fault_options(self) -> dict[str, Any]:
        return {
            "messages_to_fail": list(self.messages_to_fail), "num_fail_sends": self.num_fail_sends,
            "messages_to_delay": dict(self.messages_to_delay), "drop_fraction": self.drop_fraction,
            "fail_fraction": self.fail_fraction, "seed": self.fault_seed,
        }

    def set_device_map(self, to: str, device_map: dict[Any, Any]) -> None:
        """Map this worker's devices to worker ``to``'s devices for tensors sent to it in
        requests (responses follow the inverse). Keys and values: ints (CUDA indices), strings
        or ``torch.device``s; the map must be 1-to-1. May be called again to add entries."""
        full = to_device_map(device_map)
        if self.device_maps is None:  # (__post_init__ made it a dict)
            self.device_maps = {}
        current = self.device_maps.setdefault(to, {})
        for source, target in full.items():
            if source in current and current[source] != target:
                raise ValueError(
                    f"`set_device_map` only supports 1-to-1 mapping, trying to map {source} to {current[source]} and {target}"
                )
        merged = {**current, **full}
        to_device_map(merged)  # still 1-to-1 with the earlier entries
        self.device_maps[to] = merged

    def set_devices(self, devices: list[Any]) -> None:
        self.devices = [to_device(d) for d in devices]


# So that code ported by changing the import alone still builds its options.
TensorPipeRpcBackendOptions = ZmqRpcBackendOptions
