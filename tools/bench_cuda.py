"""CUDA tensors between two workers that share one GPU: zmqautograd next to
torch.distributed.rpc (TensorPipe) + torch.distributed.autograd, in one run.

Each framework runs alone in its own pair of processes (the frameworks alternate, round by
round), both ranks on ``cuda:0`` with the device map ``{0: 0}`` both ways, so that CUDA tensors
travel as CUDA tensors. TensorPipe picks its own CUDA channel (CUDA IPC where the driver allows it: the
receiver copies straight from the sender's GPU memory, no host copy at all), as does
zmqautograd by default (transport/cuda_ipc.py); a third group runs zmqautograd with
``cuda_ipc=False``, staging tensors through pinned host buffers (a device-to-host copy on
the sender, the bytes over its same-host transport, a host-to-device copy on the receiver).

Every call is followed by a synchronization of the current stream, so a time includes the
result being usable on the GPU. Prints medians and ratios (zmqautograd / TensorPipe).

    python tools/bench_cuda.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tools.bench import _free_port, _join_alone, identity  # noqa: E402

SIZES = (("4 KiB", 1 << 10), ("1 MiB", 1 << 18), ("16 MiB", 1 << 22), ("64 MiB", 1 << 24))  # float32 elements
COLUMNS = tuple(f"{title} round trip" for title, _ in SIZES) + ("one hop fwd+bwd", "pipeline step")


def round_trip(rpc, tensor: torch.Tensor, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        result = rpc.rpc_sync("worker1", identity, args=(tensor,))
        torch.cuda.current_stream().synchronize()
    elapsed = (time.perf_counter() - start) / calls
    assert result.device == tensor.device and result.shape == tensor.shape
    return elapsed


def one_hop(rpc, autograd, calls: int) -> float:
    """A small op on the other worker on CUDA tensors, and the distributed backward of it:
    the gradient comes back through the inverse device map."""
    x = torch.ones(2, device="cuda:0", requires_grad=True)
    start = time.perf_counter()
    for _ in range(calls):
        with autograd.context() as context_id:
            y = rpc.rpc_sync("worker1", torch.mul, args=(x, 2))
            autograd.backward(context_id, [y.sum()])
            grad = autograd.get_gradients(context_id)[x]
            torch.cuda.current_stream().synchronize()
    elapsed = (time.perf_counter() - start) / calls
    assert grad.device == x.device and torch.equal(grad.cpu(), torch.full((2,), 2.0))
    return elapsed


_weight: torch.Tensor | None = None


def cuda_stage(x: torch.Tensor) -> torch.Tensor:
    """A stage on the GPU whose weight lives on the worker that runs it."""
    global _weight
    if _weight is None:
        _weight = torch.randn(1024, 1024, device="cuda:0", generator=torch.Generator("cuda:0").manual_seed(1),
                              requires_grad=True)
    return torch.tanh(x @ _weight)


def pipeline(rpc, autograd, calls: int) -> float:
    """Two stages, one a worker: a 256 x 1024 activation (1 MiB) there and back, and its
    gradient the other way."""
    x = torch.randn(256, 1024, device="cuda:0", requires_grad=True)
    start = time.perf_counter()
    for _ in range(calls):
        with autograd.context() as context_id:
            h = rpc.rpc_sync("worker1", cuda_stage, args=(cuda_stage(x),))
            autograd.backward(context_id, [h.sum()])
            torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - start) / calls


def run_alone(rank: int, framework: str, port: int, results) -> None:
    torch.cuda.set_device(0)
    maps = {f"worker{1 - rank}": {0: 0}}
    if framework == "tp":
        rpc, autograd = _join_alone(rank, 2, "tp", 0.0, port, maps)
    else:  # "zmq-staged": CUDA IPC off, tensors staged through pinned host memory
        rpc, autograd = _join_alone(rank, 2, "zmq", 0.0, port, maps, cuda_ipc=framework == "zmq")
    if rank == 0:
        measures = [lambda t=torch.randn(n, device="cuda:0"), c=max(3, min(200, (64 << 20) // (4 * n))): round_trip(rpc, t, c)
                    for _, n in SIZES]
        measures += [lambda: one_hop(rpc, autograd, 50), lambda: pipeline(rpc, autograd, 20)]
        for measure in measures:
            measure()  # warm-up (staging buffers, CUDA contexts, channels)
        results.put(tuple(statistics.median(measure() for _ in range(5)) for measure in measures))
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda: no CUDA device here")
    results = mp.get_context("spawn").SimpleQueue()
    groups = {"TensorPipe": "tp", "zmqautograd": "zmq", "zmqautograd, staged": "zmq-staged"}
    samples: dict[str, list] = {name: [] for name in groups}
    for _ in range(args.rounds):
        for name, framework in groups.items():
            mp.spawn(run_alone, args=(framework, _free_port(), results), nprocs=2)
            samples[name].append(results.get())
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; each framework alone, 2 processes on cuda:0 "
          f"({args.rounds} alternating rounds; ratio zmqautograd / TensorPipe)", flush=True)
    print(f"{'':<20}" + "".join(f"{title:>22}" for title in COLUMNS), flush=True)
    tp = [statistics.median(v[i] for v in samples["TensorPipe"]) for i in range(len(COLUMNS))]
    for name, values in samples.items():
        cells = []
        for i in range(len(COLUMNS)):
            median = statistics.median(v[i] for v in values)
            cells.append(f"{median * 1e6:>12.0f} us {median / tp[i]:>5.2f}x")
        print(f"{name:<20}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
