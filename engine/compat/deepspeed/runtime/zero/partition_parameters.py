"""``deepspeed.runtime.zero.partition_parameters``: :class:`Init` and
:class:`GatheredParameters` (:mod:`engine.zero.init`), and DeepSpeed's external-parameter
registration where the engine's ZeRO-3 provides it (else refused with the reason).

DeepSpeed's ``ZeroParamStatus`` / ``ZeroParamType`` and its ``ds_status`` / ``ds_id``
attributes are not kept: a partitioned parameter here carries ``ds_tensor``, ``ds_numel``,
``ds_shape`` and ``ds_process_group`` only, so code that branches on ``ds_status`` is refused.

``zero_wrapper_for_fp_tensor_constructor`` is DeepSpeed's helper (a tensor constructor whose
result goes to ``target_device`` and, if floating point, to ``target_fp_dtype``) and
``_orig_torch_arange`` is ``torch.arange``, both as DeepSpeed has them: Hugging Face's
``prevent_arange_dtype_change`` swaps the helper around ``zero.Init``. Unlike DeepSpeed's, the
engine's ``Init`` does not wrap tensor constructors (it partitions parameters only; buffers a
constructor makes keep their dtype), so the swap changes nothing here, which is the effect HF
wants from it (``torch.arange`` buffers keep their explicit dtype)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

import engine.zero as _zero
from engine.compat.deepspeed._unsupported import unsupported
from engine.zero import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "ZeroParamType", "zero_wrapper_for_fp_tensor_constructor"]

_EXTERNAL = ("ZeRO-3 external-parameter registration is not implemented in this engine: a module that uses a "
             "child's parameter outside the child's forward needs it (see issue 31)")
_STATUS = ("DeepSpeed's per-parameter status (ds_status / ds_id) is not kept here: a partitioned parameter has "
           "ds_tensor / ds_numel / ds_shape; read the weights inside GatheredParameters")

# the engine's own where it has them (engine.zero), else refused with the reason
register_external_parameter: Any = getattr(_zero, "register_external_parameter", None) or unsupported(
    "deepspeed.zero.register_external_parameter", _EXTERNAL)
unregister_external_parameter: Any = getattr(_zero, "unregister_external_parameter", None) or unsupported(
    "deepspeed.zero.unregister_external_parameter", _EXTERNAL)
ZeroParamStatus = unsupported("deepspeed.runtime.zero.partition_parameters.ZeroParamStatus", _STATUS)
ZeroParamType = unsupported("deepspeed.runtime.zero.partition_parameters.ZeroParamType", _STATUS)

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype,
                                           target_device: Optional[torch.device] = None) -> Callable[..., torch.Tensor]:
    """DeepSpeed's: ``fn`` (a tensor constructor such as ``torch.empty``) creating its tensor on
    ``target_device`` (when the call names no device) and casting a floating-point result to
    ``target_fp_dtype``. Not called by the engine's ``Init`` (see the module docstring)."""

    @functools.wraps(fn)
    def wrapped_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn
