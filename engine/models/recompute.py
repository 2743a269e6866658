"""Activation recomputation (checkpointing): the policy, the recompute function, host offload.

A policy (``activation_checkpointing`` in the config, :class:`RecomputePolicy`) says what a
block keeps for backward:

- ``granularity "none"``: everything autograd saves;
- ``"full"``: only the input (B, S, H) of each recompute unit; the unit's forward runs again
  in backward. ``method "uniform"``: the chunk's blocks in runs of ``num_layers``, each run
  one unit; ``"block"``: the first ``num_layers`` blocks of each stage chunk, one unit each,
  the others kept whole (Megatron's two methods);
- ``"selective"``: the named parts of every block (:data:`RECOMPUTE_MODULES`) are recomputed,
  keeping only their inputs.

:class:`Recompute` (the autograd function behind full units and the parts ``core_attn``,
``mlp_act``, ``attn``, ``mlp``, whose inputs feed nothing else) runs the forward without a graph, saves the unit's tensor inputs with ``save_for_backward`` (so saved-tensor
hooks, host offload and measurement see them) and, in backward, restores the RNG state of
the forward, runs it again with a graph and backpropagates through it: the recomputed
forward is the same sequence of kernels on the same inputs, so outputs and gradients are
bit-identical to no recomputation. A norm's input also feeds the residual: its gradient
sums contributions from inside and outside the part, and a separate backward would change
the order of that sum, so ``norm`` uses torch's non-reentrant checkpoint instead, which keeps
the plain forward's graph and only drops and recomputes its saved tensors. FP8 scaling state is safe too: within a step a cast only
records ``max(amax_history[0], amax)`` (idempotent on a repeated input) and the scales change
after the step (engine.precision.fp8).

``partition_activations``: a full unit's input, replicated over the TP ranks, is saved as
this rank's 1/tp slice and all-gathered before recomputation (DeepSpeed's partitioned
checkpoints). ``cpu_checkpointing``: tensors saved in the blocks go to host memory
(:func:`host_offload`: pinned buffers filled on a side stream on CUDA; on a CPU device the
tensors already live on the host and are kept as they are).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from engine.distributed import comm
from engine.distributed.groups import NO_TP, AxisGroup
from engine.models.config import DEFAULT_SELECTIVE, RECOMPUTE_MODULES

__all__ = ["in_recompute_first_pass", "RECOMPUTE_MODULES", "DEFAULT_SELECTIVE", "RecomputePolicy", "policy_from_config", "maybe_offload", "RecomputeOptions", "Recompute", "recompute", "recomputed",
           "apply_selective", "host_offload", "full_units", "observe_held"]

if TYPE_CHECKING:  # engine.config imports engine.models.config, which imports this package
    from engine.config import Config

# parts a module-level forward wrap covers (the others are inside forwards: blocks.py calls recomputed())
_MODULE_PARTS = {"norm": ("attn_norm", "mlp_norm"), "attn": ("attn",), "mlp": ("mlp",)}


@dataclass(frozen=True)
class RecomputePolicy:
    """What the blocks keep for backward (module docstring); values as in the config."""

    granularity: str = "none"
    modules: tuple[str, ...] = ()
    method: str = "uniform"
    num_layers: int = 1
    cpu_checkpointing: bool = False
    partition_activations: bool = False

    @property
    def active(self) -> bool:
        return self.granularity != "none" or self.cpu_checkpointing


def policy_from_config(cfg: Config, interval: Optional[int] = None) -> RecomputePolicy:
    """The policy of ``activation_checkpointing``; ``pipeline.activation_checkpoint_interval``
    N > 0 (or ``interval``, when given) is full recompute, method uniform, N layers per unit
    (the loader refuses it together with a granularity)."""
    ac = cfg.activation_checkpointing
    n = cfg.pipeline.activation_checkpoint_interval if interval is None else interval
    if n > 0:
        return RecomputePolicy("full", (), "uniform", n, ac.cpu_checkpointing, ac.partition_activations)
    modules = (ac.modules or DEFAULT_SELECTIVE) if ac.granularity == "selective" else ()
    return RecomputePolicy(ac.granularity, tuple(modules), ac.method, ac.num_layers, ac.cpu_checkpointing,
                           ac.partition_activations)


@dataclass(frozen=True)
class RecomputeOptions:
    """How one :class:`Recompute` call stores its inputs: ``partition`` over this TP group
    (first tensor argument only, DeepSpeed's block input) when its size is > 1."""

    partition: AxisGroup = NO_TP

    @property
    def partitions(self) -> bool:
        return self.partition.size > 1


# ------------------------------------------------------------------ RNG state
def _rng_state(devices: Sequence[torch.device]) -> tuple[torch.Tensor, list[tuple[torch.device, torch.Tensor]]]:
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[tuple[torch.device, torch.Tensor]]]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)


