"""What security costs: zmqautograd before a revision and now, in one run.

Each configuration runs in its own pair of worker processes; the CPU column is the CPU time
per small call of both processes together (all their threads), which moves less with the
machine's noise than the latency does; the groups take turns sample by
sample, each frozen while another measures (tools/bench.py's ``Group``), so all see the same
machine. Workloads: a small ``rpc_sync``, a one-hop dist autograd step (forward and
backward) and a 16 MiB ``rpc_sync`` round trip. Configurations: the code at ``--before``
(checked out into a temporary git worktree) and the current tree, encrypted (the default) and
authenticated only (``encrypt=False``); each also with shared-memory rings and lending off
(``--socket``), the path messages take between hosts, where encryption costs.

    python tools/security_cost.py [--before acc9e83] [--launches 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")

SOCKET = {"shm_ring": 0, "lend_min": 0}  # what goes between hosts: through the socket
COLUMNS = ("rpc_sync small", "  CPU of both", "one hop fwd+bwd", "16 MiB round trip")


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes, all threads (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def run_config(rank: int, conn, done, source: str, options: dict, port: int) -> None:
    """A pair of workers of the zmqautograd found in ``source``: rank 0 measures a sample
    of every column on each command (see tools/bench.py, ``Group``)."""
    sys.path.insert(0, source)  # before anything imports zmqautograd or transport
    import torch

    from tools.bench import (
        _measure_on_command,
        big_round_trip,
        one_hop_backward,
        small_latency,
    )
    from zmqautograd import autograd, rpc

    torch.set_num_threads(1)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=rpc.ZmqRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", **options))
    if rank == 0:
        big = torch.zeros(4 << 20)  # 16 MiB of float32
        small_latency(rpc, 50)
        one_hop_backward(rpc, autograd, 20)
        big_round_trip(rpc, big)

        pids = [os.getpid(), rpc.rpc_sync("worker1", os.getpid)]

        def sample() -> tuple:
            small_latency(rpc, 10)  # after a freeze the caches hold the other groups' work
            cpu = _cpu_seconds(pids)
            small = small_latency(rpc, 1000)  # (enough calls for the clock ticks of CPU time)
            cpu = (_cpu_seconds(pids) - cpu) / 1000
            return (small, cpu, one_hop_backward(rpc, autograd, 50),
                    statistics.median(big_round_trip(rpc, big) for _ in range(5)))

        _measure_on_command(conn, sample)
    else:
        done.wait()
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="acc9e83", help="the revision to compare with")
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from tools import ports
    from tools.bench import interleaved
    from tools.machine import kind_line, speed_line

    before = tempfile.mkdtemp(prefix="zq-before-")
    subprocess.run(["git", "worktree", "add", "--detach", before, args.before], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        groups = {}
        for path, label in (("", "same host"), ("socket", "socket path")):
            extra = SOCKET if path else {}
            groups[f"before ({args.before}), {label}"] = (run_config, (before, dict(extra), ports.free_port), 2)
            groups[f"now, encrypted, {label}"] = (run_config, (ROOT, {**extra, "encrypt": True}, ports.free_port), 2)
            groups[f"now, authenticated, {label}"] = (run_config, (ROOT, {**extra, "encrypt": False}, ports.free_port), 2)
        print(kind_line(), flush=True)
        print(speed_line("before"), flush=True)
        started = time.monotonic()
        samples, _ = interleaved(groups, args.launches, args.rounds)
        print(f"\n{args.launches} launches x {args.rounds} rounds, medians ({time.monotonic() - started:.0f} s); "
              "ratios against the code before on the same path", flush=True)
        print(f"{'configuration':45s}" + "".join(f"{c:>26s}" for c in COLUMNS))
        for name, values in samples.items():
            medians = [statistics.median(v[i] for v in values) for i in range(len(COLUMNS))]
            base_name = next(n for n in samples if n.startswith("before") and n.endswith(name.rsplit(", ", 1)[1]))
            base = [statistics.median(v[i] for v in samples[base_name]) for i in range(len(COLUMNS))]
            cells = [f"{m * 1e6:10.0f} us ({m / b:4.2f}x)" for m, b in zip(medians, base)]
            print(f"{name:45s}" + "".join(f"{c:>26s}" for c in cells), flush=True)
        print(speed_line("after"), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT, capture_output=True, check=False)


if __name__ == "__main__":
    main()
