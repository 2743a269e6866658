"""``deepspeed.utils``: :class:`RepeatingLoader`, ``logger`` / ``log_dist``,
:mod:`zero_to_fp32`, :mod:`groups`; DeepSpeed's per-parameter accessors
(``safe_get_full_fp32_param``, ...), ZeRO-3 leaf modules and ``OnDevice`` are refused with
the reason."""

from __future__ import annotations

from engine.compat.deepspeed._unsupported import unsupported
from engine.compat.deepspeed.utils import groups, zero_to_fp32
from engine.compat.deepspeed.utils.logging import log_dist, logger, print_dist
from engine.data.ds_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "logger", "log_dist", "print_dist", "zero_to_fp32", "groups", "OnDevice",
           "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix",
           "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
           "safe_update_full_grad_vectorized"]


_FRAGMENTS = ("reading or writing one parameter's fp32 master / gradient / optimizer state through DeepSpeed's "
              "fragment mapping is not implemented in this engine: read weights inside deepspeed.zero."
              "GatheredParameters, optimizer state from engine.optimizer.state_dict(), or consolidate a checkpoint "
              "(deepspeed.utils.zero_to_fp32)")
_LEAF = ("ZeRO-3 leaf modules are not implemented in this engine: its ZeRO-3 gathers the parameters of each "
         "submodule that owns parameters (engine/zero/stage3.py) and has no way to gather a subtree at once")

safe_get_full_fp32_param = unsupported("deepspeed.utils.safe_get_full_fp32_param", _FRAGMENTS)
safe_get_full_grad = unsupported("deepspeed.utils.safe_get_full_grad", _FRAGMENTS)
safe_get_full_optimizer_state = unsupported("deepspeed.utils.safe_get_full_optimizer_state", _FRAGMENTS)
safe_get_local_fp32_param = unsupported("deepspeed.utils.safe_get_local_fp32_param", _FRAGMENTS)
safe_get_local_grad = unsupported("deepspeed.utils.safe_get_local_grad", _FRAGMENTS)
safe_get_local_optimizer_state = unsupported("deepspeed.utils.safe_get_local_optimizer_state", _FRAGMENTS)
safe_set_full_fp32_param = unsupported("deepspeed.utils.safe_set_full_fp32_param", _FRAGMENTS)
safe_set_full_grad = unsupported("deepspeed.utils.safe_set_full_grad", _FRAGMENTS)
safe_set_full_optimizer_state = unsupported("deepspeed.utils.safe_set_full_optimizer_state", _FRAGMENTS)
safe_set_local_fp32_param = unsupported("deepspeed.utils.safe_set_local_fp32_param", _FRAGMENTS)
safe_set_local_grad = unsupported("deepspeed.utils.safe_set_local_grad", _FRAGMENTS)
safe_set_local_optimizer_state = unsupported("deepspeed.utils.safe_set_local_optimizer_state", _FRAGMENTS)
safe_update_full_grad_vectorized = unsupported("deepspeed.utils.safe_update_full_grad_vectorized", _FRAGMENTS)
set_z3_leaf_modules = unsupported("deepspeed.utils.set_z3_leaf_modules", _LEAF)
unset_z3_leaf_modules = unsupported("deepspeed.utils.unset_z3_leaf_modules", _LEAF)
get_z3_leaf_modules = unsupported("deepspeed.utils.get_z3_leaf_modules", _LEAF)
z3_leaf_module = unsupported("deepspeed.utils.z3_leaf_module", _LEAF)
set_z3_leaf_modules_by_name = unsupported("deepspeed.utils.set_z3_leaf_modules_by_name", _LEAF)
set_z3_leaf_modules_by_suffix = unsupported("deepspeed.utils.set_z3_leaf_modules_by_suffix", _LEAF)
OnDevice = unsupported("deepspeed.utils.OnDevice", "building a model on the meta device through DeepSpeed's OnDevice "
                       "is not implemented: use deepspeed.zero.Init to build it partitioned")
