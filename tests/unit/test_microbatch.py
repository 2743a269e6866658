"""The one micro-batch conversion (engine.data.microbatch): every accepted format becomes a
MicroBatch whose module call, (inputs, targets) pair and document ids are those of the
format; nothing else in the engine looks at the format (checked by source search)."""

from __future__ import annotations

import collections
import pathlib
import re

import pytest
import torch

from engine.data import Batch
from engine.data.microbatch import MicroBatch, split_microbatch, to_microbatch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tokens():
    return torch.arange(2 * 5).view(2, 5)  # (B, S + 1)


def test_packed_batch_is_a_pair_with_document_ids():
    b = Batch(_tokens(), doc_ids=torch.zeros(2, 5, dtype=torch.long))
    mb = to_microbatch(b)
    assert torch.equal(mb.inputs, b.inputs) and torch.equal(mb.targets, b.targets)
    assert torch.equal(mb.doc_ids, b.input_doc_ids)
    assert len(mb.args) == 2 and set(mb.kwargs) == {"doc_ids"}  # module(inputs, targets, doc_ids=)
    plain = to_microbatch(Batch(_tokens()))
    assert plain.doc_ids is None and dict(plain.kwargs) == {}


def test_pair_dict_and_single_tensor():
    x, y = torch.ones(2, 3), torch.zeros(2)
    pair = to_microbatch((x, y))
    assert pair.args == (x, y) and pair.inputs is x and pair.targets is y and pair.doc_ids is None
    d = to_microbatch({"input_ids": x, "labels": y, "doc_ids": y})
    assert d.args == () and d.inputs is x and d.targets is y and d.doc_ids is y
    single = to_microbatch(x)
    assert single.args == (x,) and single.inputs is None and single.targets is None
    triple = to_microbatch([x, y, y])  # any other tuple/list: positional inputs, no pair
    assert triple.args == (x, y, y) and triple.inputs is None
    Pair = collections.namedtuple("Pair", "a b")
    assert to_microbatch(Pair(x, y)).args == (x, y)
    assert to_microbatch(pair) is pair  # converting twice is free


def test_split_names_the_formats_when_there_is_no_pair():
    assert split_microbatch((1, 2)) == (1, 2)
    with pytest.raises(TypeError, match="engine.data.Batch, an \\(inputs, targets\\) pair or a dict with input_ids"):
        to_microbatch({"x": torch.ones(1)}).split()
    with pytest.raises(TypeError, match="length 1"):
        split_microbatch(torch.ones(2))


def test_to_moves_every_tensor_once_and_keeps_the_structure():
    x = torch.ones(2, 3)
    mb = MicroBatch((x, {"nested": [x]}), {"doc_ids": x, "flag": True})
    moved = mb.to(torch.device("meta"))
    assert moved.args[0].device.type == "meta" and moved.args[1]["nested"][0].device.type == "meta"
    assert moved.doc_ids.device.type == "meta" and moved.kwargs["flag"] is True
    assert mb.args[0].device.type == "cpu"  # frozen: the original is unchanged


def test_no_other_module_sniffs_the_micro_batch_format():
    """The format is looked at in engine/data/microbatch.py only (the data boundary)."""
    sniff = re.compile(r"hasattr\(mb, \"inputs\"\)|input_doc_ids\"|\"input_ids\" in mb|isinstance\(mb, dict\)")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
                 if p.name != "microbatch.py" and sniff.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
