"""FP8 training: scaling recipes, per-tensor scaling state and an FP8 linear.

Recipes (per tensor role: input, weight, grad_output)
-----------------------------------------------------
* ``delayed``: the cast at step t uses a scale computed from the amax history of the
  steps before t. Each cast records its tensor's amax into ``amax_history[0]`` (max over
  micro-batches); :func:`update_fp8_scales`, called once per optimizer step after the
  backward, then (1) all-reduces the fresh amaxes (MAX) over the given group so every
  rank gets the same scales, (2) computes ``amax = max(history)`` (``"max"``) or
  ``history[0]`` (``"most_recent"``), (3) sets ``scale = FP8_MAX / amax / 2**margin``
  (kept unchanged when amax is 0, inf or NaN, or the result is not finite) and (4) rolls
  the history by one so slot 0 is zero for the next step; history[i] is the amax of i
  steps ago.
* ``current``: the cast uses this tensor's own amax (reduced over the group first):
  ``scale = FP8_MAX / amax / 2**margin``. Two passes over the tensor, no history needed.

Formats: ``hybrid`` = E4M3 for input and weight (forward), E5M2 for grad_output
(backward, more range); ``e4m3`` = E4M3 everywhere.

The GEMMs (y = x W^T + b, dx = g W, dW = g^T x) take FP8 operands and accumulate in fp32:
``torch._scaled_mm`` on GPUs with FP8 tensor cores (sm_89+, dims multiple of 16), and
quantize-dequantize emulation elsewhere (the FP8 values, exactly, as fp32, through an fp32
GEMM), so the maths is testable on CPU. Master weights and optimizer state stay fp32:
the weight is quantized on the fly in each forward. Transformer Engine is not used.

Tensor parallelism: the column/row-parallel layers call :func:`fp8_linear` on their local
shards with ``tp_group``; amaxes are reduced over it so all ranks quantize with one scale.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from engine.distributed.comm import all_reduce
from engine.distributed.groups import NO_TP, AxisGroup
from engine.errors import ConfigError
from engine.ops.fp8 import fp8_cast, fp8_max
from engine.precision.backward_phase import backward_phase
from engine.validate import check_int

__all__ = [
    "Fp8Recipe",
    "fp8_recipe_from_config",
    "ScalingMeta",
    "Fp8LinearState",
    "compute_scale",
    "fp8_linear",
    "Fp8Linear",
    "fp8_states",
    "update_fp8_scales",
    "fp8_backend",
]

logger = logging.getLogger(__name__)

_SCALINGS = ("delayed", "current")
_FORMATS = ("hybrid", "e4m3")
_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 scales are chosen (module docstring)."""

    scaling: str = "delayed"
    fp8_format: str = "hybrid"
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in _SCALINGS:
            raise ConfigError(f"fp8.recipe={self.scaling!r} is not one of {_SCALINGS}")
        if self.fp8_format not in _FORMATS:
            raise ConfigError(f"fp8.format={self.fp8_format!r} is not one of {_FORMATS}")
        if self.amax_compute_algo not in _ALGOS:
            raise ConfigError(f"fp8.amax_compute_algo={self.amax_compute_algo!r} is not one of {_ALGOS}")
        check_int("fp8.amax_history_len", self.amax_history_len, minimum=1)
        check_int("fp8.margin", self.margin, minimum=0, fix="the scale divides by 2**margin")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self.fp8_format == "hybrid" else torch.float8_e4m3fn


# JSON key in the "fp8" section -> Fp8Recipe field
_CONFIG_KEYS = {"recipe": "scaling", "format": "fp8_format", "amax_history_len": "amax_history_len",
                "amax_compute_algo": "amax_compute_algo", "margin": "margin"}


