"""``deepspeed.runtime.zero.stage3``: DeepSpeed's memory estimators are refused; the engine's
formulas are :func:`engine.zero.memory.zero_memory_formula` / ``zero_peak_formula``."""

from engine.compat.deepspeed._unsupported import unsupported

__all__ = ["estimate_zero3_model_states_mem_needs_all_live", "estimate_zero3_model_states_mem_needs_all_cold"]

_REASON = ("DeepSpeed's printed estimator tables are not reproduced: use engine.zero.memory.zero_memory_formula / "
           "zero_peak_formula (the engine's own accounting, checked against its measured peaks)")
estimate_zero3_model_states_mem_needs_all_live = unsupported(
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live", _REASON)
estimate_zero3_model_states_mem_needs_all_cold = unsupported(
    "deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_cold", _REASON)
