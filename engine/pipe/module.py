"""DeepSpeed's pipeline model description: ``PipelineModule(layers=[LayerSpec(...),
TiedLayerSpec(...), nn.Module, callable, ...], num_stages=, loss_fn=, partition_method=,
activation_checkpoint_interval=)``.

The module only *describes* the model: ``engine.initialize(model=PipelineModule(...))``
cuts its layers into this rank's stage with :func:`engine.pipeline.stages.chunks_from_layers`
and runs them with the engine's own schedules (``pipeline.schedule``, 1F1B by default),
ZeRO 0-3 and ``engine.train_batch(data_iter)`` / ``eval_batch``.

Semantics kept from DeepSpeed: the layers run in order, each one's output is the next
one's input; the first stage gets the micro-batch's inputs and the last one's output goes
to ``loss_fn(output, labels)``; ``TiedLayerSpec`` layers with the same ``key`` share one
module (built once), a later one may run it through ``forward_fn(module, x)``, and the
gradients of the shared weight are summed across the stages that hold it;
``partition_method`` ``"parameters"`` (balance trainable parameter counts), ``"uniform"``
(balance layer counts), ``"type:<regex>"`` (balance the layers whose class name matches,
case-insensitive) or this engine's ``"blocks"`` (Megatron's: the layers between the first
and the last split evenly): one table with ``pipeline.partition``,
:data:`engine.config.sections.PARTITION_METHODS`. Differences: every layer is built (on the
host) on every rank at construction, so ``parameters()`` are the whole model's until
``engine.initialize`` cuts the stage (DeepSpeed builds them to count parameters too, then
keeps its stage's); ``engine.initialize`` then keeps this rank's layers only
(:meth:`PipelineModule.keep_only`: the others are released, and the module cannot be
initialised again); a tied module may be shared only by the first and the last stage (an
embedding and its head); one tensor crosses each stage boundary.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from engine.errors import ConfigError
from engine.pipeline.partition import PARTITION_METHODS, partition_layers
from engine.validate import check_int

__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule"]


class LayerSpec:
    """A layer to build later: ``typename(*module_args, **module_kwargs)``."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec takes an nn.Module subclass, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every ``TiedLayerSpec`` with the same ``key`` (built by the first);
    ``forward_fn(module, x)`` replaces ``module(x)`` where given (e.g. a head that reuses the
    embedding's weight). ``tied_weight_attr``: the shared parameter(s), by attribute name."""

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Optional[Callable] = None,
                 tied_weight_attr: Any = ("weight",), **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class _TiedForward(nn.Module):
    """``forward_fn(module, x)`` over a shared module (registered as a child, so the shared
    parameters are found in this layer too)."""

    def __init__(self, module: nn.Module, forward_fn: Callable) -> None:
        super().__init__()
        self.tied = module
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        return self.forward_fn(self.tied, x)


class _Callable(nn.Module):
    """A plain function in the layer list (``lambda x: x.float()``): no parameters."""

    def __init__(self, fn: Callable) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


class _Released(nn.Module):
    """Where a layer of another pipeline stage was (:meth:`PipelineModule.keep_only`)."""

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this layer belongs to another pipeline stage and was released by engine.initialize")


def _type_name(spec: Any) -> Optional[str]:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", None)


class PipelineModule(nn.Module):
    """See the module docstring. ``num_stages`` is the pipeline depth (the config's
    ``pipeline.stages`` may be left out or must equal it); ``topology`` (DeepSpeed's
    ``PipeDataParallelTopology``) is not taken: give ``num_stages``."""

    def __init__(self, layers: Sequence[Any], num_stages: Optional[int] = None, topology: Any = None,  # noqa: PLR0913 (DeepSpeed's PipelineModule signature)
                 loss_fn: Optional[Callable] = None, seed_layers: bool = False, seed_fn: Optional[Callable] = None,
                 base_seed: int = 1234, partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Any = None, checkpointable_layers: Any = None,
                 dynamic_shape: bool = False) -> None:
        super().__init__()
        if topology is not None:
            raise ValueError("PipelineModule(topology=...) is not supported: pass num_stages (the data-parallel "
                             "size is the world size / num_stages, as DeepSpeed's PipeDataParallelTopology)")
        check_int("PipelineModule num_stages", num_stages, minimum=1, error=ValueError)
        for name, value, default in (("seed_fn", seed_fn, None), ("activation_checkpoint_func",
                                                                   activation_checkpoint_func, None),
                                     ("checkpointable_layers", checkpointable_layers, None),
                                     ("dynamic_shape", dynamic_shape, False)):
            if value != default:
                raise ValueError(f"PipelineModule({name}=...) is not supported: leave it at its default")
        check_int("activation_checkpoint_interval", activation_checkpoint_interval, minimum=0,
                  fix="0 disables checkpointing", error=ValueError)
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._specs = list(layers)
        if not self._specs:
            raise ValueError("PipelineModule needs a non-empty list of layers")
        self._check_method(partition_method)
        built = self._build(seed_layers, base_seed)
        self.layers = nn.ModuleList(built)
        self._weights: Optional[list[int]] = None  # layer_weights(), kept once the layers are released
        self._released = False

    # ------------------------------------------------------------------ construction
    def _build(self, seed_layers: bool, base_seed: int) -> list[nn.Module]:
        tied: dict[str, nn.Module] = {}
        out: list[nn.Module] = []
        for i, spec in enumerate(self._specs):
            if seed_layers:  # DeepSpeed's seed_layers: layer i is built after manual_seed(base_seed + i)
                torch.manual_seed(base_seed + i)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:
                    tied[spec.key] = spec.build()
                module = tied[spec.key]
                out.append(module if spec.forward_fn is None else _TiedForward(module, spec.forward_fn))
            elif isinstance(spec, LayerSpec):
                out.append(spec.build())
            elif isinstance(spec, nn.Module):
                out.append(spec)
            elif callable(spec):
                out.append(_Callable(spec))
            else:
                raise TypeError(f"layer {i}: expected a LayerSpec, an nn.Module or a callable, got "
                                f"{type(spec).__name__}")
        return out

    @staticmethod
    def _check_method(method: str) -> None:
        m = method.lower()
        if m in PARTITION_METHODS:
            return
        if m.startswith("type:"):
            try:
                re.compile(method.split(":", 1)[1])
            except re.error as exc:
                raise ValueError(f"partition_method {method!r}: the regex does not compile ({exc})") from None
            return
        raise ValueError(f"partition_method {method!r} is not one of {', '.join(PARTITION_METHODS)}")

    # ------------------------------------------------------------------ what initialize reads
    def layer_list(self) -> list[nn.Module]:
        self._check_whole("engine.initialize")
        return list(self.layers)

    def keep_only(self, kept: Sequence[nn.Module]) -> None:
        """Release every layer not in ``kept`` (this rank's stage, after ``engine.initialize``
        cut it): each becomes an empty placeholder, so its parameters are freed once nothing
        else holds them. DeepSpeed's PipelineModule likewise holds its own stage only."""
        self._weights = self.layer_weights()
        keep = {id(m) for m in kept}
        for i, layer in enumerate(self.layers):
            if id(layer) not in keep:
                self.layers[i] = _Released()
        self._released = True

    def _check_whole(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"{what}: this PipelineModule kept only one pipeline stage's layers after "
                               "engine.initialize; build a new PipelineModule for another engine or a whole-model run")

    def layer_weights(self) -> list[int]:
        """The weight of each layer that ``partition_method`` balances."""
        if self._weights is not None:
            return list(self._weights)
        m = self.partition_method.lower()
        if m in ("uniform", "blocks"):
            return [1] * len(self._specs)
        if m == "parameters":
            # a tied layer counts its module each time it appears (as DeepSpeed, which builds each spec)
            return [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in self.layers]
        pattern = re.compile(self.partition_method.split(":", 1)[1], re.IGNORECASE)
        hits = [1 if (n := _type_name(s)) is not None and pattern.search(n) else 0 for s in self._specs]
        if not any(hits):
            raise ConfigError(f"partition_method {self.partition_method!r} matches no layer class name: "
                              f"the layers are {sorted({_type_name(s) or '?' for s in self._specs})}")
        return hits

    def partition(self, num_parts: int) -> list[int]:
        """Boundaries of ``num_parts`` contiguous pieces balancing :meth:`layer_weights`
        (the largest piece as small as possible); ``blocks`` as the config's."""
        method = "blocks" if self.partition_method.lower() == "blocks" else "parameters"
        return partition_layers(self.layer_weights(), num_parts, method)

    def forward(self, x: Any) -> Any:
        """The whole model in one process (no pipeline): the layers in order."""
        self._check_whole("PipelineModule.forward")
        for layer in self.layers:
            x = layer(x)
        return x
