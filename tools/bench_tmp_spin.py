"""zmqautograd next to torch.distributed.rpc (TensorPipe) + torch.distributed.autograd, in one run.

Four processes join both RPC frameworks at once (they are independent), and every workload is
measured alternately, round by round, on one then the other, so that both see the same
machine noise. Prints medians and ratios (zmqautograd / TensorPipe: below 1 is better for
times, above 1 for throughput).

Sharing processes is not neutral: TensorPipe's same-host transport keeps a thread per process
busy-polling all the time, and zmqautograd's waiting threads spin on their shared-memory rings,
so while zmqautograd is measured the two fight for the CPUs (on the 2-vCPU development VM its
small rpc_sync took 104-106 us there against 57-59 us alone; docs/transport.md, "Busy
polling"). So a second table measures small calls, 64 calls in flight, a one-hop backward and
a compute-bound call with each framework alone in its own pair of processes (set to one
intra-op thread each), the groups taking turns sample by sample, each frozen (SIGSTOP) while
another measures (``Group``: this VM's CPU speed swings over seconds, so groups measured one
after the other compared different machines):
TensorPipe, zmqautograd, zmqautograd with the opt-in ``busy_poll``, and the *floor* of a
pure-Python design (tools/floor.py: raw pyzmq and zmqautograd's codec, one thread a side, no
RPC layer), whose throughput says how far beyond TensorPipe's such a design can get at all on
this machine, and the floor of a same-host design without sockets (tools/shm_floor.py:
shared-memory rings read by spinning threads, as TensorPipe's same-host transport), for
latency and throughput. A third table runs the 4-stage pipeline step the same way, each
framework alone in its own 4 processes.

The last column of each table is the share of the machine's CPU time the hypervisor stole
while that row was measured (tools/machine.py): on a shared VM, the slow runs are the runs
with steal. Before and after the tables, a line gives the rate of a plain Python loop (with
nothing stolen, the development VMs still differed 3-4x in it; it does not catch every slow
phase: runs minutes apart at similar loop rates gave one hop 0.60x and 0.79x,
docs/performance.md, "054205e..03aaa82") and the time of a blocking wake-up round trip
between two processes (what TensorPipe's blocking threads can pay per message).

Processes start by ``spawn`` (a fresh interpreter each, as torchrun or containers start
them): each gets its own address layout (ASLR). ``--start-method forkserver`` forks them all
from one server that imported torch and both frameworks first, so they share one layout; where
more processes than CPUs take turns (the pipeline on a 2-vCPU VM), that makes every piece of
work faster for both frameworks (docs/performance.md, "Address layouts").

    python tools/bench.py [--rounds 9] [--launches 3] [--standalone-rounds 7] [--start-method spawn|forkserver]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")  # torch's numpy and c10d chatter; nothing here depends on it

import torch  # noqa: E402
import torch.distributed.autograd as tp_autograd  # noqa: E402
import torch.distributed.rpc as tp_rpc  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zmqautograd.autograd as zmq_autograd  # noqa: E402
import zmqautograd.rpc as zmq_rpc  # noqa: E402
from tools import floor, ports, shm_floor  # noqa: E402
from tools.machine import StealMeter, kind_line, percent, speed_line  # noqa: E402

WORLD = 4
WIDTH = 64
START_METHOD = "spawn"  # --start-method
_weight: torch.Tensor | None = None


def stage(x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage; its weight lives on the worker that runs it."""
    global _weight
    if _weight is None:
        _weight = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(1), requires_grad=True)
    return torch.tanh(x @ _weight)


def identity(value):
    return value


def compute(x: torch.Tensor) -> torch.Tensor:
    """A compute-bound call: 200 small matrix products."""
    for _ in range(200):
        x = torch.tanh(x @ x)
    return x


def _start(function, args: tuple, nprocs: int) -> None:
    """``mp.spawn``, by the chosen start method (START_METHOD)."""
    mp.start_processes(function, args=args, nprocs=nprocs, start_method=START_METHOD)


def _queue():
    return mp.get_context(START_METHOD).SimpleQueue()


def _free_port() -> int:
    return ports.free_port()


def small_latency(rpc, per_round: int) -> float:
    x = torch.zeros(2)
    start = time.perf_counter()
    for _ in range(per_round):
        rpc.rpc_sync("worker1", torch.add, args=(x, 1))
    return (time.perf_counter() - start) / per_round