def fp8_recipe_from_config(section: Any) -> Optional[Fp8Recipe]:
    """The JSON ``"fp8"`` section -> a recipe, or None when absent or ``"enabled": false``.

    `section`: a mapping, or the loaded config's ``cfg.fp8`` (engine.config's FP8Config,
    anything with ``to_dict()``). Example: ``{"enabled": true, "recipe": "delayed",
    "format": "hybrid", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 0}``.
    """
    if section is None:
        return None
    if hasattr(section, "to_dict"):
        section = section.to_dict()
    unknown = sorted(set(section) - set(_CONFIG_KEYS) - {"enabled"})
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in the fp8 section; allowed: {['enabled', *_CONFIG_KEYS]}")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ConfigError(f"fp8.enabled must be true or false, got {enabled!r}")
    if not enabled:
        return None
    return Fp8Recipe(**{_CONFIG_KEYS[k]: v for k, v in section.items() if k != "enabled"})


def compute_scale(amax: torch.Tensor, scale: torch.Tensor, max_value: float, margin: int) -> torch.Tensor:
    """FP8_MAX / amax / 2**margin, falling back to `scale` where amax or the result is 0/inf/NaN."""
    new = (max_value / amax) / (2.0 ** margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(new)
    return torch.where(ok, new, scale)


@dataclass
class ScalingMeta:
    """Scale and amax history of one tensor role. Tensors live on the compute device."""

    dtype: torch.dtype
    history_len: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        self.scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.amax_history = torch.zeros(self.history_len, dtype=torch.float32, device=self.device)  # (L,)

    def to(self, device: torch.device) -> "ScalingMeta":
        self.device = torch.device(device)
        self.scale = self.scale.to(device)
        self.amax_history = self.amax_history.to(device)
        return self

    def record_amax(self, amax: torch.Tensor) -> None:
        """Slot 0 holds the max over this step's casts (several micro-batches)."""
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.to(torch.float32))


class Fp8LinearState:
    """Scaling state of one FP8 linear: input and weight (forward format), grad_output (backward)."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str = "cpu") -> None:
        self.recipe = recipe
        dev = torch.device(device)
        self.input = ScalingMeta(recipe.fwd_dtype, recipe.amax_history_len, dev)
        self.weight = ScalingMeta(recipe.fwd_dtype, recipe.amax_history_len, dev)
        self.grad_output = ScalingMeta(recipe.bwd_dtype, recipe.amax_history_len, dev)

    def metas(self) -> list[ScalingMeta]:
        return [self.input, self.weight, self.grad_output]

    def to(self, device: torch.device | str) -> "Fp8LinearState":
        for m in self.metas():
            m.to(torch.device(device))
        return self

    _ROLES = ("input", "weight", "grad_output")

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """The scaling state as plain values (JSON-able, exact: fp32 values are exact as
        Python floats): ``{role: {"scale": float, "amax_history": [float] * L}}`` per role
        (input, weight, grad_output); ``amax_history[i]`` is the amax of i steps ago."""
        return {role: {"scale": float(m.scale.item()), "amax_history": [float(v) for v in m.amax_history.tolist()]}
                for role, m in zip(self._ROLES, self.metas())}

    def load_state_dict(self, sd: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` values onto this state's device. A history of another
        length (``fp8.amax_history_len`` changed) keeps its most recent ``min(old, new)``
        entries and pads with zeros (no amax recorded), as the roll would."""
        missing = [r for r in self._ROLES if r not in sd]
        if missing:
            raise ValueError(f"FP8 scaling state lacks the roles {missing} (it has {sorted(sd)})")
        for role, m in zip(self._ROLES, self.metas()):
            hist = torch.zeros(m.history_len, dtype=torch.float32)
            saved = torch.tensor(sd[role]["amax_history"], dtype=torch.float32).reshape(-1)
            n = min(m.history_len, saved.numel())
            hist[:n] = saved[:n]
            m.amax_history = hist.to(m.device)
            m.scale = torch.tensor(float(sd[role]["scale"]), dtype=torch.float32, device=m.device)


_WARNED_SHAPES: set = set()


