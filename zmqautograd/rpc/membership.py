"""Dynamic membership: a group that workers join and leave while it runs (``init_rpc``
without ``world_size``, as torch's TensorPipe agent allows; here on every transport).

The group is an append-only log of events in torch's store: ``join`` (a member record, as
the static rendezvous publishes one), ``leave`` (a graceful shutdown) and ``lost`` (a member
some worker lost without a goodbye). A ``lost`` event names the incarnation it lost (the
number of its ``join``): every worker that loses a member says so, some late, and a late one
must not evict the same name and rank joined again since (a restarted worker). Each event is
written to the first free number with ``compare_set``, so a number is taken only by
publishing (the log has no gaps) and all workers see the events in one order. A worker that
joins reads the events before its own to learn who is a member, publishes its own, and
connects to those members; every member has a thread that follows the log (``watch``) and
admits each new member (its credential, its address) or lets go of one that left, before the
joiner's handshake can finish. Every event is signed with the cluster secret (bound to its
number) and names the group (an id its founder's join made), and one that is not signed, or
is another group's (replayed from a log signed with the same secret), is ignored with a
warning, so whoever writes to the store without the secret can neither join nor evict a
member of a running group; only with ``insecure_store`` (no
secret) is the store the group's trust root for as long as the group lives (cluster_secret.py).

A group is either static (``world_size`` given, rendezvous.py) or dynamic: torch refuses to
mix them, and so does this.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import urlparse

import torch.distributed as dist

from .errors import RendezvousError
from .rendezvous import DYNAMIC_KEY, MIXED, PREFIX, Member, _master_address, _open_store, _seal, _stores, _unseal

log = logging.getLogger(__name__)

KEY = DYNAMIC_KEY
_FOREVER = timedelta(days=365)  # a watcher waits for the next event (our own leave ends it)
LEAVE_WAIT = 5.0  # seconds a shutdown waits for the store to take its leave


class DynamicGroup:
    """What ``init_rpc`` without ``world_size`` joins (see the module's doc). Used as the
    agent's rendezvous: ``exchange`` joins; then ``watch`` follows the log."""

    dynamic = True

    def __init__(self, init_method: str, rank: int, timeout: float):
        if rank < 0:
            if init_method.startswith("env://"):
                if "RANK" not in os.environ:
                    raise ValueError("environment variable RANK expected: init_rpc without world_size needs a rank")
                rank = int(os.environ["RANK"])
            else:
                raise ValueError("rank parameter missing: init_rpc without world_size joins a dynamic group by rank")
        self.rank, self.timeout, self.init_method = rank, timeout, init_method
        store_key = (init_method, rank, None, os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        if store_key not in _stores:
            _stores[store_key] = _open_store(init_method, rank, None, timeout)
        self.store = _stores[store_key]
        if self.store.check([f"{PREFIX}/round/0"]):  # a static group's rendezvous
            raise RuntimeError(MIXED)  # torch's words
        self.master_addr = _master_address(init_method)
        self.event = 0  # the number of our join event
        self.joined: dict[int, int] = {}  # rank -> the number of its member's join event
        # This group's id, which its founder's join made and every event carries: an event of
        # another group (a log signed with the same secret, replayed here) is not this one's.
        self.group_id: str | None = None
        self._secret: bytes | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()

    def exchange(self, name: str, address: str, devices: dict | None = None, credential: str = "",
                 mechanism: str = "", secret: bytes | None = None) -> list[Member]:
        """Join: the members before us (read from the log) and ourselves, last. Refuses a
        name or rank a member has, or a mechanism other than the group's."""
        self._secret = secret
        me = {"op": "join", "name": name, "rank": self.rank, "address": address, "devices": devices or {},
              "credential": credential, "mechanism": mechanism}
        members: dict[int, dict] = {}
        number = 1
        while True:  # read the log up to its end, then take the next number, unless taken meanwhile
            while self.store.check([f"{KEY}/event/{number}"]):
                event = self._read(number)  # (None: forged, another secret's or group's; logged)
                if event is not None and self.group_id is None:
                    if event["op"] != "join":
                        log.warning("rank %d: event %d of the log comes before any member joined; ignored",
                                    self.rank, number)
                        event = None
                    else:
                        self.group_id = event["group"]  # the founder's join names the group
                if event is not None and not _stale(self.joined, event):
                    _apply(members, event)
                    _note(self.joined, event, number)
                number += 1
            self._check_joining(members, name, mechanism)
            group_id = self.group_id or secrets.token_hex(16)  # (none yet: we found the group)
            me["group"] = group_id
            if self._publish(number, me):
                self.group_id = group_id
                break
        self.event = self.joined[self.rank] = number
        return [_member(record) for record in members.values()] + [_member(me)]

    def _check_joining(self, members: dict[int, dict], name: str, mechanism: str) -> None:
        for record in members.values():
            if record["rank"] == self.rank:
                raise RendezvousError(f"rank {self.rank} is taken by member {record['name']!r} of the group")
            if record["name"] == name:
                raise RendezvousError(f"worker name {name!r} is not unique: member {record['rank']} of the group has it")
            if record.get("mechanism") != mechanism:
                raise RendezvousError(
                    f"workers disagree on encryption (the group's {record.get('mechanism')!r}, ours {mechanism!r}): "
                    "give every worker the same cluster_secret and encrypt options")

    def watch(self, on_join: Callable[[Member], None], on_leave: Callable[[int, str], None]) -> None:
        """Follow the log from after our join, on a thread of its own (with a store client of
        its own: a client waits for one thing at a time)."""
        self._watcher = threading.Thread(target=self._follow, args=(on_join, on_leave),
                                         name=f"rpc-members-{self.rank}", daemon=True)
        self._watcher.start()

    def leave(self) -> None:
        """Publish that we left (gracefully). The store's host may be out of reach (a
        partition; a store client then blocks for its whole timeout): waited for
        ``LEAVE_WAIT`` seconds at most, after which the others learn it when they lose us."""
        leave = {"op": "leave", "rank": self.rank, "join": self.event, "group": self.group_id}
        publishing = threading.Thread(target=self._publish_next, args=(leave,),
                                      name=f"rpc-leave-{self.rank}", daemon=True)
        publishing.start()
        publishing.join(LEAVE_WAIT)
        if publishing.is_alive():
            log.warning("rank %d: the group's store did not take our leave within %.0f s; leaving without it",
                        self.rank, LEAVE_WAIT)
        elif self._watcher is not None:
            # It ends once it reads our leave: no thread of ours is left inside a store call
            # (C++) when the process exits (seen: std::terminate at exit on the store's host).
            self._watcher.join(LEAVE_WAIT)

    def lost(self, rank: int) -> None:
        """Publish, on a thread (the store may be slow or gone), that we lost member ``rank``
        without a goodbye: the incarnation we know now, so that a late word cannot evict one
        that joined again since."""
        event = {"op": "lost", "rank": rank, "join": self.joined.get(rank, 0), "group": self.group_id}
        threading.Thread(target=self._publish_next, args=(event,), name=f"rpc-lost-{rank}", daemon=True).start()

    def _publish_next(self, event: dict) -> None:
        """Publish ``event`` at the first free number after our join; best effort: a store that
        is gone (its host left first) is logged, not raised."""
        op, rank = event["op"], event["rank"]
        try:
            number = self.event + 1
            while not self._publish(number, event):
                number += 1
        except Exception as exc:  # noqa: BLE001 - the group is going or gone
            log.info("rank %d: could not publish %s of rank %s to the store: %s", self.rank, op, rank, exc)

    def stop(self) -> None:
        self._stopping.set()

    # ------------------------------------------------------------------------ the log

    def _publish(self, number: int, event: dict) -> bool:
        """Write ``event`` as number ``number`` unless that is taken: whether it was ours."""
        key = f"{KEY}/event/{number}"
        sealed = _seal(self._secret, key, json.dumps(event))
        return self.store.compare_set(key, "", sealed) == sealed.encode()

    def _read(self, number: int, store: dist.Store | None = None) -> dict | None:
        """Published event ``number`` (None: forged or malformed, with a warning). Events
        that a worker with another secret wrote look forged too: the warning says so, and
        such a worker's own join is ignored by every member (it finds nobody it can reach)."""
        store = store or self.store
        key = f"{KEY}/event/{number}"
        try:
            event = _unseal(self._secret, key, store.get(key))
        except RendezvousError as exc:
            log.warning("rank %d: %s (forged, or written by a worker with another cluster secret); ignored",
                        self.rank, str(exc).removesuffix("; refusing to join"))
            return None
        if not _well_formed(event):
            log.warning("rank %d: malformed event %d of the group ignored: %.200r", self.rank, number, event)
            return None
        if self.group_id is not None and event["group"] != self.group_id:
            log.warning("rank %d: event %d of the log is another group's (replayed here); ignored", self.rank, number)
            return None
        return event

    def _follow(self, on_join: Callable[[Member], None], on_leave: Callable[[int, str], None]) -> None:
        try:
            store = _client(self.init_method, self.timeout)
        except Exception as exc:  # noqa: BLE001
            log.warning("rank %d: cannot follow the group's membership: %s", self.rank, exc)
            return
        number = self.event + 1
        while not self._stopping.is_set():
            try:
                store.wait([f"{KEY}/event/{number}"], _FOREVER)
                event = self._read(number, store)
            except Exception as exc:  # noqa: BLE001 - the store is gone (its host left)
                if not self._stopping.is_set():
                    log.info("rank %d: the group's store is gone (%s); membership is no longer followed",
                             self.rank, exc)
                return
            number += 1
            if event is None or (event["op"] == "join" and event["rank"] == self.rank):
                continue
            if _stale(self.joined, event):
                log.info("rank %d: event %d of the group (%s of rank %d) is about an earlier member of that "
                         "rank; ignored", self.rank, number - 1, event["op"], event["rank"])
                continue
            if event["rank"] != self.rank:
                _note(self.joined, event, number - 1)
            if event["op"] != "join" and event["rank"] == self.rank:
                if event["op"] == "leave":
                    return  # our own: we are gone
                continue  # someone lost us for a while; we are still here
            try:
                if event["op"] == "join":
                    on_join(_member(event))
                else:
                    on_leave(event["rank"], event["op"])
            except Exception:  # noqa: BLE001 - one bad event must not end the following
                log.exception("rank %d: applying event %d of the group failed", self.rank, number - 1)


def _well_formed(event: Any) -> bool:
    if not isinstance(event, dict) or event.get("op") not in ("join", "leave", "lost"):
        return False
    if type(event.get("group")) is not str:
        return False
    if type(event.get("rank")) is not int or event["rank"] < 0:
        return False
    if "join" in event and type(event["join"]) is not int:
        return False
    return event["op"] != "join" or (isinstance(event.get("name"), str) and isinstance(event.get("address"), str))


def _stale(joined: dict[int, int], event: dict) -> bool:
    """Whether ``event`` is a ``lost`` or ``leave`` of a member other than the one of its
    rank now (each names the join it is about)."""
    return event["op"] in ("lost", "leave") and "join" in event and joined.get(event["rank"]) != event["join"]


def _note(joined: dict[int, int], event: dict, number: int) -> None:
    if event["op"] == "join":
        joined[event["rank"]] = number
    else:
        joined.pop(event["rank"], None)


def _apply(members: dict[int, dict], event: dict) -> None:
    if event["op"] == "join":
        members[event["rank"]] = event
    elif event["op"] in ("leave", "lost"):
        members.pop(event["rank"], None)


def _member(record: dict) -> Member:
    return Member(record["name"], record["rank"], record["address"], record.get("devices") or {},
                  record.get("credential", ""), record.get("mechanism", ""))


def _client(init_method: str, timeout: float) -> dist.Store:
    """A store client of its own for the watcher thread."""
    url = urlparse(init_method)
    if url.scheme == "file":
        return dist.FileStore(url.path, -1)
    if url.scheme == "env":
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    else:
        host, port = str(url.hostname), int(url.port or 0)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False, multi_tenant=True)


def is_dynamic(rendezvous: Any) -> bool:
    return getattr(rendezvous, "dynamic", False)
