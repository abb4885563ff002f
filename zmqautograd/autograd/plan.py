"""The plan of a pass on one worker (engine.py runs it).

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
other root depends on this group's recv functions (a nested call's answer, say)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

from .context import DistAutogradContext
from .functions import (
    _ACCUMULATE_GRAD_TYPE,
    RECV_NODE_TYPE,
    SEND_NODE_TYPE,
    is_leaf_node,
    post_hooks_of,
)

log = logging.getLogger(__name__)

LOCAL_ROOT = "local"
_EXIT: list = []  # the successors of an exit (leaves and recv functions end the walk); never mutated

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

    @classmethod
    def of_part(cls, index: int, mask: int, part: "_Part") -> "_Group":
        """The group of a part, for a plan whose roots share no node (Plan._disjoint_groups):
        fed by no other group, feeding none, never stepwise. Its lists are the part's, which
        are never changed (plans share them)."""
        group = cls.__new__(cls)
        group.index, group.mask, group.nodes = index, mask, part.nodes
        group.captures, group.capture_edges, group.capture_leaves = part.captures, part.capture_edges, part.capture_leaves
        group.feeders, group.feeds, group.recv_targets = set(), [], part.recv_targets
        group.stepwise, group.pass_through = False, part.pass_through
        return group

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
    every plan it makes, and a caller builds them while its call travels (``prepare_part``).
    ``leaf_hooks``: the leaves' post-hook dicts found before (``_post_hooks_of``)."""

    __slots__ = ("edges", "nodes", "node_set", "exits", "captures", "capture_edges", "capture_leaves",
                 "recv_targets", "pass_through", "post_hooks")

    def __init__(self, edges: list, leaf_hooks: dict | None = None) -> None:
        self.edges = tuple(edges)
        exits: dict[Any, bool] = {}  # exit node -> whether it is a leaf
        nodes: list = []
        seen: set = set()
        captures: list = []  # edges leaving the group: all into exits (its nodes are its own)
        captured: set = set()
        stack: list = []
        # The roots' own edges into exits are not captures (no node of the part leads there).
        for node, _ in edges:
            if node not in exits:
                leaf = _exit_kind(node)
                if leaf is None:
                    stack.append(node)
                else:
                    exits[node] = leaf
        # A node's edges are looked at when it is taken off the stack: exits are told apart
        # there (a type test, inlined: this walk runs for every pass) and never stacked.
        leaf_type, recv_type = _LEAF_TYPE, RECV_NODE_TYPE
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            nodes.append(node)
            for edge in node.next_functions:
                target = edge[0]
                if target is None:
                    continue
                kind = type(target)
                if kind is leaf_type or kind is recv_type or (leaf_type is None and is_leaf_node(target)):
                    exits[target] = kind is not recv_type
                    if edge not in captured:
                        captured.add(edge)
                        captures.append(edge)
                elif target not in seen:
                    stack.append(target)
        self.nodes = nodes
        self.node_set = seen
        self.exits = exits
        self.captures = captures
        new_edge = tuple.__new__  # GradientEdge(node, slot), without its Python __new__
        self.capture_edges = tuple([new_edge(GradientEdge, (node, slot, None)) for node, slot in captures])
        self.capture_leaves = tuple([exits[node] for node, _ in captures])
        self.recv_targets = list(dict.fromkeys([node for node, _ in captures if not exits[node]]))
        self.pass_through = _pass_through_slots(nodes, captures) if len(nodes) == 1 else None
        # The dicts of its leaves' Python post hooks (functions.post_hooks_of).
        self.post_hooks = {node: hooks for node, leaf in exits.items()
                           if leaf and (hooks := _post_hooks_of(node, leaf_hooks)) is not None}

