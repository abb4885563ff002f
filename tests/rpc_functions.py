"""Functions the RPC tests call on remote workers (importable by every worker process)."""

from __future__ import annotations

import time

import torch

import zmqautograd.rpc as rpc


def my_function(a, b, c):
    return a + b + c


def structure(value):
    return {"type": type(value).__name__, "value": value}


def raise_value_error(message):
    raise ValueError(message)


class NeedsTwoArguments(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def raise_unbuildable():
    raise NeedsTwoArguments(7, "cannot be rebuilt from one message")


def sleep_and_return(seconds, value=None):
    time.sleep(seconds)
    return value


def whoami():
    return rpc.get_worker_info().name


def nested_chain(workers, depth):
    """Calls itself on the next worker ``depth`` times, synchronously (holds a pool thread)."""
    if depth == 0:
        return [rpc.get_worker_info().name]
    me = rpc.get_worker_info().name
    target = workers[(workers.index(me) + 1) % len(workers)]
    return [me] + rpc.rpc_sync(target, nested_chain, args=(workers, depth - 1))


def nested_with_future_wait(target):
    """Waits on an rpc_async future directly (a wait the pool cannot see)."""
    return rpc.rpc_async(target, whoami).wait()


def add_tensors(x, y, alpha=1):
    return torch.add(x, y, alpha=alpha)


def unpicklable_result():
    return lambda: None  # cannot travel back


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def echo(value):
    return value


@rpc.functions.async_execution
def async_add_after(target, seconds, value):
    """Returns a future: the reply goes out when the nested call completes."""
    return rpc.rpc_async(target, sleep_and_return, args=(seconds, value)).then(lambda fut: fut.wait() + 1)


@rpc.functions.async_execution
def async_raises(target):
    return rpc.rpc_async(target, raise_value_error, args=("inside the future",))


class AsyncHolder:
    @staticmethod
    @rpc.functions.async_execution
    def static_async(value):
        future = torch.futures.Future()
        future.set_result(value * 3)
        return future


def pool_thread_count():
    from zmqautograd.rpc import api

    return api._agent.pool.thread_count
