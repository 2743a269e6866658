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

RNG states: restored per rank when the checkpoint was saved at the same (dp, tp, pp);
at another layout there is no 1:1 map between ranks, so they are left as they are (the
reference model has no dropout and the data order depends only on the step, so nothing
the engine computes depends on them).
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from engine.checkpoint.format import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    Fragment,
    decode_bytes,
    read_latest,
    read_metadata,
    resolve_checkpoint_dir,
    unpickling_error,
)
from engine.checkpoint.layout import local_pieces, parameter_names
from engine.checkpoint.reader import ShardReader
from engine.checkpoint.reshape import assemble_full, local_to_full_index, needed_mask, numel_of, take_local
from engine.checkpoint.save import agree_on_tag
from engine.tensor_parallel.attrs import is_tied_copy

__all__ = ["load_checkpoint", "restore_rng", "checkpoint_location"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- local reading
def _canonical(name: str, p: Any, meta: dict[str, Any]) -> str:
    aliases = meta.get("aliases", {})
    if name in aliases:
        return aliases[name]
    if is_tied_copy(p) and name not in meta["params"]:
        raise CheckpointError(f"parameter {name} is a pipeline copy of a tied weight, but the checkpoint records no "
                              f"weight it is tied to")
    return name


def _model_diff(meta: dict[str, Any], engine: Any) -> str:
    saved = meta.get("config", {}).get("model", {})
    mine = engine.config.model.to_dict() if engine.config.model is not None else {}
    diff = [f"model.{k}: checkpoint {saved.get(k)!r}, this run {mine.get(k)!r}"
            for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k)]
    return "; ".join(diff)


def _group_states(meta: dict[str, Any], pg: int, states: list[str], with_state: bool) -> list[str]:
    """The states to read for user param group ``pg``: all of ``states``, or, when the
    checkpoint records them per group (Muon: momentum for matrices, AdamW moments for the
    rest), that group's."""
    by_group = meta["optimizer"].get("elementwise_by_group")
    if not with_state or not by_group:
        return states
    return ["master"] + [s for s in by_group.get(str(pg), []) if s in states]


def _read_masters(engine: Any, path: str, meta: dict[str, Any], states: list[str], reader: ShardReader,
                  with_state: bool = True) -> tuple[list[dict[str, torch.Tensor]], set[str]]:
    """This rank's flat tensors of every optimizer group, for ``states``, and the names read."""
    opt = engine.optimizer
    names, _ = parameter_names(engine.module)
    pieces = local_pieces(opt, names, engine.groups.tp_rank, engine.config.tp)
    out: list[dict[str, torch.Tensor]] = [{} for _ in opt.groups]
    used: set[str] = set()
    where = f"{os.path.join(path, METADATA_FILE)}: "
    for pc in pieces:
        cname = _canonical(pc.name, pc.param, meta)
        used.add(cname)
        entry = meta["params"].get(cname)
        shape = pc.tp.full_shape(pc.local_shape) if pc.tp is not None else pc.local_shape
        if entry is None:
            diff = _model_diff(meta, engine)
            raise CheckpointError(f"{where}the checkpoint has no parameter {cname} (shape {list(shape)}): it was "
                                  f"saved from a different model{' (' + diff + ')' if diff else ''}")
        if tuple(entry["shape"]) != tuple(shape):
            diff = _model_diff(meta, engine)
            raise CheckpointError(f"{where}parameter {cname} has shape {entry['shape']} in the checkpoint and "
                                  f"{list(shape)} in this model: the checkpoint is for a different model"
                                  f"{' (' + diff + ')' if diff else ''}")
        index = local_to_full_index(pc.local_shape, pc.tp)[pc.start:pc.start + pc.numel]
        frags = [Fragment.from_json(f) for f in entry["fragments"]]
        g = opt.groups[pc.group]
        mine = _group_states(meta, g.key.param_group, states, with_state)
        full = assemble_full(cname, shape, frags, mine, reader.read, needed_mask(numel_of(shape), index), where)
        for s in mine:
            flat = out[pc.group].get(s)
            if flat is None:
                flat = out[pc.group][s] = torch.zeros(g.master.numel(), dtype=full[s].dtype)
            flat[pc.offset:pc.offset + pc.numel] = take_local(full[s], index)
    for gi, g in enumerate(opt.groups):  # groups with no element here (all padding) still get tensors
        for s in _group_states(meta, g.key.param_group, states, with_state):
            out[gi].setdefault(s, torch.zeros(g.master.numel(), dtype=torch.float32))
    return out, used


