"""Rendezvous through torch's own stores: every worker publishes (name, rank, address, the
public part of its credentials), waits for all, and checks that the group is consistent.

Records are signed with the group's cluster secret (cluster_secret.py: HMAC-SHA256 under a
key derived from it, bound to the rank's key), and readers take each rank's first record so
signed: one that is not (a forgery by whoever can write the store, or a worker with another
secret) is ignored with a warning, and the group starts all the same. Each record goes to
the first free slot of its rank's key (``compare_set``), so a record published before or
after ours never displaces it (overwriting keys on purpose, as deleting them, or copying a
signed record of another group with the same secret into a free slot first, can only stop
the group from starting). Only with ``insecure_store`` is there no secret: the store is then the group's
trust root, as torch's is.

The init URL names a torch TCPStore (``env://``, ``tcp://``; rank 0 hosts it) or a FileStore
(``file://``). Keys are prefixed with a round number that each
worker counts for itself, so ``init_rpc`` after ``shutdown`` in the same processes (or a
FileStore that outlived a previous run) never sees stale entries.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist

from zmqautograd.transport.security import record_is_authentic, sign_record

from .errors import RendezvousError

log = logging.getLogger(__name__)

PREFIX = "zmqautograd"
DYNAMIC_KEY = f"{PREFIX}/dynamic"  # the log of a dynamic group (membership.py)
MAX_SLOTS = 64  # records a rank's key holds at most (rendezvous.exchange)
MIXED = "RPC group mixes statically and dynamically initialized members which is not supported."

# Stores outlive init_rpc/shutdown rounds. Re-creating rank 0's TCPStore server per round races
# with peers that already reconnect for the next round to the server being torn down; the keys
# of each round are namespaced, so one store serves them all.
_stores: dict[tuple, dist.Store] = {}


@dataclass(frozen=True)
class Member:
    name: str
    rank: int
    address: str
    devices: dict = field(default_factory=dict, compare=False)  # device maps, devices, CUDA count
    credential: str = ""  # the public part of its credentials (transport/security.py)
    mechanism: str = ""  # how it authenticates: "plain" or "curve"


class Rendezvous:
    def __init__(self, init_method: str, rank: int, world_size: int | None, timeout: float):
        self.timeout = timeout
        url = init_method
        if init_method.startswith("env://"):
            rank = int(os.environ["RANK"]) if rank < 0 and "RANK" in os.environ else rank
            if world_size is None and "WORLD_SIZE" in os.environ:
                world_size = int(os.environ["WORLD_SIZE"])
        if rank < 0 or world_size is None:
            raise ValueError(f"init_rpc needs rank and world_size (got rank={rank}, world_size={world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        store_key = (url, rank, world_size, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        if store_key not in _stores:
            _stores[store_key] = _open_store(url, rank, world_size, timeout)
        self.store = _stores[store_key]
        if self.store.check([f"{DYNAMIC_KEY}/event/1"]):
            raise RuntimeError(MIXED)  # torch's words
        self.round = self.store.add(f"{PREFIX}/round/{rank}", 1)
        self.key = f"{PREFIX}/{self.round}"
        self.master_addr = _master_address(init_method)

    def exchange(self, name: str, address: str, devices: dict | None = None, credential: str = "",
                 mechanism: str = "", secret: bytes | None = None) -> list[Member]:
        """Publish ours, wait for everyone's, check names and world size. ``devices``: this
        worker's device maps, devices and CUDA device count (JSON), for every peer to see;
        ``credential``/``mechanism``: how it proves itself to them; ``secret``: the cluster
        secret, which signs our record and must have signed everyone's (a record that it did
        not sign is ignored, with a warning: the group starts all the same)."""
        me = {"name": name, "rank": self.rank, "address": address, "world_size": self.world_size,
              "devices": devices or {}, "credential": credential, "mechanism": mechanism}
        self._publish(json.dumps(me), secret)
        members = self._collect(secret)
        if members[self.rank] != me:
            other = members[self.rank]
            raise RendezvousError(f"rank {self.rank} is taken: worker {other['name']!r} ({other['address']}) "
                                  "published it first")
        sizes = {m["world_size"] for m in members}
        if len(sizes) > 1:
            raise RendezvousError(f"workers disagree on world_size: {sorted(sizes)}")
        mechanisms = {m.get("mechanism") for m in members}
        if len(mechanisms) > 1:
            raise RendezvousError(
                f"workers disagree on encryption (mechanisms {sorted(map(str, mechanisms))}): "
                "give every worker the same cluster_secret and encrypt options")
        names: dict[str, int] = {}
        for m in members:
            if m["name"] in names:
                raise RendezvousError(
                    f"worker name {m['name']!r} is not unique: ranks {names[m['name']]} and {m['rank']} both have it"
                )
            names[m["name"]] = m["rank"]
        return [Member(m["name"], m["rank"], m["address"], m.get("devices") or {}, m.get("credential", ""),
                       m.get("mechanism", "")) for m in members]

    # A rank's records go to numbered slots, each taken with compare_set: one written by
    # someone else (a forgery, a leftover) never overwrites ours, nor ours it, and readers
    # take the first one signed with the group's secret.

    def _member_key(self, rank: int) -> str:
        return f"{self.key}/member/{rank}"

    def _publish(self, record: str, secret: bytes | None) -> None:
        base = self._member_key(self.rank)
        sealed = _seal(secret, base, record)
        for slot in range(1, MAX_SLOTS + 1):
            if self.store.compare_set(f"{base}/{slot}", "", sealed) == sealed.encode():
                return
        raise RendezvousError(f"rank {self.rank}: the store holds {MAX_SLOTS} records for this rank already "
                              f"({base}): it is being flooded")

    def _collect(self, secret: bytes | None) -> list[dict]:
        """Every rank's first record signed with ``secret`` (the first well-formed one,
        without a secret), waiting for them; the others are skipped, logged once each."""
        deadline = time.monotonic() + self.timeout
        found: dict[int, dict] = {}
        slots = dict.fromkeys(range(self.world_size), 1)  # rank -> the slot it reads next
        ignored: list[str] = []
        while len(found) < self.world_size:
            due = [f"{self._member_key(rank)}/{slots[rank]}" for rank in slots if rank not in found]
            self._wait(due, "join", max(deadline - time.monotonic(), 0.0), ignored)
            for rank in [r for r in slots if r not in found]:
                while rank not in found and self.store.check([key := f"{self._member_key(rank)}/{slots[rank]}"]):
                    slots[rank] += 1
                    if slots[rank] > MAX_SLOTS:
                        raise RendezvousError(f"rank {self.rank}: the store holds {MAX_SLOTS} records for rank "
                                              f"{rank} and none of them is usable: it is being flooded")
                    try:
                        found[rank] = _open(secret, self._member_key(rank), self.store.get(key), rank)
                    except RendezvousError as exc:
                        ignored.append(key)
                        log.warning("rank %d: ignored the record at %r: %s", self.rank, key,
                                    str(exc).removesuffix("; refusing to join"))
        return [found[rank] for rank in range(self.world_size)]

    def _wait(self, keys: list[str], what: str, timeout: float | None = None, ignored: list[str] | None = None) -> None:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        try:
            self.store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
            return
        except Exception:  # torch raises several types for a timeout or a lost store
            pass
        try:
            missing = [k.split("/")[3] for k in keys if not self.store.check([k])]
        except Exception:
            raise RendezvousError(
                f"rank {self.rank}: the group did not {what} within {self.timeout:.0f} s (world_size={self.world_size}), "
                "and the rendezvous store (hosted by rank 0) is gone"
            ) from None
        if not missing and time.monotonic() < deadline:
            return
        forged = ""
        if ignored:
            forged = (f"; records ignored, not signed with this worker's cluster secret (forged, or written by "
                      f"workers with another secret): {', '.join(ignored[:8])}")
        raise RendezvousError(
            f"rank {self.rank}: the group did not {what} within {self.timeout:.0f} s (world_size={self.world_size}): "
            f"rank(s) {', '.join(missing)} did not {what}{forged}"
        ) from None


def _seal(secret: bytes | None, key: str, record: str) -> str:
    """What goes to the store: the record, signed when there is a cluster secret."""
    if secret is None:
        return record
    return json.dumps({"record": record, "hmac": sign_record(secret, key, record.encode())})


def _unseal(secret: bytes | None, key: str, value: bytes) -> Any:
    """A record read back from the store, checked against its signature (with a secret)."""
    try:
        text = value.decode()
        if secret is not None:
            sealed = json.loads(text)
            if not isinstance(sealed, dict) or not isinstance(sealed.get("record"), str) or not record_is_authentic(
                    secret, key, sealed["record"].encode(), sealed.get("hmac")):
                raise RendezvousError(
                    f"rendezvous record {key!r} is not signed with this group's cluster secret: it was forged, "
                    "or written by a worker with another secret; refusing to join")
            text = sealed["record"]
        return json.loads(text)
    except ValueError as exc:  # (UnicodeDecodeError and json's errors are ValueErrors)
        raise RendezvousError(f"rendezvous record {key!r} is malformed ({exc}); refusing to join") from None


def _open(secret: bytes | None, key: str, value: bytes, rank: int) -> dict:
    """A member's record read back: checked against its signature (with a secret), well
    formed, and of the rank its key says."""
    record = _unseal(secret, key, value)
    if not isinstance(record, dict) or record.get("rank") != rank or not isinstance(record.get("name"), str) \
            or not isinstance(record.get("address"), str):
        raise RendezvousError(f"rendezvous record {key!r} is malformed (not a member record of rank {rank}); refusing to join")
    return record


def _open_store(init_method: str, rank: int, world_size: int | None, timeout: float) -> dist.Store:
    """torch's TCPStore (env://, tcp://; hosted by rank 0) or FileStore (file://). The TCPStore
    does not wait for all workers itself: the exchange does, and names who is missing."""
    url = urlparse(init_method)
    try:
        if url.scheme in ("env", "tcp"):
            port: str | int | None
            if url.scheme == "env":
                host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
                if not host or not port:
                    raise ValueError("env:// needs MASTER_ADDR and MASTER_PORT")
            else:
                host, port = url.hostname, url.port
                if not host or not port:
                    raise ValueError(f"tcp:// init_method needs a host and a port, got {init_method!r}")
            return dist.TCPStore(
                host, int(port), world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout),
                wait_for_workers=False, multi_tenant=True,
            )
        if url.scheme == "file":
            return dist.FileStore(url.path, -1 if world_size is None else world_size)
    except (RuntimeError, ValueError) as exc:
        raise RendezvousError(f"rank {rank}: cannot reach the rendezvous store at {init_method}: {exc}") from None
    raise ValueError(f"unsupported init_method {init_method!r}: use env://, tcp://host:port or file:///path")


def _master_address(init_method: str) -> str | None:
    if init_method.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    if init_method.startswith("tcp://"):
        return urlparse(init_method).hostname
    return None


def advertise_address(master_addr: str | None, override: str | None = None) -> str:
    """The IP this worker's peers can reach it at: an explicit override, else the address of
    the interface that routes to the master (never loopback unless the master is loopback)."""
    chosen = override or os.environ.get("ZMQAUTOGRAD_ADVERTISE_ADDRESS")
    if chosen:
        return chosen
    if not master_addr:
        return "127.0.0.1"
    try:
        target = socket.getaddrinfo(master_addr, 1, proto=socket.IPPROTO_UDP)[0]
        with socket.socket(target[0], socket.SOCK_DGRAM) as probe:
            probe.connect(target[4])  # UDP connect sends nothing; it only picks the route
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
