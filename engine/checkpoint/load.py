"""``load_checkpoint(engine, load_dir, tag)``: load a checkpoint saved at any layout.

There is one code path for every case. Each rank walks the fragments of its own fp32
master shards (whatever its dp, tp, pp and ZeRO stage), asks the metadata which stored
fragments hold those elements of each parameter, reads only those (safetensors slices
of files whose size and sha256 were checked first), and scatters them into place through
full-tensor indices (:mod:`engine.checkpoint.reshape`), one parameter at a time. Loading
at the saving layout is the special case where every element comes back to where it
was, so a resumed run is bit-identical; at another layout the values are the same bits
in other places, so training continues on the same trajectory up to the order of
floating-point sums.

Errors are detected on every rank before any collective that changes state (the ranks
exchange their status first), so a bad checkpoint is a :class:`CheckpointError` on every
rank, never a hang or a half-loaded model.

What is loaded goes through two typed values and nothing else: ZeRO's shard view
(:meth:`~engine.zero.shard_view.ShardView.load`: masters, optimizer state, publish) and
the engine's training state (:class:`~engine.training_state.TrainingState`).

RNG states: restored per rank when the checkpoint was saved at the same (dp, tp, pp);
at another layout there is no 1:1 map between ranks, so they are left as they are (the
reference model has no dropout and the data order depends only on the step, so nothing
the engine computes depends on them).

FP8 scaling state (scales and amax histories, by global layer name): restored at any
layout. The amaxes are MAX-reduced over TP x DP before they enter the history, and the
max over TP shards is the amax of the full tensor, so the state does not depend on the
layout and a layer keeps its state under another (dp, tp, pp); a checkpoint without it
(format version 1, or saved without FP8) leaves the layers' fresh state (a warning);
a checkpoint whose FP8 layers do not cover this model's is an error on every rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from engine.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointMetadata,
    SavedTopology,
    load_metadata,
    read_latest,
    resolve_checkpoint_dir,
    unpickling_error,
)
from engine.checkpoint.layout import local_pieces, parameter_names
from engine.checkpoint.reader import ShardReader
from engine.checkpoint.reshape import assemble_full, local_to_full_index, needed_mask, numel_of, take_local
from engine.checkpoint.save import agree_on_tag
from engine.checkpoint.target import Checkpointable
from engine.config import Config
from engine.placement import placement_of
from engine.training_state import TrainingState, restore_rng
from engine.zero.shard_view import GroupState, Scalar, ShardView

__all__ = ["load_checkpoint", "restore_rng", "checkpoint_location"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- local reading
def _canonical(name: str, p: Any, meta: CheckpointMetadata) -> str:
    if name in meta.aliases:
        return meta.aliases[name]
    if placement_of(p).tied_copy and name not in meta.params:
        raise CheckpointError(f"parameter {name} is a pipeline copy of a tied weight, but the checkpoint records no "
                              f"weight it is tied to")
    return name


def _model_diff(meta: CheckpointMetadata, cfg: Config) -> str:
    saved = meta.config.get("model", {}) or {}
    mine = cfg.model.to_dict() if cfg.model is not None else {}
    diff = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {mine.get(k)!r}"
            for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
    return "; ".join(diff)


def _group_states(meta: CheckpointMetadata, pg: int, states: list[str], with_state: bool) -> list[str]:
    """The states to read for user param group ``pg``: all of ``states``, or, when the
    checkpoint records them per group (Muon: momentum for matrices, AdamW moments for the
    rest), that group's."""
    by_group = meta.optimizer.elementwise_by_group
    if not with_state or not by_group:
        return states
    return ["master"] + [s for s in by_group.get(str(pg), []) if s in states]