def _remap_per_group(value: Any, saved_pgs: list[int], new_pgs: list[int]) -> Any:
    """A per-inner-group list of the saved layout -> the new layout's groups (matched by the
    user param group each inner group belongs to)."""
    if not isinstance(value, list) or len(value) != len(saved_pgs) or saved_pgs == new_pgs:
        return value
    by_pg = {pg: value[i] for i, pg in enumerate(saved_pgs)}
    return [by_pg[pg] for pg in new_pgs]


def _optimizer_state_dict(engine: Any, path: str, meta: dict[str, Any], flats: list[dict[str, torch.Tensor]],
                          with_state: bool) -> dict[str, Any]:
    """The ZeroOptimizer.load_state_dict argument for this rank."""
    opt = engine.optimizer
    inner = opt.optimizer.state_dict()
    saved = meta["optimizer"]
    groups, state = [], {}
    for gi, (g, cur) in enumerate(zip(opt.groups, inner["param_groups"])):
        pg = str(g.key.param_group)
        opts = dict(cur)
        if with_state:
            if pg not in saved["param_groups"]:
                raise CheckpointError(f"{path}: the checkpoint has no optimizer param group {pg} (it has "
                                      f"{sorted(saved['param_groups'])}): the optimizer's param groups changed")
            for k, v in saved["param_groups"][pg].items():
                opts[k] = tuple(v) if isinstance(opts.get(k), tuple) and isinstance(v, list) else v
            opts["params"] = cur["params"]
            if saved["elementwise_state"]:
                keys = _group_states(meta, g.key.param_group, list(saved["elementwise_state"]), True)[1:]
                entry: dict[str, Any] = {k: flats[gi][k] for k in keys}
                for k, sc in saved["scalar_state"].get(pg, {}).items():
                    entry[k] = (sc["value"] if sc["dtype"] is None
                                else torch.tensor(sc["value"], dtype=getattr(torch, sc["dtype"])))
                state[cur["params"][0]] = entry
        groups.append(opts)
    return {"stage": opt.stage, "dp_size": opt.dp_size, "dp_rank": opt.dp_rank,
            "master": [flats[gi]["master"] for gi in range(len(opt.groups))],
            "optimizer": {"state": state if with_state else inner["state"], "param_groups": groups},
            "loss_scaler": opt.loss_scaler.state_dict(), "skipped_steps": opt.skipped_steps}


def restore_rng(rng: dict[str, Any], device: torch.device) -> None:
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(decode_bytes(rng["torch_cpu"])), dtype=torch.uint8))
    if device.type == "cuda" and rng.get("torch_cuda"):
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(decode_bytes(rng["torch_cuda"])), dtype=torch.uint8),
                                 device)


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


def _read_local(engine: Any, path: str, meta: dict[str, Any], load_optimizer_states: bool,
                verify: bool) -> tuple[dict[str, Any], set[str], Optional[dict[str, Any]]]:
    reader = ShardReader(path, meta, verify)
    try:
        states = ["master"] + (list(meta["optimizer"]["elementwise_state"]) if load_optimizer_states else [])
        flats, used = _read_masters(engine, path, meta, states, reader, load_optimizer_states)
        sd = _optimizer_state_dict(engine, path, meta, flats, load_optimizer_states)
        client = None
        if meta.get("client_state"):
            full = reader.check_file(meta["client_state"])
            try:
                client = torch.load(full, weights_only=True, map_location="cpu")
            except Exception as exc:  # noqa: BLE001 - unpickling errors of every kind
                raise CheckpointError(f"{full} cannot be loaded as data (torch.load with weights_only=True refuses "
                                      f"it: {unpickling_error(exc)})") from None
        return sd, used, client
    finally:
        reader.close()


def _check_compatible(engine: Any, path: str, meta: dict[str, Any], load_optimizer_states: bool) -> None:
    saved_type = meta.get("config", {}).get("optimizer", {}).get("type") or meta["optimizer"].get("class")
    # a client optimizer (no optimizer section): its class name (AdamW, Adam, ...)
    mine = engine.config.optimizer.type if engine.config.optimizer is not None \
        else type(engine.optimizer.optimizer).__name__
    adam = {"Adam", "AdamW"}
    if load_optimizer_states and meta["optimizer"]["elementwise_state"] and saved_type != mine \
            and not (saved_type in adam and mine in adam):
        raise CheckpointError(f"{path}: optimizer state was saved for {saved_type}, this run uses {mine}: pass "
                              f"load_optimizer_states=False to load only the weights")