def fp8_backend(device: torch.device, *dims: int) -> str:
    """'scaled_mm' on FP8-capable GPUs (sm_89+) when every GEMM dim is a multiple of 16, else 'emulate'.

    On an FP8-capable GPU the emulation (an fp32 GEMM, several times slower) is a silent
    performance cliff, so falling back there is logged once per GEMM shape."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return "emulate"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "emulate"
    if any(d % 16 for d in dims):
        if dims not in _WARNED_SHAPES:
            _WARNED_SHAPES.add(dims)
            logger.warning("FP8 GEMM of shape %s falls back to the fp32 emulation (much slower): every dim must "
                           "be a multiple of 16 for torch._scaled_mm (micro_batch x seq, hidden, ffn, heads x "
                           "head_dim / tp)", dims)
        return "emulate"
    return "scaled_mm"


def _reduce_max(t: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    all_reduce(t, group, op=dist.ReduceOp.MAX)  # the identity on a group of one
    return t


def _current_scales(tensors: Sequence[torch.Tensor], metas: Sequence[ScalingMeta], recipe: Fp8Recipe,
                    group: AxisGroup) -> list[torch.Tensor]:
    """``current`` scaling: each tensor's scale from its own amax, MAX-reduced over ``group``.
    The amaxes of all tensors travel in ONE all-reduce (the forward's input and weight
    together): each collective is a stall of the compute stream under NCCL."""
    amax = torch.stack([t.detach().abs().amax().float() for t in tensors])  # (n,)
    amax = _reduce_max(amax, group)
    return [compute_scale(a, torch.ones_like(m.scale), fp8_max(m.dtype), recipe.margin)
            for a, m in zip(amax.unbind(0), metas)]


def _quantize(t: torch.Tensor, meta: ScalingMeta, recipe: Fp8Recipe, group: AxisGroup,
              transpose: bool, record: bool = True, scale: Optional[torch.Tensor] = None):
    """(fp8, scale_inv, fp8_t or None) of a 2-D tensor under the recipe; records its amax
    unless ``record`` is False (evaluation forwards must not feed the training history).
    ``scale``: a ``current`` scale computed already (:func:`_current_scales`)."""
    if scale is None:
        scale = _current_scales([t], [meta], recipe, group)[0] if recipe.scaling == "current" else meta.scale
    res = fp8_cast(t, scale, meta.dtype, transpose=transpose)
    if record:
        meta.record_amax(res[1])
    return res[0], 1.0 / scale, (res[2] if transpose else None)


def _mm(a: torch.Tensor, a_inv: torch.Tensor, b_t: torch.Tensor, b_inv: torch.Tensor, backend: str,
        out_dtype: torch.dtype) -> torch.Tensor:
    """(a * a_inv) @ (b_t * b_inv).T with FP8 a (M, K) and b_t (N, K), fp32 accumulation."""
    if backend == "scaled_mm":
        out = torch._scaled_mm(a, b_t.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
        return out[0] if isinstance(out, tuple) else out  # older torch returned (out, amax)
    # Emulation: FP8 values are exact in fp32; scale them back and multiply in fp32.
    return ((a.float() * a_inv) @ (b_t.float() * b_inv).t()).to(out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: Fp8LinearState, group, backend: str, record: bool):
        recipe = state.recipe
        in_features = weight.shape[1]
        x2 = x.reshape(-1, in_features)  # (M, K)
        transpose = backend == "scaled_mm"  # the backward GEMMs need column-major copies
        sx = sw = None
        if recipe.scaling == "current":  # one all-reduce for both amaxes
            sx, sw = _current_scales([x2, weight], [state.input, state.weight], recipe, group)
        x8, x_inv, x8_t = _quantize(x2, state.input, recipe, group, transpose, record, sx)
        w8, w_inv, w8_t = _quantize(weight, state.weight, recipe, group, transpose, record, sw)
        y = _mm(x8, x_inv, w8, w_inv, backend, x.dtype)  # (M, N)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # Only what the backward reads: the column-major copies for _scaled_mm (x8 and w8
        # themselves would be an unused FP8 copy of every activation), the row-major ones
        # for the emulation.
        if transpose:
            ctx.save_for_backward(x_inv, w_inv, x8_t, w8_t)
        else:
            ctx.save_for_backward(x_inv, w_inv, x8, w8)
        ctx.out_features = weight.shape[0]
        ctx.state, ctx.group, ctx.backend = state, group, backend
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.has_bias = bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        x_inv, w_inv, xs, ws = ctx.saved_tensors  # (x8_t, w8_t) for _scaled_mm, else (x8, w8)
        state, backend = ctx.state, ctx.backend
        want_dx, want_dw = _wanted_halves(ctx)
        transpose = backend == "scaled_mm"
        cached = getattr(ctx, "grad_fp8", None)  # (g8, g_inv, g8_t) left by the input half
        if cached is None:
            g2 = gy.reshape(-1, ctx.out_features)  # (M, N)
            cached = _quantize(g2, state.grad_output, state.recipe, ctx.group, transpose)
        g8, g_inv, g8_t = cached
        ctx.grad_fp8 = cached if backward_phase() == "input" and ctx.needs_input_grad[1] else None
        dx = dw = db = None
        if backend == "scaled_mm":
            x8_t, w8_t = xs, ws
            if want_dx:
                dx = _mm(g8, g_inv, w8_t, w_inv, backend, ctx.x_dtype)       # (M,N)@(N,K): B^T = W^T (K,N)
            if want_dw:
                dw = _mm(g8_t, g_inv, x8_t, x_inv, backend, torch.float32)   # (N,M)@(M,K): B^T = x^T (K,M)
        else:
            x8, w8 = xs, ws
            if want_dx:
                dx = ((g8.float() * g_inv) @ (w8.float() * w_inv)).to(ctx.x_dtype)   # (M, K)
            if want_dw:
                dw = (g8.float() * g_inv).t() @ (x8.float() * x_inv)                  # (N, K)
        if want_dw and ctx.has_bias:
            db = gy.reshape(-1, gy.shape[-1]).sum(0)
        return (None if dx is None else dx.reshape(ctx.x_shape), None if dw is None else dw.to(ctx.w_dtype),
                db, None, None, None, None)


def _wanted_halves(ctx: Any) -> tuple[bool, bool]:
    """(input gradient wanted, weight/bias gradients wanted) for this call of the backward.

    An ordinary backward wants both. Under the zero-bubble split (engine.pipeline.
    split_backward) the input half wants only dx: it quantizes the output gradient once
    and leaves it on ``ctx`` for the weight half, which then computes only dW (and dx only
    if autograd will use it, which the split does not arrange: asked, to stay exact). So
    each FP8 GEMM and each quantization of the output gradient runs once per micro-batch
    in both schedules (no second amax record, no second ``current`` all-reduce)."""
    phase = backward_phase()
    if phase == "input":
        return True, False
    if phase == "weight":
        node = ctx.next_functions[0][0]  # the x edge
        try:
            want_dx = node is not None and torch._C._will_engine_execute_node(node)
        except RuntimeError:  # torch cannot tell for this node: compute it (exact either way)
            want_dx = True
        return bool(want_dx), True
    return True, True


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], state: Fp8LinearState,
               tp_group: AxisGroup = NO_TP, backend: Optional[str] = None,
               record_amax: bool = True) -> torch.Tensor:
    """y = x W^T + b with FP8 GEMMs. x (..., K), weight (N, K) (a TP shard is fine), bias (N,).

    Scales follow ``state.recipe``; amaxes are MAX-reduced over ``tp_group`` (pass the
    TP group, or a TP x DP group to also share scales across data-parallel replicas).
    backend: None = :func:`fp8_backend`, or force 'emulate' / 'scaled_mm'.
    record_amax: False for forwards that must not enter the delayed-scaling history
    (evaluation); the backward always records (it only runs in training).
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(need x (..., K) and weight (N, K))")
    if state.input.scale.device != x.device:
        raise ValueError(f"fp8_linear: FP8 state is on {state.input.scale.device} but x is on {x.device}; "
                         "call state.to(device) (Fp8Linear does this in .to())")
    if backend is None:
        m = math.prod(x.shape[:-1])
        backend = fp8_backend(x.device, m, weight.shape[0], weight.shape[1])
    if backend not in ("emulate", "scaled_mm"):
        raise ValueError(f"fp8_linear: backend must be 'emulate' or 'scaled_mm', got {backend!r}")
    return _Fp8LinearFn.apply(x, weight, bias, state, tp_group, backend, bool(record_amax))


