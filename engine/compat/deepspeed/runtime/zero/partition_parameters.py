"""``deepspeed.runtime.zero.partition_parameters``: :class:`Init` and
:class:`GatheredParameters` (:mod:`engine.zero.init`), and DeepSpeed's external-parameter
registration where the engine's ZeRO-3 provides it (else refused with the reason).

DeepSpeed's ``ZeroParamStatus`` / ``ZeroParamType`` and its ``ds_status`` / ``ds_id``
attributes are not kept: a partitioned parameter here carries ``ds_tensor``, ``ds_numel``,
``ds_shape`` and ``ds_process_group`` only, so code that branches on ``ds_status`` is refused."""

from __future__ import annotations

from typing import Any

import engine.zero as _zero
from engine.compat.deepspeed._unsupported import unsupported
from engine.zero import GatheredParameters, Init

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "ZeroParamType"]

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