def _read_masters(view: ShardView, names: dict[int, str], cfg: Config, path: str, meta: CheckpointMetadata,
                  states: list[str], reader: ShardReader, with_state: bool = True
                  ) -> tuple[list[dict[str, torch.Tensor]], set[str]]:
    """This rank's flat tensors of every optimizer group, for ``states``, and the names read."""
    out: list[dict[str, torch.Tensor]] = [{} for _ in view.groups]
    used: set[str] = set()
    where = f"{os.path.join(path, METADATA_FILE)}: "
    for pc in local_pieces(view, names):
        cname = _canonical(pc.name, pc.param, meta)
        used.add(cname)
        entry = meta.params.get(cname)
        shape = pc.tp.full_shape(pc.local_shape) if pc.tp is not None else pc.local_shape
        if entry is None:
            diff = _model_diff(meta, cfg)
            raise CheckpointError(f"{where}the checkpoint has no parameter {cname} (shape {list(shape)}): it was "
                                  f"saved from a different model{' (' + diff + ')' if diff else ''}")
        if tuple(entry.shape) != tuple(shape):
            diff = _model_diff(meta, cfg)
            raise CheckpointError(f"{where}parameter {cname} has shape {list(entry.shape)} in the checkpoint and "
                                  f"{list(shape)} in this model: the checkpoint is for a different model"
                                  f"{' (' + diff + ')' if diff else ''}")
        index = local_to_full_index(pc.local_shape, pc.tp)[pc.start:pc.start + pc.numel]
        g = view.groups[pc.group]
        assert g.master is not None
        mine = _group_states(meta, g.param_group, states, with_state)
        full = assemble_full(cname, shape, entry.fragments, mine, reader.read, needed_mask(numel_of(shape), index),
                             where)
        for s in mine:
            flat = out[pc.group].get(s)
            if flat is None:
                flat = out[pc.group][s] = torch.zeros(g.master.numel(), dtype=full[s].dtype)
            flat[pc.offset:pc.offset + pc.numel] = take_local(full[s], index)
    for gi, g in enumerate(view.groups):  # groups with no element here (all padding) still get tensors
        assert g.master is not None
        for s in _group_states(meta, g.param_group, states, with_state):
            out[gi].setdefault(s, torch.zeros(g.master.numel(), dtype=torch.float32))
    return out, used


def _scalar(sc: dict[str, Any]) -> Scalar:
    return sc["value"] if sc["dtype"] is None else torch.tensor(sc["value"], dtype=getattr(torch, sc["dtype"]))


def _group_loads(view: ShardView, path: str, meta: CheckpointMetadata,
                 flats: list[dict[str, torch.Tensor]]) -> list[GroupState]:
    """What :meth:`ShardView.load` installs in each flat group: the saved hyper-parameters of
    its user param group, its element-wise states and scalars."""
    saved = meta.optimizer
    out = []
    for gi, g in enumerate(view.groups):
        pg = str(g.param_group)
        if pg not in saved.param_groups:
            raise CheckpointError(f"{path}: the checkpoint has no optimizer param group {pg} (it has "
                                  f"{sorted(saved.param_groups)}): the optimizer's param groups changed")
        cur = view.group_state(gi).options
        opts = {k: tuple(v) if isinstance(cur.get(k), tuple) and isinstance(v, list) else v
                for k, v in saved.param_groups[pg].items()}
        elementwise: dict[str, torch.Tensor] = {}
        scalars: dict[str, Scalar] = {}
        if saved.elementwise_state:
            keys = _group_states(meta, g.param_group, list(saved.elementwise_state), True)[1:]
            elementwise = {k: flats[gi][k] for k in keys}
            scalars = {k: _scalar(sc) for k, sc in saved.scalar_state.get(pg, {}).items()}
        out.append(GroupState(flats[gi]["master"], elementwise, scalars, opts))
    return out


# ---------------------------------------------------------------------------- entry point
def checkpoint_location(path: str) -> Optional[tuple[str, Optional[str]]]:
    """Where ``path`` points: a save directory (it has ``latest``) -> ``(path, None)``; a tag
    directory (it has ``metadata.json``, e.g. ``ckpt/global_step8`` as a save prints it) ->
    ``(its parent, its name)``; anything else (missing, empty, unrelated) -> None. Pure."""
    if os.path.isfile(os.path.join(path, LATEST_FILE)):
        return path, None
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        full = os.path.abspath(path)
        return os.path.dirname(full), os.path.basename(full)
    return None


class _Local:
    """What this rank read: masters, the optimizer state to install (None: keep), the names
    of the parameters it needed, the client state."""

    def __init__(self, masters: list[torch.Tensor], states: Optional[list[GroupState]], used: set[str],
                 client: Optional[dict[str, Any]]) -> None:
        self.masters, self.states, self.used, self.client = masters, states, used, client


