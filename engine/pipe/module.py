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
``partition_method`` with DeepSpeed's boundaries: ``"parameters"`` (trainable parameter
counts, counted on the meta device, cut by DeepSpeed's ``partition_balanced``),
``"uniform"`` (DeepSpeed's ``partition_uniform``), ``"type:<regex>"`` (the layers whose class
name matches, case-insensitive, cut by ``partition_balanced``) or this engine's ``"blocks"``
(Megatron's: the layers between the first and the last split evenly);
:data:`engine.config.sections.PARTITION_METHODS` and :mod:`engine.pipeline.partition`.

Building, as DeepSpeed: a rank builds only its own stage's layers. With a process group at
construction the stage is the default placement's (``num_stages`` pieces, rank ``r`` in stage
``r // (world / num_stages)``); without one the module stays empty until
``engine.initialize`` (or a one-process ``forward``, which builds every layer). An
interleaved or V schedule (``pipeline.virtual_stages`` 2) cuts ``num_stages x 2`` pieces,
so ``engine.initialize`` rebuilds the stage (layers still local keep their objects). Every
build replays the model's RNG stream from construction one layer at a time, a foreign layer
built and freed at once, so each layer's initial weights equal those of a build of the whole
model in one process and a rank holds at most its stage plus one layer (DeepSpeed instead
seeds its layers with ``seed_layers`` or draws them stage by stage). ``engine.initialize``
then keeps the stage's chunks (:meth:`PipelineModule.keep_only`; the module cannot be
initialised again). Differences: a tied module may be shared only by the first and the last
stage (an embedding and its head); one tensor crosses each stage boundary; fewer layers than
pipeline pieces is an error (DeepSpeed leaves stages empty).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from engine.errors import ConfigError
from engine.pipeline.actions import stage_and_chunk
from engine.pipeline.partition import PARTITION_METHODS, layers_of, partition_balanced, partition_layers
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


class _Elsewhere(nn.Module):
    """Where a layer of another pipeline stage is: it is built only on the ranks that hold it
    (or was released by :meth:`PipelineModule.keep_only`)."""

    def forward(self, x: Any) -> Any:
        raise RuntimeError("this layer belongs to another pipeline stage: a PipelineModule builds (and after "
                           "engine.initialize keeps) only its own stage's layers")


def _type_name(spec: Any) -> Optional[str]:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", None)


def _rng_state() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The generators a LayerSpec's constructor draws from (the host's; CUDA's once initialised)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Optional[list[torch.Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _trainable_numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _probe(spec: LayerSpec, fn: Callable[[nn.Module], Any]) -> Any:
    """``fn`` of ``spec``'s layer built on the meta device (no storage); the host's generator
    is restored, so this draws nothing from the model's RNG stream. A constructor that cannot
    run on the meta device (it reads its weights' values) is built on the host, alone, and
    freed: at most one layer, as DeepSpeed's own parameter count."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return fn(spec.build())
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            pass
        return fn(spec.build())


def _count_params(spec: LayerSpec) -> int:
    return int(_probe(spec, _trainable_numel))


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
        assert num_stages is not None
        self.num_stages = num_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.seed_layers, self.base_seed = seed_layers, base_seed
        self._specs = list(layers)
        if not self._specs:
            raise ValueError("PipelineModule needs a non-empty list of layers")
        for i, spec in enumerate(self._specs):
            if not isinstance(spec, (LayerSpec, nn.Module)) and not callable(spec):
                raise TypeError(f"layer {i}: expected a LayerSpec, an nn.Module or a callable, got "
                                f"{type(spec).__name__}")
        self._check_method(partition_method)
        self._weights: Optional[list[int]] = None  # layer_weights(), computed once
        self._released = False
        self._callables = {i: _Callable(s) for i, s in enumerate(self._specs)
                           if not isinstance(s, (LayerSpec, nn.Module))}
        self.layers = nn.ModuleList([_Elsewhere() for _ in self._specs])
        self._tied: dict[str, nn.Module] = {}  # key -> the shared module, where a local layer uses it
        self._local: Optional[frozenset[int]] = None  # the layer indices built here (None: none yet)
        self._built_params: set[int] = set()  # ids of every parameter built here (model_parameters check)
        # The model's RNG stream starts here: every build replays it from this state, so a
        # layer's initial weights do not depend on which layers this rank builds.
        self._rng_start = _rng_state()
        local = self._default_local()
        self._build(local if local is not None else frozenset(), fork=False)
        if local is None:
            self._local = None  # lazy: the stage is known at engine.initialize (or forward builds all)

    # ------------------------------------------------------------------ construction
    def _default_local(self) -> Optional[frozenset[int]]:
        """This rank's layers in the default placement (one piece per stage, DeepSpeed's),
        or None when no process group tells the stage yet (stay lazy)."""
        n = len(self._specs)
        if self.num_stages == 1:
            return frozenset(range(n))
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.get_world_size()
        if world % self.num_stages:
            raise ValueError(f"PipelineModule num_stages = {self.num_stages} must divide the world size {world} "
                             "(the data-parallel size is world size / num_stages)")
        stage = dist.get_rank() // (world // self.num_stages)  # PP is the outermost mesh axis
        bounds = self.partition(self.num_stages)
        return frozenset(range(bounds[stage], bounds[stage + 1]))

    def _build(self, local: frozenset[int], fork: bool = True) -> None:
        """Build the layers in ``local`` (those already built are kept), one layer at a time,
        replaying the whole model's RNG stream from construction: a layer of another stage is
        built and freed at once (its random draws are the next layer's starting point), so
        every rank's weights equal the all-layers build's and at most one foreign layer is
        alive. ``seed_layers``: layer i is built after ``manual_seed(base_seed + i)``
        (DeepSpeed's), so foreign layers are skipped (the last one still runs, to leave the
        stream where the whole build leaves it). The caller's RNG state is kept when this is a
        later build (``fork``: the stream is replayed in a fork); the construction's build
        leaves the stream where the whole model's build leaves it."""
        old_local = self._local or frozenset()
        needed = {s.key for i, s in enumerate(self._specs) if i in local and isinstance(s, TiedLayerSpec)}
        for i in old_local - local:  # a layer no longer local is freed before anything is built
            self.layers[i] = _Elsewhere()
        old_tied = {k: m for k, m in self._tied.items() if k in needed}
        self._tied = {}
        resume = _rng_state() if fork else None
        _set_rng_state(self._rng_start)
        try:
            tied = self._replay(local & old_local, local, needed, old_tied)
        finally:
            if resume is not None:
                _set_rng_state(resume)
        self._register(local, tied)
        self._local = local
        self._built_params |= {id(p) for p in self.parameters()}

    def _replay(self, kept: frozenset[int], local: frozenset[int], needed: set[str],
                old_tied: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Build every LayerSpec in order from the construction's RNG state: ``local`` ones (and
        the tied modules ``needed``) are set into ``self.layers``, the others freed at once;
        a layer in ``kept`` (built before) keeps its old object. Returns the tied modules."""
        n = len(self._specs)
        first_use: dict[str, int] = {}
        for i, s in enumerate(self._specs):
            if isinstance(s, TiedLayerSpec):
                first_use.setdefault(s.key, i)
        tied: dict[str, nn.Module] = {}
        for i, spec in enumerate(self._specs):
            # nothing to build for a module, a callable or a later use of a tied module
            key = spec.key if isinstance(spec, TiedLayerSpec) else None
            buildable = isinstance(spec, LayerSpec) and (key is None or first_use[key] == i)
            keep = buildable and (key in needed if key is not None else i in local)
            if self.seed_layers:  # (the whole build seeds at every index, the last one included)
                if not keep and i != n - 1:
                    continue
                torch.manual_seed(self.base_seed + i)
            if not buildable:
                continue
            built = spec.build()
            if keep and key is not None:  # a layer built before (the placement changed) keeps its object and values
                tied[key] = old_tied.get(key, built)
            elif keep:
                self.layers[i] = self.layers[i] if i in kept else built
            del built  # a foreign layer: only its random draws mattered
        return tied

    def _register(self, local: frozenset[int], tied: dict[str, nn.Module]) -> None:
        """``self.layers``: the local positions' modules (tied ones through their module), placeholders elsewhere."""
        self._tied = tied
        for i, spec in enumerate(self._specs):
            if i not in local:
                self.layers[i] = _Elsewhere()
            elif isinstance(spec, TiedLayerSpec):
                module = tied[spec.key]
                self.layers[i] = module if spec.forward_fn is None else _TiedForward(module, spec.forward_fn)
            elif isinstance(spec, nn.Module):
                self.layers[i] = spec
            elif i in self._callables:
                self.layers[i] = self._callables[i]

    @staticmethod
    def _check_method(method: str) -> None:
        m = method.lower()
        if m in PARTITION_METHODS:
            return
        if m.startswith("type:"):
            try:
                re.compile(m.split(":")[1])
            except re.error as exc:
                raise ValueError(f"partition_method {method!r}: the regex does not compile ({exc})") from None
            return
        raise ValueError(f"partition_method {method!r} is not one of {', '.join(PARTITION_METHODS)}")

    # ------------------------------------------------------------------ what initialize reads
    def build_stage(self, stage: int, num_stages: int, virtual_stages: int = 1, placement: str = "loop") -> list[int]:
        """Build pipeline rank ``stage``'s layers for ``virtual_stages`` chunks per rank in the
        schedule's ``placement`` (``engine.initialize``: the construction built the default,
        one piece per stage; interleaved and V schedules cut ``num_stages x virtual_stages``
        pieces, so the layers are rebuilt: those still local keep their objects, the others
        are freed). Returns the boundaries of the pieces."""
        self._check_whole("engine.initialize")
        bounds = self.partition(num_stages * virtual_stages)
        local = frozenset(i for c in range(virtual_stages)
                          for i in layers_of(bounds, stage, num_stages, c, placement))
        if local != self._local:
            self._build(local)
        return bounds

    def rebuilt_for(self, virtual_stages: int) -> bool:
        """True when :meth:`build_stage` with ``virtual_stages`` replaces the construction's
        stage (the same answer on every rank: the pieces are cut anew)."""
        return self._local is not None and self.num_stages > 1 and virtual_stages > 1

    def built_parameter_ids(self) -> set[int]:
        """ids of every parameter this module built (a ``model_parameters`` list taken before a rebuild)."""
        return set(self._built_params)

    def check_tied(self, bounds: Sequence[int], num_stages: int, placement: str = "loop") -> None:
        """The ranks using each TiedLayerSpec key, from the specs (every rank sees them all, so
        every rank raises the same error): only the first and the last stage may share one."""
        owners: dict[str, set[int]] = {}
        for k in range(len(bounds) - 1):
            rank = stage_and_chunk(k, num_stages, placement)[0]
            for spec in self._specs[bounds[k]:bounds[k + 1]]:
                if isinstance(spec, TiedLayerSpec):
                    owners.setdefault(spec.key, set()).add(rank)
        for key, ranks in owners.items():
            if len(ranks) > 1 and ranks != {0, num_stages - 1}:
                raise ConfigError(f"TiedLayerSpec {key!r} is used by layers on pipeline stages {sorted(ranks)}: only "
                                  "the first and the last stage may share one (a tied embedding and head)")

    def any_layer(self, test: Callable[[nn.Module], Any]) -> bool:
        """Whether ``test`` holds for some layer of the whole model (a LayerSpec's built on the
        meta device): the same answer on every rank, whichever layers it holds (the config
        checks of ``engine.initialize`` must raise on all ranks together)."""
        for spec in self._specs:
            if isinstance(spec, LayerSpec):
                if _probe(spec, lambda m: bool(test(m))):
                    return True
            elif isinstance(spec, nn.Module) and test(spec):
                return True
        return False

    def layer_list(self) -> list[nn.Module]:
        """Every position's layer as this rank sees it: its own built layers; a tied module it
        holds wherever its key appears (so the sharing is visible); a user's nn.Module as
        given; other stages' LayerSpecs as empty placeholders."""
        self._check_whole("engine.initialize")
        out = []
        for i, spec in enumerate(self._specs):
            if self._local is not None and i in self._local:
                out.append(self.layers[i])
            elif isinstance(spec, TiedLayerSpec) and spec.key in self._tied:
                m = self._tied[spec.key]
                out.append(m if spec.forward_fn is None else _TiedForward(m, spec.forward_fn))
            elif isinstance(spec, nn.Module):
                out.append(spec)
            else:
                out.append(self._callables[i] if i in self._callables else self.layers[i])
        return out

    def keep_only(self, kept: Sequence[nn.Module]) -> None:
        """Release every layer not in ``kept`` (this rank's stage, after ``engine.initialize``
        cut it): each becomes an empty placeholder, so its parameters are freed once nothing
        else holds them. DeepSpeed's PipelineModule likewise holds its own stage only."""
        self._weights = self.layer_weights()
        keep = {id(m) for m in kept}
        for i, layer in enumerate(self.layers):
            if id(layer) not in keep:
                self.layers[i] = _Elsewhere()
        self._released = True

    def _check_whole(self, what: str) -> None:
        if self._released:
            raise RuntimeError(f"{what}: this PipelineModule kept only one pipeline stage's layers after "
                               "engine.initialize; build a new PipelineModule for another engine or a whole-model run")

    def layer_weights(self) -> list[int]:
        """The weight of each layer that ``partition_method`` balances (DeepSpeed's): trainable
        parameters (a LayerSpec counted on the meta device; a tied layer counts its module
        each time it appears; a callable 0), 1 per layer, or 1 per layer whose class name
        matches the ``type:`` regex."""
        if self._weights is not None:
            return list(self._weights)
        m = self.partition_method.lower()
        if m in ("uniform", "blocks"):
            weights = [1] * len(self._specs)
        elif m == "parameters":
            counted: dict[str, int] = {}
            weights = []
            for spec in self._specs:
                if isinstance(spec, TiedLayerSpec):
                    if spec.key not in counted:
                        counted[spec.key] = _count_params(spec)
                    weights.append(counted[spec.key])
                elif isinstance(spec, LayerSpec):
                    weights.append(_count_params(spec))
                else:
                    weights.append(_trainable_numel(spec) if isinstance(spec, nn.Module) else 0)
        else:
            # DeepSpeed lower-cases the whole method and takes the text up to a second ':'
            pattern = re.compile(m.split(":")[1], re.IGNORECASE)
            weights = [1 if (n := _type_name(s)) is not None and pattern.search(n) else 0 for s in self._specs]
            if not any(weights):
                raise ConfigError(f"partition_method {self.partition_method!r} matches no layer class name: "
                                  f"the layers are {sorted({_type_name(s) or '?' for s in self._specs})}")
        self._weights = weights
        return list(weights)

    def partition(self, num_parts: int) -> list[int]:
        """Boundaries of ``num_parts`` contiguous, non-empty pieces: DeepSpeed's cut
        (``partition_uniform`` for ``uniform``, ``partition_balanced`` over
        :meth:`layer_weights` for ``parameters`` and ``type:``), Megatron's for ``blocks``."""
        m = self.partition_method.lower()
        if m in ("uniform", "blocks"):
            return partition_layers([1] * len(self._specs), num_parts, m)
        weights = self.layer_weights()
        if len(weights) < num_parts:  # DeepSpeed would leave stages empty; the engine's schedules need a layer each
            partition_layers(weights, num_parts, "uniform")  # raises the error naming the fix
        return partition_balanced(weights, num_parts)

    def forward(self, x: Any) -> Any:
        """The whole model in one process (no pipeline): the layers in order. Without a
        process group the module is built on first use here (every layer)."""
        self._check_whole("PipelineModule.forward")
        everything = frozenset(range(len(self._specs)))
        if self._local != everything:
            if self.num_stages > 1 and dist.is_available() and dist.is_initialized():
                raise RuntimeError("PipelineModule.forward runs the whole model, but this rank built only its "
                                   "pipeline stage's layers: train it through engine.initialize / train_batch")
            self._build(everything)
        for layer in self.layers:
            x = layer(x)
        return x
