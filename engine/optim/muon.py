"""Muon for the hidden matrices, AdamW for everything else, exact under every layout.

:class:`Muon` is one ``torch.optim.Optimizer`` with two kinds of param groups (as
DeepSpeed's ``MuonWithAuxAdam`` and Moonlight): ``use_muon=True`` groups get torch 2.13's
``torch.optim.Muon`` update, ``use_muon=False`` groups get ``torch.optim.AdamW``'s
(torch's own functional ``adam`` with decoupled weight decay). Muon update per matrix ``W``
with gradient ``G`` and momentum buffer ``B`` (torch's formulas, bit for bit)::

    B <- lerp(B, G, 1 - momentum)            (B = momentum B + (1 - momentum) G)
    U <- lerp(G, B, momentum) if nesterov else B
    O <- NewtonSchulz(U)                     (ns_coefficients, ns_steps, eps; ns_dtype)
    W <- W (1 - lr weight_decay) - adjusted_lr(lr, adjust_lr_fn, shape(W)) O

Two ways to run it:

- *plain*: over real parameters (2-D for Muon groups), in one process, like torch's.
- *under ZeRO* (what the engine does): the ZeRO optimizer calls :meth:`attach_shard_view`
  and the param groups are flat fp32 master shards. The momentum and the Nesterov blend
  are element-wise, so they live on the shard; Newton–Schulz runs on the full, fully
  reduced, fully accumulated update of each matrix exactly once per step, on one owner
  rank of the stage's dp x tp grid (owners balanced by FLOPs), and each rank gets back its
  elements (:mod:`engine.optim.muon_exchange`). Fused TP projections are orthogonalised
  as their parts (:mod:`engine.optim.muon_plan`).

``ns_calls`` counts this rank's Newton–Schulz calls (one per Muon matrix or fused part,
summed over the job, per step); ``ns_seconds`` / ``ns_cpu_seconds`` their wall / CPU time; ``comm_elements`` the elements
its collectives sent.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch.optim.adam import adam as _adam_functional

from engine.optim.muon_exchange import ExchangeStats, orthogonalize_bucket, orthogonalize_full
from engine.optim.muon_plan import MuonMatrix, assign_owners, lr_segments, matrix_of
from engine.optim.newton_schulz import (
    ADJUST_LR_FNS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_EPS,
    DEFAULT_NS_STEPS,
    adjusted_lr,
    newton_schulz,
)
from engine.zero.shard_view import ShardView

__all__ = ["Muon", "NS_DTYPES"]

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class Muon(torch.optim.Optimizer):
    """See the module docstring. ``lr`` ... ``adjust_lr_fn``: torch.optim.Muon's arguments
    (defaults of Muon groups); ``ns_dtype``: ``"bfloat16"`` (torch's) or ``"float32"``;
    ``adamw_*``: defaults of the AdamW groups (``use_muon=False``)."""

    # torch.optim.Muon's arguments plus the AdamW groups' defaults: the public signature, kept flat
    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,  # noqa: PLR0913
                 nesterov: bool = True, ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
                 eps: float = DEFAULT_NS_EPS, ns_steps: int = DEFAULT_NS_STEPS, adjust_lr_fn: Optional[str] = None,
                 ns_dtype: str = "bfloat16", *, adamw_lr: float = 1e-3,
                 adamw_betas: Sequence[float] = (0.9, 0.999), adamw_eps: float = 1e-8,
                 adamw_weight_decay: float = 0.01) -> None:
        if lr < 0 or adamw_lr < 0 or momentum < 0 or weight_decay < 0 or adamw_weight_decay < 0:
            raise ValueError("Muon: lr, adamw_lr, momentum and weight decays must be >= 0")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"Muon: adjust_lr_fn must be one of {ADJUST_LR_FNS} or None, got {adjust_lr_fn!r}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype must be one of {sorted(NS_DTYPES)}, got {ns_dtype!r}")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon: ns_coefficients must be 3 numbers (a, b, c), got {ns_coefficients!r}")
        self._muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                   ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=int(ns_steps),
                                   adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype)
        self._adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                    weight_decay=adamw_weight_decay)
        self.view: Optional[ShardView] = None
        self._plan: dict[int, dict[int, list[MuonMatrix]]] = {}  # group -> bucket -> matrices
        self._stats = ExchangeStats()
        super().__init__(params, dict(lr=lr))

    # ----------------------------------------------------------------- groups and view
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        use = bool(param_group.setdefault("use_muon", True))
        for k, v in (self._muon_defaults if use else self._adamw_defaults).items():
            param_group.setdefault(k, v)
        super().add_param_group(param_group)

    def attach_shard_view(self, view: ShardView) -> None:
        """Called by the ZeRO optimizer: the param groups are its flat master shards, laid
        out as ``view`` says; plan every Muon matrix and its owner."""
        if len(view.groups) != len(self.param_groups):
            raise ValueError(f"shard view has {len(view.groups)} groups, the optimizer {len(self.param_groups)}")
        mats: list[MuonMatrix] = []
        steps = {g["ns_steps"] for g in self.param_groups if g["use_muon"]}
        for gi, (gv, group) in enumerate(zip(view.groups, self.param_groups)):
            if not group["use_muon"]:
                continue
            if gv.expert:
                raise ValueError("expert-sharded parameters are in a Muon group: Muon's owners and exchange span the "
                                 "grad group, not an expert shard's replicas; keep expert weights in an AdamW group")
            if gv.tied:
                raise ValueError("a tied weight (embedding / LM head) is in a Muon group: tied weights are AdamW "
                                 "parameters; remove it from the muon patterns")
            for bi, bv in enumerate(gv.buckets):
                for s in bv.params:
                    mats.append(matrix_of(s.param, s.shape, view.tp_size, gi, bi, s.index))
        owned = assign_owners(mats, view.grad_size, view.tp_size, max(steps) if steps else DEFAULT_NS_STEPS)
        self._plan = {}
        for m in owned:
            self._plan.setdefault(m.group, {}).setdefault(m.bucket, []).append(m)
        self.view = view

    @property
    def matrices(self) -> list[MuonMatrix]:
        """Every Muon matrix of this optimizer's stage with its owner (under ZeRO)."""
        return [m for g in self._plan.values() for b in g.values() for m in b]

    @property
    def ns_calls(self) -> int:
        return self._stats.ns_calls

    @property
    def ns_seconds(self) -> float:
        return self._stats.ns_seconds

    @property
    def ns_cpu_seconds(self) -> float:
        return self._stats.ns_cpu_seconds

    @property
    def comm_elements(self) -> int:
        return self._stats.comm_elements

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._muon_group(gi, group)
            else:
                self._adamw_group(group)
        return loss

    def _ns(self, group: dict[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
        coeffs, steps, eps = tuple(group["ns_coefficients"]), int(group["ns_steps"]), float(group["eps"])
        dtype = NS_DTYPES[group["ns_dtype"]]
        return lambda x: newton_schulz(x, coeffs, steps, eps, dtype)

    def _blend(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Momentum update and the Nesterov blend, element-wise (torch's exact ops)."""
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        m = group["momentum"]
        buf.lerp_(grad, 1 - m)
        return grad.lerp(buf, m) if group["nesterov"] else buf

    def _muon_group(self, gi: int, group: dict[str, Any]) -> None:
        lr, wd, fn = group["lr"], group["weight_decay"], group["adjust_lr_fn"]
        ns = self._ns(group)
        if self.view is None:  # plain: every parameter is a whole matrix
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon group parameter of shape {tuple(p.shape)} is not a matrix: put "
                                     f"non-2-D parameters in a use_muon=False (AdamW) group")
                if p.grad is None:
                    continue
                update = self._blend(p, group)
                m = MuonMatrix(gi, 0, 0, tuple(p.shape), tuple(p.shape), None, (p.shape[0],))
                o = orthogonalize_full(update, m, ns, self._stats)
                p.mul_(1 - lr * wd)
                p.add_(o, alpha=-adjusted_lr(lr, fn, p.shape))
            return
        (master,) = group["params"]
        update = self._blend(master, group)                                 # (shard,) fp32
        master.mul_(1 - lr * wd)
        plan = self._plan.get(gi, {})
        for bi, bv in enumerate(self.view.groups[gi].buckets):
            lo = bv.master_offset
            o = orthogonalize_bucket(self.view, bv, update[lo:lo + bv.shard_numel], plan.get(bi, []), ns,
                                     self._stats)                          # (shard of bucket,)
            self._apply(master, o, bv, plan.get(bi, []), lr, fn)

    def _apply(self, master: torch.Tensor, o: torch.Tensor, bv: Any, mats: list[MuonMatrix], lr: float,
               fn: Optional[str]) -> None:
        """``master -= adjusted_lr * o`` on this shard's pieces, the lr of each piece's part."""
        shard_lo = bv.layout.shard_range(bv.shard_index)[0]
        for m in mats:
            s = bv.params[m.slot]
            if s.lo >= s.hi:
                continue
            for a, b, shape in lr_segments(m, self.view.tp_size if self.view else 1):
                a, b = max(a, s.lo), min(b, s.hi)
                if a >= b:
                    continue
                src = s.bucket_offset + a - shard_lo                        # in the bucket's shard
                dst = s.master_offset + a - s.lo                            # in the group's master
                master[dst:dst + b - a].add_(o[src:src + b - a], alpha=-adjusted_lr(lr, fn, shape))

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """torch.optim.AdamW's step (its functional ``adam``, decoupled weight decay)."""
        params, grads, m1, m2, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            m1.append(st["exp_avg"])
            m2.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _adam_functional(params, grads, m1, m2, [], steps, foreach=False, decoupled_weight_decay=True,
                         amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                         eps=group["eps"], maximize=False)

    # ----------------------------------------------------------------- state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then each parameter keeps only its own kind's state (a checkpoint
        reader may hand every group every element-wise state it saw)."""
        super().load_state_dict(state_dict)
        keep = {True: ("momentum_buffer",), False: ("step", "exp_avg", "exp_avg_sq")}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if st:
                    for k in [k for k in st if k not in keep[bool(group["use_muon"])]]:
                        del st[k]
