"""Run on the worker under attack in tests/test_bad_input.py."""

import zmqautograd.rpc as rpc


def address() -> str:
    return rpc.api._current().endpoint.address


def protocol_errors() -> int:
    return sum(s.protocol_errors for s in rpc.api._current().endpoint.stats().values())
