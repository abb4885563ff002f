"""A stress run for fault-injection users: driver threads on worker0 make a random mix of
calls (sync, async, remote + fork to a third worker, remote errors), distributed backward
passes (two hops, nested, async_execution, fan-out/fan-in, retain_graph) and check every
result against local torch, optionally while retryable control messages fail (--faults)
and while one worker is SIGKILLed part-way (--kill-after). Afterwards every surviving
worker must hold no autograd context and no owned RRef.

    python tools/stress.py --seconds 60 --kill-after 10

Exits non-zero on a wrong result, on an error that does not name the killed worker, on a
driver thread that hangs, or on anything left on a survivor. It found the RRef forks of a
dead worker, the contexts it passed on, and RRefs leaked through failed futures'
tracebacks (README, "Reliability").
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # stress_functions, for the workers too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import stress_functions as sf  # noqa: E402
import zmqautograd.autograd as dist_autograd  # noqa: E402
import zmqautograd.rpc as rpc  # noqa: E402

WORLD = 4
RETRYABLE = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"]


def _grad(fn, leaf: torch.Tensor) -> torch.Tensor:
    local = leaf.detach().requires_grad_()
    return torch.autograd.grad(fn(local), [local])[0]


def _backward(forward, local, leaf: torch.Tensor, times: int = 1) -> None:
    """``forward(leaf)`` through other workers, backward ``times`` times in one context; the
    gradient must be ``times`` x what local autograd gives for ``local``."""
    expected = _grad(local, leaf) * times
    with dist_autograd.context() as context_id:
        loss = forward(leaf)
        for left in range(times, 0, -1):
            dist_autograd.backward(context_id, [loss], retain_graph=left > 1)
        torch.testing.assert_close(dist_autograd.get_gradients(context_id)[leaf], expected)


def one_step(kind: str, rng: random.Random, workers: list[str]) -> None:
    others = workers[1:]
    x = torch.randn(4, 4)
    leaf = torch.randn(4, 4, requires_grad=True)
    a, b = rng.sample(others, 2)
    if kind == "sync":
        assert torch.equal(rpc.rpc_sync(rng.choice(workers), torch.add, args=(x, 1.0)), x + 1.0)
    elif kind == "async":
        futures = [rpc.rpc_async(rng.choice(workers), torch.mul, args=(x, i)) for i in range(8)]
        for i, value in enumerate(torch.futures.wait_all(futures)):
            assert torch.equal(value, x * i)
    elif kind == "remote+fork":
        rref = rpc.remote(a, torch.mul, args=(x, 3.0))
        torch.testing.assert_close(rpc.rpc_sync(b, sf.rref_sum, args=(rref,)), (x * 3.0).sum())
    elif kind == "error":
        try:
            rpc.rpc_sync(a, sf.fail, args=("expected",))
            raise AssertionError("no error")
        except ValueError as exc:
            assert "expected" in str(exc)
    elif kind == "two hops":
        _backward(lambda l: rpc.rpc_sync(b, sf.stage, args=(rpc.rpc_sync(a, sf.stage, args=(l, 0.5)), 2.0)).pow(2).sum(),
                  lambda l: sf.stage(sf.stage(l, 0.5), 2.0).pow(2).sum(), leaf)
    elif kind == "nested":
        _backward(lambda l: rpc.rpc_sync(a, sf.nested_stage, args=(l, 0.5, b)).sum(),
                  lambda l: sf.stage(sf.stage(l, 0.5), 1.5).sum(), leaf)
    elif kind == "async_execution":
        _backward(lambda l: rpc.rpc_sync(a, sf.async_stage, args=(l, 0.7, b)).sum(),
                  lambda l: (sf.stage(l, 0.7) * 2.0).sum(), leaf)
    elif kind == "fan-out":
        def forward(l):
            fa, fb = rpc.rpc_async(a, sf.stage, args=(l, 0.2)), rpc.rpc_async(b, sf.stage, args=(l, 0.9))
            return (fa.wait() * fb.wait()).sum()
        _backward(forward, lambda l: (sf.stage(l, 0.2) * sf.stage(l, 0.9)).sum(), leaf)
    elif kind == "retain_graph":
        _backward(lambda l: rpc.rpc_sync(a, sf.stage, args=(l, 0.3)).sum(), lambda l: sf.stage(l, 0.3).sum(), leaf, 2)


KINDS = ["sync", "async", "remote+fork", "error", "two hops", "nested", "async_execution", "fan-out", "retain_graph"]


DEAD = f"worker{WORLD - 1}"  # the one --kill-after kills


def drive(thread: int, seed: int, stop: threading.Event, counts: collections.Counter, unexpected: list,
          killed: list) -> None:
    rng = random.Random(seed * 1000 + thread)
    workers = [f"worker{r}" for r in range(WORLD)]
    while not stop.is_set():
        kind = rng.choice(KINDS)
        try:
            one_step(kind, rng, workers)
            counts[kind] += 1
        except Exception as exc:  # noqa: BLE001 - expected only after the kill, naming the dead
            # (Only text is kept: an exception keeps its frames, and they the call's RRefs.)
            if killed and _names_the_dead(str(exc)):
                counts["failed, naming the dead worker"] += 1
            else:
                unexpected.append((kind, traceback.format_exc()))


def _names_the_dead(text: str) -> bool:
    return f"name={DEAD}" in text or f"'{DEAD[6:]}'" in text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=4, help="driver threads on worker0")
    parser.add_argument("--kill-after", type=float, default=None, help="SIGKILL worker3 after this many seconds")
    parser.add_argument("--faults", action="store_true", help="fail a quarter of the retryable control messages")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    options = {"num_worker_threads": 4, "rpc_timeout": 30, "heartbeat_interval": 0.5, "peer_timeout": 10.0}
    if args.faults:
        options.update(messages_to_fail=RETRYABLE, num_fail_sends=3, fail_fraction=0.25, fault_seed=args.seed,
                       messages_to_delay={"RREF_USER_DELETE": 0.05, "CLEANUP_AUTOGRAD_CONTEXT_REQ": 0.05},
                       max_retries=12, retry_delay=0.02, retry_backoff=1.5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    processes = [ctx.Process(target=sf.serve, args=(rank, WORLD, init_method, options), daemon=True) for rank in range(1, WORLD)]
    for process in processes:
        process.start()
    rpc.init_rpc("worker0", rank=0, world_size=WORLD,
                 rpc_backend_options=rpc.ZmqRpcBackendOptions(init_method=init_method, **options))

    counts: collections.Counter = collections.Counter()
    unexpected: list = []
    killed: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=drive, args=(t, args.seed, stop, counts, unexpected, killed), daemon=True)
               for t in range(args.threads)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    while time.monotonic() - started < args.seconds:
        time.sleep(0.1)  # the run's clock: nothing to wait on
        if args.kill_after is not None and not killed and time.monotonic() - started >= args.kill_after:
            os.kill(processes[-1].pid, signal.SIGKILL)
            killed.append(dict(counts))
    stop.set()
    for thread in threads:
        thread.join(60)
    hung = [thread.name for thread in threads if thread.is_alive()]

    print(f"{args.seconds:.0f} s, {args.threads} driver threads{', faults' if args.faults else ''}"
          f"{f', worker3 killed at {args.kill_after:.0f} s' if killed else ''}")
    print("completed:", dict(counts))
    if killed:
        print("after the kill:", {k: counts[k] - killed[0].get(k, 0) for k in counts})
    for kind, tb in unexpected[:5]:
        print(f"UNEXPECTED ERROR in {kind}:\n{tb}")
    survivors = [f"worker{r}" for r in range(WORLD - 1 if killed else WORLD)]
    deadline = time.monotonic() + 30
    while True:  # deletes and releases are asynchronous, and retried under faults
        states = {w: rpc.rpc_sync(w, sf.state) for w in survivors}
        left = {w: s for w, s in states.items() if s["contexts"] or s["owned_rrefs"]}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # polls other processes' bookkeeping: nothing to wait on
    print("left on survivors:", left or "nothing")
    for rank, process in enumerate(processes, start=1):
        if process.is_alive():
            rpc.rpc_sync(f"worker{rank}", sf.stop)
    rpc.shutdown(graceful=False)
    for process in processes:
        process.join(10)
    ok = not unexpected and not hung and not left and all(counts[kind] for kind in KINDS)
    print("OK" if ok else f"FAILED: {len(unexpected)} unexpected error(s), hung threads {hung}, left {left}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
