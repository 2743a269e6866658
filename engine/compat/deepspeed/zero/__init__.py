"""``deepspeed.zero``: the names of :mod:`engine.compat.deepspeed.runtime.zero` (``Init``,
``GatheredParameters``, ``register_external_parameter``, ...)."""

from engine.compat.deepspeed.runtime.zero import (
    GatheredParameters,
    Init,
    MiCS_Init,
    TiledLinear,
    TiledLinearReturnBias,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter",
           "ZeroParamStatus", "ZeroParamType", "TiledLinear", "TiledLinearReturnBias", "MiCS_Init"]