def async_throughput(rpc, batches: int) -> float:
    x = torch.zeros(2)
    start = time.perf_counter()
    for _ in range(batches):
        torch.futures.wait_all([rpc.rpc_async("worker1", torch.add, args=(x, 1)) for _ in range(64)])
    return batches * 64 / (time.perf_counter() - start)


def big_round_trip(rpc, tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    result = rpc.rpc_sync("worker1", identity, args=(tensor,))
    elapsed = time.perf_counter() - start
    assert result.shape == tensor.shape
    return elapsed


def one_hop_backward(rpc, autograd, per_round: int) -> float:
    """Forward of a small op on another worker, then the distributed backward of it."""
    x = torch.ones(2, requires_grad=True)
    start = time.perf_counter()
    for _ in range(per_round):
        with autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            autograd.backward(context_id, [y.sum()])
            assert autograd.get_gradients(context_id)[x][0] == 2
    return (time.perf_counter() - start) / per_round


def pipeline_step(rpc, autograd, per_round: int) -> float:
    """A 4-stage pipeline (stage 0 here, stages 1-3 on the other workers): forward, then the
    distributed backward through every stage."""
    x = torch.randn(32, WIDTH, requires_grad=True)
    start = time.perf_counter()
    for _ in range(per_round):
        with autograd.context() as context_id:
            h = stage(x)
            for worker in ("worker1", "worker2", "worker3"):
                h = rpc.rpc_sync(worker, stage, args=(h,))
            autograd.backward(context_id, [h.sum()])
    return (time.perf_counter() - start) / per_round


def run(rank: int, tp_port: int, zmq_port: int, rounds: int, ratios) -> None:
    """The shared table: both frameworks in the same 4 processes. Rank 0 measures, prints,
    and puts the ratios it found (by workload title) on ``ratios``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(tp_port)
    tp_rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD,
                    rpc_backend_options=tp_rpc.TensorPipeRpcBackendOptions(num_worker_threads=16))
    zmq_rpc.init_rpc(f"worker{rank}", rank=rank, world_size=WORLD,
                     rpc_backend_options=zmq_rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{zmq_port}"))
    if rank == 0:
        frameworks = {"TensorPipe": (tp_rpc, tp_autograd), "zmqautograd": (zmq_rpc, zmq_autograd)}
        big = torch.randn(4 << 20)  # 16 MiB
        workloads = [
            ("rpc_sync latency, small", "us", 1e6, lambda rpc, _: small_latency(rpc, 200), "time"),
            ("rpc_async throughput, 64 in flight", "calls/s", 1, lambda rpc, _: async_throughput(rpc, 10), "rate"),
            ("16 MiB round trip", "ms", 1e3, lambda rpc, _: big_round_trip(rpc, big), "time"),
            ("dist autograd: one hop fwd+bwd", "us", 1e6, lambda rpc, ag: one_hop_backward(rpc, ag, 50), "time"),
            ("dist autograd: 4-stage pipeline step", "us", 1e6, lambda rpc, ag: pipeline_step(rpc, ag, 20), "time"),
        ]
        print(f"{'workload':<38}{'TensorPipe':>14}{'zmqautograd':>14}{'ratio':>8}{'stolen':>9}", flush=True)
        found = {}
        for title, unit, scale, measure, _kind in workloads:
            for rpc, autograd in frameworks.values():
                measure(rpc, autograd)  # warm-up
            samples = {name: [] for name in frameworks}
            steal = StealMeter()
            for _ in range(rounds):
                for name, (rpc, autograd) in frameworks.items():
                    samples[name].append(measure(rpc, autograd))
            tp, ours = (statistics.median(samples[n]) for n in frameworks)
            print(f"{title:<38}{tp * scale:>10.0f} {unit:<4}{ours * scale:>9.0f} {unit:<4}{ours / tp:>6.2f}x"
                  f"{steal.text():>9}", flush=True)
            found[title] = ours / tp
        ratios.put(found)
    zmq_rpc.shutdown()
    tp_rpc.shutdown()


# ------------------------------------------------------------- each framework on its own

BUSY_POLL = 0.02
STANDALONE = {  # name -> (framework, zmqautograd's busy_poll)
    "TensorPipe": ("tp", 0.0),
    "zmqautograd": ("zmq", 0.0),
    "zmqautograd, spin=0.02": ("zmq", -1.0),
    # No RPC layer at all: what any pure-Python design over ZeroMQ pays per call (tools/floor.py).
    "floor: raw pyzmq + our codec": ("floor", 0.0),
    # Nor sockets: shared-memory rings read by spinning threads (tools/shm_floor.py).
    "floor: shared memory, spinning": ("shm", 0.0),
}
# (title, "time" or "rate") of the standalone table's columns, in run_alone's order.
STANDALONE_COLUMNS = (
    ("rpc_sync small", "time"), ("rpc_async, 64 in flight", "rate"), ("one hop fwd+bwd", "time"),
    ("compute-bound call", "time"),
)


def compute_call(rpc, per_round: int) -> float:
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) * 0.1
    start = time.perf_counter()
    for _ in range(per_round):
        rpc.rpc_sync("worker1", compute, args=(x,))
    return (time.perf_counter() - start) / per_round


def run_alone(rank: int, conn, done, framework: str, busy_poll: float, where) -> None:
    """One framework alone in two processes, each set to one intra-op thread (as CPU jobs
    that run a process per worker often are): rank 0 warms up, then measures a sample of
    every column on each command from ``conn`` (see :class:`Group`)."""
    torch.set_num_threads(1)
    if framework == "floor":
        _floor_alone(rank, conn, where)
        return
    if framework == "shm":
        _shm_floor_alone(rank, conn, where)
        return
    rpc, autograd = _join_alone(rank, 2, framework, busy_poll, where)
    if rank == 0:
        small_latency(rpc, 50)  # warm-up
        async_throughput(rpc, 2)
        one_hop_backward(rpc, autograd, 20)
        compute_call(rpc, 5)

        workloads = (  # (warm-up, measure): after a freeze the caches hold the other groups' work
            (lambda: small_latency(rpc, 20), lambda: small_latency(rpc, 200)),
            (lambda: async_throughput(rpc, 1), lambda: async_throughput(rpc, 10)),
            (lambda: one_hop_backward(rpc, autograd, 5), lambda: one_hop_backward(rpc, autograd, 50)),
            (lambda: compute_call(rpc, 2), lambda: compute_call(rpc, 20)),
        )

        def sample() -> tuple:
            values = []
            for warm_up, measure in workloads:
                warm_up()
                values.append(measure())
            return tuple(values)

        _measure_on_command(conn, sample)
    else:
        done.wait()
    rpc.shutdown()


def _join_alone(rank: int, world: int, framework: str, busy_poll: float, port: int,
                device_maps: dict | None = None, **zmq_options) -> tuple:
    """``init_rpc`` of one framework alone ("tp" or "zmq"): its rpc and autograd modules.
    ``device_maps``: peer name -> device map; ``zmq_options``: more ZmqRpcBackendOptions."""
    if framework == "tp":
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        rpc, autograd = tp_rpc, tp_autograd
        options = tp_rpc.TensorPipeRpcBackendOptions(num_worker_threads=16)
    else:
        rpc, autograd = zmq_rpc, zmq_autograd
        if busy_poll == -1.0:
            busy_poll, zmq_options = 0.0, dict(zmq_options, spin=0.02)
        options = zmq_rpc.ZmqRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", busy_poll=busy_poll,
                                               **zmq_options)
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, mapping)
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    return rpc, autograd


def run_pipeline_alone(rank: int, conn, done, framework: str, port: int) -> None:
    """The 4-stage pipeline step with one framework alone in its 4 processes (no other
    framework's threads compete for the CPUs, see the module's docstring): rank 0 measures
    20 steps on each command from ``conn``."""
    torch.set_num_threads(1)
    rpc, autograd = _join_alone(rank, WORLD, framework, 0.0, port)
    if rank == 0:
        pipeline_step(rpc, autograd, 20)  # warm-up

        def sample() -> float:
            pipeline_step(rpc, autograd, 2)  # after a freeze the caches hold the other group's work
            return pipeline_step(rpc, autograd, 20)

        _measure_on_command(conn, sample)
    else:
        done.wait()
    rpc.shutdown()


def standalone_pipeline(launches: int, rounds: int) -> float:
    """The pipeline step with each framework alone; prints the table and returns our ratio."""
    groups = {"TensorPipe": (run_pipeline_alone, ("tp", _free_port), WORLD),
              "zmqautograd": (run_pipeline_alone, ("zmq", _free_port), WORLD)}
    samples, stolen = interleaved(groups, launches, rounds)
    print(f"\neach framework alone, {WORLD} processes, torch.set_num_threads(1) ({launches} launches of"
          f" {rounds} interleaved rounds of 20 steps; started by {START_METHOD})", flush=True)
    print(f"{'':<34}{'4-stage pipeline step':>24}{'stolen':>9}", flush=True)
    tp = statistics.median(samples["TensorPipe"])
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<34}{median * 1e6:>11.0f} us {median / tp:>5.2f}x{percent(_median_share(stolen[name])):>9}",
              flush=True)
    # Most of the spread between runs is the launch (each gets new address layouts: the
    # module's docstring), so each launch's own ratio is shown too.
    ours, theirs = samples["zmqautograd"], samples["TensorPipe"]
    per_launch = [statistics.median(ours[i:i + rounds]) / statistics.median(theirs[i:i + rounds])
                  for i in range(0, len(ours), rounds)]
    print(f"{'zmqautograd, launch by launch':<34}{' / '.join(f'{r:.2f}x' for r in per_launch):>24}", flush=True)
    return statistics.median(samples["zmqautograd"]) / tp


def _floor_alone(rank: int, conn, port: int) -> None:
    """run_alone for the floor: rank 1 serves, rank 0 measures its throughput. Not its
    latency: a thread that blocks in libzmq's receive is no floor for that (it took
    600-680 us where zmqautograd's rpc_sync, whose waiting thread receives for itself,
    took ~550); tools/bench_transport.py's raw ping-pong is."""
    if rank == 1:
        floor.serve(port)
        return
    client = floor.Client(port)
    try:
        small_latency(client, 50)  # warm-up (the connection too)
        client.throughput(2)
        _measure_on_command(conn, lambda: (None, client.throughput(10), None, None))
    finally:
        client.close()


