"""Distributed autograd contexts (the seeds' context.cpp and container.cpp).

A context collects, for one forward/backward of a training step, the send and recv autograd
functions recorded on this worker, the workers it talked to, and the gradients of this
worker's leaves. Contexts live in one container per RPC session. Ids are
``(worker_id << 48) + counter`` so every worker makes ids no other worker makes; autograd
message ids (which pair a send function with the recv function on the other side) are made
the same way. The low 48 bits of a context id are a counter put through a keyed permutation
(``_UnguessableIds``): unique as the counter, and unpredictable to the other members, so that
none can join or release a context it was never told of (docs/security.md).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections import deque
from typing import Any

import torch

from ..rpc.errors import RpcError
from .cleanup import CleanupBatcher

MAX_AUTO_INCREMENT = (1 << 48) - 1
MAX_TOMBSTONES = 100_000  # released context ids remembered (8 bytes or so each)
MAX_RELEASES_AHEAD = 4096  # releases of contexts not here that one worker's word keeps out
_EXPECTED_SEND_WAIT = 10.0  # seconds a pass waits for a send function still being recorded


class DistAutogradContext:
    """One context on one worker. Thread-safe."""

    def __init__(self, context_id: int):
        self._id = context_id
        self._lock = threading.Lock()
        self._known_workers: set[int] = set()
        self._sends: dict[int, Any] = {}  # autograd message id -> SendRpcBackward node
        # autograd message id -> (the worker the send's tensors went to, its token): who may
        # send the gradients of that send function (``check_gradient_sender``).
        self._send_targets: dict[int, tuple[int | None, int | None]] = {}
        # Send functions of answers that left before they were recorded (expect_send); who
        # needs the send functions waits for them (made on first use: most contexts never
        # have a waiter).
        self._expected: set[int] = set()
        self._recorded: threading.Condition | None = None
        self._recvs: dict[int, Any] = {}  # autograd message id -> RecvRpcBackward node
        # Tensors that keep those nodes alive where their Python objects do not (functions.py,
        # NODE_NEEDS_AN_OUTPUT): the context owns its send and recv functions, as in the seeds.
        self._keep_alive: list[torch.Tensor] = []
        self._grads: dict[torch.Tensor, torch.Tensor] = {}
        self.released = False
        # The backward pass in progress on this worker, and the cached plan (engine.py).
        self.current_pass: Any = None
        self.plan_cache: Any = None
        self.sends_version = 0  # counts send functions added (whether plan_for's cached plan is current)
        self.part_cache: dict = {}  # root key -> what it reaches (plan._Part)
        self.leaf_hooks: dict = {}  # leaf node -> its dict of Python post hooks (plan._post_hooks_of)

    # The seeds' accessors (used by tests and tools).

    def _context_id(self) -> int:
        return self._id

    @property
    def context_id(self) -> int:
        return self._id

    def _send_functions(self) -> dict[int, Any]:
        """By message id, in the order the ids were handed out: the order the seeds record
        them in. Recording order can differ here: an ``rpc_sync`` records its send function
        while its call travels, so the answer to a nested call back to this worker may be
        recorded first (the seed test ``test_graph_for_py_nested_call_itself`` takes the
        first one as its call's)."""
        with self._lock:
            if self._expected:
                self._wait_recorded_locked(lambda: not self._expected)
            return dict(sorted(self._sends.items()))

    def _recv_functions(self) -> dict[int, Any]:
        with self._lock:
            return dict(self._recvs)

    def _known_worker_ids(self) -> set[int]:
        with self._lock:
            return set(self._known_workers)

    def __repr__(self) -> str:
        return f"DistAutogradContext(id={self._id})"

    # Recording (forward pass).

    def add_known_worker(self, worker_id: int) -> None:
        with self._lock:
            self._known_workers.add(worker_id)

    def add_send_function(self, message_id: int, node: Any, keep_alive: torch.Tensor | None = None,
                          to: int | None = None, token: int | None = None) -> None:
        """``to``: the worker the tensors went to, the one whose gradients for them are
        taken; ``token``: what a worker that the originator routes them through must show
        (engine.py, "Forwarding")."""
        with self._lock:
            if message_id in self._sends:
                raise RpcError(f"autograd message id {message_id} already has a send function")
            self._sends[message_id] = node
            self._send_targets[message_id] = (to, token)
            if keep_alive is not None:
                self._keep_alive.append(keep_alive)
            self.sends_version += 1
            self.plan_cache = None

    def sends_unchanged_since(self, version: int) -> bool:
        """Whether no send function was added since ``sends_version`` read ``version``, and
        none is due (``expect_send``): what was built from them then is current."""
        return version == self.sends_version and not self._expected  # (reads of an int and a set: atomic)

    def recorded_send(self, message_id: int) -> Any:
        """The send function of ``message_id`` if it is recorded (None if not), never waiting."""
        return self._sends.get(message_id)  # (a dict lookup is atomic)

    def expect_send(self, message_id: int) -> None:
        """The answer with autograd message id ``message_id`` leaves before its send function
        is recorded (the RPC agent records it while the answer travels): until
        ``send_recorded(message_id)``, whoever needs the send functions waits for it."""
        with self._lock:
            self._expected.add(message_id)

    def send_recorded(self, message_id: int) -> None:
        """The send function of ``message_id`` is recorded, or will never be."""
        with self._lock:
            self._expected.discard(message_id)
            if self._recorded is not None:
                self._recorded.notify_all()

    def _wait_recorded_locked(self, ready: Any) -> None:
        # Bounded: the recording follows the send on the same thread within microseconds; a
        # thread that never records (it died) must not hang a pass, which then reports the
        # send function it does not find.
        if self._recorded is None:
            self._recorded = threading.Condition(self._lock)
        self._recorded.wait_for(ready, _EXPECTED_SEND_WAIT)

    def check_gradient_sender(self, message_id: int, sender: int | None, token: int | None) -> str | None:
        """Why ``sender`` may not deliver the gradients of send function ``message_id``
        (None: it may): only the worker its tensors went to may, or one the originator routed
        them through, which shows the send's token. ``sender`` None: from this worker."""
        if sender is None:
            return None
        target = self._send_targets.get(message_id)  # (a dict lookup is atomic)
        if target is None:  # no such send function: the pass says so, to a worker of the context
            return None if self.knows(sender) else f"gradients for autograd context {self._id}"
        to, expected = target
        if to is None or sender == to:
            return None
        if expected is not None and token == expected:
            return None
        return (f"gradients for send function {message_id} of autograd context {self._id}, whose tensors "
                f"went to worker {to}")

    def send_target(self, message_id: int) -> int | None:
        """The worker the tensors of send function ``message_id`` went to (None: unknown)."""
        target = self._send_targets.get(message_id)
        return None if target is None else target[0]

    def knows(self, worker: int) -> bool:
        """Whether ``worker`` took part in this context here (sent to or heard from), or made it."""
        return worker == self._id >> 48 or worker in self._known_workers  # (set lookups are atomic)

    def add_recv_function(self, message_id: int, node: Any, keep_alive: torch.Tensor | None = None) -> None:
        with self._lock:
            if message_id in self._recvs:
                raise RpcError(f"autograd message id {message_id} already has a recv function")
            self._recvs[message_id] = node
            if keep_alive is not None:
                self._keep_alive.append(keep_alive)

    def send_function(self, message_id: int) -> Any:
        with self._lock:
            if message_id in self._expected:
                self._wait_recorded_locked(lambda: message_id not in self._expected)
            node = self._sends.get(message_id)
        if node is None:
            raise RpcError(f"Could not find send function for autograd message id: {message_id}")
        return node

    # Gradients (backward pass).

    def accumulate_grad(self, variable: torch.Tensor, grad: torch.Tensor, may_steal: bool) -> None:
        """Add ``grad`` to ``variable``'s gradient in this context, as AccumulateGrad does for
        ``.grad``: the first gradient is kept as it is when nothing else references it
        (``may_steal``) and it obeys the variable's layout, else it is copied; later ones are
        summed out of place, so a gradient handed out by ``get_gradients`` never changes."""
        if grad.requires_grad:  # (never, without create_graph) kept out of any graph:
            grad = grad.detach()  # cheaper than torch.no_grad() around every accumulation
        with self._lock:
            old = self._grads.get(variable)
            if old is None:
                if not (may_steal and _obeys_layout(variable, grad)):
                    grad = _clone_like(variable, grad)
                self._grads[variable] = grad
            else:
                self._grads[variable] = add_gradients(old, grad)

    def set_grad(self, variable: torch.Tensor, grad: torch.Tensor) -> None:
        """Make ``grad`` ``variable``'s gradient in this context (what DDP's reducer wrote)."""
        with self._lock:
            self._grads[variable] = grad.detach() if grad.requires_grad else grad

    def gradients(self) -> dict[torch.Tensor, torch.Tensor]:
        with self._lock:
            return dict(self._grads)


def add_gradients(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Out-of-place sum of two gradients of one tensor (a dense one on the left when the
    other is sparse: sparse + dense is not defined)."""
    return new + old if old.is_sparse and not new.is_sparse else old + new


def _obeys_layout(variable: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` can be stored as is (the rules of torch's AccumulateGrad)."""
    if grad.is_sparse:
        return grad._indices().is_contiguous() and grad._values().is_contiguous()
    if grad.layout != torch.strided or variable.is_sparse:
        return True
    if variable.is_contiguous() and grad.is_contiguous() and grad.shape == variable.shape:
        # The common case, decided without walking the strides: equal on every dim of size
        # > 1; a size-1 dim of stride 0 marks a view, which is not kept (torch's rule).
        return 0 not in grad.stride()
    if _dense_non_overlapping(variable):
        return grad.stride() == variable.stride()
    return grad.is_contiguous()


def _dense_non_overlapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory exactly, in some order of its dims."""
    expected = 1
    for dim in sorted(range(t.dim()), key=lambda d: (t.stride(d), t.size(d))):
        if t.size(dim) == 1:
            continue
        if t.stride(dim) != expected:
            return False
        expected *= t.size(dim)
    return True


def _clone_like(variable: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    if grad.is_sparse:
        return grad.coalesce() if not grad.is_coalesced() else grad.clone()
    if grad.layout == torch.strided and not variable.is_sparse and _dense_non_overlapping(variable) \
            and grad.shape == variable.shape:
        return torch.empty_strided(variable.shape, variable.stride(), dtype=grad.dtype, device=grad.device).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


class _UnguessableIds:
    """A keyed permutation of 48-bit counters: a Feistel network of 6 rounds over two 24-bit
    halves, keyed BLAKE2b as its round function, with a key made at random per container.
    Its outputs are unique, as the counters are, and a member that sees some of them cannot
    tell the others (ids of contexts it was never told of). ~3 us an id: one per context."""

    ROUNDS = 6

    def __init__(self) -> None:
        key = os.urandom(32)
        self._rounds = [hashlib.blake2b(key=key, digest_size=3, person=bytes([r])) for r in range(self.ROUNDS)]

    def __call__(self, counter: int) -> int:
        left, right = counter >> 24, counter & 0xFFFFFF
        from_bytes = int.from_bytes
        for round_function in self._rounds:
            digest = round_function.copy()
            digest.update(right.to_bytes(3, "big"))
            left, right = right, left ^ from_bytes(digest.digest(), "big")
        return (left << 24) | right


class _ThreadContext(threading.local):
    # A class default rather than getattr(local, name, None): a miss raises and catches an
    # AttributeError inside getattr, on every RPC made outside a context.
    context: "DistAutogradContext | None" = None


class ContextContainer:
    """Every context of this worker, and the context current on each thread."""

    def __init__(self, worker_id: int):
        if not 0 <= worker_id < (1 << 16):
            raise ValueError(f"worker id must fit in 16 bits, got {worker_id}")
        self.worker_id = worker_id
        self._base = worker_id << 48
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._release_waiters = 0  # threads in wait_released
        self._contexts: dict[int, DistAutogradContext] = {}
        # Recently released ids: a message of a released context that arrives late (a
        # remote()'s acknowledgement after its to_here(), a call overtaken by the cleanup)
        # must not bring the context back, where nothing would release it again.
        self._tombstones: set[int] = set()
        self._tombstone_order: deque = deque()
        # Releases of contexts not here (yet): each keeps out only the messages of the
        # workers that sent it (of everyone, where its creator did), so that no other member
        # can keep a context from being made here; bounded per releaser, apart from the
        # tombstones above, which one member's releases of made-up ids must not flush.
        self._foreign: dict[int, set[int]] = {}  # context id -> its releasers
        self._foreign_by: dict[int, deque] = {}  # releaser -> the ids it released, oldest first
        self._unguessable = _UnguessableIds()
        self._context_counter = itertools.count(0)
        self._message_counter = itertools.count(0)
        self._local = _ThreadContext()
        self.cleanups = CleanupBatcher()  # releases bound for other workers (cleanup.py)

    def _next_id(self, counter: itertools.count, what: str) -> int:
        value = next(counter)
        if value > MAX_AUTO_INCREMENT:
            raise RpcError(f"ran out of {what} ids on worker {self.worker_id}")
        return self._base + value

    def start_ids(self, incarnation: int) -> None:
        """Ids from ``incarnation << 32`` on (within the 48 bits): a worker that joins a
        dynamic group under the rank of an earlier one makes none of that one's ids, which
        may live on (released ones as tombstones) on other workers."""
        start = (incarnation << 32) & MAX_AUTO_INCREMENT
        self._context_counter = itertools.count(start)
        self._message_counter = itertools.count(start)

    def max_id(self) -> int:
        return self._base + MAX_AUTO_INCREMENT

    def new_message_id(self) -> int:
        return self._next_id(self._message_counter, "autograd message")

    # The current context of this thread.

    def current(self) -> DistAutogradContext | None:
        return self._local.context

    def set_current(self, context: DistAutogradContext | None) -> DistAutogradContext | None:
        previous = self._local.context
        self._local.context = context
        return previous

    # Creating, finding and releasing.

    def new_context(self) -> DistAutogradContext:
        current = self.current()
        if current is not None:
            raise RpcError(f"Already have an autograd context id for this thread: {current.context_id}")
        context = DistAutogradContext(self._base + self._unguessable(
            self._next_id(self._context_counter, "autograd context") - self._base))
        with self._lock:
            self._contexts[context.context_id] = context
        self._local.context = context
        return context

    def get_or_create(self, context_id: int, from_worker: int) -> DistAutogradContext | None:
        """The context, joined on a message of ``from_worker`` (made on first contact, with
        ``from_worker`` known to it at once: a release from it may race with the message);
        None if it was released here already, or released before it came by its creator or
        by that worker."""
        with self._lock:
            context = self._contexts.get(context_id)
            if context is None:
                if context_id in self._tombstones:
                    return None
                releasers = self._foreign.get(context_id)
                if releasers is not None and (from_worker in releasers or context_id >> 48 in releasers):
                    return None
                context = self._contexts[context_id] = DistAutogradContext(context_id)
            context.add_known_worker(from_worker)
            return context

    def get(self, context_id: int) -> DistAutogradContext | None:
        with self._lock:
            return self._contexts.get(context_id)

    def retrieve(self, context_id: int) -> DistAutogradContext:
        with self._lock:
            context = self._contexts.get(context_id)
        if context is None:
            raise RpcError(f"Could not find autograd context with id: {context_id}")
        return context

    def is_valid(self, context_id: int) -> bool:
        with self._lock:
            return context_id in self._contexts

    def remove(self, context_id: int, releaser: int | None = None) -> DistAutogradContext | None:
        """Forget a context here (None if it is not here); clears it as current on this thread.
        ``releaser``: the worker whose release this is, of a context that may not be here yet
        (None: this worker's own)."""
        with self._lock:
            context = self._contexts.pop(context_id, None)
            if context is not None or releaser is None:
                if context_id not in self._tombstones:  # released for good: keeps out everyone
                    self._tombstones.add(context_id)
                    self._tombstone_order.append(context_id)
                    if len(self._tombstone_order) > MAX_TOMBSTONES:
                        self._tombstones.discard(self._tombstone_order.popleft())
            else:
                self._keep_out_locked(context_id, releaser)
            if self._release_waiters:  # (a notify costs ~1 us; only tests and shutdown wait)
                self._released.notify_all()
        if context is not None:
            context.released = True
        current = self.current()
        if current is not None and current.context_id == context_id:
            self._local.context = None
        return context

    def _keep_out_locked(self, context_id: int, releaser: int) -> None:
        releasers = self._foreign.setdefault(context_id, set())
        if releaser in releasers:
            return
        releasers.add(releaser)
        order = self._foreign_by.setdefault(releaser, deque())
        order.append(context_id)
        if len(order) > MAX_RELEASES_AHEAD:
            oldest = order.popleft()
            others = self._foreign.get(oldest)
            if others is not None:
                others.discard(releaser)
                if not others:
                    del self._foreign[oldest]

    def release_from(self, context_ids: list, from_worker: int) -> tuple[list[DistAutogradContext], list[int]]:
        """``from_worker`` released these contexts: remove those it takes part in (or made)
        and those that are not here (kept out while it is the one who sends them); the
        contexts removed, and the ids of those it may not release (it never took part in
        them here: refused)."""
        removed, refused = [], []
        contexts = self._contexts
        for context_id in context_ids:
            if type(context_id) is not int:
                raise RpcError(f"malformed autograd context id {context_id!r:.40}")
            context = contexts.get(context_id)  # (a dict lookup is atomic: remove() decides under the lock)
            if context is not None and not context.knows(from_worker):
                refused.append(context_id)
                continue
            context = self.remove(context_id, from_worker)
            if context is not None:
                removed.append(context)
        return removed, refused

    def release_created_by(self, worker_id: int, error: BaseException) -> int:
        """Release every context that ``worker_id`` created (it is gone: nobody else would);
        a backward pass still running in one fails with ``error``. Returns how many."""
        with self._lock:
            orphans = [cid for cid in self._contexts if cid >> 48 == worker_id]
        return self._release_all(orphans, error)

    def release_unreachable(self, is_lost: Any, error: BaseException) -> int:
        """Release every context created elsewhere whose other workers are all lost
        (``is_lost(worker_id)``). A release reaches this worker only from a worker the
        context knows (cleanup.py: each passes it on to the workers it sent to or heard
        from), so nobody could release these any more. A backward pass still running in one
        fails with ``error``. Returns how many."""
        with self._lock:
            contexts = [(cid, context) for cid, context in self._contexts.items() if cid >> 48 != self.worker_id]
        stranded = []
        for context_id, context in contexts:
            others = context._known_worker_ids() - {self.worker_id}
            if others and all(is_lost(worker) for worker in others):
                stranded.append(context_id)
        return self._release_all(stranded, error)

    def _release_all(self, context_ids: list, error: BaseException) -> int:
        released = 0
        for context_id in context_ids:
            context = self.remove(context_id)
            if context is not None:
                released += 1
                running = context.current_pass
                if running is not None:
                    running.fail(error)
        return released

    def peer_lost(self, worker_id: int, error: BaseException, name: str | None = None) -> None:
        """``worker_id`` (named ``name``) is lost: passes here that wait for reports fail if
        it took part in their context (engine.Pass.peer_lost, "Forwarding")."""
        with self._lock:
            contexts = list(self._contexts.values())
        for context in contexts:
            running = context.current_pass
            if running is not None:
                running.peer_lost(worker_id, error, name)

    def wait_released(self, context_ids: set[int] | None, timeout: float) -> bool:
        """Wait until none of ``context_ids`` (None: no context at all) is here any more;
        False if some still is after ``timeout`` seconds."""
        def gone() -> bool:
            if context_ids is None:
                return not self._contexts
            return not any(c in self._contexts for c in context_ids)

        with self._lock:
            self._release_waiters += 1
            try:
                return self._released.wait_for(gone, timeout)
            finally:
                self._release_waiters -= 1

    def count(self) -> int:
        with self._lock:
            return len(self._contexts)

    def active_passes(self) -> int:
        with self._lock:
            contexts = list(self._contexts.values())
        return sum(1 for c in contexts if c.current_pass is not None)