def load_checkpoint(engine: Any, load_dir: str, tag: Optional[str] = None, *, load_optimizer_states: bool = True,
                    load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                    verify_checksums: bool = True, load_rng_states: bool = True) -> tuple[Optional[str], Optional[dict[str, Any]]]:
    """Load ``<load_dir>/<tag>`` (default: the tag ``<load_dir>/latest`` names) into ``engine``,
    whatever (dp, tp, pp, ZeRO stage) it was saved at. Returns ``(path, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` (as DeepSpeed).

    Collective. ``load_optimizer_states=False``: fp32 weights only (optimizer moments stay
    as they are); ``load_module_only=True``: weights only, no counters, LR schedule, loss
    scale or RNG states either. ``verify_checksums``: sha256 of every file read.
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
    path, meta, status, sd, used, client = None, None, None, None, set(), None
    try:
        path = resolve_checkpoint_dir(load_dir, tag)
        meta = read_metadata(path)
        _check_compatible(engine, path, meta, load_optimizer_states)
        sd, used, client = _read_local(engine, path, meta, load_optimizer_states, verify_checksums)
    except Exception as exc:  # noqa: BLE001 - exchanged below so that every rank raises
        status = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (status, sorted(used)))
    failed = [(r, s) for r, (s, _) in enumerate(everyone) if s is not None]
    if failed:
        r, s = failed[0]
        raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}) failed on rank {r}"
                              f"{f' (and {len(failed) - 1} other ranks)' if len(failed) > 1 else ''}: {s}")
    extra = sorted(set(meta["params"]) - {n for _, names in everyone for n in names})
    if extra:
        diff = _model_diff(meta, engine)
        raise CheckpointError(f"{path}: the checkpoint has parameters this model does not have ({extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''}): it is for a different model"
                              f"{' (' + diff + ')' if diff else ''}")
    _apply(engine, meta, sd, load_optimizer_states, load_lr_scheduler_states, load_module_only, load_rng_states)
    logger.info("loaded checkpoint %s (saved at dp=%d tp=%d pp=%d ZeRO-%d, step %d)", path,
                meta["topology"]["dp"], meta["topology"]["tp"], meta["topology"]["pp"],
                meta["topology"]["zero_stage"], meta["counters"]["global_steps"])
    return path, client


def _apply(engine: Any, meta: dict[str, Any], sd: dict[str, Any], load_optimizer_states: bool,
           load_lr_scheduler_states: bool, load_module_only: bool, load_rng_states: bool = True) -> None:
    """Install what was read (collective: the optimizer publishes the weights)."""
    opt = engine.optimizer
    if not load_module_only:
        sd["skipped_steps"] = int(meta["counters"]["skipped_steps"])
        cur = opt.loss_scaler.state_dict()
        if set(cur) == set(meta["loss_scaler"]):
            sd["loss_scaler"] = meta["loss_scaler"]
        else:
            logger.warning("the checkpoint's loss scaler (%s) does not match this run's (%s): keeping this run's",
                           sorted(meta["loss_scaler"]), sorted(cur))
    opt.load_state_dict(sd)
    if load_module_only:
        return
    c = meta["counters"]
    engine.global_steps = int(c["global_steps"])
    engine.global_samples = int(c["global_samples"])
    engine.micro_steps = int(c["micro_steps"])
    sched = engine.lr_scheduler
    if load_lr_scheduler_states and sched is not None and meta.get("lr_scheduler") is not None:
        saved_pgs = meta.get("lr_scheduler_groups") or []
        new_pgs = [g.key.param_group for g in opt.groups]
        state = {k: _remap_per_group(v, saved_pgs, new_pgs) for k, v in meta["lr_scheduler"].items()}
        sched.load_state_dict(state)
        if hasattr(sched, "get_last_lr"):  # the lr the next step uses, also when moments were not loaded
            for group, lr in zip(opt.optimizer.param_groups, sched.get_last_lr()):
                group["lr"] = lr
    topo, cfg = meta["topology"], engine.config
    if not load_rng_states:
        return
    if (topo["dp"], topo["tp"], topo["pp"]) == (cfg.dp, cfg.tp, cfg.pp):
        rng = meta["rng"].get(str(engine.groups.rank))
        if rng is not None:
            restore_rng(rng, engine.device)
    elif engine.groups.rank == 0:
        logger.info("RNG states not restored: the checkpoint was saved at dp=%d tp=%d pp=%d, this run is dp=%d "
                    "tp=%d pp=%d (no rank-to-rank correspondence)", topo["dp"], topo["tp"], topo["pp"],
                    cfg.dp, cfg.tp, cfg.pp)