def _shm_floor_alone(rank: int, conn, name: str) -> None:
    """run_alone for the shared-memory floor (``name``: its memory, made by ``standalone``):
    rank 1 serves, rank 0 measures small-call latency, throughput and the one-hop floor of
    distributed autograd (tools/floor.py, ``one_hop``)."""
    if rank == 1:
        shm_floor.serve(name)
        return
    client = shm_floor.Client(name)
    try:
        small_latency(client, 200)  # warm-up
        client.throughput(2)
        client.one_hop(20)

        def sample() -> tuple:
            small_latency(client, 20)
            latency = small_latency(client, 200)
            rate = client.throughput(10)
            client.one_hop(5)
            return (latency, rate, client.one_hop(50), None)

        _measure_on_command(conn, sample)
    finally:
        client.close()


def standalone(launches: int, rounds: int) -> dict[str, float]:
    """The tables of each framework alone in 2 processes; prints them and returns zmqautograd's
    ratios to TensorPipe by column title."""
    # Where each group meets, made anew for each launch: a port, or the shm floor's memory.
    groups = {name: (run_alone, (framework, busy_poll, shm_floor.create if framework == "shm" else _free_port), 2)
              for name, (framework, busy_poll) in STANDALONE.items()}
    floors = frozenset(name for name, (framework, _) in STANDALONE.items() if framework in ("floor", "shm"))
    samples, stolen = interleaved(groups, launches, rounds, optional=floors)
    print(f"\neach framework alone, 2 processes, torch.set_num_threads(1) ({launches} launches of {rounds}"
          " interleaved rounds; ratios to TensorPipe: times, and calls/s for the rpc_async column)", flush=True)
    print(f"{'':<34}" + "".join(f"{title:>24}" for title, _ in STANDALONE_COLUMNS) + f"{'stolen':>9}", flush=True)
    tp = [statistics.median(v[i] for v in samples["TensorPipe"]) for i in range(len(STANDALONE_COLUMNS))]
    for name, values in samples.items():
        if not values:  # a floor that failed in every launch (its errors are on stderr above)
            print(f"{name:<34}{'failed':>24}", flush=True)
            continue
        cells = []
        for i, (_, kind) in enumerate(STANDALONE_COLUMNS):
            if values[0][i] is None:  # the floors measure what they can (_floor_alone, _shm_floor_alone)
                cells.append(f"{'-':>24}")
                continue
            median = statistics.median(v[i] for v in values)
            shown = f"{median * 1e6:>11.0f} us" if kind == "time" else f"{median:>8.0f} calls/s"
            cells.append(f"{shown:>17} {median / tp[i]:>5.2f}x")
        print(f"{name:<34}" + "".join(cells) + f"{percent(_median_share(stolen[name])):>9}", flush=True)
    ours = samples["zmqautograd"]
    return {title: statistics.median(v[i] for v in ours) / tp[i] for i, (title, _) in enumerate(STANDALONE_COLUMNS)}


