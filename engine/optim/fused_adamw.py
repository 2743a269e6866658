"""FusedAdamW: torch.optim.AdamW's constructor and state, with the fused kernel (csrc/adam/).

One kernel call per (param group, device, grad dtype, copy dtype, step) bucket instead of
five torch ops per parameter; each element is read and written once. If the op cannot be
built here (or was built without its CUDA kernel, e.g. no nvcc) the PyTorch reference runs
instead (engine.ops.adam), and the constructor says so once per device type, naming the
cause (a logged warning and a RuntimeWarning).

State is torch.optim.AdamW's (``step`` as a float32 scalar tensor, ``exp_avg``,
``exp_avg_sq``), so state dicts move between the two optimizers.

Mixed precision / ZeRO: keep fp32 master parameters in the optimizer and register each
one's low-precision copy (the model weight, or a ZeRO shard of it) with
:meth:`FusedAdamW.attach_param_copy`; the kernel then writes ``copy = param.to(copy.dtype)``
(round to nearest even) in the same pass as the update.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional, Union

import torch

from engine.ops.adam import AdamWHyper, adamw_step, fused_adamw_available, fused_adamw_problem

__all__ = ["FusedAdamW"]

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()  # device types whose missing kernel was reported (once per process)

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOW_CHUNK = 1 << 20  # elements per fp32 temporary in the bf16-parameter update
_COPY_DTYPES = (torch.bfloat16, torch.float16)


def _warn_if_reference(device: torch.device) -> None:
    """Say once per device type, as a warning, when the step will run the PyTorch reference
    instead of the kernel, and why (builds/loads the op on first call)."""
    problem = fused_adamw_problem(device)
    if problem is None or device.type in _WARNED:
        return
    _WARNED.add(device.type)
    msg = (f"FusedAdamW on {device}: NO FUSED KERNEL, running the PyTorch reference instead ({problem}). The "
           "reference updates one tensor at a time with five ops and parameter-sized temporaries: several times "
           "slower on a GPU. `python -m engine.ops` reports the ops' state.")
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, Loshchilov & Hutter) with a fused per-element kernel.

    Arguments are torch.optim.AdamW's. Not supported (ValueError): ``amsgrad=True``,
    ``capturable=True``, ``differentiable=True``, ``fused=False``; ``foreach`` is accepted and
    ignored (the kernel already handles lists). ``maximize=True`` is supported. Extra:
    ``bias_correction`` (default True, as in torch) turns Adam's bias correction off;
    ``adam_w_mode=False`` gives Adam with L2 weight decay (torch.optim.Adam's update).
    Parameters must be float32 (master weights), or bfloat16 (DeepSpeed's bf16 master weights:
    updated in fp32 and rounded, :meth:`_step_low`); gradients may be fp32, bf16 or fp16.
    """

    # torch.optim.AdamW's signature, argument for argument (a drop-in replacement), plus bias_correction
    def __init__(self, params: Iterable[Any], lr: Union[float, torch.Tensor] = 1e-3,  # noqa: PLR0913
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, bias_correction: bool = True, adam_w_mode: bool = True) -> None:
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        if not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if amsgrad:
            raise ValueError("FusedAdamW does not implement amsgrad; use torch.optim.AdamW(amsgrad=True)")
        if capturable or differentiable:
            raise ValueError("FusedAdamW does not support capturable/differentiable; use torch.optim.AdamW")
        if maximize and not adam_w_mode:
            raise ValueError("FusedAdamW: maximize=True with adam_w_mode=False (L2) is not implemented; use torch.optim.Adam")
        if fused is False:
            raise ValueError("FusedAdamW is always fused; pass fused=None (or use torch.optim.AdamW)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False,
                        fused=fused, bias_correction=bias_correction, adam_w_mode=adam_w_mode)
        super().__init__(params, defaults)
        # Build/load the kernel now, at construction: a JIT build inside the first step would
        # hold every other rank in a collective for minutes (NCCL timeout on a cold cache).
        for device in {p.device for g in self.param_groups for p in g["params"]}:
            _warn_if_reference(device)
        # param -> low-precision tensor the kernel refreshes after each update; not part of
        # the state dict (it is model memory, not optimizer state).
        self._param_copies: dict[torch.Tensor, torch.Tensor] = {}
        # dtype of exp_avg / exp_avg_sq: None = the parameter's (fp32 masters: fp32; bf16 masters:
        # bf16, DeepSpeed's bf16_optimizer_states); fp32 = DeepSpeedCPUAdam(fp32_optimizer_states=True)
        self.state_dtype: Optional[torch.dtype] = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # state dicts saved by torch.optim.AdamW
            group.setdefault("bias_correction", True)
            group.setdefault("maximize", False)
            group.setdefault("amsgrad", False)
            group.setdefault("adam_w_mode", True)
            if group["amsgrad"]:
                raise ValueError("the loaded state has amsgrad=True, which FusedAdamW does not implement")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that moments kept in ``state_dtype`` stay in it: torch casts every
        floating state to its parameter's dtype, which would round the fp32 moments of bf16
        parameters (DeepSpeedCPUAdam(fp32_optimizer_states=True) over bf16 master weights) to
        bf16 on every resume. They are taken from the saved values instead."""
        super().load_state_dict(state_dict)
        dtype = getattr(self, "state_dtype", None)
        if dtype is None:
            return
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(saved_ids, params):
            saved = state_dict["state"].get(i)
            if not saved or p.dtype == dtype:
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                if isinstance(saved.get(k), torch.Tensor):
                    self.state[p][k] = saved[k].to(device=p.device, dtype=dtype, copy=True)

    def attach_param_copy(self, param: torch.Tensor, copy: torch.Tensor) -> None:
        """After each update also write ``copy.copy_(param)`` (bf16/fp16), in the same pass."""
        if not any(param is p for g in self.param_groups for p in g["params"]):
            raise ValueError("attach_param_copy: `param` is not one of this optimizer's parameters")
        if copy.dtype not in _COPY_DTYPES:
            raise TypeError(f"attach_param_copy: copy must be bfloat16 or float16, got {copy.dtype}")
        if copy.numel() != param.numel() or copy.device != param.device or not copy.is_contiguous():
            raise ValueError(f"attach_param_copy: copy must be contiguous with {param.numel()} elements on "
                             f"{param.device}, got {tuple(copy.shape)} on {copy.device}")
        self._param_copies[param] = copy

    def clear_param_copies(self) -> None:
        """Forget every attached copy (a clone of this optimizer over other parameters)."""
        self._param_copies = {}

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            dtype = getattr(self, "state_dtype", None) or p.dtype  # (older pickles lack it)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _check_param(self, p: torch.Tensor) -> None:
        assert p.grad is not None  # step() checks only parameters that have a gradient
        if p.grad.is_sparse:
            raise RuntimeError("FusedAdamW does not support sparse gradients; use torch.optim.SparseAdam")
        if p.dtype not in (torch.float32, torch.bfloat16) or (p.dtype != torch.float32 and p in self._param_copies):
            raise TypeError(f"FusedAdamW needs float32 parameters (master weights) or bfloat16 ones (DeepSpeed's "
                            f"bf16 master weights, no attached copy), got {p.dtype}; keep fp32 masters in the "
                            "optimizer and attach the low-precision weights with attach_param_copy")
        if p.grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"FusedAdamW: gradient dtype {p.grad.dtype} is not float32/bfloat16/float16")

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                self._check_param(p)
            states = [self._init_state(p) for p in params]
            steps = [st["step"] for st in states]
            torch._foreach_add_(steps, 1.0)  # one call, as torch's own AdamW does
            step_values = torch.stack(steps).tolist()
            # (device, grad dtype, copy dtype, step, contiguous) -> (params, grads, m, v, copies)
            buckets: dict[tuple, tuple[list, list, list, list, list]] = defaultdict(lambda: ([], [], [], [], []))
            for p, st, step in zip(params, states, step_values):
                copy = self._param_copies.get(p) if self._param_copies else None
                contiguous = p.is_contiguous() and p.grad.is_contiguous()  # states follow p's layout
                key = (p.device, (p.dtype, p.grad.dtype), None if copy is None else copy.dtype, step, contiguous)
                b = buckets[key]
                b[0].append(p)
                b[1].append(p.grad)
                b[2].append(st["exp_avg"])
                b[3].append(st["exp_avg_sq"])
                if copy is not None:
                    b[4].append(copy)
            beta1, beta2 = group["betas"]
            # adam_w_mode False (DeepSpeed's Adam mode, torch.optim.Adam): L2, g + wd * p, then
            # Adam's update with no decoupled decay (the kernel's decay factor is then exactly 1)
            l2 = 0.0 if group.get("adam_w_mode", True) else float(group["weight_decay"])
            for (device, _, copy_dtype, step, contiguous), (ps, gs, ms, vs, cs) in buckets.items():
                if ps[0].dtype != torch.float32:  # bf16 masters (the key's grad dtype is theirs)
                    self._step_low(ps, gs, ms, vs, group, step, l2)
                    continue
                if l2:
                    gs = [g.add(p, alpha=l2) if g.dtype == p.dtype else g.float().add_(p, alpha=l2)
                          for g, p in zip(gs, ps)]
                hp = AdamWHyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                                weight_decay=0.0 if l2 else group["weight_decay"], step=step,
                                bias_correction=group["bias_correction"], maximize=group["maximize"])
                adamw_step(ps, gs, ms, vs, hp, param_copies=cs if copy_dtype is not None else None,
                           use_kernel=contiguous and fused_adamw_available(device))
        return loss

    def _step_low(self, ps: list, gs: list, ms: list, vs: list, group: dict[str, Any], step: float,  # noqa: PLR0913
                  l2: float) -> None:
        """The update of bf16 parameters (DeepSpeed's bf16 master weights): as DeepSpeed's CPU
        Adam kernel does it, each element loaded to fp32 (parameter, gradient and the moments,
        bf16 or fp32), updated in fp32 and stored back rounded to nearest even; here through
        fp32 temporaries of at most ``_LOW_CHUNK`` elements per tensor at a time."""
        beta1, beta2 = group["betas"]
        hp = AdamWHyper(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=0.0 if l2 else group["weight_decay"], step=step,
                        bias_correction=group["bias_correction"], maximize=group["maximize"])
        for p, g, m, v in zip(ps, gs, ms, vs):
            flat = [t.view(-1) for t in (p, g, m, v)]
            for lo in range(0, p.numel(), _LOW_CHUNK):
                p_, g_, m_, v_ = (t[lo:lo + _LOW_CHUNK] for t in flat)
                p32, g32, m32, v32 = (t.float() for t in (p_, g_, m_, v_))  # copies when not fp32
                if l2:
                    g32 = g32.add(p32, alpha=l2)
                adamw_step([p32], [g32], [m32], [v32], hp, use_kernel=fused_adamw_available(p.device))
                for low, hi in ((p_, p32), (m_, m32), (v_, v32)):
                    if low.data_ptr() != hi.data_ptr():
                        low.copy_(hi)  # round to nearest even (bf16), as DeepSpeed's store
