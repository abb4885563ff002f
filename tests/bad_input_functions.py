"""Run on the worker under attack in tests/rpc/test_bad_input.py."""

import zmqautograd.rpc as rpc


def address() -> str:
    return rpc.api._current().endpoint.address


def protocol_errors() -> int:
    return sum(s.protocol_errors for s in rpc.api._current().endpoint.stats().values())


def type_name(value) -> str:
    """What a value arrived as: the qualified name of a class or function."""
    return f"{value.__module__}.{value.__qualname__}"
