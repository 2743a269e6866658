"""Context parallelism for Hugging Face decoders (Llama, Qwen2, Mistral): the role of
DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers`` and
``UlyssesSPDataLoaderAdapter``, inside the model.

``engine.initialize(model=hf_model, config={..., "sequence_parallel_size": C})`` (or a
``context_parallel`` section: ring, Ulysses or hybrid) calls :func:`prepare_hf_model`, which
changes three things of the model (in place, as DeepSpeed does):

1. **Attention.** A function registered in transformers' ``AttentionInterface`` (one name
   per prepared model, ``engine_context_parallel_<n>``) becomes the model's
   ``attn_implementation``. It receives the rank's q (B, nh, S/C, d) and k, v (B, nkv, S/C,
   d) after rotary and calls :func:`engine.context_parallel.attention.context_parallel_attention`
   with the tokens' global positions (the ``position_ids`` transformers passes along); the
   4D mask transformers would build for the local shard is neither built (the name has no
   mask function) nor needed (the CP attention masks by global positions).
2. **The batch.** Every CP rank of a data-parallel replica is given the SAME whole batch
   (B, S), as one process would be (the engine's ``training_data`` loader does this: CP
   ranks read the same rows); the engine, not the user, cuts it. A forward pre-hook checks
   that the CP ranks hold the same batch (one all-gather of a fingerprint), shifts the labels
   on the whole row (target of token i is token i + 1, -100 after the last), and keeps this
   rank's head-tail shard of ``input_ids``, of the global ``position_ids`` (rotary uses the
   true positions) and of the shifted labels. (DeepSpeed's adapter instead gathers one
   different sample per SP rank and processes them one after the other; here the loop stays
   one process's: one batch per forward.)
3. **The loss.** A forward hook sets ``outputs.loss`` to the mean cross-entropy over the
   target tokens of the whole batch: (sum over CP ranks of each shard's token-loss sum) /
   (count of targets that are not -100 over the CP ranks), the same on every CP rank; 0
   when there is no target. Its backward gives each rank's shard C times the gradient of that
   mean, because the engine averages gradients over the grad role (cp x dp) (engine/zero/step.py):
   the averaged gradient is one process's. ``outputs.logits`` are this rank's shard's
   (B, S/C, V), in head-tail order.

Refused, with the reason: ``attention_mask`` with padding, ``position_ids`` other than
0..S-1 (packed documents), ``inputs_embeds``, a KV cache (``use_cache``, generation),
attention dropout, a sliding window shorter than the sequence, softcapping.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.context_parallel.attention import context_parallel_attention
from engine.context_parallel.layout import CPLayout
from engine.context_parallel.sharding import head_tail_indices
from engine.distributed import comm
from engine.distributed.groups import AxisGroup
from engine.errors import ConfigError

__all__ = ["SUPPORTED_MODEL_TYPES", "is_hf_model", "check_hf_model", "prepare_hf_model"]

# The model families whose attention goes through transformers' AttentionInterface with
# (B, heads, S, d) q/k/v after rotary, head_dim ** -0.5 scaling and position_ids in kwargs.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
IGNORE_INDEX = -100
_names = itertools.count()


def is_hf_model(model: Any) -> bool:
    """A transformers ``PreTrainedModel`` (checked by class path, so transformers stays optional)."""
    return isinstance(model, nn.Module) and any(c.__module__.startswith("transformers.") and
                                                c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def check_hf_model(model: nn.Module, key: str, cp: int, ulysses_size: int) -> None:
    """Refuse, with a :class:`ConfigError` naming ``key``, a Hugging Face model the adapter
    cannot split (same answer on every rank: it reads only the model's config)."""
    hf: Any = model.config  # a transformers PretrainedConfig
    kind = getattr(hf, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{key} = {cp}: Hugging Face model type {kind!r} ({type(model).__name__}) is not supported "
                          f"by the context-parallel attention adapter (supported: {', '.join(SUPPORTED_MODEL_TYPES)}); "
                          "set the size to 1")
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise ConfigError(f"{key} = {cp}: this transformers version has no PreTrainedModel.set_attn_implementation, "
                          "which the adapter uses to install its attention; upgrade transformers or set the size to 1")
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    if heads % ulysses_size:
        raise ConfigError(f"{key} = {cp}: Ulysses exchanges whole attention heads over {ulysses_size} ranks but the "
                          f"model has num_attention_heads = {heads}, not divisible by {ulysses_size}: use "
                          "context_parallel mode \"ring\" (any head count), or \"hybrid\" with a ulysses_size that "
                          f"divides {heads}")
    if kv % ulysses_size and ulysses_size % kv:
        raise ConfigError(f"{key} = {cp}: the model's num_key_value_heads = {kv} neither divides nor is divisible by "
                          f"the Ulysses size {ulysses_size} (KV heads are split, or replicated when fewer): use mode "
                          f"\"ring\", or a ulysses_size that divides or is a multiple of {kv}")
    if getattr(hf, "attention_dropout", 0.0):
        raise ConfigError(f"{key} = {cp}: the model's attention_dropout = {hf.attention_dropout} is not supported "
                          "by the context-parallel attention (exact softmax, no dropout): set it to 0.0")


class _SumOverGroup(torch.autograd.Function):
    """Forward: (sum over the group of each rank's token-loss sum) / max(1, summed target
    count), one fp64 all-reduce of both. Backward: ``size / count`` times the incoming
    gradient, the gradient of the mean times the group size (module docstring, point 3);
    every rank's incoming gradient is the same, so no communication."""

    @staticmethod
    def forward(ctx, loss_sum, count, group):
        both = torch.stack([loss_sum.detach().double(), count.double()])
        comm.all_reduce(both, group)
        total = both[1].clamp(min=1)
        ctx.scale = group.size / total
        return (both[0] / total).to(loss_sum.dtype)

    @staticmethod
    def backward(ctx, g):
        return (g.double() * ctx.scale).to(g.dtype), None, None


class _Adapter:
    """The pre- and post-forward hooks of one prepared model (module docstring, points 2-3)."""

    def __init__(self, layout: CPLayout, group: AxisGroup) -> None:
        self.layout, self.group = layout, group
        self.labels: Optional[torch.Tensor] = None   # (B, S/C) this forward's shifted label shard

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs = dict(kwargs)
        if args:
            if len(args) > 1 or "input_ids" in kwargs:
                raise ValueError("context parallelism (Hugging Face adapter): pass the model's inputs by keyword "
                                 "(input_ids=..., labels=...); only input_ids may be positional")
            kwargs["input_ids"] = args[0]
        for bad, why in (("inputs_embeds", "give input_ids"), ("cache", "a KV cache (generation) is not supported"),
                         ("past_key_values", "a KV cache (generation) is not supported")):
            if kwargs.get(bad) is not None:
                raise ValueError(f"context parallelism (Hugging Face adapter): {bad} is not supported: {why}")
        if kwargs.get("use_cache"):
            raise ValueError("context parallelism (Hugging Face adapter): use_cache=True (a KV cache, generation) "
                             "is not supported; train and evaluate with use_cache off")
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError("context parallelism (Hugging Face adapter): input_ids must be a (B, S) tensor of the "
                             f"whole sequence, got {getattr(ids, 'shape', type(ids))}")
        b, s = ids.shape
        try:  # a refused batch is raised after the fingerprint exchange, on every CP rank together
            shifted, problem = self._shifted_labels(kwargs, ids), None
            self._check_mask_and_positions(kwargs, b, s, ids.device)
        except ValueError as e:
            shifted, problem = None, e
        self._check_same_batch(ids, shifted, problem)
        idx = head_tail_indices(s, self.layout.size, self.layout.rank, device=ids.device)   # (S/C,)
        kwargs["input_ids"] = ids.index_select(1, idx)
        kwargs["position_ids"] = idx.expand(b, -1)                                          # global positions
        self.labels = None if shifted is None else shifted.index_select(1, idx)
        return (), kwargs

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        labels, self.labels = self.labels, None
        if labels is None:
            return output
        logits = getattr(output, "logits", None)                                             # (B, S/C, V)
        if not isinstance(logits, torch.Tensor):
            raise ValueError("context parallelism (Hugging Face adapter): the model returned no logits (was "
                             "return_dict=False passed?); call it with the default return_dict")
        loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum")
        count = (labels != IGNORE_INDEX).sum()
        loss = _SumOverGroup.apply(loss_sum, count, self.group)
        # rebuilt, not assigned: a ModelOutput keeps only fields set at construction as keys, so
        # ``output[0]`` / ``output["loss"]`` / ``to_tuple()`` see the loss first, as with labels
        return type(output)(**{**output, "loss": loss})

    @staticmethod
    def _shifted_labels(kwargs: dict, ids: torch.Tensor) -> Optional[torch.Tensor]:
        """(B, S) targets: ``labels`` shifted on the whole row (before any sharding), or
        DeepSpeed ALST's ``shift_labels`` as given; None without either."""
        labels, shift = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        if labels is not None and shift is not None:
            raise ValueError("context parallelism (Hugging Face adapter): give labels or shift_labels, not both")
        given = labels if labels is not None else shift
        if given is None:
            return None
        if given.shape != ids.shape:
            raise ValueError(f"context parallelism (Hugging Face adapter): labels {tuple(given.shape)} must have "
                             f"input_ids' shape {tuple(ids.shape)} (the whole sequence)")
        if shift is not None:
            return shift
        return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)

    @staticmethod
    def _check_mask_and_positions(kwargs: dict, b: int, s: int, device: torch.device) -> None:
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not (mask.shape == (b, s) and bool(mask.bool().all())):
            raise ValueError("context parallelism (Hugging Face adapter): attention_mask must be None or all ones "
                             "(B, S): padding masks are not supported; pad at the end with labels -100 instead "
                             "(causal attention never lets a real token see later padding)")
        pos = kwargs.get("position_ids")
        if pos is not None and not bool((pos == torch.arange(s, device=pos.device)).all()):
            raise ValueError("context parallelism (Hugging Face adapter): position_ids must be None or 0..S-1 on "
                             "every row (packed documents with restarting positions are not supported)")

    def _check_same_batch(self, ids: torch.Tensor, shifted: Optional[torch.Tensor],
                          problem: Optional[ValueError] = None) -> None:
        """Every CP rank must hold the same whole batch: all-gather a fingerprint (shape,
        weighted sums of ids and labels, whether this rank refused its batch: ``problem``) and
        compare; every rank sees the same answer and raises together, so none is left waiting
        in the collective."""
        w = torch.arange(1, ids.shape[1] + 1, device=ids.device)
        lab = shifted if shifted is not None else torch.zeros_like(ids)
        dev = ids.device
        mine = torch.stack([torch.tensor(ids.shape[0], device=dev), torch.tensor(ids.shape[1], device=dev),
                            (ids * w).sum(), (lab * w).sum(), torch.tensor(int(shifted is None), device=dev),
                            torch.tensor(int(problem is not None), device=dev)])
        rows = mine.new_empty((self.group.size * 6,))
        comm.all_gather(rows, mine, self.group)
        rows = rows.view(self.group.size, 6)
        if problem is not None:
            raise problem
        if bool(rows[:, 5].any()):
            raise ValueError("context parallelism (Hugging Face adapter): another context-parallel rank of this "
                             "replica refused its batch (its error names the problem); every CP rank must be given "
                             "the same whole batch")
        if not bool((rows[:, :5] == rows[0, :5]).all()):
            raise ValueError(f"context parallelism: the {self.group.size} context-parallel ranks of a replica must "
                             "be given the same whole batch (the engine cuts it along the sequence); they got "
                             "different ones. Feed every CP rank the same rows (engine.initialize's training_data "
                             "does; a DistributedSampler must use the data-parallel rank and size, not the world's)")


