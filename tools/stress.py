"""A stress run for fault-injection users: driver threads on worker0 (and, with
--everyone-drives, on every worker) make a random mix of calls (sync, async, remote + fork
to a third worker, remote errors), distributed backward passes (two hops, nested,
async_execution, fan-out/fan-in, retain_graph) and check every result against local torch,
optionally while retryable control messages fail (--faults) and while one worker is
SIGKILLed part-way (--kill-after). Afterwards every surviving worker must hold no autograd
context and no RRef, owned or user.

    python tools/stress.py --seconds 60 --kill-after 10 [--everyone-drives 2]

Exits non-zero on a wrong result, on an error that does not name the killed worker, on a
driver thread that hangs, or on anything left on a survivor. It found the RRef forks of a
dead worker, the contexts it passed on, and RRefs leaked through failed futures'
tracebacks (README, "Reliability").
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # stress_functions, for the workers too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.multiprocessing as mp  # noqa: E402

import stress_functions as sf  # noqa: E402
from tools import ports  # noqa: E402
import zmqautograd.rpc as rpc  # noqa: E402

WORLD = 4
WORKERS = [f"worker{r}" for r in range(WORLD)]
DEAD = WORKERS[-1]  # the one --kill-after kills
RETRYABLE = ["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE", "CLEANUP_AUTOGRAD_CONTEXT_REQ"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=4, help="driver threads on worker0")
    parser.add_argument("--kill-after", type=float, default=None, help="SIGKILL worker3 after this many seconds")
    parser.add_argument("--faults", action="store_true", help="fail a quarter of the retryable control messages")
    parser.add_argument("--everyone-drives", type=int, default=0, metavar="N",
                        help="N driver threads on every other worker too (the killed one then creates RRefs and "
                             "contexts that others hold)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    options = {"num_worker_threads": 4, "rpc_timeout": 30, "heartbeat_interval": 0.5, "peer_timeout": 10.0}
    if args.faults:
        options.update(messages_to_fail=RETRYABLE, num_fail_sends=3, fail_fraction=0.25, fault_seed=args.seed,
                       messages_to_delay={"RREF_USER_DELETE": 0.05, "CLEANUP_AUTOGRAD_CONTEXT_REQ": 0.05},
                       max_retries=12, retry_delay=0.02, retry_backoff=1.5)
    init_method = f"tcp://127.0.0.1:{ports.free_port()}"
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
    threads = [threading.Thread(target=sf.drive, args=("worker0", WORKERS, t, args.seed, stop.is_set, counts,
                                                      unexpected, DEAD), daemon=True)
               for t in range(args.threads)]
    started = time.monotonic()
    elsewhere = {w: rpc.rpc_async(w, sf.drive_here, timeout=args.seconds + 120,
                                  args=(args.seconds, args.everyone_drives, args.seed + rank, WORKERS,
                                        DEAD if args.kill_after is not None else None))
                 for rank, w in enumerate(WORKERS) if rank and args.everyone_drives}
    for thread in threads:
        thread.start()
    while time.monotonic() - started < args.seconds:
        time.sleep(0.1)  # the run's clock: nothing to wait on
        if args.kill_after is not None and not killed and time.monotonic() - started >= args.kill_after:
            killed.append(dict(counts))  # (before: no error can name it yet)
            os.kill(processes[-1].pid, signal.SIGKILL)
    stop.set()
    for thread in threads:
        thread.join(60)
    hung = [thread.name for thread in threads if thread.is_alive()]
    if killed and killed[0].get(sf.NAMED_DEAD):
        unexpected.append(("any", f"{killed[0][sf.NAMED_DEAD]} error(s) named {DEAD} before it was killed"))
    if not killed and counts[sf.NAMED_DEAD]:
        unexpected.append(("any", f"{counts[sf.NAMED_DEAD]} error(s) named {DEAD}, never killed"))
    driven = collections.Counter()
    for worker, future in elsewhere.items():
        try:
            their_counts, their_unexpected, their_hung = future.wait()
        except Exception as exc:  # noqa: BLE001 - the killed worker's own drive dies with it
            if not (killed and worker == DEAD and sf.names(str(exc), DEAD)):
                unexpected.append((f"drive on {worker}", str(exc)))
            continue
        driven.update(their_counts)
        unexpected += [(f"{kind} on {worker}", tb) for kind, tb in their_unexpected]
        hung += [f"{name} on {worker}" for name in their_hung]

    print(f"{args.seconds:.0f} s, {args.threads} driver threads{', faults' if args.faults else ''}"
          f"{f', {args.everyone_drives} more on every other worker' if args.everyone_drives else ''}"
          f"{f', {DEAD} killed at {args.kill_after:.0f} s' if killed else ''}")
    print("completed:", dict(counts))
    if killed:
        print("after the kill:", {k: counts[k] - killed[0].get(k, 0) for k in counts})
    if elsewhere:
        print("completed by the other workers' drivers (the killed one's lost with it):", dict(driven))
    for kind, tb in unexpected[:5]:
        print(f"UNEXPECTED ERROR in {kind}:\n{tb}")
    survivors = WORKERS[:-1] if killed else WORKERS
    deadline = time.monotonic() + 30
    while True:  # deletes and releases are asynchronous, and retried under faults
        states = {w: rpc.rpc_sync(w, sf.state) for w in survivors}
        left = {w: s for w, s in states.items() if s["contexts"] or s["owned_rrefs"] or s["user_rrefs"]}
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
    ok = not unexpected and not hung and not left and all(counts[kind] for kind in sf.KINDS)
    print("OK" if ok else f"FAILED: {len(unexpected)} unexpected error(s), hung threads {hung}, left {left}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
