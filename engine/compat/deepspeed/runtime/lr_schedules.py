"""``deepspeed.runtime.lr_schedules``: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``
(:mod:`engine.optim.lr_schedules`, DeepSpeed's parameter names and formulas; see that module
for how their step indexing relates to DeepSpeed's). ``OneCycle`` and ``LRRangeTest`` are
refused with the reason."""

from engine.compat.deepspeed._unsupported import unsupported
from engine.optim.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "VALID_LR_SCHEDULES"]

VALID_LR_SCHEDULES = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]  # the ones implemented here
OneCycle = unsupported("deepspeed.runtime.lr_schedules.OneCycle", "the OneCycle schedule is not implemented in this "
                       "engine: use WarmupLR / WarmupDecayLR / WarmupCosineLR, or a torch scheduler")
LRRangeTest = unsupported("deepspeed.runtime.lr_schedules.LRRangeTest", "the LR range test is not implemented in "
                          "this engine: use a torch scheduler (e.g. LambdaLR)")