def _pass_through_slots(nodes: list, captures: list) -> tuple | None:
    """_Group.pass_through for a group of ``nodes`` whose exit edges are ``captures``."""
    if len(nodes) != 1 or type(nodes[0]) is not SEND_NODE_TYPE:
        return None
    where = {edge: index for index, edge in enumerate(captures)}
    slots: list[int | None] = []
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

    def __init__(self, roots: dict[Any, list[Edge]], general: bool = False, parts: dict | None = None,
                 leaf_hooks: dict | None = None):
        """``parts``: the roots' parts made before, by root key (see _Part); the parts made
        here are added to it (pass a context's ``part_cache``); ``leaf_hooks``: the leaves'
        post-hook dicts found before, to which those found here are added (a context's)."""
        self.root_keys = list(roots)
        self.root_bits = {key: 1 << i for i, key in enumerate(self.root_keys)}
        self.roots = roots
        self._forwardable: dict | None = None
        if not general and self._disjoint_groups({} if parts is None else parts, leaf_hooks):
            return
        self._link(*self._mask_groups(), leaf_hooks)

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

    def _disjoint_groups(self, parts: dict, leaf_hooks: dict | None = None) -> bool:
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
                part = parts[key] = _Part(edges, leaf_hooks)
            found.append(part)
        if len(found) > 1:
            reached = sum([len(part.nodes) for part in found])
            if reached and len(set().union(*[part.node_set for part in found])) != reached:
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
            if part.post_hooks:
                post_hooks.update(part.post_hooks)
            if not part.nodes:
                continue
            index = len(groups)
            group = _Group.of_part(index, 1 << position, part)
            groups.append(group)
            group_of.update(dict.fromkeys(part.nodes, index))
            for target, _ in part.captures:
                exits[target].feeders.add(index)
        self.exits = exits
        self.groups = groups
        self.group_of = group_of
        self.post_hooks = post_hooks
        self._aggregate(leaves)
        return True

    def _link(self, successors: dict, leaves: set, may_chain: bool, leaf_hooks: dict | None = None) -> None:
        """What the engine needs beyond the groups' nodes: each group's exit edges and who
        feeds whom, the roots' direct exits, the leaves' hooks; ``may_chain``: look for
        groups whose exits chain (impossible when groups are disjoint); ``leaf_hooks`` as
        for ``__init__``."""
        exits, groups, group_of = self.exits, self.groups, self.group_of
        # The dicts of the leaves' Python post hooks (functions.post_hooks_of): the engine
        # runs them once per pass, with the leaf's whole gradient of the pass.
        self.post_hooks = {node: hooks for node in leaves if (hooks := _post_hooks_of(node, leaf_hooks)) is not None}
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
        self.leaves = leaves
        for key, edges in self.roots.items():
            for node, _ in edges:
                if node in exits:
                    exits[node].direct_roots |= self.root_bits[key]
        # Leaves that several groups feed: their tensor hooks must not run in each group's
        # call (see Pass._held_leaves).
        self.shared_leaves = [node for node in leaves if len(exits[node].feeders) > 1]
        # Per root: the recv functions its own edges point at (they wait for its delivery),
        # and the groups it reaches (the only ones its delivery can make ready). By the bits
        # of each mask, not by root: the caller of a fan-out has a root and a recv function
        # per call, and plans are made per context.
        recvs = [(node, e) for node, e in exits.items() if node not in leaves]
        root_keys = self.root_keys  # (root i has bit 1 << i)
        direct_exits: dict[Any, list] = {}  # (a root without any is absent)
        for node, e in recvs:
            bits = e.direct_roots
            while bits:
                bit = bits & -bits
                direct_exits.setdefault(root_keys[bit.bit_length() - 1], []).append(node)
                bits ^= bit
        self.direct_exits = direct_exits
        groups_by_bit: dict[int, list[int]] = {}
        for group in groups:
            bits = group.mask
            while bits:
                bit = bits & -bits
                groups_by_bit.setdefault(bit, []).append(group.index)
                bits ^= bit
        self.groups_by_bit = groups_by_bit
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
    plan = Plan(roots, parts=parts, leaf_hooks=ctx.leaf_hooks)
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
        ctx.part_cache[message_id] = _Part([(node, slot) for slot in range(len(node.next_functions))], ctx.leaf_hooks)
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

_NOT_FOUND = object()


def _post_hooks_of(node: Any, found: dict | None) -> dict | None:
    """functions.post_hooks_of(node), looked up once per context: ``found`` (a context's
    ``leaf_hooks``) keeps what it gave. A node keeps one dict of Python post hooks for its
    life (hooks registered later land in it), and the probe that finds it registers and
    removes a hook, tens of microseconds in situ: the caller of a fan-out to n workers has a
    part per call, each into the same leaves."""
    if found is None:
        return post_hooks_of(node)
    hooks = found.get(node, _NOT_FOUND)
    if hooks is _NOT_FOUND:
        hooks = found[node] = post_hooks_of(node)
    return hooks  # type: ignore[return-value]

def _exit_kind(node: Any) -> bool | None:
    """Where a walk of the graph stops: True at a leaf (AccumulateGrad), False at a recv
    function (its gradients leave this worker), None at any other node (walked through)."""
    kind = type(node)
    if kind is _LEAF_TYPE or (_LEAF_TYPE is None and is_leaf_node(node)):
        return True
    if kind is RECV_NODE_TYPE:
        return False
    return None

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

_STRIDED = torch.strided
