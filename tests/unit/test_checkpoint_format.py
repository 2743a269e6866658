"""Checkpoint building blocks without processes: the full-tensor index maths behind
reshaping (checked against the TP layers' own shard_tensor and the ZeRO flat layouts),
the sealed metadata, the streamed safetensors and torch writers, tags and pruning.
All comparisons are exact: these pieces only move bits."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile

import pytest
import torch

from engine.checkpoint.consolidate import main as consolidate_main
from engine.checkpoint.export import _TorchStreamWriter
from engine.checkpoint.format import (
    CheckpointError,
    Fragment,
    SafetensorsWriter,
    TPSlice,
    check_tag,
    read_latest,
    read_metadata,
    resolve_checkpoint_dir,
    sha256_file,
    tag_step,
    write_latest,
    write_metadata,
)
from engine.checkpoint.reshape import assemble_full, local_to_full_index, needed_mask, take_local
from engine.checkpoint.save import prune_tags
from engine.tensor_parallel.layers import shard_tensor
from engine.zero.partition import build_layout

# (full shape, dim, fused parts, padded size along dim)
CASES = {
    "column": ((12, 5), 0, None, None),
    "row": ((5, 12), 1, None, None),
    "qkv_gqa": ((16 + 8 + 8, 6), 0, (16, 8, 8), None),   # q, k, v of different sizes, split separately
    "gate_up": ((8, 3), 0, (4, 4), None),
    "vocab_padded": ((10, 4), 0, None, 12),              # vocabulary 10 padded to 12 for tp=4/3
}


def _padded(full: torch.Tensor, dim: int, padded: int | None) -> torch.Tensor:
    if padded is None:
        return full
    shape = list(full.shape)
    shape[dim] = padded - full.shape[dim]
    return torch.cat([full, full.new_zeros(shape)], dim=dim)


def _slice(full_shape, dim, parts, padded, rank, world) -> tuple[TPSlice, tuple[int, ...]]:
    local = list(full_shape)
    local[dim] = (padded or full_shape[dim]) // world
    unpadded = full_shape[dim] if padded is not None else None
    return TPSlice(dim, rank, world, parts, unpadded), tuple(local)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [1, 2, 4])
def test_local_to_full_index_matches_the_layers_sharding(name, world):
    shape, dim, parts, padded = CASES[name]
    if padded is not None and padded % world:
        padded = -(-shape[dim] // world) * world
    full = torch.randn(shape)
    for rank in range(world):
        tp, local_shape = _slice(shape, dim, parts, padded, rank, world)
        idx = local_to_full_index(local_shape, tp)
        want = shard_tensor(_padded(full, dim, padded), dim, rank, world, parts).reshape(-1)
        assert torch.equal(take_local(full.reshape(-1), idx), want)
        pad_rows = 0 if padded is None or rank != world - 1 else padded - shape[dim]
        assert int((idx < 0).sum()) == pad_rows * shape[1 - dim]


def _save_fragments(full: torch.Tensor, case: str, tp: int, dp: int, align: int = 4):
    """What ``tp`` x ``dp`` ranks would store (ZeRO flat shards of each TP-local tensor):
    fragments and an in-memory 'file' per rank."""
    shape, dim, parts, padded = CASES[case]
    padded = None if padded is None else -(-shape[dim] // tp) * tp
    frags, files = [], {}
    for t in range(tp):
        sl, local_shape = _slice(shape, dim, parts, padded, t, tp)
        local = shard_tensor(_padded(full, dim, padded), dim, t, tp, parts).reshape(-1)
        layout = build_layout([3, local.numel()], dp, align)      # another parameter first: offsets move
        flat = torch.zeros(layout.padded_numel)
        lo, hi = layout.param_range(1)
        flat[lo:hi] = local
        for d in range(dp):
            name = f"tp{t}dp{d}"
            s_lo, s_hi = layout.shard_range(d)
            files[name] = {"master": flat[s_lo:s_hi].clone(), "exp_avg": 2 * flat[s_lo:s_hi]}
            for pc in layout.pieces(d):
                if pc.param_index == 1:
                    frags.append(Fragment(name, 0, pc.shard_start, pc.numel, pc.param_start, local_shape, sl))
    return frags, files


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("src,dst", [((2, 3), (4, 2)), ((4, 1), (1, 3)), ((1, 2), (2, 5))])
def test_assemble_and_take_reshard_between_any_tp_and_zero_layouts(case, src, dst):
    shape = CASES[case][0]
    full = torch.randn(shape)
    frags, files = _save_fragments(full, case, *src)

    def read(f, state):
        return files[f.file][state][f.offset:f.offset + f.numel]

    # every target rank's fragments, read only where needed, equal the direct sharding
    tgt_frags, _ = _save_fragments(full, case, *dst)
    for tf in tgt_frags:
        idx = local_to_full_index(tf.local_shape, tf.tp)[tf.start:tf.start + tf.numel]
        got = assemble_full("w", shape, frags, ["master", "exp_avg"], read, needed_mask(full.numel(), idx))
        want_flat = take_local(full.reshape(-1), idx)
        assert torch.equal(take_local(got["master"], idx), want_flat)
        assert torch.equal(take_local(got["exp_avg"], idx), 2 * want_flat)
    whole = assemble_full("w", shape, frags, ["master"], read)["master"]
    assert torch.equal(whole.view(shape), full)
    with pytest.raises(CheckpointError, match=r"parameter w: \d+ of its \d+ elements are in no shard"):
        assemble_full("w", shape, frags[1:], ["master"], read)


def test_metadata_is_sealed(tmp_path):
    meta = {"format": "engine-checkpoint", "format_version": 1, "x": [1, 2.5, "a"]}
    write_metadata(str(tmp_path), meta)
    assert read_metadata(str(tmp_path))["x"] == [1, 2.5, "a"]
    p = tmp_path / "metadata.json"
    raw = json.loads(p.read_text())
    raw["x"][0] = 2
    p.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="metadata.json: checksum mismatch"):
        read_metadata(str(tmp_path))
    write_metadata(str(tmp_path), dict(meta, format_version=99))
    with pytest.raises(CheckpointError, match="format version 99"):
        read_metadata(str(tmp_path))
    with pytest.raises(CheckpointError, match="does not exist"):
        read_metadata(str(tmp_path / "nowhere"))


def test_streamed_safetensors_equals_the_library(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
               "empty": torch.zeros(0)}
    path = str(tmp_path / "x.safetensors")
    w = SafetensorsWriter(path, [(k, v.dtype, v.shape) for k, v in tensors.items()], metadata={"k": "v"})
    for v in tensors.values():
        w.write(v, chunk_numel=2)  # several chunks per tensor
    digest = w.close()
    assert digest == sha256_file(path) and w.bytes == os.path.getsize(path)
    back = load_file(path)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    w = SafetensorsWriter(str(tmp_path / "y.safetensors"), [("a", torch.float32, (2,))])
    with pytest.raises(ValueError, match="declared"):
        w.write(torch.zeros(3))
    with pytest.raises(ValueError, match="not written"):
        w.close()
    w.abort()


def test_streamed_torch_state_dict_with_aliases(tmp_path):
    sd = {"emb": torch.randn(6, 4), "norm": torch.randn(4), "big": torch.randn(33, 5)}
    path = str(tmp_path / "m.pt")
    w = _TorchStreamWriter(path, [(k, tuple(v.shape)) for k, v in sd.items()], {"head": "emb"})
    for k in ("norm", "big", "emb"):  # any order
        w.write(k, sd[k])
    w.close()
    back = torch.load(path, weights_only=True)
    assert list(back) == ["emb", "norm", "big", "head"]
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert torch.equal(back["head"], sd["emb"]) and back["head"].data_ptr() == back["emb"].data_ptr()
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # CRCs patched: a valid archive
    w = _TorchStreamWriter(str(tmp_path / "n.pt"), [("a", (2,))], {})
    with pytest.raises(CheckpointError, match="bytes"):
        w.write("a", torch.zeros(3))
    with pytest.raises(CheckpointError, match="never written"):
        w.close()


def test_tags_latest_pruning_and_recovery(tmp_path):
    for bad in ["", ".tmp-x", "a/b", "..", "latest", "x\ny", None]:
        with pytest.raises(ValueError, match="not usable"):
            check_tag(bad)
    assert tag_step("global_step12") == 12 and tag_step("global_step") is None and tag_step("best") is None
    d = str(tmp_path)
    assert read_latest(d) is None
    for s in (1, 2, 10, 3):
        os.makedirs(os.path.join(d, f"global_step{s}"))
    os.makedirs(os.path.join(d, "best"))
    write_latest(d, "global_step2")
    assert read_latest(d) == "global_step2"
    assert sorted(prune_tags(d, 2, keep="global_step3")) == ["global_step1"]  # latest and keep survive
    assert sorted(os.listdir(d)) == ["best", "global_step10", "global_step2", "global_step3", "latest"]
    # an overwrite interrupted between moving the old directory aside and publishing the new one
    os.rename(os.path.join(d, "global_step2"), os.path.join(d, ".old-global_step2-abc"))
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_dir(d, "global_step2")  # no metadata in the aside copy: not complete
    write_metadata(os.path.join(d, ".old-global_step2-abc"), {"format": "engine-checkpoint", "format_version": 1})
    assert resolve_checkpoint_dir(d, "global_step2").endswith(".old-global_step2-abc")
    (tmp_path / "latest").write_text("../etc\n")
    with pytest.raises(CheckpointError, match="corrupted"):
        read_latest(d)


def test_consolidate_cli_reports_a_bad_checkpoint(tmp_path, capsys):
    assert consolidate_main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("checkpoint error:") and "nothing" in err


def test_sha256_file_streams(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(3 << 20 | 17)
    p.write_bytes(data)
    assert sha256_file(str(p), chunk=1 << 16) == hashlib.sha256(data).hexdigest()
