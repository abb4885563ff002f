"""The distributed backward pass on one worker (the seeds' dist_engine.cpp, FAST mode).

On each worker, a pass over a context has as roots the local root (on the worker that called
``backward``) and every send function recorded in the context. Every graph node runs at most
once per pass, with the sum of what all roots deliver to it; a recv function sends its
gradient to the worker it came from once everything that feeds it has run.

The work between RPC boundaries runs in PyTorch's own engine, in *groups*:

* Plan: walk the graph from the roots (stopping at leaves and recv functions) and label every
  node with the set of roots that reach it (a bit mask). Nodes with the same mask form a
  group; edges only go from a group to groups with larger masks, so groups form a DAG.
* A group runs as one ``torch.autograd.grad`` call whose outputs are the gradient edges into
  it (from its roots and from smaller groups) and whose inputs are the edges leaving it (into
  leaves, recv functions and larger groups). Leaf gradients go to the context (then the
  leaf's post hooks run, once per pass; a leaf that several groups feed gets its tensor
  hooks once too, on the sum: see ``_leaves_due``); edges into larger groups add to their
  input buffers; recv gradients are sent once all feeders ran.
* A group is ready when all its roots delivered and all groups feeding it ran. Whoever
  delivers (the caller of ``backward``, or the RPC thread that received a gradient) runs
  what became ready, so no thread ever waits for a remote answer inside the engine.

One PyTorch rule shapes the plan: in a ``torch.autograd.grad`` call, a captured node that
leads to another captured node runs. A group whose exits are chained that way (a node of a
larger group leads to another exit of the group) cannot run as one call without running that
node early, with part of its gradient; such a group runs *stepwise*: its nodes are called one
by one from Python in topological order (see ``_chained``). Stepwise nodes keep their saved
tensors until the graph is freed, and hooks registered on those nodes do not run; leaf hooks
do. Merging the group into the larger one instead would deadlock when the larger group's
other root depends on this group's recv functions (a nested call's answer, say).

Completion follows the seeds: the first gradient request of a pass on a worker is answered
when that worker's whole pass is done and the requests it sent are answered; later ones at
once. So ``backward`` returns when every worker is done, and an error anywhere comes back as
``Error on Node N: ...``. One shortcut: a worker does not wait for the answer to gradients it
sends to the pass's *originator* (the worker that called ``backward``): the originator waits
for its own work anyway, and fails its own pass if such a request fails there. Those go as
one-way messages, which saves a round trip on every path that leads back to the caller (all
of them, in a driver-orchestrated pipeline).

Forwarding. Where the originator only relays gradients (a pipeline it drives: the answer of
one stage went on to the next, so the send function of that call feeds, unchanged, the recv
function of the earlier answer), the stage that computes them sends them straight to the
stage before, saving the originator's hop and its work. The originator publishes such
*routes* (``routes_for``: its send function -> the worker and send function its recv
function leads to) and, when it has any, sends its gradient requests one-way, each under a
*ticket*, with the routes and its report sink (Agent.open_sink); a pass that such a
ticketed request starts applies the routes when a recv function of the originator's tensors
fires: it sends those gradients one-way to where the route leads, under a new ticket. When done, a ticketed pass
*reports* to the originator (one message to its sink, handled on its backward thread): its
ticket, the forwards it made (which announce their tickets), the gradients that ride on it
(as on an answer), or its error. A pass whose last step is a forward hands its report on
with it instead (*delegated*: the next report carries it), so a driven pipeline's backward
sends one message per stage and one report at the end. The originator counts a forwarded
send function and its recv function as done once announced, and finishes when every ticket
was reported; reports may come before their announcement (it finds them then), and a
ticket whose announcer has not reported keeps the pass open, so none is missed. A worker of
the context lost while reports are due fails the pass (a report delegated to it cannot come),
and the idle check covers reports that never come. Gradients the originator's engine would
convert (another layout, dtype or shape) go there as usual (``forwarded_gradients``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from typing import Any, Callable

import torch
from torch.autograd.graph import GradientEdge

from .. import timers
from ..rpc.errors import RpcError
from ..rpc.futures import Outcome
from .context import DistAutogradContext, add_gradients
from .functions import (
    _ACCUMULATE_GRAD_TYPE, RECV_NODE_TYPE, SEND_NODE_TYPE, RecvInfo, profiling, call_tensor_hooks, is_leaf_node, is_recv_node, make_suppressible, post_hooks_of, profiled, recv_info,
    run_tensor_hooks, suppressing, tensor_hooks_of,
)

log = logging.getLogger(__name__)

LOCAL_ROOT = "local"

Edge = tuple  # (node, input slot)


# A plan is built for every context's first pass on each worker (a context per training step,
# typically), so its parts are plain slotted classes: dataclasses with default factories take
# several times as long to make.


class _Group:
    __slots__ = ("index", "mask", "nodes", "captures", "capture_edges", "capture_leaves", "feeders", "feeds",
                 "recv_targets", "stepwise", "pass_through")

    def __init__(self, index: int, mask: int) -> None:
        self.index = index
        self.mask = mask
        self.nodes: list = []
        self.captures: list = []  # edges leaving the group, deduplicated
        self.capture_edges: tuple = ()  # the same, as GradientEdges (the engine's inputs)
        self.capture_leaves: tuple = ()  # for each, whether it is a leaf's AccumulateGrad
        self.feeders: set = set()  # indices of groups with edges into this one
        self.feeds: list = []  # indices of the groups it has edges into
        self.recv_targets: list = []  # recv functions among its exits
        self.stepwise = False  # its exits chain: run node by node (see the module docstring)
        # A send function alone, into leaves and recv functions only: for each of its slots,
        # the index of the capture it gives its gradient to (None: no edge); else None (see
        # _pass_through).
        self.pass_through: tuple | None = None


class _Exit:
    """A leaf or recv function, and who must deliver to it before it is complete."""

    __slots__ = ("node", "feeders", "direct_roots")

    def __init__(self, node: Any) -> None:
        self.node = node
        self.feeders: set = set()  # group indices
        self.direct_roots = 0  # mask of roots whose own edges point at it


class _Part:
    """What one root reaches, walked on its own (stopping at leaves and recv functions): its
    nodes (one group, when no other root reaches them) and that group's exit edges. It
    depends on nothing but the root's graph, which does not change once recorded, so a
    context keeps the parts of its send functions (``DistAutogradContext.part_cache``) for
    every plan it makes, and a caller builds them while its call travels (``prepare_part``)."""

    __slots__ = ("edges", "nodes", "node_set", "exits", "captures", "capture_edges", "capture_leaves",
                 "recv_targets", "pass_through", "post_hooks")

    def __init__(self, edges: list) -> None:
        self.edges = tuple(edges)
        exits: dict[Any, bool] = {}  # exit node -> whether it is a leaf
        nodes: list = []
        seen: set = set()
        successors: dict[Any, list] = {}
        stack = [node for node, _ in edges]
        while stack:
            node = stack.pop()
            if node in exits or node in seen:
                continue
            leaf = _exit_kind(node)
            if leaf is not None:
                exits[node] = leaf
                continue
            seen.add(node)
            node_edges = [(n, slot) for n, slot in node.next_functions if n is not None]
            successors[node] = node_edges
            nodes.append(node)
            for target, _ in node_edges:
                stack.append(target)
        captures: list = []
        captured: set = set()
        for node in nodes:  # edges leaving the group: all into exits (its nodes are its own)
            for edge in successors[node]:
                if edge[0] in exits and edge not in captured:
                    captured.add(edge)
                    captures.append(edge)
        self.nodes = nodes
        self.node_set = seen
        self.exits = exits
        self.captures = captures
        self.capture_edges = tuple(GradientEdge(node, slot) for node, slot in captures)
        self.capture_leaves = tuple(exits[node] for node, _ in captures)
        self.recv_targets = list(dict.fromkeys(node for node, _ in captures if not exits[node]))
        self.pass_through = _pass_through_slots(nodes, captures)
        # The dicts of its leaves' Python post hooks (functions.post_hooks_of).
        self.post_hooks = {node: hooks for node, leaf in exits.items() if leaf and (hooks := post_hooks_of(node)) is not None}


def _pass_through_slots(nodes: list, captures: list) -> tuple | None:
    """_Group.pass_through for a group of ``nodes`` whose exit edges are ``captures``."""
    if len(nodes) != 1 or type(nodes[0]) is not SEND_NODE_TYPE:
        return None
    where = {edge: index for index, edge in enumerate(captures)}
    slots = []
    for target, slot in nodes[0].next_functions:
        if target is None:
            slots.append(None)
            continue
        index = where.get((target, slot))
        if index is None or _exit_kind(target) is None:
            return None  # into another group's node
        slots.append(index)
    return tuple(slots)


class Plan:
    """Groups and exits for one set of roots. Built once per context and root set."""

    def __init__(self, roots: dict[Any, list[Edge]], general: bool = False, parts: dict | None = None):
        """``parts``: the roots' parts made before, by root key (see _Part); the parts made
        here are added to it (pass a context's ``part_cache``)."""
        self.root_keys = list(roots)
        self.root_bits = {key: 1 << i for i, key in enumerate(self.root_keys)}
        self.roots = roots
        self._forwardable: dict | None = None
        if not general and self._disjoint_groups({} if parts is None else parts):
            return
        self._link(*self._mask_groups())

    def _mask_groups(self) -> tuple[dict, set, bool]:
        """Exits and groups (nodes only), the general way: label every node with the mask of
        the roots that reach it, one group per mask (in topological order)."""
        nodes, successors, leaves = _discover(self.roots)
        masks = self._masks(nodes, successors)
        self.group_of: dict[Any, int] = {}
        self.groups: list[_Group] = []
        self.exits: dict[Any, _Exit] = {}
        by_mask: dict[int, _Group] = {}
        for node in nodes:
            if successors[node] is _EXIT:
                self.exits[node] = _Exit(node)
                continue
            mask = masks[node]
            group = by_mask.get(mask)
            if group is None:
                group = by_mask[mask] = _Group(len(self.groups), mask)
                self.groups.append(group)
            group.nodes.append(node)
            self.group_of[node] = group.index
        return successors, leaves, True

    def _disjoint_groups(self, parts: dict) -> bool:
        """The whole plan when no graph node is reached from two roots (False, having set
        nothing, when one is): each root's nodes then have that root's mask alone, so each
        root gets one group, its part (_Part), which exits only into leaves and recv
        functions (never into another group, never chained) and needs no topological order
        (it runs as one engine call). The general construction gives the same plan (a test
        compares them); this skips the masks, the order and the chain search, and reuses the
        parts made before. The usual passes are such: a worker that answered calls in a
        context has one root (its answer's send function), and the caller of backward has
        its loss's graph and the send functions of its calls, which lead to its leaves."""
        found = []
        for key in self.root_keys:
            edges = self.roots[key]
            part = parts.get(key)
            if part is None or part.edges != tuple(edges):
                part = parts[key] = _Part(edges)
            found.append(part)
        reached = sum(len(part.nodes) for part in found)
        if reached and len(set().union(*(part.node_set for part in found))) != reached:
            return False  # shared: masks differ within a root's part
        exits: dict[Any, _Exit] = {}
        leaves: set = set()
        groups: list[_Group] = []
        group_of: dict[Any, int] = {}
        post_hooks: dict = {}
        for position, part in enumerate(found):
            for node, leaf in part.exits.items():
                if node not in exits:
                    exits[node] = _Exit(node)
                    if leaf:
                        leaves.add(node)
            post_hooks.update(part.post_hooks)
            if not part.nodes:
                continue
            index = len(groups)
            group = _Group(index, 1 << position)
            group.nodes = part.nodes  # (a part's lists are never changed: plans share them)
            group.captures = part.captures
            group.capture_edges = part.capture_edges
            group.capture_leaves = part.capture_leaves
            group.recv_targets = part.recv_targets
            group.pass_through = part.pass_through
            groups.append(group)
            for node in part.nodes:
                group_of[node] = index
            for target, _ in part.captures:
                exits[target].feeders.add(index)
        self.exits = exits
        self.groups = groups
        self.group_of = group_of
        self.post_hooks = post_hooks
        self._aggregate(leaves)
        return True

    def _link(self, successors: dict, leaves: set, may_chain: bool) -> None:
        """What the engine needs beyond the groups' nodes: each group's exit edges and who
        feeds whom, the roots' direct exits, the leaves' hooks; ``may_chain``: look for
        groups whose exits chain (impossible when groups are disjoint)."""
        exits, groups, group_of = self.exits, self.groups, self.group_of
        # The dicts of the leaves' Python post hooks (functions.post_hooks_of): the engine
        # runs them once per pass, with the leaf's whole gradient of the pass.
        self.post_hooks = {node: hooks for node in leaves if (hooks := post_hooks_of(node)) is not None}
        for group in groups:
            seen = set()
            for node in group.nodes:
                for edge in successors[node]:
                    target = edge[0]
                    if target in exits:
                        exits[target].feeders.add(group.index)
                    elif group_of[target] != group.index:
                        groups[group_of[target]].feeders.add(group.index)
                    else:
                        continue
                    if edge not in seen:
                        seen.add(edge)
                        group.captures.append(edge)
        for group in groups:
            for index in group.feeders:  # (groups in index order: each ``feeds`` stays sorted)
                groups[index].feeds.append(group.index)
            group.stepwise = may_chain and len(group.captures) > 1 and _chained(group, successors)
            capture_edges, capture_leaves, recv_targets = [], [], group.recv_targets
            for node, slot in group.captures:
                capture_edges.append(GradientEdge(node, slot))
                leaf = node in leaves
                capture_leaves.append(leaf)
                if not leaf and node in exits and node not in recv_targets:
                    recv_targets.append(node)
            group.capture_edges = tuple(capture_edges)
            group.capture_leaves = tuple(capture_leaves)
            if not group.stepwise:
                group.pass_through = _pass_through_slots(group.nodes, group.captures)
        self._aggregate(leaves)

    def _aggregate(self, leaves: set) -> None:
        """From the groups and exits: the roots' direct exits and what passes count down."""
        exits, groups = self.exits, self.groups
        for key, edges in self.roots.items():
            for node, _ in edges:
                if node in exits:
                    exits[node].direct_roots |= self.root_bits[key]
        # Leaves that several groups feed: their tensor hooks must not run in each group's
        # call (see Pass._held_leaves).
        self.shared_leaves = [node for node in leaves if len(exits[node].feeders) > 1]
        # Per root: the recv functions its own edges point at (they wait for its delivery).
        recvs = [(node, e) for node, e in exits.items() if node not in leaves]
        self.direct_exits = {
            key: [node for node, e in recvs if e.direct_roots & bit] for key, bit in self.root_bits.items()
        }
        # What each pass starts counting down from (Pass.__init__ copies them).
        self.feeder_counts = [len(group.feeders) for group in groups]
        self.recv_counts = {node: len(e.feeders) + bin(e.direct_roots).count("1") for node, e in recvs}
        self.post_hook_feeders = {node: len(exits[node].feeders) for node in self.post_hooks}

    def forwardable(self) -> dict:
        """The send functions whose gradients could skip this worker (see "Forwarding" in
        the module docstring): root key -> (its group's index, the recv function it feeds,
        for each of its slots the recv function's slot it feeds or -1). Such a send function
        is a group of its own that passes its gradients through (_pass_through) into one
        recv function of CPU tensors, which nothing else feeds."""
        found = self._forwardable
        if found is not None:
            return found
        found = {}
        for key in self.root_keys:
            if key == LOCAL_ROOT:
                continue
            index = self.group_of.get(self.roots[key][0][0]) if self.roots[key] else None
            group = self.groups[index] if index is not None else None
            if group is None or group.pass_through is None:
                continue
            targets = {group.captures[i][0] for i in group.pass_through if i is not None}
            if len(targets) != 1:
                continue
            (recv,) = targets
            exit_ = self.exits[recv]
            if _exit_kind(recv) is not False or exit_.feeders != {index} or exit_.direct_roots:
                continue
            if any(device.type != "cpu" or layout is not _STRIDED for _, _, device, layout in recv.recv_info.metadata):
                continue
            found[key] = (index, recv, tuple(-1 if i is None else group.captures[i][1] for i in group.pass_through))
        self._forwardable = found
        return found

    def _masks(self, nodes: list, successors: dict) -> dict[Any, int]:
        masks = {node: 0 for node in nodes}
        for key, edges in self.roots.items():
            for node, _ in edges:
                masks[node] |= self.root_bits[key]
        for node in nodes:  # topological order
            for target, _ in successors[node]:
                masks[target] |= masks[node]
        return masks


def plan_for(ctx: DistAutogradContext, local_edges: list | None) -> Plan:
    """The plan of a pass over ``ctx`` on this worker: its roots are ``local_edges`` (the
    caller of backward's) and the context's send functions. Kept in the context for its next
    pass with the same local root while no send function is added (a plan is the same for
    the same roots)."""
    cached = ctx.plan_cache
    local = None if local_edges is None else tuple(local_edges)
    if cached is not None and cached[0] == local and ctx.sends_unchanged_since(cached[2]):
        # A worker's every pass: the plan that prepare_plan built after its answer left (or
        # a second pass from the same loss). Known current without listing the send
        # functions, which a busy context may have many of (none was added since, and none
        # is due to be).
        return cached[1]
    version = ctx.sends_version  # before listing them: one added meanwhile makes this plan stale
    roots: dict[Any, Any] = {}
    if local_edges:
        roots[LOCAL_ROOT] = local_edges
    parts = ctx.part_cache
    for message_id, node in ctx._send_functions().items():  # (by message id)
        part = parts.get(message_id)  # (walked ahead of time: its edges are the node's)
        roots[message_id] = part.edges if part is not None else [(node, slot) for slot in range(len(node.next_functions))]
    plan = Plan(roots, parts=parts)
    # (the local root, None for none; the plan; the send functions' version it was built at)
    ctx.plan_cache = (local, plan, version)
    return plan


def prepare_part(ctx: DistAutogradContext, message_id: int) -> None:
    """Walk the graph of send function ``message_id`` ahead of time (_Part), as the caller of
    an ``rpc_sync`` does while its call travels: its plan then reuses the walk when the
    caller runs backward."""
    node = ctx.recorded_send(message_id)
    if node is None or message_id in ctx.part_cache:
        return
    try:
        ctx.part_cache[message_id] = _Part([(node, slot) for slot in range(len(node.next_functions))])
    except Exception:  # noqa: BLE001 - the plan walks it again, and reports what fails
        log.debug("walking send function %d of context %d ahead of time failed", message_id, ctx.context_id, exc_info=True)


def prepare_plan(ctx: DistAutogradContext) -> None:
    """Build the plan of the next pass over ``ctx`` here ahead of time, as a worker that
    answered a recorded call does while it has nothing else to do: the gradients for that
    answer come later, and their pass then starts without building it (a plan takes tens of
    microseconds, on the critical path of every backward pass through this worker). Its
    roots are the send functions only: on the worker that calls backward, the local root
    differs, and the plan is built anew then."""
    if ctx.current_pass is not None or ctx.released:
        return
    try:
        plan_for(ctx, None)
    except Exception:  # noqa: BLE001 - the pass builds it again, and reports what fails
        log.debug("building the plan of context %d ahead of time failed", ctx.context_id, exc_info=True)


_LEAF_TYPE = _ACCUMULATE_GRAD_TYPE


def _exit_kind(node: Any) -> bool | None:
    """Where a walk of the graph stops: True at a leaf (AccumulateGrad), False at a recv
    function (its gradients leave this worker), None at any other node (walked through)."""
    kind = type(node)
    if kind is _LEAF_TYPE or (_LEAF_TYPE is None and is_leaf_node(node)):
        return True
    if kind is RECV_NODE_TYPE:
        return False
    return None


_EXIT: list = []  # the successors of an exit (leaves and recv functions end the walk); never mutated


def _discover(roots: dict[Any, list[Edge]]) -> tuple[list, dict, set]:
    """All nodes reachable from the roots in topological order (parents first), each node's
    outgoing edges (``_EXIT`` for an exit: leaves and recv functions end the walk), and the
    set of leaves (AccumulateGrad nodes) among them."""
    successors: dict[Any, list[Edge]] = {}
    indegree: dict[Any, int] = {}
    leaves: set = set()
    stack = [node for edges in roots.values() for node, _ in edges]
    for node in stack:
        indegree.setdefault(node, 0)
    while stack:
        node = stack.pop()
        if node in successors:
            continue
        leaf = _exit_kind(node)
        if leaf is not None:
            if leaf:
                leaves.add(node)
            successors[node] = _EXIT
            continue
        edges = [(n, slot) for n, slot in node.next_functions if n is not None]
        successors[node] = edges
        for target, _ in edges:
            if target not in indegree:
                indegree[target] = 0
                stack.append(target)
    for edges in successors.values():
        for target, _ in edges:
            indegree[target] += 1
    # Kahn's algorithm. A node counted once per edge (a node may use a tensor twice).
    ready = [node for node, degree in indegree.items() if degree == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for target, _ in successors[node]:
            indegree[target] -= 1
            if indegree[target] == 0:
                ready.append(target)
    return order, successors, leaves


def _chained(group: _Group, successors: dict) -> bool:
    """Whether one of the group's exit targets (a node of a larger group) leads to another."""
    targets = {target for target, _ in group.captures}
    return any(successors[t] is not _EXIT and _reaches_any(t, targets - {t}, successors) for t in targets)


def _reaches_any(start: Any, targets: set, successors: dict) -> bool:
    seen = {start}
    stack = [start]
    while stack:
        for target, _ in successors.get(stack.pop(), ()):
            if target in targets:
                return True
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return False


# ----------------------------------------------------------------------------- one pass


class Pass:
    """One backward pass over one context on this worker."""

    def __init__(
        self, context: DistAutogradContext, plan: Plan, pass_id: int, retain_graph: bool, worker_id: int,
        send_gradients: Callable[[Any, list, "Pass", bool, bool], Outcome | None], home: bool = False,
        idle_timeout: float | None = None, requester: int | None = None, home_waiting: tuple | None = None,
        ticket: tuple | None = None, forward_gradients: Callable[[tuple, list, "Pass", bool], None] | None = None,
    ):
        self.context = context
        self.plan = plan
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.worker_id = worker_id
        self.originator = pass_id >> 48  # pass ids are made like context ids
        self._send_gradients = send_gradients
        self._lock = threading.Lock()
        self._delivered = 0  # mask of roots that delivered
        self._buffers: list[dict] = [{} for _ in plan.groups]
        self._waiting_feeders = plan.feeder_counts.copy()
        self._started = [False] * len(plan.groups)
        self._exit_buffers: dict[Any, dict] = {}
        # Leaves with post hooks when the pass starts (most passes: none): how many feeding
        # groups have yet to run, and the sum of what those that ran gave (the hooks run once,
        # after the last).
        self._hook_waiting = {
            node: count for node, count in plan.post_hook_feeders.items() if plan.post_hooks[node]
        } if plan.post_hooks else {}
        self._hook_grads: dict[Any, torch.Tensor] = {}
        # CPU leaves that several groups feed and that have tensor hooks when the pass starts
        # (most passes: none): torch's engine runs those hooks once, on the leaf's whole
        # gradient, so they are held back in the groups' calls (functions.py, "leaves'
        # tensor hooks"), the groups' parts wait here, and after the last feeding group the
        # hooks run on their sum, which then goes to the context (and to the post hooks).
        self._held_leaves: dict[Any, dict] = {}
        for node in plan.shared_leaves:
            hooks = tensor_hooks_of(node)
            if hooks is not None and node.variable.device.type == "cpu":  # CUDA nodes run on device threads
                make_suppressible(hooks)
                self._held_leaves[node] = hooks
                self._hook_waiting.setdefault(node, len(plan.exits[node].feeders))
        self._suppressed = frozenset(id(hooks) for hooks in self._held_leaves.values()) if self._held_leaves else _NONE
        self._exit_waiting = plan.recv_counts.copy()
        self._remaining = len(plan.groups) + len(self._exit_waiting)
        self._outstanding = 0
        self._error: BaseException | None = None
        # The worker whose gradient request started this pass here (None on the originator):
        # it waits for our answer, which is sent once the pass is done.
        self.requester = requester
        # Gradients that go back with that answer instead of in a request of their own: a
        # recv function whose tensors the requester sent us, when it is the last thing the
        # pass does (see _fire_recv). ``done``'s result then.
        self.answer: tuple[RecvInfo, list] | None = None
        # Forwarding (see the module docstring). A pass a ticketed request started: its
        # ticket, the originator's routes it applies (as they came, and parsed), the
        # originator's report sink, the reports delegated to it, [ticket, send function,
        # worker] of each forward it made, and whether it handed its report on with one.
        # On the originator: the routes it publishes and its sink (both set by the caller),
        # the tickets due (ticket -> worker), those reported before they were announced, and
        # how many announcements and reports came (progress, for the idle check).
        self.ticket, routes, self.sink, self.delegated = ticket if ticket is not None and not home else (None,) * 4
        self.wire_routes = routes or None
        self.routes = parse_routes(routes) if routes else None
        self.reported = False
        self._forward_gradients = forward_gradients
        self.forwards: list = []
        self.published: list | None = None
        self._tickets: dict[int, int] = {}
        self._early: set = set()
        self._settled = 0
        self.done = Outcome()  # all local work and every request we sent
        self.node_runs = 0  # groups and recv functions run (tests count them)
        # The caller of backward() runs its pass's work itself (``run_at_home``): its
        # thread-local state (the profiler, grad mode) then applies, as torch's engine
        # carries the graph task's thread-local state to its worker threads.
        # On the originator: how long the pass may sit with nothing in flight and work left
        # (gradients that never come: a root whose sender's answer arrived without them, or
        # FAST mode's unused send function) before it fails instead of waiting for ever.
        self._idle_timeout = idle_timeout
        self._idle_timer: timers.TimerHandle | None = None
        self._home = threading.get_ident() if home else None
        # Work for the home thread: (function, args), None once the pass is done.
        self._home_queue: queue.SimpleQueue | None = queue.SimpleQueue() if home else None
        # How the home thread waits for that work: ``wait(ready)`` blocks until ``ready()``
        # (the transport's wait_until, receiving from the socket meanwhile, so an answer the
        # pass waits for usually reaches this very thread), ``wake()`` ends such a wait.
        # Without them it blocks on the queue.
        self._home_wait, self._home_wake = home_waiting if home_waiting is not None else (None, None)
        if home or idle_timeout is not None:
            self.done.add_done_callback(self._ended)

    def _ended(self, _: Any) -> None:
        # The idle timer's thread must not outlive the pass (the soak test counts threads);
        # then the home thread learns that the pass is over.
        if self._idle_timeout is not None:
            self._cancel_idle()
        if self._home is not None:
            self._post_home(None)

    # ------------------------------------------------------------------- delivering roots

    def deliver(self, key: Any, grads: list) -> None:
        """Root ``key`` delivers its gradients (one per root edge; None for none); then run
        what became ready on this thread."""
        plan = self.plan
        bit = plan.root_bits.get(key)
        if bit is None:
            raise RpcError(f"backward pass {self.pass_id}: unknown root {key!r} for context {self.context.context_id}")
        ready: list[int] = []
        fire: list = []
        with self._lock:
            if self._delivered & bit:
                raise RpcError(f"backward pass {self.pass_id}: root {key!r} delivered twice")
            self._delivered |= bit
            for (node, slot), grad in zip(plan.roots[key], grads):
                if grad is not None:
                    self._buffer(node, slot, grad)
            for node in plan.direct_exits[key]:
                self._exit_waiting[node] -= 1
                if self._exit_waiting[node] == 0:
                    fire.append(node)
            ready = self._ready_groups()
        if self._home is not None and threading.get_ident() != self._home:
            self.post_home(self._run_delivered, ready, fire)
            return
        self._run_delivered(ready, fire)

    def _run_delivered(self, ready: list[int], fire: list) -> None:
        for node in fire:
            self._fire_recv(node)
        self._drain(ready)

    @property
    def is_home(self) -> bool:
        """Whether this pass runs on the thread that called ``backward`` (the originator)."""
        return self._home is not None

    def post_home(self, function: Callable, *args: Any) -> None:
        """Have the home thread (the caller of ``backward``) run ``function(*args)``; for
        the answers to this pass's requests, which then complete on that thread."""
        self._post_home((function, args))

    def _post_home(self, item: tuple | None) -> None:
        self._home_queue.put(item)
        if self._home_wake is not None:
            self._home_wake()

    def run_at_home(self) -> None:
        """On the caller's thread: run the work other threads hand over, until the pass is
        done (its ``done`` future then holds the outcome)."""
        work = self._home_queue
        wait = self._home_wait

        def has_work() -> bool:
            return not work.empty()

        while True:
            if wait is not None:
                wait(has_work)
                item = work.get_nowait()
            else:
                item = work.get()
            if item is None:
                return
            function, args = item
            try:
                function(*args)
            except Exception as exc:  # noqa: BLE001 - every error ends the pass (then None comes)
                self.fail(exc)
            del item, function, args  # the gradients they hold

    @staticmethod
    def _add(buffer: dict, key: Any, grad: torch.Tensor) -> None:
        old = buffer.get(key)
        buffer[key] = grad if old is None else add_gradients(old, grad)

    def _buffer(self, node: Any, slot: int, grad: torch.Tensor) -> None:  # caller holds the lock
        """Add ``grad`` to what waits for ``node`` (a recv function, or a group's entry)."""
        if is_recv_node(node):
            self._add(self._exit_buffers.setdefault(node, {}), slot, grad)
        else:
            self._add(self._buffers[self.plan.group_of[node]], (node, slot), grad)

    def _ready_groups(self) -> list[int]:  # caller holds the lock
        ready = []
        for group in self.plan.groups:
            i = group.index
            if not self._started[i] and self._waiting_feeders[i] == 0 and group.mask & ~self._delivered == 0:
                self._started[i] = True
                ready.append(i)
        return ready

    # ------------------------------------------------------------------------ running

    def _drain(self, ready: list[int]) -> None:
        while ready and self._error is None:
            index = ready.pop()
            try:
                more, fire = self._run_group(index)
            except BaseException as exc:  # noqa: BLE001 - every error ends the pass
                self.fail(exc)
                return
            ready.extend(more)
            for node in fire:
                self._fire_recv(node)

    def _run_group(self, index: int) -> tuple[list[int], list]:
        group = self.plan.groups[index]
        with self._lock:
            buffer, self._buffers[index] = self._buffers[index], {}
        results: tuple = ()
        if buffer and group.captures:
            with suppressing(self._suppressed) if self._suppressed else _NO_SUPPRESSION:
                if group.pass_through is not None:
                    results = _pass_through(group, buffer)
                if not results:
                    if group.stepwise:
                        results = _run_stepwise(group, buffer)
                    else:
                        results = _grad(*_engine_roots(buffer), group.capture_edges, self.retain_graph)
        del buffer
        aliased = _aliased(results)
        fire = []
        held = self._held_leaves
        with self._lock:
            self.node_runs += 1
            for (target, slot), leaf, grad in zip(group.captures, group.capture_leaves, results):
                if grad is None:
                    continue
                if leaf:
                    if held and target in held:
                        continue  # its part waits for the others (_leaves_due)
                    # Outside the lock would be nicer; the context has its own lock and
                    # accumulating is cheap next to the group's backward.
                    self.context.accumulate_grad(target.variable, grad, may_steal=id(grad) not in aliased and grad._use_count() <= 1)
                else:
                    self._buffer(target, slot, grad)
            post_hooks = self._leaves_due(group, results) if self._hook_waiting else ()
            results = ()
            for target in group.recv_targets:
                self._exit_waiting[target] -= 1
                if self._exit_waiting[target] == 0:
                    fire.append(target)
            for other in group.feeds:
                self._waiting_feeders[other] -= 1
            ready = self._ready_groups()
            self._remaining -= 1
            finished = self._all_done()
        for node, hooks, grad in post_hooks:
            # An error in a hook fails the pass (the caller's _drain).
            if node in held:
                grad = run_tensor_hooks(held[node], grad)
                self.context.accumulate_grad(node.variable, grad, may_steal=grad._use_count() <= 1)
            # Post hooks as the seeds' capture hook calls them: no grad_inputs (the node has
            # no outputs), the gradient it was given as grad_outputs; what they return is
            # not used.
            for hook in tuple(hooks.values()):
                hook((), (grad,))
        if finished:
            self._finish()
        return ready, fire

    def _leaves_due(self, group: _Group, results: tuple) -> list:  # caller holds the lock
        """Count ``group`` in for its leaves with post hooks or held tensor hooks;
        (node, post hooks, gradient) of those whose last feeding group it was and that got
        a gradient this pass (a held leaf's gradient: the sum its tensor hooks are for)."""
        due = []
        waiting = self._hook_waiting
        for position, ((node, _), leaf) in enumerate(zip(group.captures, group.capture_leaves)):
            if not leaf or node not in waiting:
                continue  # most leaves: no hooks
            waiting[node] -= 1
            grad = results[position] if position < len(results) else None
            if grad is not None:
                self._add(self._hook_grads, node, grad)
            if waiting[node] == 0 and (total := self._hook_grads.pop(node, None)) is not None:
                due.append((node, self.plan.post_hooks.get(node) or {}, total))
        return due

    def _fire_recv(self, node: Any) -> None:
        """All gradients for a recv function are in: send them to the worker it came from,
        or where a route of the originator's says they would go from there."""
        info = recv_info(node)
        with self._lock:
            buffer = self._exit_buffers.pop(node, {})
            self.node_runs += 1
        grads = [buffer.get(slot) for slot in range(len(info.metadata))]
        del buffer
        try:
            if self.routes is not None and info.from_worker == self.originator and self._forward(info, grads):
                with self._lock:
                    self._remaining -= 1
                self._maybe_finish()
                return
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        with self._lock:
            # The last step of the pass sends to the worker waiting for our answer: the
            # gradients ride on that answer, one message instead of a request, its answer
            # and ours (the requester delivers them before it counts our answer in). Only
            # for tensors that came in a request: the answer follows the response device map.
            rides = (
                info.from_worker == self.requester and not info.in_response
                and self._remaining == 1 and self._outstanding == 0
            )
            awaited = not rides and (info.from_worker == self.worker_id or info.from_worker != self.originator)
            # The originator that publishes routes waits for a report instead of an answer.
            ticketed = awaited and self.published is not None and info.from_worker != self.worker_id
            awaited = awaited and not ticketed
            self._outstanding += awaited
        if rides:
            self.answer = (info, grads)
            with self._lock:
                self._remaining -= 1
            self._maybe_finish()
            return
        try:
            with profiled("torch::distributed::autograd::RecvRpcBackward"):
                future = self._send_gradients(info, grads, self, awaited, ticketed)
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        if future is not None:
            future.add_done_callback(self._request_done)
        with self._lock:
            self._remaining -= 1
        self._maybe_finish()

    def _forward(self, info: RecvInfo, grads: list) -> bool:
        """Send the gradients of a recv function whose tensors the originator sent straight
        to where its route leads, if it has one and they need no conversion there."""
        route = self.routes.get(info.message_id)
        if route is None:
            return False
        forwarded = forwarded_gradients(route, grads, info.metadata)
        if forwarded is None:
            return False
        with self._lock:
            last = self._remaining == 1 and self._outstanding == 0
        self._forward_gradients(route, forwarded, self, last)
        return True

    def reports(self) -> list:
        """This pass's report ([ticket, forwards made]) after those delegated to it."""
        return (self.delegated or []) + [[self.ticket, self.forwards]]

    # ----------------------------------------------------------- on the originator

    def announce(self, forwards: Any) -> None:
        """A report says its pass forwarded the gradients of our send functions (``[ticket,
        message id, worker]`` each): their groups and the recv functions they feed are done
        elsewhere, and each ticket's report is due."""
        if type(forwards) is not list:
            raise RpcError(f"malformed forwarding announcement {forwards!r:.80}")
        for forward in forwards:
            if (type(forward) is not list or len(forward) != 3 or not all(type(item) is int for item in forward)):
                raise RpcError(f"malformed forwarding announcement {forward!r:.80}")
            ticket, key, peer = forward
            entry = self.plan.forwardable().get(key) if self.published is not None else None
            if entry is None or not any(route[0] == key for route in self.published):
                raise RpcError(f"backward pass {self.pass_id}: gradients of send function {key} were forwarded, "
                               "which this pass did not route")
            index = entry[0]
            bit = self.plan.root_bits[key]
            with self._lock:
                if self._delivered & bit:
                    raise RpcError(f"backward pass {self.pass_id}: root {key!r} delivered twice")
                self._delivered |= bit
                self._started[index] = True
                self._remaining -= 2  # its group and the recv function it feeds
                self._expect_locked(ticket, peer)
                ready = self._ready_groups()
            self._drain(ready)
        self._maybe_finish()

    def expect(self, ticket: int, peer: int) -> None:
        """A ticketed request to ``peer`` is about to leave: its report is due."""
        with self._lock:
            self._expect_locked(ticket, peer)

    def _expect_locked(self, ticket: int, peer: int) -> None:
        if ticket in self._early:
            self._early.discard(ticket)
        else:
            self._tickets[ticket] = peer
        self._settled += 1

    def settle(self, ticket: int) -> None:
        """The report of ``ticket`` came: that worker's part is done (reports may overtake
        the announcement of their ticket, which then finds it here)."""
        with self._lock:
            if self._tickets.pop(ticket, None) is None:
                self._early.add(ticket)
            self._settled += 1
        self._maybe_finish()

    def peer_lost(self, peer: int, error: BaseException) -> None:
        """Fail if reports are due and ``peer`` took part in the context: a request may have
        been forwarded to it (announced in a report that cannot come now), or come from it."""
        with self._lock:
            waiting = bool(self._tickets) or bool(self._early)
        if waiting and (peer in self._tickets.values() or peer in self.context._known_worker_ids()):
            self.fail(RpcError(f"worker {peer}, which took part in this pass, is lost: {error}"))

    def _all_done(self) -> bool:  # caller holds the lock
        return self._remaining == 0 and self._outstanding == 0 and not self._tickets and not self._early

    def _request_done(self, future: Outcome) -> None:
        try:
            future.value()
        except BaseException as exc:  # noqa: BLE001
            self.fail(exc)
            return
        with self._lock:
            self._outstanding -= 1
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        with self._lock:
            finished = self._all_done()
        if finished:
            self._finish()
        else:
            self.watch_idle()

    def watch_idle(self) -> None:
        """Arm the idle check when nothing is in flight but work remains (originator only)."""
        if self._idle_timeout is None or self.done.done():
            return
        with self._lock:
            if self._outstanding or self._all_done() or self._idle_timer is not None:
                return
            self._idle_timer = timers.call_later(self._idle_timeout, self._idle_check, self.node_runs + self._settled)
        if self.done.done():  # finished while we armed it: its callback may have run already
            self._cancel_idle()

    def _cancel_idle(self) -> None:
        with self._lock:
            timer, self._idle_timer = self._idle_timer, None
        if timer is not None:
            timer.cancel()

    def _idle_check(self, runs_when_armed: int) -> None:
        with self._lock:
            self._idle_timer = None
            progressed = self.node_runs + self._settled != runs_when_armed or self._outstanding
            waiting = [str(k) for k, bit in self.plan.root_bits.items() if not self._delivered & bit]
            reporting = sorted(set(self._tickets.values()))
        if self.done.done():
            return
        if progressed:
            self.watch_idle()
            return
        if reporting:
            what = f"no report came for the gradients sent (or forwarded) to worker(s) {', '.join(map(str, reporting))}"
        else:
            what = f"no gradients arrived for {len(waiting)} root(s) (send functions {', '.join(waiting[:8])})"
        self.fail(RpcError(
            f"backward pass {self.pass_id} of context {self.context.context_id}: {what} within "
            f"{self._idle_timeout:.0f} s with nothing else in flight "
            "(FAST mode waits for every send function of the context)"
        ))

    def _finish(self) -> None:
        with self._lock:
            if self.done.done() or self._error is not None:
                return
            # Claim completion under the lock: two threads may see the last step at once.
            self._error = _FINISHED
        answer, self.answer = self.answer, None
        self.done.set_result(answer)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = exc
        log.debug("backward pass %d of context %d failed on node %d: %s", self.pass_id, self.context.context_id, self.worker_id, exc)
        self.done.set_exception(RpcError(f"Error on Node {self.worker_id}: {exc}"))


_FINISHED = RpcError("finished")
_NONE: frozenset = frozenset()
_NO_SUPPRESSION = contextlib.nullcontext()


def _grad(outputs: tuple, grads: tuple, inputs: tuple, retain_graph: bool) -> tuple:
    """``torch.autograd.grad(outputs, inputs, grads, retain_graph, allow_unused=True)``, with
    gradient edges on both sides, straight into PyTorch's C++ engine: the Python wrapper
    costs twice the engine's own time on a small graph (measured: 33 us against 10 us), once
    per group and pass. The engine validates the gradients' shapes itself."""
    if _run_backward is None:
        return torch.autograd.grad(outputs, inputs, grads, retain_graph=retain_graph, allow_unused=True)
    return _run_backward(outputs, grads, retain_graph, False, inputs, True, False)


def _engine_roots(entries: dict) -> tuple[tuple, tuple]:
    """The roots of a group's engine call (GradientEdges) and their gradients, from the
    group's buffered entries. An entry into a send function starts at the edge that slot of
    the function leads to instead: its backward is the identity, and PyTorch's engine would
    run it as a Python node only to hand the gradient on (a Python call under the GIL from
    the engine, ~7 us of a worker's ~22 us call, measured warm). The engine sums roots that
    share an edge, as it would have summed what the node gave them. Under the profiler the
    node runs, so that it shows as SendRpcBackward."""
    past_sends = not profiling()
    edges = []
    for node, slot in entries:
        if past_sends and type(node) is SEND_NODE_TYPE:
            target = node.next_functions[slot]
            if target[0] is not None:  # (always: the function only takes tensors that require grad)
                node, slot = target
        edges.append(GradientEdge(node, slot))
    return tuple(edges), tuple(entries.values())


_engine = getattr(torch.autograd.Variable, "_execution_engine", None)
_run_backward = getattr(_engine, "run_backward", None)  # private; torch.autograd.grad is the fallback


def _run_stepwise(group: _Group, entries: dict) -> tuple:
    """Run a group's nodes one by one (topological order), each with the sum of its inputs;
    the gradients of its captured edges, in ``group.captures`` order."""
    members = set(group.nodes)
    inputs: dict[Any, dict[int, torch.Tensor]] = {}
    for (node, slot), grad in entries.items():
        inputs.setdefault(node, {})[slot] = grad
    captured: dict[Edge, torch.Tensor] = {}
    for node in group.nodes:
        given = inputs.pop(node, None)
        if not given:
            continue
        arity = len(node._input_metadata) if hasattr(node, "_input_metadata") else max(given) + 1
        args = [given.get(slot) for slot in range(arity)]
        with torch.no_grad():
            outputs = node.apply(*args) if hasattr(node, "_forward_cls") else node(*args)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        for (target, slot), grad in zip(node.next_functions, outputs):
            if target is None or grad is None:
                continue
            if target in members:
                Pass._add(inputs.setdefault(target, {}), slot, grad)
            else:
                Pass._add(captured, (target, slot), grad)
    # The leaves' tensor hooks, as PyTorch runs them where a call captures an edge: once, on
    # what the group gave the leaf (those the pass holds back do nothing here).
    for edge, leaf in zip(group.captures, group.capture_leaves):
        if leaf and edge in captured and (hooks := tensor_hooks_of(edge[0])) is not None:
            captured[edge] = call_tensor_hooks(hooks.values(), captured[edge])
    return tuple(captured.get(edge) for edge in group.captures)


def _pass_through(group: _Group, entries: dict) -> tuple:
    """A group that is a send function alone, feeding only leaves and recv functions (a
    parameter sent to another worker; in a pipeline that the caller drives, an answer passed
    on to the next stage): its backward is the identity, so the gradients it was given go
    on as they are, without a call into PyTorch's engine (one per group and pass: ~10 us in
    situ, more than the rest of the group). Each exit gets what the engine would capture
    there: the sum over the slots that lead to it, a leaf's through its tensor hooks. ``()``
    when that could differ: a gradient the engine would convert or reject (another shape,
    dtype, device or layout than the tensor's), a CUDA gradient, a received tensor with hooks or
    ``retain_grad`` (they run where the engine captures its gradient; a gone tensor's hooks
    stay on its node, which notes them), or the profiler recording (it shows the node). The
    engine then runs the group."""
    if profiling():
        return ()
    node = group.nodes[0]
    captures = group.captures
    sums: list = [None] * len(captures)
    for (entry_node, slot), grad in entries.items():
        if entry_node is not node or grad is None:
            continue
        index = group.pass_through[slot] if slot < len(group.pass_through) else None
        if index is None:
            continue
        target, target_slot = captures[index]
        if group.capture_leaves[index]:
            variable = target.variable
            shape, dtype, device = variable.shape, variable.dtype, variable.device
        else:
            shape, dtype, device, _ = target.recv_info.metadata[target_slot]
        if not _taken_as_is(grad, shape, dtype, device):
            return ()
        old = sums[index]
        sums[index] = grad if old is None else old + grad
    for index, grad in enumerate(sums):
        if grad is None:
            continue
        target, target_slot = captures[index]
        if group.capture_leaves[index]:
            if (hooks := tensor_hooks_of(target)) is not None:
                sums[index] = call_tensor_hooks(hooks.values(), grad)
            continue
        if _hooks_could_run(target, target_slot):
            return ()
    return tuple(sums)


def _taken_as_is(grad: torch.Tensor, shape: Any, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether PyTorch's engine would take ``grad`` as it is for a tensor of that shape, dtype
    and device: nothing to convert or reject, and on the CPU (the engine orders CUDA
    gradients with their streams)."""
    return (grad.layout is _STRIDED and grad.is_cpu and grad.shape == shape and grad.dtype == dtype
            and grad.device == device)


def _hooks_could_run(recv: Any, slot: int) -> bool:
    """Whether PyTorch's engine could run hooks where it captures the gradient of ``recv``'s
    ``slot``: its received tensor has a hook or retains its grad, or it is gone and had a
    hook (which stays on the node), or that is not known."""
    received = recv.recv_info.received
    if slot >= len(received):
        return True
    tensor = received[slot]()
    if tensor is None:
        return recv.hooked
    return bool(tensor._backward_hooks) or tensor.retains_grad


def routes_for(plan: Plan, worker_id: int) -> list | None:
    """The routes that the caller of backward (``worker_id``) publishes with its gradient
    requests: one for each send function of its plan whose gradients may skip it
    (Plan.forwardable) and whose recv function's tensors have no hooks for the engine to
    run: ``[its message id, the worker the recv function's tensors came from, their message
    id there, whether they came in a response, for each slot of the send function the recv
    function's slot or -1, the recv function's width]``. None when there are none, or when
    the profiler records (it shows the nodes that forwarding skips)."""
    forwardable = plan.forwardable()
    if not forwardable or profiling():
        return None
    routes = []
    for key, (_, recv, slots) in forwardable.items():
        info = recv.recv_info
        if info.from_worker == worker_id or any(slot >= 0 and _hooks_could_run(recv, slot) for slot in slots):
            continue
        routes.append([key, info.from_worker, info.message_id, info.in_response, list(slots), len(info.metadata)])
    return routes or None


def parse_routes(routes: Any) -> dict[int, tuple]:
    """Published routes as they came from a peer (routes_for), by send function message id;
    an RpcError when malformed."""
    parsed = {}
    try:
        for key, peer, message_id, in_response, slots, width in routes:
            if not (type(key) is int and type(peer) is int and type(message_id) is int and type(in_response) is bool
                    and type(width) is int and width >= 0 and type(slots) is list
                    and all(type(slot) is int and -1 <= slot < width for slot in slots)):
                raise ValueError
            parsed[key] = (key, peer, message_id, in_response, tuple(slots), width)
    except (TypeError, ValueError):
        raise RpcError(f"malformed gradient routes: {routes!r:.120}") from None
    return parsed


def forwarded_gradients(route: tuple, grads: list, metadata: tuple) -> list | None:
    """The gradients of a recv function (``grads``, for its tensors of ``metadata``) as the
    gradients of the send function that ``route`` leads to: each slot's sum, as the pass
    through on the originator gives them (_pass_through). None when the engine there could
    have converted one (another layout, device, shape or dtype): they then go the usual way."""
    _, _, _, _, slots, width = route
    if len(slots) != len(grads):
        raise RpcError(f"gradient route for {len(slots)} tensor(s) applied to {len(grads)}")
    forwarded: list = [None] * width
    for grad, target, (shape, dtype, device, _) in zip(grads, slots, metadata):
        if grad is None or target < 0:
            continue
        if not _taken_as_is(grad, shape, dtype, device):
            return None
        old = forwarded[target]
        forwarded[target] = grad if old is None else old + grad
    return forwarded


_STRIDED = torch.strided


def _aliased(results: tuple) -> set[int]:
    """Ids of gradients that are handed to more than one input (they must be copied)."""
    counts: dict[int, int] = {}
    for grad in results:
        if grad is not None:
            counts[id(grad)] = counts.get(id(grad), 0) + 1
    return {key for key, count in counts.items() if count > 1}