# ------------------------------------------------------------------ partitioned inputs
def _shard(t: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """This rank's 1/tp slice of ``t`` flattened (padded to a multiple of tp), a copy (N/tp,)."""
    flat = t.detach().reshape(-1)
    per = -(-flat.numel() // group.size)
    lo = min(group.rank * per, flat.numel())
    piece = flat[lo:lo + per]
    out = flat.new_zeros(per)
    out[:piece.numel()] = piece
    return out


def _unshard(piece: torch.Tensor, shape: torch.Size, group: AxisGroup) -> torch.Tensor:
    full = piece.new_empty(piece.numel() * group.size)
    comm.all_gather(full, piece, group)
    return full[:shape.numel()].view(shape)


_FIRST_PASS = threading.local()  # .depth: Recompute forwards running (no graph kept) on this thread


def in_recompute_first_pass() -> bool:
    """Whether a recomputed unit's first forward (the one run without a graph) is running:
    layers that record per-step statistics once per training forward (the MoE router's
    counts) record them here, and not in the replay inside backward."""
    return getattr(_FIRST_PASS, "depth", 0) > 0


class Recompute(torch.autograd.Function):
    """``Recompute.apply(run, options, *args)``: ``run(*args)`` without keeping its graph
    (module docstring). ``run`` returns a tensor or a tuple of tensors; non-tensor
    ``args`` (masks, None) are passed through as they are."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], options: RecomputeOptions, *args: Any) -> Any:
        ctx.run, ctx.options = run, options
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        devices = sorted({t.device for t in tensors if t.device.type == "cuda"}, key=str)
        ctx.rng = _rng_state(devices)
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.shape = None
        if options.partitions and tensors and tensors[0].is_floating_point():
            ctx.shape = tensors[0].shape
            tensors = [_shard(tensors[0], options.partition)] + tensors[1:]
        ctx.save_for_backward(*tensors)
        _FIRST_PASS.depth = getattr(_FIRST_PASS, "depth", 0) + 1
        try:
            with torch.no_grad():
                return run(*args)
        finally:
            _FIRST_PASS.depth -= 1

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        tensors = list(ctx.saved_tensors)
        if ctx.shape is not None:
            tensors[0] = _unshard(tensors[0], ctx.shape, ctx.options.partition)
        needs = [n for n, is_t in zip(ctx.needs_input_grad[2:], ctx.layout) if is_t]
        inputs = [t.detach().requires_grad_(n) for t, n in zip(tensors, needs)]
        it = iter(inputs)
        args = [next(it) if is_t else o for is_t, o in zip(ctx.layout, ctx.others)]
        here = _rng_state(ctx.rng[1] and [d for d, _ in ctx.rng[1]])
        _set_rng_state(ctx.rng)
        try:
            with torch.enable_grad():
                out = ctx.run(*args)
        finally:
            _set_rng_state(here)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        it = iter(inputs)
        return (None, None) + tuple(next(it).grad if is_t else None for is_t in ctx.layout)


def recompute(run: Callable[..., Any], *args: Any, options: RecomputeOptions = RecomputeOptions()) -> Any:
    """``run(*args)``, recomputed in backward when grad is on (plain call otherwise).

    When no tensor argument requires grad (a user's first pipeline layer fed the batch), the
    autograd function's output would not require grad either and the unit's parameters would
    get no gradient: torch's non-reentrant checkpoint, which tracks the parameters used inside,
    runs such a unit instead (same RNG replay, same arithmetic)."""
    if not torch.is_grad_enabled():
        return run(*args)
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(run, *args, use_reentrant=False)
    return Recompute.apply(run, options, *args)


def recomputed(module: nn.Module, part: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, recomputed in backward when ``part`` is in ``module``'s selective set
    (:func:`apply_selective` sets it); the hook blocks.py calls around a part of a forward."""
    parts = getattr(module, "recompute_parts", ())
    return recompute(run, *args) if part in parts else run(*args)


# Observers of the tensors a graph-keeping region holds (its inputs, kept by the closure, not
# through saved-tensor hooks): the activation-memory benchmark counts them (observe_held).
_HELD_OBSERVERS: list[Callable[[torch.Tensor], None]] = []


@contextlib.contextmanager
def observe_held(observer: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call ``observer`` on every tensor input a norm region keeps for its recomputation."""
    _HELD_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _HELD_OBSERVERS.remove(observer)


def _keep_graph_recompute(run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run`` with its saved tensors dropped and recomputed when backward first needs them
    (torch's non-reentrant checkpoint): the autograd graph is the one of the plain forward,
    so gradients meeting outside the region (the norm's input also feeds the residual) are
    summed in the same order as without recomputation: bit-identical."""
    if not torch.is_grad_enabled():
        return run(*args, **kwargs)
    for obs in _HELD_OBSERVERS:
        for a in args:
            if isinstance(a, torch.Tensor):
                obs(a)
    return checkpoint(run, *args, use_reentrant=False, **kwargs)


def _wrap_forward(module: nn.Module, keep_graph: bool) -> None:
    """Recompute ``module``'s own forward (an instance attribute shadowing the class's, so
    parameter names, hooks and state dicts are unchanged). ``keep_graph``: the input has
    consumers outside the module (:func:`_keep_graph_recompute`); otherwise :class:`Recompute`."""
    inner = type(module).forward.__get__(module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if keep_graph:
            return _keep_graph_recompute(inner, *args, **kwargs)
        if kwargs:
            return recompute(lambda *a: inner(*a, **kwargs), *args)
        return recompute(inner, *args)

    module.forward = forward


def apply_selective(block: nn.Module, modules: Sequence[str]) -> None:
    """Mark ``block``'s parts named in ``modules`` (:data:`RECOMPUTE_MODULES`) for recomputation."""
    parts = frozenset(modules)
    for name, children in _MODULE_PARTS.items():
        if name in parts:
            for child in children:
                _wrap_forward(getattr(block, child), keep_graph=name == "norm")
    for m in block.modules():
        object.__setattr__(m, "recompute_parts", parts)  # read by recomputed() in Attention / SwiGLU forwards


def full_units(policy: RecomputePolicy, lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """The blocks ``[lo, hi)`` of a chunk as runs ``(a, b, recomputed)`` under a full policy."""
    if policy.granularity != "full" or hi <= lo:
        return [(lo, hi, False)] if hi > lo else []
    n = policy.num_layers
    if policy.method == "uniform":
        return [(a, min(a + n, hi), True) for a in range(lo, hi, n)]
    head = min(lo + n, hi)  # "block": the first n blocks one unit each, the rest kept whole
    return [(a, a + 1, True) for a in range(lo, head)] + ([(head, hi, False)] if head < hi else [])


# ------------------------------------------------------------------ host offload
@contextlib.contextmanager
def host_offload(device: torch.device) -> Iterator[None]:
    """Tensors saved for backward inside the block live in host memory until backward.

    CUDA: each is copied into a pinned host buffer on a side stream (waiting for the
    producing stream, recorded on the copy event) and copied back (non-blocking) when
    backward unpacks it; parameters (and views of them) saved by a matmul stay where they are. Any other device: the tensor already is in host memory, kept as is."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream(device)

    def pack(t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base
        if t.device.type != "cuda" or (base.is_leaf and base.requires_grad):  # parameters (and views) stay
            return t
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            t.record_stream(side)
            done = torch.cuda.Event()
            done.record(side)
        return (t.device, host, done)

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        dev, host, done = packed
        done.synchronize()
        return host.to(dev, non_blocking=True)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def maybe_offload(policy: Optional[RecomputePolicy], device: torch.device) -> contextlib.AbstractContextManager[None]:
    """:func:`host_offload` when the policy asks for ``cpu_checkpointing``, else nothing."""
    if policy is not None and policy.cpu_checkpointing:
        return host_offload(device)
    return contextlib.nullcontext()
