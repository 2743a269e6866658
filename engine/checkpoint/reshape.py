"""Pure index maths that makes checkpoints layout-independent (no torch.distributed, no files).

Every stored element is addressed by its index in the flattened FULL (unsharded,
unpadded) parameter. A TP-local tensor of shape ``local_shape`` cut by a
:class:`~engine.checkpoint.format.TPSlice` maps its flattened elements to full indices by
:func:`local_to_full_index` (built with the layers' own :func:`shard_tensor`, so it
agrees with how the layers shard by construction); padded vocabulary rows map to -1.
A ZeRO fragment is a contiguous range ``[start, start + numel)`` of that local index.

Loading a parameter into any layout (:func:`assemble_full`, :func:`take_local`): scatter
the stored fragments that overlap the needed elements into a full fp32 buffer, check
that every needed element was found, gather the target fragment's elements out of it.
Memory: a few tensors of the parameter's full size (values, an int64 index, masks), one
parameter at a time.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from engine.checkpoint.format import CheckpointError, Fragment, TPSlice
from engine.tensor_parallel.layers import shard_tensor

__all__ = ["numel_of", "local_to_full_index", "assemble_full", "take_local", "needed_mask"]

ReadFn = Callable[[Fragment, str], torch.Tensor]


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def local_to_full_index(local_shape: Sequence[int], tp: Optional[TPSlice]) -> torch.Tensor:
    """``(prod(local_shape),)`` int64: the full-tensor flat index of each element of the
    flattened TP-local tensor, -1 for padding (vocabulary rows beyond the true size)."""
    local_shape = tuple(int(s) for s in local_shape)
    n_local = numel_of(local_shape)
    if tp is None:
        return torch.arange(n_local, dtype=torch.int64)
    full = tp.full_shape(local_shape)
    idx = torch.arange(numel_of(full), dtype=torch.int64).view(full)        # full shape
    padded_size = local_shape[tp.dim] * tp.world
    extra = padded_size - full[tp.dim]
    if extra < 0:
        raise CheckpointError(f"TP slice {tp} of a local tensor {list(local_shape)} is inconsistent: the "
                              f"unpadded size {full[tp.dim]} exceeds {tp.world} x {local_shape[tp.dim]}")
    if extra:
        pad_shape = list(full)
        pad_shape[tp.dim] = extra
        idx = torch.cat([idx, torch.full(pad_shape, -1, dtype=torch.int64)], dim=tp.dim)  # padded full
    try:
        local = shard_tensor(idx, tp.dim, tp.rank, tp.world, tp.parts)        # local shape
    except ValueError as exc:
        raise CheckpointError(f"TP slice {tp} does not fit a tensor of local shape {list(local_shape)}: "
                              f"{exc}") from None
    if tuple(local.shape) != local_shape:
        raise CheckpointError(f"TP slice {tp} yields a local shape {list(local.shape)}, expected {list(local_shape)}")
    return local.reshape(-1)


def assemble_full(name: str, full_shape: Sequence[int], fragments: Sequence[Fragment], states: Sequence[str],
                  read: ReadFn, needed: Optional[torch.Tensor] = None, where: str = "") -> dict[str, torch.Tensor]:
    """The flat full values of ``states`` of parameter ``name`` from its stored ``fragments``.

    ``read(fragment, state)`` returns the fragment's ``(numel,)`` values. ``needed``: a
    bool mask over the full tensor; fragments that hold none of those elements are not
    read, and elements outside it are left zero. Raises if a needed element is in no
    fragment (a shard missing from the checkpoint).
    """
    n = numel_of(full_shape)
    out: dict[str, torch.Tensor] = {}
    covered = torch.zeros(n, dtype=torch.bool)
    index_cache: dict[tuple, torch.Tensor] = {}
    for frag in fragments:
        if tuple(frag.full_shape()) != tuple(full_shape):
            raise CheckpointError(f"{where}parameter {name}: fragment in {frag.file} is a slice of a tensor of shape "
                                  f"{list(frag.full_shape())}, the parameter's shape is {list(full_shape)}")
        key = (frag.local_shape, frag.tp)
        if key not in index_cache:
            index_cache[key] = local_to_full_index(frag.local_shape, frag.tp)
        idx = index_cache[key][frag.start:frag.start + frag.numel]
        if idx.numel() != frag.numel:
            raise CheckpointError(f"{where}parameter {name}: fragment [{frag.start}, {frag.start + frag.numel}) in "
                                  f"{frag.file} exceeds the local tensor of shape {list(frag.local_shape)}")
        valid = idx >= 0
        idx = idx[valid]
        if needed is not None and not bool(needed[idx].any()):
            continue
        for state in states:
            vals = read(frag, state)
            if vals.numel() != frag.numel:
                raise CheckpointError(f"{where}{frag.file}: {state} of parameter {name} has {vals.numel()} elements "
                                      f"where the metadata says {frag.numel}")
            if state not in out:
                out[state] = torch.zeros(n, dtype=vals.dtype)
            out[state][idx] = vals[valid]
        covered[idx] = True
    missing = ~covered if needed is None else (needed & ~covered)
    if bool(missing.any()):
        files = sorted({f.file for f in fragments})
        raise CheckpointError(f"{where}parameter {name}: {int(missing.sum())} of its {n} elements are in no shard of "
                              f"the checkpoint (it has fragments in {files}): a shard file or its metadata entry is "
                              f"missing")
    for state in states:  # a parameter with no needed elements still yields (zero) tensors
        out.setdefault(state, torch.zeros(n, dtype=torch.float32))
    return out


def take_local(full: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Elements ``index`` (full-tensor flat indices, -1 = padding -> 0) of the flat ``full``."""
    out = torch.zeros(index.numel(), dtype=full.dtype)
    valid = index >= 0
    out[valid] = full[index[valid]]
    return out


def needed_mask(full_numel: int, index: torch.Tensor) -> torch.Tensor:
    """Bool mask over the full tensor of the (non-padding) elements ``index`` names."""
    mask = torch.zeros(full_numel, dtype=torch.bool)
    mask[index[index >= 0]] = True
    return mask

