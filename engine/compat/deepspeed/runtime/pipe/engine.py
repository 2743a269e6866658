"""``deepspeed.runtime.pipe.engine.PipelineEngine``: the engine runs pipelines itself (one
:class:`~engine.engine.Engine` class for every layout), so ``PipelineEngine`` is a name to
test with: ``isinstance(e, PipelineEngine)`` is true for an engine built from a
``PipelineModule`` (or any config with pipeline stages), as DeepSpeed's
``deepspeed.initialize`` returns a ``PipelineEngine`` for those. It cannot be constructed:
``deepspeed.initialize(model=PipelineModule(...))`` builds it."""

from __future__ import annotations

from typing import Any, NoReturn

from engine.compat.deepspeed._unsupported import UnsupportedFeatureError
from engine.engine import Engine

__all__ = ["PipelineEngine"]


class _PipelineEngineMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, Engine) and obj.pipeline is not None

    def __call__(cls, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedFeatureError("PipelineEngine(...) cannot be built directly here: call "
                                      "deepspeed.initialize(model=PipelineModule(...), config=...)")


class PipelineEngine(metaclass=_PipelineEngineMeta):
    """See the module docstring."""
