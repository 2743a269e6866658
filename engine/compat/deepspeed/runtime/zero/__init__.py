"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ``Init``, ``GatheredParameters``,
``register_external_parameter`` / ``unregister_external_parameter``
(:mod:`.partition_parameters`); ``TiledLinear`` and ``MiCS_Init`` are refused with the reason."""

from engine.compat.deepspeed._unsupported import unsupported
from engine.compat.deepspeed.runtime.zero import partition_parameters
from engine.compat.deepspeed.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "ZeroParamType", "TiledLinear", "TiledLinearReturnBias", "MiCS_Init",
           "partition_parameters"]

TiledLinear = unsupported("deepspeed.zero.TiledLinear", "TiledLinear is not implemented in this engine")
TiledLinearReturnBias = unsupported("deepspeed.zero.TiledLinearReturnBias", "TiledLinear is not implemented in this engine")
MiCS_Init = unsupported("deepspeed.zero.MiCS_Init", "MiCS (ZeRO-3 within sub-groups) is not implemented in this engine")
