"""The RRef bookkeeping for lost workers (zmqautograd/rpc/rref.py), in one process: where a
message's forks went, and what a lost worker's loss lets go. End to end, with a SIGKILL:
tests/test_kill.py."""

from __future__ import annotations

import pytest

from zmqautograd.rpc.rref import RRef, RRefContext

pytestmark = pytest.mark.timeout(30)


class _Endpoint:
    def __init__(self, lost: set[str]) -> None:
        self.lost = lost

    def is_lost(self, peer: str) -> bool:
        return peer in self.lost


class _Agent:
    """What RRefContext uses of its agent; ``closed`` keeps user deletes from being sent."""

    rank = 0
    closed = True

    def __init__(self, lost: set[str]) -> None:
        self.endpoint = _Endpoint(lost)
        self.rrefs = None


@pytest.fixture
def context():
    agent = _Agent(lost=set())
    rrefs = agent.rrefs = RRefContext(agent)
    yield rrefs
    rrefs.stop_releasing()


def _user_rref(rrefs: RRefContext) -> RRef:
    rref = RRef._user(rrefs, (1, 1), 1, (0, 99), "Tensor")
    rref._creation.set_result(True)
    return rref


def test_an_rref_kept_for_a_child_lost_before_the_send_was_noted_is_let_go(context):
    """The child's loss was handled before the message's forks were noted (the loss found no
    fork of it then): noting them must let go at once."""
    rref = _user_rref(context)
    context.encode(rref)  # a fork of our user RRef, kept until the child accepts it
    assert len(context._pending_children) == 1
    context.agent.endpoint.lost.add("6")
    context.sent_to(context.take_made(), 6)
    assert context._pending_children == {}


def test_forks_of_an_unsent_message_are_taken_back(context):
    owned = RRef.__new__(RRef)
    owned._init_owner(context, (0, 7), "Tensor")
    context.owner_value((0, 7)).set_result(1)
    context.set_created((0, 7))
    context.encode(owned)  # the owner registers the receiver's fork itself
    assert len(context._owned[(0, 7)].forks) == 1
    context.unsent(context.take_made())
    assert context._owned[(0, 7)].forks == {}


def test_a_lost_worker_s_forks_and_early_deletes_go(context):
    owned = RRef.__new__(RRef)
    owned._init_owner(context, (0, 8), "Tensor")
    context.owner_value((0, 8)).set_result(1)
    context.set_created((0, 8))
    context.add_fork((0, 8), (5, 1), holder=5)
    context.delete_fork((0, 8), (5, 2), sender=5)  # its fork request is still on its way
    context.add_fork((0, 8), (3, 1), holder=3)
    del owned
    context.flush_releases(10)  # (our handle's release)
    context.peer_lost(5)
    assert context._owned[(0, 8)].forks == {(3, 1): 3} and not context._owned[(0, 8)].deleted_early
    context.peer_lost(3)
    assert context.owned_count() == 0
