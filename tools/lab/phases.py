"""Where a dist autograd step's time goes, phase by phase, TensorPipe next to zmqautograd.

The bench (tools/bench.py) times whole steps; this splits the one-hop step or the 4-stage
pipeline step of the bench into what the caller sees: entering the context, the local stage,
each ``rpc_sync`` of the forward, the loss, ``backward``, ``get_gradients`` (one hop) and
leaving the context (which releases it everywhere). ``fan4`` and ``fan8`` split the fan-out
step of tools/bench_scale.py (world 4 and 8) the same way: the ``rpc_async`` calls, the
waits for their answers, the loss, ``backward``, ``get_gradients``. Each framework runs
alone in its own processes (one intra-op thread each), the launches alternating
(TensorPipe, zmqautograd, TensorPipe, ...); a phase's figure is the median over its steps,
and the table gives the median over launches and the ratio zmqautograd / TensorPipe. It
answers "which half of the step is behind" (e.g. the forward's calls or the backward's
messages) before any tracing.

    python tools/lab/phases.py hop|pipe|fan4|fan8 [--steps 1000] [--launches 2] [--frameworks tp,zmq]

``--frameworks zmq`` measures ours alone (TensorPipe's ``init_rpc`` needs numpy, which only
the benchmark's extras install): its column and the ratios then show "-".
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tools import ports  # noqa: E402
from tools.machine import kind_line  # noqa: E402
from tools.bench import WIDTH, _join_alone, stage  # noqa: E402

FRAMEWORKS = {"tp": "TensorPipe", "zmq": "zmqautograd"}  # key -> the table's heading
STAGES = ("worker1", "worker2", "worker3")
HOP_PHASES = ["enter", "rpc_sync", "loss", "backward", "get_gradients", "exit"]
PIPELINE_PHASES = ["enter", "stage 0 (local)"] + [f"rpc_sync to {w}" for w in STAGES] + ["loss", "backward", "exit"]
FAN_PHASES = ["enter", "rpc_async calls", "their waits", "loss", "backward", "get_gradients", "exit"]


def _backward_marked(autograd, context_id: int, loss, x, marks: list, clock) -> torch.Tensor:
    """``backward`` and ``get_gradients`` (``x``'s gradient), each followed by a mark."""
    autograd.backward(context_id, [loss])
    marks.append(clock())
    grad = autograd.get_gradients(context_id)[x]
    marks.append(clock())
    return grad


def hop_step(rpc, autograd, x, clock) -> list[float]:
    """The one-hop step of the bench, with a mark at each boundary of HOP_PHASES."""
    marks = [clock()]
    with autograd.context() as context_id:
        marks.append(clock())
        y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
        marks.append(clock())
        loss = y.sum()
        marks.append(clock())
        grad = _backward_marked(autograd, context_id, loss, x, marks, clock)
    marks.append(clock())
    if grad[0] != 2:
        raise AssertionError(f"one hop: gradient {grad} instead of 2")
    return marks


def pipeline_step(rpc, autograd, x, clock) -> list[float]:
    """The 4-stage pipeline step of the bench, with a mark at each boundary of PIPELINE_PHASES."""
    marks = [clock()]
    with autograd.context() as context_id:
        marks.append(clock())
        h = stage(x)
        marks.append(clock())
        for worker in STAGES:
            h = rpc.rpc_sync(worker, stage, args=(h,))
            marks.append(clock())
        loss = h.sum()
        marks.append(clock())
        autograd.backward(context_id, [loss])
        marks.append(clock())
    marks.append(clock())
    return marks


def fan_step(rpc, autograd, x, clock, world: int) -> list[float]:
    """A fan-out step of tools/bench_scale.py (the driver calls its ``world - 1`` workers at
    once, sums, backward), with a mark at each boundary of FAN_PHASES: its backward is where
    a wide fan-out fell behind TensorPipe (docs/performance.md)."""
    workers = [f"worker{rank}" for rank in range(1, world)]
    marks = [clock()]
    with autograd.context() as context_id:
        marks.append(clock())
        futures = [rpc.rpc_async(worker, torch.mul, args=(x, 2)) for worker in workers]
        marks.append(clock())
        values = [future.wait() for future in futures]
        marks.append(clock())
        loss = torch.stack(values).sum()
        marks.append(clock())
        grad = _backward_marked(autograd, context_id, loss, x, marks, clock)
    marks.append(clock())
    if not bool((grad == 2 * len(workers)).all()):
        raise AssertionError(f"fan-out to {len(workers)}: gradient {grad} instead of {2 * len(workers)} everywhere")
    return marks


# kind -> (processes, phase names, the step, its input, as the bench's)
KINDS = {
    "hop": (2, HOP_PHASES, hop_step, lambda: torch.ones(2, requires_grad=True)),
    "pipe": (4, PIPELINE_PHASES, pipeline_step, lambda: torch.randn(32, WIDTH, requires_grad=True)),
    # bench_scale.py's fan-out rows (4 by 16 inputs), world 4 and 8
    **{f"fan{world}": (world, FAN_PHASES, functools.partial(fan_step, world=world),
                       lambda: torch.randn(4, 16, requires_grad=True)) for world in (4, 8)},
}


def _run(rank: int, framework: str, kind: str, port: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    world, names, step, make_input = KINDS[kind]
    rpc, autograd = _join_alone(rank, world, framework, 0.0, port)
    if rank == 0:
        x = make_input()
        clock = time.perf_counter
        for _ in range(max(10, steps // 10)):  # warm-up
            step(rpc, autograd, x, clock)
        columns: list[list[float]] = [[] for _ in range(len(names) + 1)]
        for _ in range(steps):
            marks = step(rpc, autograd, x, clock)
            for column, (start, end) in zip(columns, zip(marks, marks[1:])):
                column.append(end - start)
            columns[-1].append(marks[-1] - marks[0])
        results.put([statistics.median(column) * 1e6 for column in columns])
    rpc.shutdown()


def measure(kind: str, steps: int, launches: int, frameworks: tuple = tuple(FRAMEWORKS)) -> dict[str, list[list[float]]]:
    """Per framework measured, one list of phase medians (us; the last: the whole step) per launch."""
    world = KINDS[kind][0]
    context = mp.get_context("spawn")
    found: dict[str, list[list[float]]] = {framework: [] for framework in frameworks}
    for _ in range(launches):
        for framework in frameworks:
            results = context.SimpleQueue()
            mp.start_processes(_run, args=(framework, kind, ports.free_port(), steps, results), nprocs=world,
                               start_method="spawn")
            found[framework].append(results.get())
    return found


def table(kind: str, found: dict[str, list[list[float]]]) -> list[str]:
    """The printed table: each phase's median over launches per framework ("-" for one not
    measured), and the ratio."""
    names = KINDS[kind][1] + ["whole step"]
    lines = [f"{'phase (' + kind + ')':<24}{FRAMEWORKS['tp']:>12}{FRAMEWORKS['zmq']:>13}{'ratio':>8}"]

    def median(framework: str, index: int) -> float | None:
        launches = found.get(framework)
        return statistics.median(launch[index] for launch in launches) if launches else None

    def cell(value: float | None, width: int) -> str:
        return f"{value:>{width},.1f} us" if value is not None else f"{'-':>{width + 3}}"

    for index, name in enumerate(names):
        tp, ours = median("tp", index), median("zmq", index)
        ratio = f"{ours / tp:.2f}x" if tp and ours is not None else "-"
        lines.append(f"{name:<24}{cell(tp, 9)}{cell(ours, 10)}{ratio:>8}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--launches", type=int, default=2, help="launches of each framework, alternating")
    parser.add_argument("--frameworks", default="tp,zmq", help="which to measure, of tp and zmq (comma-separated)")
    args = parser.parse_args()
    frameworks = tuple(name for name in args.frameworks.split(",") if name)
    if not frameworks or not set(frameworks) <= set(FRAMEWORKS):
        parser.error(f"--frameworks takes a comma-separated choice of {', '.join(FRAMEWORKS)}")
    print(kind_line(), flush=True)
    found = measure(args.kind, args.steps, args.launches, frameworks)
    print(f"medians over {args.steps} steps, median of {args.launches} launch(es) each, each framework alone, "
          f"torch.set_num_threads(1), spawn", flush=True)
    for line in table(args.kind, found):
        print(line, flush=True)


if __name__ == "__main__":
    main()
