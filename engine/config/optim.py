"""Parsers for the ``optimizer`` and ``scheduler`` sections (DeepSpeed schema, plus our two schedules)."""

from __future__ import annotations

from typing import Optional

from engine.config.reader import Section, did_you_mean
from engine.config.schema import (
    AdamParams,
    CosineParams,
    LionParams,
    MuonParams,
    OptimizerConfig,
    SchedulerConfig,
    SchedulerParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    WSDParams,
)
from engine.errors import ConfigError

__all__ = ["parse_optimizer", "parse_scheduler", "OPTIMIZER_TYPES", "SCHEDULER_TYPES"]

OPTIMIZER_TYPES = ("Adam", "AdamW", "Lion", "Muon")
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "cosine", "WSD")

# Other optimizer types DeepSpeed knows (lower-cased, as DeepSpeed compares them).
_DS_OPTIMIZERS_NOT_HERE = ("adagrad", "lamb", "onebitadam", "zerooneadam", "onebitlamb", "muadam",
                           "muadamw", "musgd", "muon", "sgd")
_DS_SCHEDULERS_NOT_HERE = ("OneCycle", "LRRangeTest")

_LR_AUTO = (" (the Hugging Face Trainer fills it from its own arguments, and there are none here)")
_MAX_GRAD_NORM = ("gradient clipping is configured by the top-level key gradient_clipping: move the value "
                  "there and remove optimizer.params.max_grad_norm")


def parse_optimizer(top: Section) -> Optional[OptimizerConfig]:
    """``None`` when there is no optimizer section: the script passes its own optimizer to
    ``engine.initialize(optimizer=...)`` (checked there, where the client object is known)."""
    if not top.has("optimizer") or top.raw("optimizer") is None:
        return None
    s = top.sub("optimizer", ("type", "params"), fixed={
        "legacy_fusion": (False, "there is one fused implementation per optimizer"),
    })
    raw_type = s.raw("type")
    if not isinstance(raw_type, str):
        raise ConfigError(f"optimizer.type is required and must be one of {', '.join(OPTIMIZER_TYPES)}, "
                          f"got {raw_type!r}")
    # DeepSpeed compares optimizer names case-insensitively ("adamw" == "AdamW").
    canonical = {t.lower(): t for t in OPTIMIZER_TYPES}
    opt_type = canonical.get(raw_type.lower())
    if opt_type is None:
        why = (" is a DeepSpeed optimizer this engine does not implement"
               if raw_type.lower() in _DS_OPTIMIZERS_NOT_HERE else " is not an optimizer type")
        raise ConfigError(f"optimizer.type \"{raw_type}\"{why}{did_you_mean(raw_type, OPTIMIZER_TYPES)}: "
                          f"use one of {', '.join(OPTIMIZER_TYPES)}")
    if opt_type == "Lion":
        return OptimizerConfig(type=opt_type, params=_lion_params(s))
    if opt_type == "Muon":
        return OptimizerConfig(type=opt_type, params=_muon_params(s))
    return OptimizerConfig(type=opt_type, params=_adam_params(s, opt_type))


def _adam_params(opt: Section, opt_type: str) -> AdamParams:
    p = opt.sub("params", ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam"),
                rejected={"max_grad_norm": _MAX_GRAD_NORM},
                fixed={"amsgrad": (False, "the AMSGrad variant is not implemented; DeepSpeed's fused Adam "
                                          "lacks it too"),
                       "bias_correction": (True, "Adam without bias correction is not implemented")})
    d = AdamParams()
    adam_w_mode = p.bool("adam_w_mode", True)
    if opt_type == "AdamW" and not adam_w_mode:
        raise ConfigError("optimizer.params.adam_w_mode = false contradicts optimizer.type \"AdamW\": use "
                          "type \"Adam\" with adam_w_mode false for L2-regularised Adam")
    return AdamParams(
        lr=p.number("lr", d.lr, min=0.0, min_exclusive=True, auto_hint=_LR_AUTO),
        betas=p.number_pair("betas", d.betas, lo=0.0, hi=1.0),
        eps=p.number("eps", d.eps, min=0.0, min_exclusive=True, auto_hint=_LR_AUTO),
        weight_decay=p.number("weight_decay", d.weight_decay, min=0.0, auto_hint=_LR_AUTO),
        adam_w_mode=adam_w_mode,
        torch_adam=p.bool("torch_adam", d.torch_adam),
    )


def _lion_params(opt: Section) -> LionParams:
    p = opt.sub("params", ("lr", "betas", "weight_decay"),
                rejected={"max_grad_norm": _MAX_GRAD_NORM,
                          "eps": "Lion takes the sign of its update and has no eps: remove the key"})
    d = LionParams()
    return LionParams(
        lr=p.number("lr", d.lr, min=0.0, min_exclusive=True, auto_hint=_LR_AUTO),
        betas=p.number_pair("betas", d.betas, lo=0.0, hi=1.0),
        weight_decay=p.number("weight_decay", d.weight_decay, min=0.0, auto_hint=_LR_AUTO),
    )


