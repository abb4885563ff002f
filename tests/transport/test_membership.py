"""ZAP answers of a membership (transport/security.py) while another thread admits the
members: a member's credentials are never refused because they were admitted between the
handler's lookup and its look at whether the membership is sealed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from zmq.utils import z85

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
