"""Functions the distributed autograd graph tests run on worker processes."""

from __future__ import annotations

import threading

import torch

import zmqautograd.rpc as rpc

_counts: dict[str, int] = {}
_lock = threading.Lock()


class Counted(torch.autograd.Function):
    """Identity whose backward counts its runs under ``tag`` (on the worker that ran it)."""

    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        with _lock:
            _counts[ctx.tag] = _counts.get(ctx.tag, 0) + 1
        return grad, None


def take_counts() -> dict[str, int]:
    with _lock:
        counts = dict(_counts)
        _counts.clear()
    return counts


_stages: dict[str, torch.nn.Module] = {}


def make_stage(name: str, seed: int, width: int) -> None:
    torch.manual_seed(seed)
    _stages[name] = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())


def stage_state(name: str) -> dict:
    return {k: v.detach().clone() for k, v in _stages[name].state_dict().items()}


def run_stage(name: str, x: torch.Tensor) -> torch.Tensor:
    return Counted.apply(_stages[name](Counted.apply(x, f"{name}.in")), f"{name}.out")


def pipeline(x: torch.Tensor, names: list, workers: list) -> torch.Tensor:
    """Stage i on workers[i]; each stage calls the next one itself (a chain of nested calls)."""
    y = run_stage(names[0], x)
    if len(names) == 1:
        return y
    return rpc.rpc_sync(workers[1], pipeline, args=(y, names[1:], workers[1:]))


def stage_grads(name: str, context_id: int) -> list:
    import zmqautograd.autograd as dist_autograd

    grads = dist_autograd.get_gradients(context_id)
    return [grads.get(p) for p in _stages[name].parameters()]


def scale(x: torch.Tensor, factor: float, tag: str) -> torch.Tensor:
    return Counted.apply(x * factor, tag).sin()


def combine(a: torch.Tensor, b: torch.Tensor, tag: str) -> torch.Tensor:
    return Counted.apply(a * b + a, tag)


def set_cleanup_delay(seconds: float) -> float:
    """Set how long context releases for other workers wait for a ride (see
    autograd/cleanup.py); returns the previous delay."""
    import zmqautograd.autograd as dist_autograd

    cleanups = dist_autograd.api._container().cleanups
    previous, cleanups.delay = cleanups.delay, seconds
    return previous


def has_context(context_id: int) -> bool:
    import zmqautograd.autograd as dist_autograd

    return dist_autograd._is_valid_context(context_id)


def context_gone_within(context_id: int, timeout: float) -> bool:
    """Whether the context is released here within ``timeout`` seconds (it may be released
    by the thread that answered the call before this one, just after that answer left)."""
    import zmqautograd.autograd as dist_autograd

    container = dist_autograd.api._container()
    return container.wait_released({context_id}, timeout)


def plan_built_within(context_id: int, timeout: float) -> bool:
    """Whether the context's next pass here has its plan within ``timeout`` seconds, before any
    backward pass asked for it (engine.prepare_plan)."""
    import time

    import zmqautograd.autograd as dist_autograd

    container = dist_autograd.api._container()
    deadline = time.monotonic() + timeout
    while True:
        context = container.get(context_id)
        if context is not None and context.plan_cache is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)  # polls a field nothing signals; bounded by the timeout


_real_record_send = None


def delay_answer_recording(seconds: float) -> None:
    """Make this worker record the send functions of its answers ``seconds`` late (an injected
    delay: the agent records them while the answer travels); 0 restores it."""
    import time

    from zmqautograd.autograd import forward

    global _real_record_send
    if _real_record_send is None:
        _real_record_send = forward.record_send
    if seconds <= 0:
        forward.record_send = _real_record_send
        return

    def late(*args, **kwargs):
        time.sleep(seconds)  # the fault itself, not a wait for something
        return _real_record_send(*args, **kwargs)

    forward.record_send = late


def forward_to(worker: str, x: torch.Tensor) -> torch.Tensor:
    """A nested call: this worker learns of the context and passes x on to ``worker``."""
    return rpc.rpc_sync(worker, torch.mul, args=(x, 2))


