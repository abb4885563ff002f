"""Fault injection (transport/faults.py): the policy on its own, and on a live endpoint."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from zmqautograd.transport import FaultPolicy, InjectedFaultError, Message, MessageType
from zmqautograd.transport.endpoint import Endpoint
from zmqautograd.transport.faults import ENVIRONMENT_VARIABLE

pytestmark = pytest.mark.timeout(60)

FORK = MessageType.RREF_FORK_REQUEST
CALL = MessageType.PYTHON_CALL


def test_first_n_sends_of_each_named_type_fail_then_succeed():
    policy = FaultPolicy(messages_to_fail=["RREF_FORK_REQUEST", "RREF_USER_DELETE"], num_fail_sends=3)
    assert [policy.on_send("1", FORK).fail for _ in range(5)] == [True, True, True, False, False]
    assert [policy.on_send("2", MessageType.RREF_USER_DELETE).fail for _ in range(4)] == [True, True, True, False]
    assert not policy.on_send("1", CALL).fail
    assert policy.injected["failed"] == 6


def test_delays_drops_and_torch_names():
    policy = FaultPolicy(messages_to_delay={"SCRIPT_CALL": 1.5})  # torch's name for builtins
    assert policy.on_send("1", CALL).delay == 1.5
    assert policy.on_send("1", FORK).delay == 0
    dropping = [FaultPolicy(drop_fraction=0.3, seed=7) for _ in range(2)]
    runs = [[p.on_send("1", CALL).drop for _ in range(1000)] for p in dropping]
    assert runs[0] == runs[1]  # the seed makes a run repeatable
    assert 250 < sum(runs[0]) < 350
    assert not FaultPolicy(drop_fraction=1.0).on_send("1", MessageType.HEARTBEAT).drop  # transport control: never


def test_partition_and_heal():
    policy = FaultPolicy()
    policy.partition("2")
    assert policy.on_send("2", MessageType.HEARTBEAT).drop and policy.is_partitioned("2")
    assert not policy.on_send("3", CALL).drop
    policy.heal("2")
    assert not policy.on_send("2", CALL).drop and not policy.is_partitioned("2")


def test_bad_options_are_refused_clearly(monkeypatch):
    with pytest.raises(ValueError, match="NO_SUCH_TYPE"):
        FaultPolicy(messages_to_fail=["NO_SUCH_TYPE"])
    with pytest.raises(ValueError, match="drop_fraction"):
        FaultPolicy(drop_fraction=2)
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, "{not json")
    with pytest.raises(ValueError, match=ENVIRONMENT_VARIABLE):
        FaultPolicy.from_env()
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, json.dumps({"messages_to_fial": ["RREF_FORK_REQUEST"]}))
    with pytest.raises(ValueError, match="unknown fault options"):
        FaultPolicy.from_env()


def test_environment_variable_turns_faults_on(monkeypatch):
    assert FaultPolicy.from_env({"messages_to_fail": [], "num_fail_sends": 0}) is None
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, json.dumps({"messages_to_fail": ["RREF_FORK_REQUEST"], "num_fail_sends": 2}))
    policy = FaultPolicy.from_env({"messages_to_fail": [], "num_fail_sends": 0})
    assert [policy.on_send("1", FORK).fail for _ in range(3)] == [True, True, False]


def test_endpoint_fails_delays_and_partitions_for_real():
    received: list = []
    arrived = threading.Condition()

    def on_message(message):
        with arrived:
            received.append((message.type, time.monotonic()))
            arrived.notify_all()

    policy = FaultPolicy(messages_to_fail=["RREF_FORK_REQUEST"], num_fail_sends=1,
                         messages_to_delay={"RREF_ACK": 0.5})
    server = Endpoint("server", on_message=on_message)
    client = Endpoint("client", faults=policy, on_message=lambda m: None)
    try:
        client.connect("server", server.address)
        client.wait_for_peer("server", 10)
        with pytest.raises(InjectedFaultError, match="on purpose"):
            client.send("server", Message(FORK, 1, "client", {"x": torch.ones(1)}))
        client.send("server", Message(FORK, 2, "client"))  # the second one goes
        sent = time.monotonic()
        client.send("server", Message(MessageType.RREF_ACK, 3, "client"))  # 0.5 s late
        policy.partition("server")
        client.send("server", Message(CALL, 4, "client"))  # lost
        with arrived:
            assert arrived.wait_for(lambda: len(received) >= 2, 10)
        assert [t for t, _ in received] == [FORK, MessageType.RREF_ACK]
        assert received[1][1] - sent >= 0.45
        policy.heal("server")
        client.send("server", Message(CALL, 5, "client"))
        with arrived:
            assert arrived.wait_for(lambda: len(received) >= 3, 10)
        assert [t for t, _ in received] == [FORK, MessageType.RREF_ACK, CALL]
    finally:
        client.close()
        server.close()