def _read_local(engine: Checkpointable, view: ShardView, path: str, meta: CheckpointMetadata,
                load_optimizer_states: bool, verify: bool) -> _Local:
    reader = ShardReader(path, meta, verify)
    try:
        states = ["master"] + (list(meta.optimizer.elementwise_state) if load_optimizer_states else [])
        names, _ = parameter_names(engine.module)
        flats, used = _read_masters(view, names, engine.config, path, meta, states, reader, load_optimizer_states)
        loads = _group_loads(view, path, meta, flats) if load_optimizer_states else None
        client = None
        if meta.client_state:
            full = reader.check_file(meta.client_state)
            try:
                client = torch.load(full, weights_only=True, map_location="cpu")
            except Exception as exc:  # noqa: BLE001 - unpickling errors of every kind
                raise CheckpointError(f"{full} cannot be loaded as data (torch.load with weights_only=True refuses "
                                      f"it: {unpickling_error(exc)})") from None
        return _Local([f["master"] for f in flats], loads, used, client)
    finally:
        reader.close()


def _check_compatible(cfg: Config, view: ShardView, path: str, meta: CheckpointMetadata,
                      load_optimizer_states: bool) -> None:
    saved_type = (meta.config.get("optimizer") or {}).get("type") or meta.optimizer.cls
    # a client optimizer (no optimizer section): its class name (AdamW, Adam, ...)
    mine = cfg.optimizer.type if cfg.optimizer is not None else view.optimizer_class
    adam = {"Adam", "AdamW"}
    if load_optimizer_states and meta.optimizer.elementwise_state and saved_type != mine \
            and not (saved_type in adam and mine in adam):
        raise CheckpointError(f"{path}: optimizer state was saved for {saved_type}, this run uses {mine}: pass "
                              f"load_optimizer_states=False to load only the weights")


def _check_fp8(state: TrainingState, path: str, meta: CheckpointMetadata) -> None:
    """Before any collective: every FP8 layer of this rank has saved scaling state, or the
    checkpoint has none at all (version 1, or saved without FP8: the layers keep their
    fresh state, see docs/checkpoints.md)."""
    if meta.fp8 is None or not state.fp8:
        return
    missing = state.fp8_names_missing(meta.fp8)
    if missing:
        raise CheckpointError(f"{path}: the checkpoint's FP8 scaling state has no entry for the FP8 layers "
                              f"{missing[:8]} of this model (it has {sorted(meta.fp8)[:8]}...): the model's FP8 "
                              f"layers differ from the saved run's; pass load_module_only=True to load the weights "
                              f"and start FP8 scaling afresh")


def _aux_free(cfg: Config) -> bool:
    moe = cfg.model.moe if cfg.model is not None else None
    return moe is not None and moe.load_balancing == "aux_free"


def _check_moe_bias(cfg: Config, state: TrainingState, path: str, meta: CheckpointMetadata) -> None:
    """Before any collective: under aux-free balancing every MoE layer's routing bias is in
    the checkpoint (saved by global expert index; without it the resumed run would route
    with zero biases, unlike the uninterrupted one)."""
    if not _aux_free(cfg):
        return
    missing = state.moe_bias_names_missing(meta.moe_bias)
    if missing:
        raise CheckpointError(f"{path}: model.moe.load_balancing is \"aux_free\" but the checkpoint has no routing "
                              f"bias for {missing[:8]} (saved before the biases were saved, or by another model): "
                              "the resumed run would route differently; resume it with load_balancing \"aux_loss\" "
                              "or \"none\", or from a checkpoint this engine wrote with the biases")


