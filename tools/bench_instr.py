"""Instructions per step under ``valgrind --tool=callgrind``: an A/B measure of two commits
that the machine's noise does not move (it counts instructions executed, not time).

For each workload and each tree, every process of the group runs under callgrind with
instrumentation off (importing torch stays fast); once the driver has warmed up, all of them
are switched on (``callgrind_control -i on``), the driver runs ``--steps`` steps, and all are
switched off again. What each process executed in that window, divided by the steps, is its
share of a step; the sum over processes is the step's cost. Workloads (the steps of
tools/bench_scale.py): ``hop`` (one-hop dist autograd step, 2 processes), ``fanout``
(the driver calls 3 workers at once, sums, backward; 4 processes) and ``chain`` (a chain of
nested calls through 3 workers, backward; 4 processes); on request, ``fanout8`` and
``fanout16``: the fan-out step with 8 and 16 processes, for costs that grow with the group
(16 processes under callgrind take several minutes and ~10 GB).

Waiting is switched to sleeping for the measure (``spin=0``, no busy polling): a spinning
thread executes instructions for as long as it waits, which depends on time. So this counts
the work a step does, not the way processes wait; judge spinning by CPU seconds per step
(tools/bench_scale.py).

    python tools/bench_instr.py [A [B]] [--steps 100] [--workloads hop,fanout,chain] [--repeat 1]

A and B are git revisions; A defaults to HEAD, B to the working tree (uncommitted changes
included). Each is exported (``git archive``) and imported from there through PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import ports  # tools/ports.py (this script's folder is first on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = {"hop": 2, "fanout": 4, "chain": 4, "fanout8": 8, "fanout16": 16}  # workload: processes
WARMUP = 20
# Slow under callgrind (20-50x): generous bounds, so that nothing times out while measured.
# Heartbeats practically off: a step takes about a second here, so heartbeats between idle
# workers (every 5 s, to each of 14 peers in fanout16) came with most steps, more the
# slower the run, and moved what a worker executes by 5% and more.
OPTIONS = dict(spin=0.0, busy_poll=0.0, rpc_timeout=600, peer_timeout=600, heartbeat_interval=120.0)


# ------------------------------------------------------------- inside a measured process


def _worker(rank: int, world: int, port: int, workload: str, steps: int) -> None:
    """One process of the group. The driver (rank 0) talks to the controller on its standard
    streams: "warm" once warmed up, then waits for a line, runs the steps, says "done"."""
    import torch

    import zmqautograd.autograd as autograd
    import zmqautograd.rpc as rpc

    # The steps of tools/bench_scale.py (imported after zmqautograd: it puts this repository
    # first on sys.path, and zmqautograd must come from the tree under test).
    import bench_scale

    torch.set_num_threads(1)
    options = rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", **OPTIONS)  # type: ignore[arg-type]
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        import zmqautograd

        x = torch.randn(4, bench_scale.WIDTH, requires_grad=True)
        workers = [f"worker{r}" for r in range(1, world)]

        def step() -> None:
            if workload == "hop":
                bench_scale.one_hop_step(rpc, autograd, x)
            elif workload == "chain":
                bench_scale.chain_step(rpc, autograd, x, workers)
            else:
                bench_scale.fan_out_step(rpc, autograd, x, workers)

        for _ in range(WARMUP):
            step()
        print("warm", os.path.dirname(os.path.dirname(os.path.abspath(zmqautograd.__file__))), flush=True)
        sys.stdin.readline()
        for _ in range(steps):
            step()
        print("done", flush=True)
        sys.stdin.readline()
    rpc.shutdown()


# ------------------------------------------------------------------- the controller


def _callgrind_control(switch: str, pids: list[int]) -> None:
    for pid in pids:
        done = subprocess.run(["callgrind_control", "-i", switch, str(pid)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0 or "OK" not in done.stdout:
            raise RuntimeError(f"callgrind_control -i {switch} {pid} failed: {(done.stdout + done.stderr).strip()}")


def _totals(path: str) -> int:
    with open(path) as f:
        found = re.search(r"^totals: (\d+)", f.read(), re.M)
    if found is None:
        raise RuntimeError(f"no totals in {path}")
    return int(found.group(1))


def measure(tree: str, workload: str, steps: int, out: str) -> list[int]:
    """Instructions per step of each process (driver first) of one group run from ``tree``."""
    world, port = WORKLOADS[workload], ports.free_port()
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    processes = []
    try:
        for rank in range(world):
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={out}/{workload}.{rank}.out", sys.executable, os.path.abspath(__file__),
                       "--worker", str(rank), str(world), str(port), workload, str(steps)]
            processes.append(subprocess.Popen(command, env=env, text=True, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=open(f"{out}/{workload}.{rank}.log", "w")))
        driver = processes[0]
        assert driver.stdout is not None and driver.stdin is not None
        line = driver.stdout.readline().split()
        if line[:1] != ["warm"]:
            raise RuntimeError(f"the driver did not warm up (log: {out}/{workload}.0.log)")
        if os.path.realpath(line[1]) != os.path.realpath(tree):
            raise RuntimeError(f"the driver imported zmqautograd from {line[1]}, not from {tree}")
        pids = [p.pid for p in processes]
        _callgrind_control("on", pids)
        driver.stdin.write("go\n")
        driver.stdin.flush()
        if driver.stdout.readline().strip() != "done":
            raise RuntimeError(f"the driver failed (log: {out}/{workload}.0.log)")
        _callgrind_control("off", pids)
        driver.stdin.write("end\n")
        driver.stdin.flush()
        for rank, process in enumerate(processes):
            if process.wait(timeout=300) != 0:
                raise RuntimeError(f"process {rank} exited with {process.returncode} (log: {out}/{workload}.{rank}.log)")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [_totals(f"{out}/{workload}.{rank}.out") // steps for rank in range(world)]


def _export(revision: str, into: str) -> str:
    """The tree of ``revision`` (None: the working tree) as a directory to import from."""
    if revision == "WORKTREE":
        return ROOT
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", ROOT, "archive", revision], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"bench_instr: cannot export {revision!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        rank, world, port, workload, steps = sys.argv[2:7]
        _worker(int(rank), int(world), int(port), workload, int(steps))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", nargs="?", default="HEAD", help="git revision (default HEAD)")
    parser.add_argument("b", nargs="?", default="WORKTREE", help="git revision (default: the working tree)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workloads", default="hop,fanout,chain")
    parser.add_argument("--repeat", type=int, default=1, help="runs per tree and workload (shows the spread)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench_instr: valgrind is not installed (Debian: apt-get install valgrind)")
    scratch = tempfile.mkdtemp(prefix="bench-instr-")
    try:
        trees = {name: _export(rev, os.path.join(scratch, name)) for name, rev in (("A", args.a), ("B", args.b))}
        print(f"A = {args.a}, B = {args.b}; {args.steps} steps, instructions per step (Ir), spin off", flush=True)
        for workload in args.workloads.split(","):
            found: dict[str, list[list[int]]] = {"A": [], "B": []}
            for _ in range(args.repeat):
                for name in ("A", "B"):
                    out = tempfile.mkdtemp(dir=scratch)
                    start = time.monotonic()
                    per_process = measure(trees[name], workload, args.steps, out)
                    found[name].append(per_process)
                    print(f"  {workload:<7} {name}: {sum(per_process):>12,} per step  "
                          f"(by process: {', '.join(f'{n:,}' for n in per_process)}; {time.monotonic() - start:.0f} s)",
                          flush=True)
            a = min(sum(p) for p in found["A"])
            b = min(sum(p) for p in found["B"])
            print(f"{workload:<7} A {a:>12,}  B {b:>12,}  B/A {b / a:.4f}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
