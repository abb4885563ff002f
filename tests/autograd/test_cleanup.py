"""Batching of context releases for other workers (zmqautograd/autograd/cleanup.py). The
releases riding on calls, end to end: test_autograd_graphs.py."""

from __future__ import annotations

import logging
import threading

import pytest

from zmqautograd import timers
from zmqautograd.autograd.cleanup import CleanupBatcher

pytestmark = pytest.mark.timeout(30)


class _Recorder:
    """A batcher's ``send``: records what it sends; ``sent_one`` is set at the first send."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, list]] = []
        self.sent_one = threading.Event()

    def __call__(self, worker: int, context_ids: list) -> None:
        self.sent.append((worker, context_ids))
        self.sent_one.set()


def test_a_batch_that_rode_away_leaves_no_timer_that_sends_the_next_batch_early():
    send = _Recorder()
    sent, next_batch_sent = send.sent, send.sent_one
    batcher = CleanupBatcher(delay=0.2)
    batcher.add(1, [10], send)
    assert batcher.take(1) == (send, [10])  # it rides on a call
    batcher.delay = 1.0
    batcher.add(1, [11], send)  # the next batch, due to ride on the next call within 1 s
    # Timers fire in deadline order on one thread: when this one runs, the first batch's
    # timer (0.2 s) has run already, and the second's (1 s) has not.
    seen_then: list = []
    probed = threading.Event()
    timers.call_later(0.5, lambda: (seen_then.append(list(sent)), probed.set()))
    assert probed.wait(10)
    assert seen_then == [[]], "the first batch's timer sent the second batch"
    # Its own timer sends it, once.
    assert next_batch_sent.wait(10)
    assert sent == [(1, [11])]
    assert batcher.take(1) is None


def test_releases_added_to_a_waiting_batch_leave_with_it():
    send = _Recorder()
    batcher = CleanupBatcher(delay=0.05)
    batcher.add(2, [1], send)
    batcher.add(2, [2, 3], send)
    assert send.sent_one.wait(10)
    assert send.sent == [(2, [1, 2, 3])]


def test_one_timer_serves_the_batches_of_every_worker(monkeypatch):
    # A context that reached 16 workers leaves 16 batches at each step's end; they ride on
    # the next step's calls. One timer for them all: a timer each cost a heap entry, a
    # cancellation and often a wake-up of the timer thread, per worker and step.
    armed = []
    call_later = timers.call_later
    monkeypatch.setattr(timers, "call_later", lambda *args: armed.append(args) or call_later(*args))
    send = _Recorder()
    batcher = CleanupBatcher(delay=0.2)
    for step in range(3):
        for worker in range(16):
            batcher.add(worker, [step], send)
        assert len(armed) == 1
        for worker in range(16):
            assert batcher.take(worker) == (send, [step])
    batcher.add(3, [99], send)  # one that does not ride leaves on its own, once
    assert send.sent_one.wait(10)
    assert send.sent == [(3, [99])]


def test_a_batch_leaves_after_the_delay_it_was_added_with_even_when_that_was_cut():
    # Tests and users change the delay at run time: an hour, then short again. A batch
    # added after the cut must not wait for the timer armed for the hour.
    send = _Recorder()
    batcher = CleanupBatcher(delay=3600.0)
    batcher.add(1, [1], send)
    batcher.delay = 0.05
    batcher.add(2, [2], send)
    assert send.sent_one.wait(10)
    assert send.sent == [(2, [2])]
    assert batcher.take(1) == (send, [1])  # still waiting for its hour


class _AgentWhoseCallsFail:
    """The parts of an agent ``_send_batch`` uses, failing every call with ``error``."""

    closed = False
    rank = 0

    def __init__(self, error: Exception, departed: bool) -> None:
        self.error, self.departed = error, departed

    def call_retrying(self, *args, **kwargs):
        raise self.error

    def is_lost(self, worker: int) -> bool:
        return self.departed


@pytest.mark.parametrize("lost", ["lost", "departed", "live"])
def test_a_release_that_cannot_reach_its_worker_is_logged_by_what_it_leaves_behind(caplog, lost):
    from zmqautograd.transport import PeerLostError
    from zmqautograd.autograd import cleanup
    from zmqautograd.rpc.errors import RpcError

    error = {"lost": PeerLostError("3", "lost peer '3': connection closed"),
             # a member of a dynamic group that was lost, and that the group no longer lists
             "departed": RpcError("could not find destination worker id 3; ids are [0, 1, 2]"),
             "live": RpcError("RPC ran for more than 5 s")}[lost]
    with caplog.at_level(logging.DEBUG, logger=cleanup.__name__):
        cleanup._send_batch(_AgentWhoseCallsFail(error, lost == "departed"), 3, list(range(100, 130)))
    (record,) = [r for r in caplog.records if r.name == cleanup.__name__]
    # A lost worker's contexts died with it (its loss was reported once already); a live
    # worker that kept them is worth a warning. Either way the ids are cut short.
    assert record.levelno == (logging.WARNING if lost == "live" else logging.DEBUG)
    assert "100, 101" in record.getMessage() and "and 22 more" in record.getMessage()
    assert "129" not in record.getMessage()


def test_a_release_abandoned_by_our_own_shutdown_is_a_debug_line(caplog):
    """A nested chain passes each release on down the chain, so the last ones can leave a
    worker after its graceful shutdown's last wait: its close abandons them, which says
    nothing worth a warning (the whole group is shutting down, the contexts go with it)."""
    import torch

    from zmqautograd.autograd import cleanup
    from zmqautograd.rpc.errors import RpcError

    class AgentThatShutsDown:
        closed = False
        rank = 0
        sent: torch.futures.Future = torch.futures.Future()

        def call_retrying(self, *args, **kwargs):
            return self.sent

        def is_lost(self, worker: int) -> bool:
            return False

    agent = AgentThatShutsDown()
    with caplog.at_level(logging.DEBUG, logger=cleanup.__name__):
        cleanup._send_batch(agent, 4, [329])
        agent.closed = True  # as _close_now does before it abandons what is pending
        agent.sent.set_exception(RpcError("call to WorkerInfo(id=4, name=worker4) abandoned: shutdown"))
    (record,) = [r for r in caplog.records if r.name == cleanup.__name__]
    assert record.levelno == logging.DEBUG and "[329] on worker 4" in record.getMessage()


# ------------------------------------------------- who may release a context (docs/security.md)


def test_a_context_is_released_only_by_a_worker_of_it_or_its_creator():
    from zmqautograd.autograd.context import ContextContainer

    container = ContextContainer(0)
    context_id = (4 << 48) + 17  # made by worker 4; here through worker 1's call
    assert container.get_or_create(context_id, 1) is not None
    removed, refused = container.release_from([context_id], 2)  # worker 2 took no part in it
    assert removed == [] and refused == [context_id] and container.is_valid(context_id)
    removed, refused = container.release_from([context_id], 4)  # its creator
    assert [c.context_id for c in removed] == [context_id] and refused == []
    assert container.get_or_create(context_id, 1) is None  # released for good: nobody brings it back


def test_a_release_of_a_context_not_here_keeps_out_only_its_releasers_messages():
    from zmqautograd.autograd.context import MAX_RELEASES_AHEAD, ContextContainer

    container = ContextContainer(0)
    released_for_good = (4 << 48) + 1
    container.get_or_create(released_for_good, 4)
    container.remove(released_for_good)
    context_id = (4 << 48) + 2
    container.release_from([context_id], 2)  # worker 2's word, before the context came here
    assert container.get_or_create(context_id, 2) is None  # its own messages stay out
    assert container.get_or_create(context_id, 1) is not None  # another worker's make it
    # One worker's releases of made-up ids are kept apart and bounded: they flush nothing.
    container.release_from([(9 << 48) + i for i in range(MAX_RELEASES_AHEAD + 100)], 3)
    assert len(container._foreign_by[3]) == MAX_RELEASES_AHEAD
    assert container.get_or_create(released_for_good, 1) is None
    created_ahead = (4 << 48) + 3
    container.release_from([created_ahead], 4)  # its creator's word keeps out everyone's
    assert container.get_or_create(created_ahead, 1) is None