def load_checkpoint(engine: Checkpointable, load_dir: str, tag: Optional[str] = None, *,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, verify_checksums: bool = True,
                    load_rng_states: bool = True) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Load ``<load_dir>/<tag>`` (default: the tag ``<load_dir>/latest`` names) into ``engine``,
    whatever (dp, tp, pp, ZeRO stage) it was saved at. Returns ``(path, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` (as DeepSpeed).

    Collective. ``load_optimizer_states=False``: fp32 weights only (optimizer moments stay
    as they are); ``load_module_only=True``: weights only, no counters, LR schedule, loss
    scale, RNG or FP8 scaling states either. ``verify_checksums``: sha256 of every file read.
    ``load_rng_states=False``: keep this process's RNG states.
    """
    if not dist.is_initialized():
        raise RuntimeError("checkpoints are collective: torch.distributed must be initialised (the engine does it)")
    rank = dist.get_rank()
    if tag is None:
        try:
            tag = read_latest(load_dir)
            err = None
        except CheckpointError as exc:
            tag, err = None, str(exc)
        errs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errs, (tag, err))
        bad = [e for _, e in errs if e is not None]
        if bad:
            raise CheckpointError(bad[0])
        if all(t is None for t, _ in errs):
            if rank == 0:
                logger.warning("no checkpoint to load: %s has no 'latest' file", load_dir)
            return None, None
        tag = errs[0][0]
    tag = agree_on_tag(tag, engine.config.checkpoint.tag_validation, "load_checkpoint")
    if load_module_only:
        load_optimizer_states, load_lr_scheduler_states = False, False
    path: Optional[str] = None
    meta: Optional[CheckpointMetadata] = None
    local: Optional[_Local] = None
    status = None
    view: Optional[ShardView] = None
    state: Optional[TrainingState] = None
    try:
        view, state = engine.optimizer.shard_view(), engine.training_state()
        path = resolve_checkpoint_dir(load_dir, tag)
        meta = load_metadata(path)
        _check_compatible(engine.config, view, path, meta, load_optimizer_states)
        if not load_module_only:
            _check_fp8(state, path, meta)
        _check_moe_bias(engine.config, state, path, meta)
        local = _read_local(engine, view, path, meta, load_optimizer_states, verify_checksums)
    except Exception as exc:  # noqa: BLE001 - exchanged below so that every rank raises
        status = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (status, sorted(local.used) if local is not None else []))
    failed = [(r, s) for r, (s, _) in enumerate(everyone) if s is not None]
    if failed:
        r, s = failed[0]
        raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}) failed on rank {r}"
                              f"{f' (and {len(failed) - 1} other ranks)' if len(failed) > 1 else ''}: {s}")
    assert meta is not None and local is not None and path is not None and view is not None and state is not None
    extra = sorted(set(meta.params) - {n for _, names in everyone for n in names})
    if extra:
        diff = _model_diff(meta, engine.config)
        raise CheckpointError(f"{path}: the checkpoint has parameters this model does not have ({extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''}): it is for a different model"
                              f"{' (' + diff + ')' if diff else ''}")
    view.load(local.masters, local.states)  # collective over DP: publishes the weights
    if state.moe_bias and not state.moe_bias_names_missing(meta.moe_bias):  # module state: loaded with the weights
        state.load_moe_bias(meta.moe_bias or {})
    if not load_module_only:
        state.load_state_dict(_training_state_dict(engine, meta, state, load_lr_scheduler_states, load_rng_states))
    topo = meta.topology
    logger.info("loaded checkpoint %s (saved at %s ZeRO-%d, step %d)", path, topo.describe(), topo.zero_stage,
                meta.global_steps)
    return path, local.client


def _training_state_dict(engine: Checkpointable, meta: CheckpointMetadata, state: TrainingState,
                         load_lr_scheduler_states: bool, load_rng_states: bool) -> dict[str, Any]:
    """The part of the saved training state to restore (TrainingState restores the keys
    present): RNG states only at the saving (dp, tp, pp), where rank r is the same rank."""
    sd: dict[str, Any] = {k: meta.training[k] for k in ("counters", "loss_scaler", "lr_scheduler_groups")}
    if load_lr_scheduler_states:
        sd["lr_scheduler"] = meta.training["lr_scheduler"]
    rank0 = engine.groups is not None and engine.groups.rank == 0
    if state.fp8 and meta.fp8 is None and rank0:
        logger.warning("the checkpoint has no FP8 scaling state (format version %d, or saved without FP8 layers): "
                       "this run's FP8 layers start from fresh scales and an empty amax history",
                       meta.format_version)
    sd["fp8"] = meta.fp8
    topo, cfg = meta.topology, engine.config
    if not load_rng_states or engine.groups is None:
        return sd
    if topo.same_mesh(cfg.topology):
        rng = meta.rng.get(str(engine.groups.rank))
        if rng is not None:
            sd["rng"] = rng
    elif rank0:
        logger.info("RNG states not restored: the checkpoint was saved at %s, this run is %s (no rank-to-rank "
                    "correspondence)", topo.describe(), SavedTopology.of(cfg.topology, 0).describe())
    return sd