def _attention_function(layout: CPLayout) -> Callable[..., tuple[torch.Tensor, None]]:
    """transformers' attention interface over :func:`context_parallel_attention`."""

    def attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
        d = query.shape[-1]
        s = query.shape[2] * layout.size
        if dropout:
            raise ValueError(f"context-parallel attention: attention dropout {dropout} is not supported")
        if scaling is not None and abs(scaling - d ** -0.5) > 1e-12 * d ** -0.5:
            raise ValueError(f"context-parallel attention: scaling {scaling} is not head_dim ** -0.5 = {d ** -0.5}")
        window = kwargs.get("sliding_window")
        if window is not None and window < s:
            raise ValueError(f"context-parallel attention: a sliding window of {window} tokens is shorter than the "
                             f"sequence ({s}): not supported (no sliding window in the CP attention)")
        if kwargs.get("softcap") is not None or kwargs.get("is_causal") is False:
            raise ValueError("context-parallel attention: softcapping and non-causal attention are not supported")
        pos = kwargs.get("position_ids")
        if pos is None:
            raise ValueError("context-parallel attention: transformers passed no position_ids; the model must be "
                             "called through the engine (engine(input_ids=..., labels=...))")
        positions = pos.expand(query.shape[0], -1)                                          # (B, S/C) global
        o = context_parallel_attention(query, key, value, layout, positions=positions)   # (B, nh, S/C, d)
        return o.transpose(1, 2), None                                                     # (B, S/C, nh, d)

    return attend


def prepare_hf_model(model: nn.Module, layout: CPLayout, group: AxisGroup) -> None:
    """Install the adapter of the module docstring on ``model`` (checked with
    :func:`check_hf_model` first). ``layout``: this rank's CP layout; ``group``: the whole CP
    group (``groups[Axis.CP]``: the loss and the same-batch check)."""
    from transformers import AttentionInterface

    name = f"engine_context_parallel_{next(_names)}"
    AttentionInterface.register(name, _attention_function(layout))
    set_attn: Any = model.set_attn_implementation  # Tensor | Module to mypy
    set_attn(name)
    adapter = _Adapter(layout, group)
    model.register_forward_pre_hook(adapter.before, with_kwargs=True)
    model.register_forward_hook(adapter.after, with_kwargs=True)
