"""ZAP answers of a membership (transport/security.py, transport/handshake.py): a member's
credentials are never refused because another thread admitted them between the handler's
lookup and its look at whether the membership is sealed, and connections held because
nobody knows their credentials yet (strangers, perhaps) do not hold up the members'."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import zmq
from zmq.utils import z85

from tests.conftest import poll_until
from zmqautograd.transport.endpoint import Endpoint, EndpointOptions
from zmqautograd.transport.security import Membership, NotYetKnown

pytestmark = pytest.mark.timeout(30)


class _AdmittedDuringFirstLookup(dict):
    """A membership's credential table whose first lookup lets ``admit`` run right after it
    (as the agent's thread may, between two bytecodes of the I/O thread)."""

    def __init__(self, contents: dict, admit: Callable[[], None]):
        super().__init__(contents)
        self._admit: Callable[[], None] | None = admit

    def get(self, key, default=None):
        found = super().get(key, default)
        admit, self._admit = self._admit, None
        if admit is not None:
            admit()
        return found


def _zap_request(client: Membership, server: str) -> list[bytes]:
    """What libzmq asks the ZAP handler for ``client``'s connection (RFC 27)."""
    head = [b"1.0", b"1", b"zmqautograd", b"127.0.0.1", client.name.encode()]
    if client.mechanism == "curve":
        return [*head, b"CURVE", z85.decode(client.own.public)]
    return [*head, b"PLAIN", client.name.encode(), client._password(client.own.public, client.name, server).encode()]


@pytest.mark.parametrize("mechanism", ["curve", "plain"])
def test_a_member_admitted_during_the_lookup_is_held_then_admitted_never_refused(mechanism):
    server = Membership.generate("2", mechanism)
    client = Membership.generate("1", mechanism)
    stranger = Membership.generate("1", mechanism)  # the same name, credentials of its own

    def admit_and_seal():  # what Agent._set_members does on its thread
        server.admit("0", Membership.generate("0", mechanism).own.public)
        server.admit("1", client.own.public)
        server.seal()

    table = "_by_curve_key" if mechanism == "curve" else "_members"
    setattr(server, table, _AdmittedDuringFirstLookup(getattr(server, table), admit_and_seal))
    request = _zap_request(client, "2")

    # The lookup missed the member, which was admitted (and the group sealed) right after:
    # not refused, but held, to be asked about again.
    with pytest.raises(NotYetKnown):
        server.zap_reply(request, lambda name: True)
    assert server.sealed
    # Asked again (the endpoint does, once told the members changed): admitted as itself.
    reply, admitted, why = server.zap_reply(request, lambda name: True)
    assert (reply[2], admitted, why) == (b"200", "1", "")
    # Sealed, strangers are refused at once, not held.
    reply, admitted, why = server.zap_reply(_zap_request(stranger, "2"), lambda name: True)
    assert reply[2] == b"400" and admitted is None and why


def test_a_key_leads_to_a_name_that_is_already_a_member():
    """What the ZAP handler admits by key, the HELLO check finds among the members: admit()
    makes the name a member before its key enters the handler's table (a new member, and
    one whose key changed)."""
    server = Membership.generate("2", "curve")
    seen: list[bool] = []

    class _Table(dict):
        def __setitem__(self, key, name):
            seen.append(name in server)
            super().__setitem__(key, name)

    server._by_curve_key = _Table()
    server.admit("1", Membership.generate("1", "curve").own.public)
    server.admit("1", Membership.generate("1", "curve").own.public)  # joined again, a new key
    assert seen == [True, True]
    assert len(server._by_curve_key) == 1  # the old key leads nowhere


@contextlib.contextmanager
def _strangers(address: str, server_key: bytes, count: int) -> Iterator[None]:
    """``count`` raw CURVE clients with keys of their own, connected to ``address``."""
    context = zmq.Context()
    dealers = []  # (a socket nobody refers to is closed)
    try:
        for _ in range(count):
            dealer = context.socket(zmq.DEALER)
            dealers.append(dealer)
            dealer.setsockopt(zmq.LINGER, 0)
            public, secret = zmq.curve_keypair()
            dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_key, public, secret
            dealer.connect(address)
        yield
    finally:
        context.destroy(linger=0)


def test_a_held_stranger_does_not_hold_up_a_member_who_connects_after_it():
    """An endpoint that may still admit members (a dynamic group's) holds a connection with
    unknown credentials until its deadline. A member admitted meanwhile connects at once:
    with a REP socket as the ZAP handler, no request was taken until the held one was
    answered, and the member waited for the stranger's deadline (60 s here)."""
    membership = Membership.generate("server", "curve")
    server = Endpoint("server", "tcp://127.0.0.1:0", on_message=lambda m: None, membership=membership,
                      options=EndpointOptions(connect_timeout=60))
    member = None
    try:
        with _strangers(server.address, membership.own.public, 1):
            poll_until(lambda: len(server._zap_held) == 1, 10, "the stranger's connection held")
            joining = Membership.generate("member", "curve")
            joining.admit("server", membership.own.public)
            membership.admit("member", joining.own.public)
            server.members_changed()
            member = Endpoint("member", on_message=lambda m: None, membership=joining)
            member.connect("server", server.address)
            member.wait_for_peer("server", 10)
            assert server.refused_connections == 0 and len(server._zap_held) == 1  # still held
            membership.seal()
            server.members_changed()
            poll_until(lambda: server.refused_connections == 1, 10, "the stranger refused once sealed")
            assert not server._zap_held
    finally:
        if member is not None:
            member.close()
        server.close()


def test_strangers_beyond_the_bound_are_refused_not_held():
    """At most 64 connections are held; each one beyond refuses the oldest."""
    membership = Membership.generate("server", "curve")
    server = Endpoint("server", "tcp://127.0.0.1:0", on_message=lambda m: None, membership=membership,
                      options=EndpointOptions(connect_timeout=60))
    try:
        with _strangers(server.address, membership.own.public, 70):
            poll_until(lambda: server.refused_connections >= 6, 20, "six strangers refused")
            assert len(server._zap_held) == 64
    finally:
        server.close()
