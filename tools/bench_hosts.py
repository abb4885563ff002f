"""Between hosts: zmqautograd next to TensorPipe, every byte over TCP, in one run.

Two (``--hosts 3``: three) "hosts", each a network namespace on one bridge (tools/netns.py),
and every worker in a pid namespace of its own as well (``unshare --pid --fork``): workers in
one pid namespace of one boot may read each other's memory, and zmqautograd then lends big
buffers or moves them through shared-memory rings instead of the socket (as TensorPipe's
``cma`` channel would). Separate pid namespaces rule both out, as between real machines; the
driver checks that they did (no buffer lent or borrowed, no ring, and each worker's pid
namespace differs from the driver's) and says so in its output, or fails.

Each configuration runs alone in its own processes, the launches alternating
(TensorPipe, zmqautograd's default, ``encrypt=False``, then again), and a size's figure is
the median of its launch's round trips, best over launches. Measured: ``rpc_sync`` of an
identity function (the tensor goes and comes back), from the driver to worker 1 (``--hosts
3``: to both workers at once, ``rpc_async``), and the one-way throughput of one 256 MiB
tensor to a function that returns its size. CPU seconds per GiB moved count every process
of the group (all their threads: ``time.process_time``) over the timed calls.

Needs root (network namespaces). ``--load N`` runs N busy Python loops on the machine
meanwhile (a machine under load).

    python3 dev.py bench-hosts [--hosts 2|3] [--launches 2] [--load 0] [--configs tp,default,plain]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
warnings.filterwarnings("ignore")  # torch's numpy and c10d chatter

from tools.netns import SUBNET, bridged_hosts  # noqa: E402

SIZES = {"4 KiB": 4 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20, "64 MiB": 64 << 20}
CALLS = {4 << 10: 200, 1 << 20: 40, 16 << 20: 8, 64 << 20: 4}
ONE_WAY = 256 << 20
SECRET = "bench-hosts: a cluster secret of this run only"
CONFIGS = {"tp": "TensorPipe", "default": "default (encrypted)", "plain": "encrypt=False + secret"}
PORT = 29531


# ------------------------------------------------------------------ run on the workers

def identity(value):
    return value


def size_of(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def cpu_seconds() -> float:
    return time.process_time()


def namespaces() -> dict[str, str]:
    return {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in ("pid", "net")}


def transport_paths() -> dict[str, int]:
    """What went around the socket: buffers lent or borrowed, peers on a ring (zmqautograd)."""
    from zmqautograd.rpc import api

    stats = api._current().endpoint.stats().values()
    return {"lent": sum(s.buffers_lent for s in stats), "borrowed": sum(s.buffers_borrowed for s in stats),
            "rings": sum(s.shared_memory for s in stats)}


def _rpc_module(config: str):
    if config == "tp":
        import torch.distributed.rpc as rpc
        return rpc
    import zmqautograd.rpc as rpc
    return rpc


def _options(rpc, config: str, master: str):
    if config == "tp":
        return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{master}", num_worker_threads=8, rpc_timeout=300)
    return rpc.ZmqRpcBackendOptions(init_method=f"tcp://{master}", rpc_timeout=300, cluster_secret=SECRET,
                                    encrypt=config != "plain", num_worker_threads=8)


def _timed(rpc, peers: list[str], tensor, calls: int) -> tuple[float, float]:
    """Median round trip of ``calls`` (after two unmeasured), and the group's CPU seconds."""
    import torch

    for _ in range(2):
        torch.futures.wait_all([rpc.rpc_async(p, identity, args=(tensor,)) for p in peers])
    cpu_before = cpu_seconds() + sum(rpc.rpc_sync(p, cpu_seconds) for p in peers)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        results = torch.futures.wait_all([rpc.rpc_async(p, identity, args=(tensor,)) for p in peers])
        times.append(time.perf_counter() - start)
        assert all(r.shape == tensor.shape for r in results)
    cpu = cpu_seconds() + sum(rpc.rpc_sync(p, cpu_seconds) for p in peers) - cpu_before
    return statistics.median(times), cpu


def drive(rpc, config: str, world: int, sizes: list[int]) -> dict:
    import torch

    peers = [f"worker{r}" for r in range(1, world)]
    mine = namespaces()
    theirs = [rpc.rpc_sync(p, namespaces) for p in peers]
    assert all(t["pid"] != mine["pid"] and t["net"] != mine["net"] for t in theirs), (mine, theirs)
    result: dict = {"round_trip": {}, "cpu_per_gib": {}}
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        seconds, cpu = _timed(rpc, peers, tensor, CALLS[nbytes])
        moved = 2 * nbytes * len(peers) * CALLS[nbytes]
        result["round_trip"][nbytes] = seconds
        result["cpu_per_gib"][nbytes] = cpu / (moved / (1 << 30))
    big = torch.ones(ONE_WAY // 4)
    rpc.rpc_sync(peers[0], size_of, args=(big,))
    start = time.perf_counter()
    for _ in range(2):
        assert rpc.rpc_sync(peers[0], size_of, args=(big,)) == ONE_WAY
    result["one_way_mb_s"] = 2 * ONE_WAY / (time.perf_counter() - start) / 1e6
    if config != "tp":
        paths = [transport_paths(), *(rpc.rpc_sync(p, transport_paths) for p in peers)]
        assert not any(any(p.values()) for p in paths), f"not the socket path: {paths}"
        result["socket_path"] = True
    return result


def worker(rank: int, world: int, config: str, master: str, sizes: list[int]) -> None:
    rpc = _rpc_module(config)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=_options(rpc, config, master))
    result = drive(rpc, config, world, sizes) if rank == 0 else None
    rpc.shutdown()
    if result is not None:
        print(json.dumps(result), flush=True)