def _median_share(shares: list) -> float | None:
    known = [share for share in shares if share is not None]
    return statistics.median(known) if known else None


# ------------------------------------------------------- interleaving frozen process groups

def _measure_on_command(conn, sample) -> None:
    """Rank 0 of a :class:`Group`: say it is ready (warmed up), then answer each "sample"
    command with ``sample()``, until "stop"."""
    conn.send("ready")
    while conn.recv() == "sample":
        conn.send(sample())


class Group:
    """One framework's processes, started once and frozen (SIGSTOP) except while their rank 0
    measures a sample on command, so that several groups can take turns sample by sample.

    Why: the development VM's CPU speed swings by up to 1.7x over seconds with no time
    stolen (a plain Python loop: 29,000-61,000 iterations of 1,000 adds a second, minutes
    apart, nothing else running), so groups launched one after the other, each measuring for
    ~10 s, compared a fast phase of the machine with a slow one (the pipeline's ratio took
    0.55x, 1.02x and 1.86x in three runs of the same code within minutes). Taking turns
    sample by sample puts both frameworks in the same phases. While frozen a group uses no
    CPU at all, not even the threads that poll or spin (TensorPipe's do all the time), so
    the one measuring has the machine to itself, as when it runs alone.

    ``function(rank, conn, done, *args)`` runs in every process: rank 0 calls
    :func:`_measure_on_command` on ``conn``; the other ranks wait for ``done``, which
    :meth:`close` sets as it tells rank 0 to stop, then all shut down together (no shutdown
    is under way while samples are taken)."""

    def __init__(self, function, args: tuple, nprocs: int) -> None:
        context = mp.get_context(START_METHOD)
        self._conn, child = context.Pipe()
        self._done = context.Event()
        self._processes = mp.start_processes(function, args=(child, self._done, *args), nprocs=nprocs,
                                             start_method=START_METHOD, join=False)
        child.close()  # (ours; the children hold theirs)

    def _receive(self):
        """The next answer of rank 0; where a process failed instead, its exception (with the
        traceback it left), never a hang."""
        while True:
            if self._conn.poll(1.0):
                try:
                    return self._conn.recv()
                except EOFError:  # rank 0 is gone: join says why
                    self._processes.join(10)
                    raise RuntimeError("rank 0 of a benchmark group ended without answering") from None
            if self._processes.join(0):
                raise RuntimeError("a benchmark group ended without answering")

    def wait_ready(self) -> None:
        """Wait until rank 0 has warmed up, then freeze the group."""
        answer = self._receive()
        if answer != "ready":
            raise RuntimeError(f"a benchmark group said {answer!r} where it should have said it was ready")
        self._signal(signal.SIGSTOP)

    def sample(self):
        """One sample, measured while every other group is frozen."""
        self._signal(signal.SIGCONT)
        try:
            self._conn.send("sample")
            return self._receive()
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        """Let the processes finish; kill them if they do not within a minute."""
        self._signal(signal.SIGCONT)
        try:
            self._conn.send("stop")
            self._done.set()
            deadline = time.monotonic() + 60
            while not self._processes.join(max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise RuntimeError("benchmark processes did not finish within 60 s")
        finally:
            for process in self._processes.processes:
                if process.is_alive():
                    process.kill()
            self._conn.close()

    def _signal(self, number: int) -> None:
        for process in self._processes.processes:
            if process.is_alive():
                os.kill(process.pid, number)


def interleaved(groups: dict, launches: int, rounds: int, optional: frozenset = frozenset()) -> tuple[dict, dict]:
    """Samples of every group, taking turns (see :class:`Group`). ``groups``: name ->
    (function, args, nprocs), where an arg that is callable is called anew for each launch
    (a free port, shared memory). Each launch starts every group afresh (new address
    layouts) and takes ``rounds`` samples of each, the order reversed every round. Returns
    the samples and the stolen shares by name. A group named in ``optional`` (a reference
    row: the floors) that fails is left out of the rest of its launch, with its error on
    stderr, instead of ending the run."""
    samples: dict[str, list] = {name: [] for name in groups}
    stolen: dict[str, list] = {name: [] for name in groups}

    def drop(name: str, exc: Exception) -> None:
        if name not in optional:
            raise exc
        last = [line for line in str(exc).splitlines() if line.strip()][-1:] or [repr(exc)]
        print(f"benchmark group {name!r} failed, left out of this launch: {last[0]}", file=sys.stderr, flush=True)
        try:
            started.pop(name).close()
        except Exception:  # noqa: BLE001 - it failed already; close() killed what was left
            pass

    for _ in range(launches):
        started: dict[str, Group] = {}
        memories = []
        try:
            for name, (function, args, nprocs) in groups.items():
                made = [arg() if callable(arg) else arg for arg in args]
                memories += [arg for arg in made if hasattr(arg, "unlink")]
                started[name] = Group(function, tuple(arg.name if hasattr(arg, "unlink") else arg for arg in made),
                                      nprocs)
            for name, group in list(started.items()):
                try:
                    group.wait_ready()
                except Exception as exc:  # noqa: BLE001 - drop() re-raises unless optional
                    drop(name, exc)
            order = list(started)
            for round_ in range(rounds):
                for name in order if round_ % 2 == 0 else reversed(order):
                    if name not in started:
                        continue
                    steal = StealMeter()
                    try:
                        samples[name].append(started[name].sample())
                    except Exception as exc:  # noqa: BLE001 - drop() re-raises unless optional
                        drop(name, exc)
                        continue
                    stolen[name].append(steal.share())
        finally:
            for group in started.values():
                try:
                    group.close()
                except Exception as exc:  # noqa: BLE001 - the others must still close
                    print(f"closing a benchmark group: {exc}", file=sys.stderr, flush=True)
            for memory in memories:
                memory.close()
                memory.unlink()
    return samples, stolen


# The performance goals of issues 3 and 4: (table, column or workload, "<=" or ">=", ratio).
# Ratios are zmqautograd / TensorPipe (for throughput, calls/s over calls/s).
GOALS = (
    ("alone", "rpc_sync small", "<=", 0.5),
    ("alone", "rpc_async, 64 in flight", ">=", 2.0),
    ("shared", "16 MiB round trip", "<=", 1.5),
    ("alone", "one hop fwd+bwd", "<=", 0.6),
    ("alone", "4-stage pipeline step", "<=", 0.6),
)


def print_goals(ratios: dict[str, dict[str, float]]) -> None:
    """Each goal with this run's ratio and whether it was met ("alone": each framework in its
    own processes; "shared": both in the same four)."""
    print("\ngoals (issues 3 and 4), this run:", flush=True)
    for table, title, sense, goal in GOALS:
        ratio = ratios.get(table, {}).get(title)
        if ratio is None:
            continue
        met = ratio <= goal if sense == "<=" else ratio >= goal
        verdict = "met" if met else "NOT met"
        print(f"  {title + ' (' + table + ')':<40}{ratio:>6.3f}x  goal {sense} {goal}x: {verdict}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--launches", type=int, default=3,
                        help="launches of the process groups of the tables of each framework alone (0: skip them)")
    parser.add_argument("--standalone-rounds", type=int, default=7,
                        help="samples of each group per launch, in turns")
    parser.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn",
                        help="how worker processes start (see above); the goals are for spawn")
    args = parser.parse_args()
    global START_METHOD
    START_METHOD = args.start_method
    if START_METHOD == "forkserver":
        print("processes started by forkserver: one address layout for all (docs/performance.md)", flush=True)
        mp.set_forkserver_preload(["torch", "torch.distributed.rpc", "zmqautograd.rpc", "zmqautograd.autograd"])
    print(kind_line(), flush=True)
    print(speed_line("before"), flush=True)
    shared = _queue()
    _start(run, (_free_port(), _free_port(), args.rounds, shared), WORLD)
    ratios = {"shared": shared.get()}
    if args.launches:
        ratios["alone"] = standalone(args.launches, args.standalone_rounds)
        ratios["alone"]["4-stage pipeline step"] = standalone_pipeline(args.launches, args.standalone_rounds)
    print(speed_line("after"), flush=True)
    print_goals(ratios)


if __name__ == "__main__":
    main()
