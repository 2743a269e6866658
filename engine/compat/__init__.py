"""DeepSpeed's public API over this engine, for scripts written against DeepSpeed.

:mod:`engine.compat.deepspeed` mirrors DeepSpeed's module tree (``import
engine.compat.deepspeed as deepspeed``, or unmodified scripts through
``python -m engine.compat.deepspeed SCRIPT`` / :func:`engine.compat.deepspeed.alias`);
:mod:`engine.compat.comm` (``deepspeed.comm``), :mod:`engine.compat.zero_to_fp32`
(``deepspeed.utils.zero_to_fp32``) and :mod:`engine.compat.api` (``init_distributed``,
``add_config_arguments``) are its pieces.
"""

__all__: list[str] = []