# ------------------------------------------------------------------ run by the user

def launch(hosts: list[str], config: str, sizes: list[int], timeout: float) -> dict:
    master = f"{SUBNET}.1:{PORT}"
    env = {**os.environ, "PYTHONPATH": ROOT, "TP_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0",
           "OMP_NUM_THREADS": "1"}
    env.pop("ZMQAUTOGRAD_CLUSTER_SECRET", None)
    processes = [
        subprocess.Popen(["ip", "netns", "exec", host, "unshare", "--pid", "--fork", sys.executable,
                          "-m", "tools.bench_hosts", "--worker", str(rank), "--world", str(len(hosts)),
                          "--config", config, "--master", master, "--sizes", ",".join(map(str, sizes))],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
        for rank, host in enumerate(hosts)]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:  # the whole session: unshare's child outlives a killed unshare
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    if any(process.returncode != 0 for process in processes):
        errors = "\n".join(f"--- worker {rank} (exit {process.returncode}):\n{err[-3000:]}"
                           for rank, (process, (_, err)) in enumerate(zip(processes, outputs)))
        raise SystemExit(f"{CONFIGS[config]}: a worker failed:\n{errors}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def _best(results: list[dict]) -> dict:
    best: dict = {"round_trip": {}, "cpu_per_gib": {}}
    for key in ("round_trip", "cpu_per_gib"):
        for nbytes in results[0][key]:
            best[key][nbytes] = min(r[key][nbytes] for r in results)
    best["one_way_mb_s"] = max(r["one_way_mb_s"] for r in results)
    best["socket_path"] = all(r.get("socket_path", False) for r in results)
    return best


def report(best: dict[str, dict], hosts: int) -> None:
    configs = list(best)
    base = best.get("tp")
    what = "round trip, driver to worker 1" if hosts == 2 else "round trip, driver to both workers at once"
    print(f"\n{what} (median of a launch, best launch; x: time / TensorPipe's)")
    print(f"{'tensor':>8}" + "".join(f"{CONFIGS[c]:>26}" for c in configs))
    for label, nbytes in SIZES.items():
        key = str(nbytes)
        if key not in best[configs[0]]["round_trip"]:
            continue
        cells = []
        for c in configs:
            seconds = best[c]["round_trip"][key]
            ratio = f" ({seconds / base['round_trip'][key]:.2f}x)" if base and c != "tp" else ""
            cells.append(f"{seconds * 1e3:.2f} ms{ratio}")
        print(f"{label:>8}" + "".join(f"{cell:>26}" for cell in cells))
    print("\nCPU seconds per GiB moved, all processes of the group")
    for label, nbytes in SIZES.items():
        key = str(nbytes)
        if key in best[configs[0]]["cpu_per_gib"]:
            print(f"{label:>8}" + "".join(f"{best[c]['cpu_per_gib'][key]:>26.2f}" for c in configs))
    print(f"\none way, {ONE_WAY >> 20} MiB tensor, MB/s (x: / TensorPipe's)")
    cells = []
    for c in configs:
        rate = best[c]["one_way_mb_s"]
        cells.append(f"{rate:.0f}" + (f" ({rate / base['one_way_mb_s']:.2f}x)" if base and c != "tp" else ""))
    print(f"{'':>8}" + "".join(f"{cell:>26}" for cell in cells))
    zmq = [c for c in configs if c != "tp"]
    if zmq:
        assert all(best[c]["socket_path"] for c in zmq)
        print("\nsocket path: every byte of zmqautograd crossed TCP (no buffer lent, no shared-memory ring;"
              " every worker in a pid and network namespace of its own)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2, choices=(2, 3))
    parser.add_argument("--launches", type=int, default=2)
    parser.add_argument("--load", type=int, default=0, help="busy Python loops running meanwhile")
    parser.add_argument("--configs", default="tp,default,plain")
    parser.add_argument("--sizes", default=",".join(str(s) for s in SIZES.values()))
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.worker is not None:
        worker(args.worker, args.world, args.config, args.master, sizes)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench-hosts needs root: it makes network namespaces (ip netns) and pid namespaces")
    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"unknown configuration {config!r}; known: {', '.join(CONFIGS)}")
    from tools.machine import kind_line, speed_line

    print(kind_line(), flush=True)
    print(speed_line("before"), flush=True)
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        with bridged_hosts(args.hosts) as hosts:
            for round_ in range(args.launches):
                for config in configs:
                    start = time.monotonic()
                    results[config].append(launch(hosts, config, sizes, timeout=600))
                    print(f"launch {round_ + 1}, {CONFIGS[config]}: {time.monotonic() - start:.0f} s", flush=True)
    finally:
        for process in load:
            process.kill()
    print(speed_line("after"), flush=True)
    print(f"{args.hosts} hosts, {args.load} busy loops beside; {time.strftime('%Y-%m-%d %H:%M')}")
    report({c: _best(r) for c, r in results.items()}, args.hosts)


if __name__ == "__main__":
    main()