def train_step_here(worker: str, x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """A whole distributed step inside an RPC call: this worker (a pool thread) opens a
    context, sends x through ``worker``, runs the backward pass it started, and returns the
    loss and the gradients the context got for x and weight."""
    import zmqautograd.autograd as dist_autograd

    x = x.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    with dist_autograd.context() as context_id:
        h = rpc.rpc_sync(worker, torch.matmul, args=(x, weight))
        loss = torch.tanh(h).pow(2).sum()
        dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        return loss.detach(), grads[x], grads[weight]


class HookedLeaf:
    """A leaf tensor with a post hook on its AccumulateGrad node that records the gradients
    it is called with; the node is kept alive here (a leaf refers to it only weakly). With
    ``clamp``, also a tensor hook (``register_hook`` on the leaf) that records its input and
    clamps it to [-clamp, clamp]."""

    def __init__(self, seed: int, shape: tuple, clamp: float | None = None) -> None:
        torch.manual_seed(seed)
        self.tensor = torch.randn(*shape, requires_grad=True)
        self.node = self.tensor.view_as(self.tensor).grad_fn.next_functions[0][0]
        self.seen: list = []
        self.tensor_seen: list = []
        self.failure: str | None = None
        self.node.register_hook(self._record)
        self.node.register_hook(self._maybe_fail)
        if clamp is not None:
            self.tensor.register_hook(lambda grad: self._clamp(grad, clamp))

    def _clamp(self, grad: torch.Tensor, bound: float) -> torch.Tensor:
        self.tensor_seen.append(grad.detach().clone())
        return grad.clamp(-bound, bound)

    def _record(self, grad_inputs, grad_outputs):
        assert grad_inputs == ()
        self.seen.append(grad_outputs[0].detach().clone())

    def _maybe_fail(self, grad_inputs, grad_outputs):
        if self.failure is not None:
            raise ValueError(self.failure)


_hooked: dict[str, HookedLeaf] = {}


def make_hooked_leaf(name: str, seed: int, shape: tuple, clamp: float | None = None) -> None:
    _hooked[name] = HookedLeaf(seed, shape, clamp)


def matmul_hooked(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, _hooked[name].tensor)


def take_hook_calls(name: str) -> list:
    seen, _hooked[name].seen = _hooked[name].seen, []
    return seen


def take_tensor_hook_calls(name: str) -> list:
    seen, _hooked[name].tensor_seen = _hooked[name].tensor_seen, []
    return seen


def hooked_leaf_gradient(name: str, context_id: int) -> torch.Tensor | None:
    import zmqautograd.autograd as dist_autograd

    return dist_autograd.get_gradients(context_id).get(_hooked[name].tensor)


def fail_hook(name: str, message: str | None) -> None:
    _hooked[name].failure = message


_api_calls: dict[str, int] = {}


def count_api_calls(name: str) -> None:
    """Count the calls this worker makes to ``zmqautograd.autograd.api.<name>`` from now on,
    from zero (``_forward_gradients``: gradient forwards, engine.py "Forwarding";
    ``_send_gradients``: gradient requests its recv functions send)."""
    from zmqautograd.autograd import api

    with _lock:
        _api_calls[name] = 0
    real = getattr(api, name)
    if getattr(real, "counted", False):
        return

    def counted(*args):
        with _lock:
            _api_calls[name] += 1
        return real(*args)

    counted.counted = True
    counted.real = real
    setattr(api, name, counted)


def restore_api_calls(name: str) -> None:
    """Stop counting calls to ``api.<name>``."""
    from zmqautograd.autograd import api

    current = getattr(api, name)
    setattr(api, name, getattr(current, "real", current))


def take_api_calls(name: str) -> int:
    with _lock:
        count, _api_calls[name] = _api_calls[name], 0
    return count


def count_forwards() -> None:
    count_api_calls("_forward_gradients")


def take_forwards() -> int:
    return take_api_calls("_forward_gradients")


def sparse_rows(weight: torch.Tensor) -> torch.Tensor:
    """Rows 0 and 2 of ``weight`` by a sparse embedding: its gradient is a sparse tensor."""
    return torch.nn.functional.embedding(torch.tensor([0, 2]), weight, sparse=True)


class _Identity(torch.autograd.Function):
    """An identity forward, for subclasses that give it a backward of their own."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)


class FailingBackward(_Identity):
    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this stage fails on purpose")


def failing_stage(name: str, x: torch.Tensor) -> torch.Tensor:
    return FailingBackward.apply(run_stage(name, x))


_held_backward = threading.Event()


class HeldBackward(_Identity):
    """Identity whose backward waits until :func:`release_backward` (at most 30 s)."""

    @staticmethod
    def backward(ctx, grad):
        _held_backward.wait(30)
        return grad


def held(x: torch.Tensor) -> torch.Tensor:
    _held_backward.clear()
    return HeldBackward.apply(x * 2)


def release_backward() -> None:
    _held_backward.set()


_gate = threading.Event()


def gated_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """``x * factor`` once :func:`open_gate` was called (at most 30 s)."""
    _gate.wait(30)
    return x * factor


def open_gate() -> None:
    _gate.set()