class Fp8Linear(nn.Module):
    """nn.Linear whose GEMMs run in FP8 (fp32 master weight, quantized per forward)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Optional[Fp8Recipe] = None, tp_group: AxisGroup = NO_TP,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.tp_group = tp_group
        self.fp8_state = Fp8LinearState(recipe or Fp8Recipe(), self.weight.device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's init
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self.fp8_state.to(self.weight.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.fp8_state, self.tp_group, record_amax=self.training)


def fp8_states(module: nn.Module) -> list[Fp8LinearState]:
    """Every FP8 state in a module tree (modules with an ``fp8_state`` attribute)."""
    return [s for m in module.modules() if isinstance(s := getattr(m, "fp8_state", None), Fp8LinearState)]


def update_fp8_scales(states: Iterable[Fp8LinearState],
                      group: Union[AxisGroup, Sequence[AxisGroup]] = ()) -> None:
    """Once per optimizer step, after backward: reduce, rescale, roll (module docstring).

    Every rank of `group` must pass its states in the same order (same layer structure):
    the fresh amaxes of all of them travel in one stacked all-reduce. `group` may also be a
    sequence of groups (e.g. the amax role's ``groups.role_axes(Role.AMAX)``): the MAX is taken over each in turn,
    which equals the MAX over their product (TP x DP) without building that group; ``()``
    (the default): this rank's amaxes only.

    For ``current`` scaling only the history roll happens (scales are per cast). One
    collective for all tensors: the fresh amaxes are stacked, MAX-reduced, written back.
    """
    states = list(states)
    metas = [m for s in states for m in s.metas()]
    if not metas:
        return
    recipes = [s.recipe for s in states for _ in s.metas()]
    lens = {m.amax_history.numel() for m in metas}
    if len(lens) != 1:  # mixed history lengths: one stacked update per length
        for n in sorted(lens):
            _update_same_length([m for m in metas if m.amax_history.numel() == n],
                                [r for m, r in zip(metas, recipes) if m.amax_history.numel() == n], group)
        return
    _update_same_length(metas, recipes, group)


def _update_same_length(metas: list[ScalingMeta], recipes: list[Fp8Recipe],
                        group: Union[AxisGroup, Sequence[AxisGroup]]) -> None:
    """All metas at once: a fixed number of kernels whatever the number of layers (the
    per-meta loop was ~10 tiny kernels per meta, 3 metas per layer)."""
    device = metas[0].amax_history.device
    hist = torch.stack([m.amax_history for m in metas])  # (n, L)
    fresh = hist[:, 0].clone()                            # (n,) this step's amaxes
    for g in ([group] if isinstance(group, AxisGroup) else group):
        _reduce_max(fresh, g)
    hist[:, 0] = fresh
    # per-meta constants, built on the host and copied once
    consts = torch.tensor([[fp8_max(m.dtype), 2.0 ** r.margin, r.scaling == "delayed", r.amax_compute_algo == "max"]
                           for m, r in zip(metas, recipes)], dtype=torch.float32).to(device, non_blocking=True)
    max_value, div, delayed, use_max = consts.unbind(1)
    amax = torch.where(use_max.bool(), hist.max(dim=1).values, fresh)
    old = torch.stack([m.scale for m in metas])
    # FP8_MAX / amax / 2**margin, computed as compute_scale does (python scalar / tensor is
    # reciprocal-then-multiply in torch), so both give the same bits
    new = amax.reciprocal() * max_value / div
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(new)
    scales = torch.where(delayed.bool() & ok, new, old)
    hist = torch.roll(hist, 1, dims=1)
    hist[:, 0] = 0.0
    for m, h, sc in zip(metas, hist.unbind(0), scales.unbind(0)):  # views: no kernels
        m.amax_history, m.scale = h, sc