_MUON_KEYS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "adam_weight_decay", "betas", "eps",
              "nesterov", "ns_coefficients", "ns_steps", "ns_eps", "adjust_lr_fn", "ns_dtype", "muon_params",
              "adam_params")


def _muon_params(opt: Section) -> MuonParams:
    p = opt.sub("params", _MUON_KEYS,
                rejected={"max_grad_norm": _MAX_GRAD_NORM,
                          "torch_adam": "the AdamW part of Muon is always torch.optim.AdamW's update: remove the key",
                          "fp32_optimizer_states": "optimizer state is always fp32 here: remove the key"},
                fixed={"adam_w_mode": (True, "the auxiliary Adam of Muon is AdamW (decoupled weight decay)"),
                       "ns_method": ("standard", "Newton-Schulz is torch.optim.Muon's quintic iteration "
                                                 "(DeepSpeed's \"standard\"); its \"gram\" variant is not implemented"),
                       "per_head_muon": (False, "Muon orthogonalises whole matrices (fused q/k/v and gate/up as "
                                                "their separate parts), not per attention head")})
    d = MuonParams()
    lr = p.number("lr", d.lr, min=0.0, min_exclusive=True, auto_hint=_LR_AUTO)
    wd = p.number("weight_decay", d.weight_decay, min=0.0, auto_hint=_LR_AUTO)
    coeffs = p.raw("ns_coefficients", list(d.ns_coefficients))
    if (not isinstance(coeffs, (list, tuple)) or len(coeffs) != 3
            or any(isinstance(c, bool) or not isinstance(c, (int, float)) for c in coeffs)):
        raise p.error("ns_coefficients", f"must be a list of three numbers [a, b, c], got {coeffs!r}")
    return MuonParams(
        lr=lr,
        muon_lr=p.number("muon_lr", lr, min=0.0, min_exclusive=True) if p.has("muon_lr") else None,
        adam_lr=p.number("adam_lr", lr, min=0.0, min_exclusive=True) if p.has("adam_lr") else None,
        momentum=p.number("momentum", d.momentum, min=0.0, max=1.0),
        weight_decay=wd,
        adam_weight_decay=p.number("adam_weight_decay", wd, min=0.0) if p.has("adam_weight_decay") else None,
        betas=p.number_pair("betas", d.betas, lo=0.0, hi=1.0),
        eps=p.number("eps", d.eps, min=0.0, min_exclusive=True, auto_hint=_LR_AUTO),
        nesterov=p.bool("nesterov", d.nesterov),
        ns_coefficients=tuple(float(c) for c in coeffs),  # type: ignore[arg-type]
        ns_steps=p.int("ns_steps", d.ns_steps, min=1, max=99),
        ns_eps=p.number("ns_eps", d.ns_eps, min=0.0, min_exclusive=True),
        adjust_lr_fn=p.choice("adjust_lr_fn", ("original", "match_rms_adamw"), d.adjust_lr_fn),
        ns_dtype=p.choice("ns_dtype", ("bfloat16", "float32"), d.ns_dtype),
        muon_params=p.str_list("muon_params"),
        adam_params=p.str_list("adam_params"),
    )


# ---------------------------------------------------------------- scheduler
_LAST_BATCH = {"last_batch_iteration": (-1, "a resumed run takes its step from the checkpoint")}
_WARMUP_TYPES = ("log", "linear")


def parse_scheduler(top: Section, optimizer_lr: Optional[float]) -> Optional[SchedulerConfig]:
    """``None`` when there is no scheduler (the optimizer's lr is used throughout).
    ``optimizer_lr``: the optimizer section's lr, None without one (a client optimizer)."""
    if not top.has("scheduler") or top.raw("scheduler") is None:
        return None
    s = top.sub("scheduler", ("type", "params"))
    t = s.raw("type")
    if t not in SCHEDULER_TYPES:
        why = " is a DeepSpeed scheduler this engine does not implement" if t in _DS_SCHEDULERS_NOT_HERE else ""
        hint = did_you_mean(t, SCHEDULER_TYPES) if isinstance(t, str) else ""
        raise ConfigError(f"scheduler.type {t!r}{why}{hint}: use one of {', '.join(SCHEDULER_TYPES)}")
    parse = {"WarmupLR": _warmup_lr, "WarmupDecayLR": _warmup_decay_lr, "WarmupCosineLR": _warmup_cosine_lr,
             "cosine": _cosine, "WSD": _wsd}[t]
    return SchedulerConfig(type=t, params=parse(s, optimizer_lr))


