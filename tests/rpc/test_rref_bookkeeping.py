"""The RRef bookkeeping for lost workers (zmqautograd/rpc/rref.py), in one process: where a
message's forks went, and what a lost worker's loss lets go. End to end, with a SIGKILL:
tests/system/test_kill.py."""

from __future__ import annotations

import pytest

from tests.conftest import poll_until
from zmqautograd.transport.errors import PeerLostError
from zmqautograd.rpc.rref import RRef
from zmqautograd.rpc.rref_context import RRefContext

pytestmark = pytest.mark.timeout(30)


class _Endpoint:
    def __init__(self, lost: set[str]) -> None:
        self.lost = lost

    def is_lost(self, peer: str) -> bool:
        return peer in self.lost


class _Pool:
    def owns_current_thread(self) -> bool:
        return False


class _Agent:
    """What RRefContext uses of its agent; ``closed`` keeps user deletes from being sent."""

    rank = 0
    info = "worker 0"
    closed = True
    default_timeout = 30.0
    pool = _Pool()

    def incarnation_of(self, worker: int) -> int:
        return 0

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
    owned = _owned_value_kept(context, (0, 7))
    context.encode(owned)  # the owner registers the receiver's fork itself
    assert len(context._owned[(0, 7)].forks) == 1
    context.unsent(context.take_made())
    assert context._owned[(0, 7)].forks == {}


def test_a_lost_worker_s_forks_and_early_deletes_go(context):
    context.delete_fork((5, 8), (5, 9), sender=5)  # its remote() (which registers the fork) is on its way
    context.add_fork((5, 8), (3, 1), holder=3)  # and a fork of it that worker 3 registered
    context.peer_lost(5)
    assert context._owned[(5, 8)].forks == {(3, 1): 3} and not context._owned[(5, 8)].deleted_early
    context.peer_lost(3)
    assert context.owned_count() == 0


def test_only_a_creator_deletes_a_fork_before_it_is_registered(context):
    """A child's delete follows its fork's registration (RRefContext._release_loop): one that
    comes first is another member's, and is refused; so is a creator's of another's value."""
    from zmqautograd.rpc.errors import NotEntitledError

    owned = _owned_value_kept(context, (0, 8))  # held here: its release would end the value
    for fork_id, sender in (((5, 2), 5), ((0, 9), 5)):
        with pytest.raises(NotEntitledError, match="which is not registered"):
            context.delete_fork((0, 8), fork_id, sender=sender)
    assert not context._owned[(0, 8)].deleted_early
    assert owned.is_owner()


def _owned_value_kept(rrefs: RRefContext, rref_id: tuple) -> RRef:
    """A value this worker owns and created, and the owner's handle that keeps it."""
    owned = RRef.__new__(RRef)
    owned._init_owner(rrefs, rref_id, "Tensor")
    rrefs.owner_value(rref_id).set_result(1)
    rrefs.set_created(rref_id)
    return owned


def _owned_value(rrefs: RRefContext, rref_id: tuple) -> None:
    """A value this worker owns and created, which only forks keep now."""
    _owned_value_kept(rrefs, rref_id)  # the handle goes at once
    rrefs.flush_releases(10)  # (our handle's release)


def test_requests_of_a_lost_worker_handled_after_its_loss_keep_nothing(context):
    """A fork request or an early delete that waited in our pool while its sender's loss was
    handled: the loss could not drop what was not there yet, so noting it would keep it."""
    _owned_value(context, (0, 9))
    context.add_fork((0, 9), (3, 1), holder=3)  # keeps the value
    context.agent.endpoint.lost.add("5")
    context.peer_lost(5)
    context.add_fork((0, 9), (5, 1), holder=5)
    context.delete_fork((5, 7), (5, 8), sender=5)  # its remote(), which registers that fork, has not come
    entry = context._owned[(0, 9)]
    assert entry.forks == {(3, 1): 3} and entry.deleted_early == {}
    assert (5, 7) not in context._owned or context._owned[(5, 7)].deleted_early == {}


def test_a_value_its_lost_creator_never_created_fails_and_goes(context):
    """Worker 5's remote() to us never arrived (it died first), but worker 3 registered its
    fork and fetches the value: the fetch fails naming worker 5, and the value goes with the
    fork."""
    context.add_fork((5, 1), (3, 1), holder=3)
    fetched = context.owner_value((5, 1))
    context.add_fork((5, 2), (3, 2), holder=3)
    context.agent.endpoint.lost.add("5")
    context.peer_lost(5, RuntimeError("the connection broke"))
    assert fetched.done()  # (a wait would never end otherwise)
    with pytest.raises(PeerLostError, match=r"creator, worker 5, was lost before its remote\(\) call arrived "
                                            r"\(the connection broke\)") as raised:
        fetched.wait()
    assert raised.value.peer == "5"
    assert context.begin_making((5, 1)) is None  # its remote() waited in our pool: it need not run
    assert context.owned_count() == 2  # worker 3 holds its forks
    context.delete_fork((5, 1), (3, 1), sender=3)
    context.delete_fork((5, 2), (3, 2), sender=3)
    assert context.owned_count() == 0


def test_a_value_whose_remote_runs_when_its_creator_is_lost_is_kept(context):
    """The remote() call arrived and runs when its creator is lost: the value it makes is
    still the value for the forks others hold."""
    context.add_fork((5, 3), (3, 1), holder=3)
    value = context.begin_making((5, 3))
    context.agent.endpoint.lost.add("5")
    context.peer_lost(5, RuntimeError("killed"))
    assert not value.done()
    value.set_result(42)
    context.set_created((5, 3))
    assert context.owner_value((5, 3)).wait() == 42
    context.delete_fork((5, 3), (3, 1), sender=3)
    assert context.owned_count() == 0


def test_a_peer_holds_at_most_64_threads_waiting_for_values_not_made(context):
    """Worker 2 calls for values of its own that it never makes (ids it may name): 64 of its
    threads wait, the 65th is refused at once, and the value's making frees them."""
    import threading

    from zmqautograd.rpc import current
    from zmqautograd.rpc.errors import NotEntitledError

    results: list = []

    def wait_as_worker_2(rref_id: tuple) -> None:
        current._calls.rank = 2
        try:
            results.append(context.wait_for_value(rref_id))
        except NotEntitledError as exc:
            results.append(exc)

    waiting = [threading.Thread(target=wait_as_worker_2, args=((2, i),)) for i in range(64)]
    for thread in waiting:
        thread.start()
    poll_until(lambda: context._waits.get(2) == 64, 10, "64 waits")
    wait_as_worker_2((2, 99))
    assert isinstance(results[-1], NotEntitledError) and "64 of its calls wait" in str(results[-1])
    for i in range(64):
        context.owner_value((2, i)).set_result(i)
    for thread in waiting:
        thread.join(10)
    assert sorted(r for r in results if isinstance(r, int)) == list(range(64)) and context._waits[2] == 0


def test_a_later_worker_of_a_rank_is_not_the_creator_of_an_earlier_ones_values(context):
    from zmqautograd.rpc.errors import NotEntitledError

    context.agent.incarnation_of = lambda worker: 7 if worker == 3 else 0  # rank 3's member joined as event 7
    first = (3, 5 << 32)  # an id the earlier worker of rank 3 (joined as event 5) made
    with pytest.raises(NotEntitledError, match="which it holds no fork of"):
        context.check_user(first, None, 3)
    context.check_user((3, 7 << 32), None, 3)  # its own
