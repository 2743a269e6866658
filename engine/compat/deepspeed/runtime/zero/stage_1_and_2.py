"""``deepspeed.runtime.zero.stage_1_and_2``: DeepSpeed's memory estimators are refused (see
:mod:`engine.compat.deepspeed.runtime.zero.stage3`)."""

from engine.compat.deepspeed._unsupported import unsupported
from engine.compat.deepspeed.runtime.zero.stage3 import _REASON

__all__ = ["estimate_zero2_model_states_mem_needs_all_live", "estimate_zero2_model_states_mem_needs_all_cold"]

estimate_zero2_model_states_mem_needs_all_live = unsupported(
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live", _REASON)
estimate_zero2_model_states_mem_needs_all_cold = unsupported(
    "deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold", _REASON)