def _warmup_lr_fields(p: Section, optimizer_lr: Optional[float], max_lr_default: float) -> dict:
    # warmup_max_lr "auto" (Hugging Face) and, for WarmupLR, "absent" (DeepSpeed) mean the optimizer's lr.
    if optimizer_lr is None and p.is_auto("warmup_max_lr"):
        raise ConfigError(f"{p.full('warmup_max_lr')} is \"auto\" but the config has no optimizer section to take "
                          "the lr from (a client optimizer's lr is not known to the config): give a number")
    max_lr = optimizer_lr if p.is_auto("warmup_max_lr") else p.number(
        "warmup_max_lr", max_lr_default, min=0.0, min_exclusive=True)
    min_lr = p.number("warmup_min_lr", 0.0, min=0.0)
    assert max_lr is not None  # "auto" without an optimizer lr raised above
    if min_lr > max_lr:
        raise ConfigError(f"{p.full('warmup_min_lr')} ({min_lr:g}) is greater than {p.full('warmup_max_lr')} "
                          f"({max_lr:g}): the warmup would lower the learning rate; swap or fix them")
    return dict(warmup_min_lr=min_lr, warmup_max_lr=max_lr,
                warmup_num_steps=p.int("warmup_num_steps", 1000, min=1, auto_hint=_STEPS_AUTO),
                warmup_type=p.choice("warmup_type", _WARMUP_TYPES, "log"))


_STEPS_AUTO = " (it depends on the dataset length and epochs, which the config does not know)"


def _total_after_warmup(p: Section, warmup: int) -> int:
    total = p.int("total_num_steps", required=True, min=1, auto_hint=_STEPS_AUTO)
    if total <= warmup:
        raise ConfigError(f"{p.full('total_num_steps')} ({total}) must be greater than "
                          f"{p.full('warmup_num_steps')} ({warmup}) so that the decay phase has steps: "
                          "raise total_num_steps or lower warmup_num_steps")
    return total


def _warmup_lr(s: Section, lr: Optional[float]) -> SchedulerParams:
    p = s.sub("params", ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"), fixed=_LAST_BATCH)
    # without an optimizer section, DeepSpeed's own default (0.001)
    return WarmupLRParams(**_warmup_lr_fields(p, lr, max_lr_default=0.001 if lr is None else lr))


def _warmup_decay_lr(s: Section, lr: Optional[float]) -> SchedulerParams:
    p = s.sub("params", ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
              fixed=_LAST_BATCH)
    f = _warmup_lr_fields(p, lr, max_lr_default=0.001)  # DeepSpeed's default for this scheduler
    return WarmupDecayLRParams(total_num_steps=_total_after_warmup(p, f["warmup_num_steps"]), **f)


def _warmup_cosine_lr(s: Section, lr: Optional[float]) -> SchedulerParams:
    p = s.sub("params", ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
              fixed=_LAST_BATCH)
    warmup = p.int("warmup_num_steps", 1000, min=1, auto_hint=_STEPS_AUTO)
    return WarmupCosineLRParams(
        total_num_steps=_total_after_warmup(p, warmup),
        warmup_min_ratio=p.number("warmup_min_ratio", 0.0, min=0.0, max=1.0),
        warmup_num_steps=warmup,
        cos_min_ratio=p.number("cos_min_ratio", 0.0001, min=0.0, max=1.0),
        warmup_type=p.choice("warmup_type", _WARMUP_TYPES, "log"),
    )


def _cosine(s: Section, lr: Optional[float]) -> SchedulerParams:
    p = s.sub("params", ("warmup_num_steps", "total_num_steps", "min_lr_ratio", "warmup_type"))
    warmup = p.int("warmup_num_steps", 0, min=0, auto_hint=_STEPS_AUTO)
    return CosineParams(
        warmup_num_steps=warmup,
        total_num_steps=_total_after_warmup(p, warmup),
        min_lr_ratio=p.number("min_lr_ratio", 0.1, min=0.0, max=1.0),
        warmup_type=p.choice("warmup_type", ("linear",), "linear"),
    )


def _wsd(s: Section, lr: Optional[float]) -> SchedulerParams:
    p = s.sub("params", ("warmup_num_steps", "total_num_steps", "decay_num_steps", "min_lr_ratio", "decay_type"))
    warmup = p.int("warmup_num_steps", 0, min=0, auto_hint=_STEPS_AUTO)
    total = p.int("total_num_steps", required=True, min=1, auto_hint=_STEPS_AUTO)
    decay = p.int("decay_num_steps", required=True, min=1, auto_hint=_STEPS_AUTO)
    if warmup + decay > total:
        raise ConfigError(f"scheduler.params: warmup_num_steps ({warmup}) + decay_num_steps ({decay}) = "
                          f"{warmup + decay} exceeds total_num_steps ({total}): shorten a phase or raise the total")
    return WSDParams(warmup_num_steps=warmup, total_num_steps=total, decay_num_steps=decay,
                     min_lr_ratio=p.number("min_lr_ratio", 0.0, min=0.0, max=1.0),
                     decay_type=p.choice("decay_type", ("linear", "cosine", "sqrt"), "linear"))
