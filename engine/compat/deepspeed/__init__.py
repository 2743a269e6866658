"""DeepSpeed's module-level API over this engine: change a DeepSpeed script's import

    import deepspeed                          ->  import engine.compat.deepspeed as deepspeed

and the rest of the script stays as it is:

- ``initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
  lr_scheduler=None, distributed_port=..., mpu=None, dist_init_required=None, collate_fn=None,
  config=None, config_params=None)`` -> ``(engine, optimizer, dataloader, lr_scheduler)``;
- ``init_distributed(dist_backend=None, ..., timeout=..., init_method=None, ...)``;
- ``add_config_arguments(parser)`` (``--deepspeed``, ``--deepspeed_config``);
- ``zero``: the :mod:`engine.zero` package (``zero.Init`` / ``zero.GatheredParameters`` where
  that package provides them);
- ``pipe``: :mod:`engine.pipe` (``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``);
- ``comm``: :mod:`engine.compat.comm` (the collectives DeepSpeed scripts call as ``deepspeed.comm``);
- ``ops.adam``: :mod:`engine.compat.deepspeed.ops.adam` (``DeepSpeedCPUAdam``, ``FusedAdam``: client
  optimizers with DeepSpeed's signatures; ``DeepSpeedCPUAdam`` is what ZeRO-Offload steps on the host);
- ``utils.zero_to_fp32``: :mod:`engine.compat.zero_to_fp32` (``get_fp32_state_dict_from_zero_checkpoint``,
  ``convert_zero_checkpoint_to_fp32_state_dict``, ``load_state_dict_from_zero_checkpoint``);
  ``engine.save_16bit_model(save_dir)`` is a method of the engine, as in DeepSpeed.

Names DeepSpeed has and this module lacks are features the engine does not have.
"""

from __future__ import annotations

import types

from engine import pipe, zero
from engine.assembly.initialize import initialize
from engine.compat import comm, zero_to_fp32
from engine.compat.api import add_config_arguments, init_distributed
from engine.compat.deepspeed import ops

# attribute access only (deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint):
# ``from deepspeed.utils.zero_to_fp32 import ...`` becomes ``from engine.compat.zero_to_fp32 import ...``
utils = types.SimpleNamespace(zero_to_fp32=zero_to_fp32)

__version__ = "0.19.8+engine"  # the DeepSpeed release whose API this mirrors

__all__ = ["initialize", "init_distributed", "add_config_arguments", "zero", "pipe", "comm", "utils", "ops", "__version__"]
