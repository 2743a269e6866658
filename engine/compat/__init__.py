"""DeepSpeed's public names over this engine, for scripts written against DeepSpeed.

``import engine.compat.deepspeed as deepspeed`` gives ``initialize``, ``init_distributed``,
``add_config_arguments``, ``zero``, ``pipe`` and ``comm`` (see :mod:`engine.compat.deepspeed`).
"""

__all__: list[str] = []
