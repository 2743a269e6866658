"""Data pipeline: tokenizer, corpus, token file, packing, masks, build cache, bad input."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.data import (
    Batch,
    DataError,
    FileCorpus,
    PackedDataset,
    StdlibCorpus,
    TokenFile,
    Tokenizer,
    build_dataset,
    check_train_files,
    document_causal_mask,
    position_ids_from_doc_ids,
    token_dtype,
    train_tokenizer,
    write_token_file,
)
from engine.errors import ConfigError


def _documents(n_bytes: int = 300_000) -> list[str]:
    """Varied-length documents: standard-library sources cut at top-level definitions."""
    docs = []
    for text in StdlibCorpus(n_bytes).documents:
        parts = text.split("\ndef ")
        docs.extend(p if i == 0 else "def " + p for i, p in enumerate(parts))
    return [d for d in docs if d]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = _documents()
    half = len(docs) // 2
    with open(d / "a.jsonl", "w", encoding="utf-8") as f:
        for doc in docs[:half]:
            f.write(json.dumps({"text": doc}) + "\n")
    # A plain-text file is one document.
    (d / "b.txt").write_text("".join(docs[half:]), encoding="utf-8")
    return d, docs[:half] + ["".join(docs[half:])]


@pytest.fixture(scope="module")
def tokenizer_512(corpus_dir, tmp_path_factory):
    d, _ = corpus_dir
    out = tmp_path_factory.mktemp("tok") / "t512.model"
    return train_tokenizer(FileCorpus([str(d / "a.jsonl"), str(d / "b.txt")]), 512, str(out))


@pytest.fixture(scope="module")
def token_file(corpus_dir, tokenizer_512, tmp_path_factory):
    d, _ = corpus_dir
    prefix = str(tmp_path_factory.mktemp("tokens") / "tokens")
    return write_token_file(prefix, FileCorpus([str(d / "a.jsonl"), str(d / "b.txt")]), tokenizer_512)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_text_exactly(corpus_dir, tmp_path):
    d, _ = corpus_dir
    tok = train_tokenizer(FileCorpus([str(d / "a.jsonl")]), 1024, str(tmp_path / "t.model"))
    assert tok.vocab_size == 1024
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.separator_id) == (0, 1, 2, 2)
    # Unseen characters go through byte fallback at this vocabulary size; whitespace is kept.
    text = "def f(x):\n\treturn  x  # héllo 世界 ✓\n\n\n   trailing   \n"
    ids = tok.encode(text)
    assert all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode(np.array(ids)) == text
    with pytest.raises(DataError, match="out of range"):
        tok.decode([5, 1024])


def test_tokenizer_training_is_deterministic(corpus_dir, tokenizer_512, tmp_path):
    d, _ = corpus_dir
    again = train_tokenizer(FileCorpus([str(d / "a.jsonl"), str(d / "b.txt")]), 512,
                            str(tmp_path / "again.model"))
    assert again.sha256 == tokenizer_512.sha256


def test_vocab_size_too_large_or_small_for_corpus(tmp_path):
    f = tmp_path / "small.txt"
    f.write_text("a tiny corpus with few distinct words\n" * 20)
    with pytest.raises(DataError, match=r"model.vocab_size = 5000 is too large.*at most \d+"):
        train_tokenizer(FileCorpus([str(f)]), 5000, str(tmp_path / "x.model"))
    with pytest.raises(DataError, match=r"model.vocab_size = 8 is too small.*at least \d+"):
        train_tokenizer(FileCorpus([str(f)]), 8, str(tmp_path / "y.model"))


def test_tokenizer_vocab_must_match_model(tokenizer_512, corpus_dir, tmp_path):
    d, _ = corpus_dir
    with pytest.raises(DataError) as e:
        build_dataset(train_files=[str(d / "a.jsonl")], tokenizer_model=tokenizer_512.path,
                      cache_dir=str(tmp_path), document_masking=False, vocab_size=600, seq_len=16)
    msg = str(e.value)
    assert "512" in msg and "600" in msg and "set model.vocab_size to 512" in msg


def test_bad_tokenizer_model_paths(tmp_path):
    (tmp_path / "empty.model").write_bytes(b"")
    (tmp_path / "junk.model").write_bytes(b"this is not a protobuf \xff\x00" * 10)
    cases = {str(tmp_path / "missing.model"): "does not exist",
             str(tmp_path): "is a directory",
             str(tmp_path / "empty.model"): "empty file",
             str(tmp_path / "junk.model"): "not a SentencePiece model"}
    for path, expected in cases.items():
        with pytest.raises(DataError, match=expected) as e:
            Tokenizer(path)
        assert "data.tokenizer_model" in str(e.value)
        assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)


# ---------------------------------------------------------------- train_files


def test_bad_train_files(tmp_path, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text("hello\n")
    (tmp_path / "empty.txt").write_text("")
    sub = tmp_path / "folder"
    sub.mkdir()
    cases = [
        ("good.txt", "must be a list of paths"),
        ([], "empty list"),
        ([str(tmp_path / "nope.txt")], "does not exist"),
        ([str(sub)], "is a directory"),
        ([str(tmp_path / "empty.txt")], "is empty"),
        ([str(good), 3], r"data.train_files\[1\] must be"),
    ]
    for files, expected in cases:
        with pytest.raises(DataError, match=expected):
            check_train_files(files)
    # A file that exists but cannot be opened (as root chmod does not stop reads, so the
    # failure is injected at the open call the check makes).
    real_open = open

    def deny(path, *a, **k):
        if str(path) == str(good):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    with pytest.raises(DataError, match=r"cannot be read \(Permission denied\).*good.txt|good.txt.*cannot be read"):
        check_train_files([str(good)])


def test_bad_file_contents_name_file_and_line(tmp_path):
    bad_utf8 = tmp_path / "latin1.txt"
    bad_utf8.write_bytes(b"fine line\ncaf\xe9\n")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n{not json}\n')
    no_text = tmp_path / "notext.jsonl"
    no_text.write_text('{"text": "ok"}\n{"body": "x"}\n')
    for path, expected in [(bad_utf8, "latin1.txt: line 2, byte 3 is not valid UTF-8"),
                           (bad_json, "bad.jsonl:2 is not valid JSON"),
                           (no_text, 'notext.jsonl:2 has no string field "text"')]:
        with pytest.raises(DataError, match=expected):
            list(FileCorpus([str(path)]).chunks())


def test_file_corpus_documents(corpus_dir):
    d, docs = corpus_dir
    corpus = FileCorpus([str(d / "a.jsonl"), str(d / "b.txt")])
    got: dict[int, str] = {}
    for i, chunk in corpus.chunks():
        got[i] = got.get(i, "") + chunk
    assert [got[i] for i in range(len(got))] == docs


# ---------------------------------------------------------------- embedded corpus


def test_stdlib_corpus_order_exclusions_and_cap(tmp_path):
    root = tmp_path / "lib"
    for rel, text in [("b.py", "b = 2\n"), ("a.py", "a = 1\n"), ("pkg/c.py", "c = 3\n" * 50),
                      ("test/t.py", "skipped\n"), ("site-packages/x.py", "skipped\n"),
                      ("notes.txt", "not python\n")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "bad.py").write_bytes(b"\xff\xfe bad bytes\n")
    full = StdlibCorpus(10_000, root=str(root))
    assert full.documents == ["a = 1\n", "b = 2\n", "c = 3\n" * 50]
    capped = StdlibCorpus(20, root=str(root))  # c.py (300 bytes) does not fit
    assert capped.documents == ["a = 1\n", "b = 2\n"]
    assert capped.fingerprint() != full.fingerprint()
    assert StdlibCorpus(10_000, root=str(root)).fingerprint() == full.fingerprint()
    with pytest.raises(DataError, match="set data.train_files"):
        StdlibCorpus(3, root=str(root))


def test_embedded_default_dataset(tmp_path):
    ds = build_dataset(train_files=None, tokenizer_model=None, cache_dir=str(tmp_path),
                       document_masking=False, vocab_size=1024, seq_len=64,
                       embedded_max_bytes=200_000)
    assert ds.tokenizer.vocab_size == 1024 and len(ds) > 100
    corpus = StdlibCorpus(200_000)
    tf = ds.token_file
    assert tf.num_documents == len(corpus.documents)
    # build_dataset encodes with several threads: same tokens as one-by-one encoding.
    eos = ds.tokenizer.eos_id
    for i, doc in enumerate(corpus.documents):
        assert tf.document(i).tolist() == ds.tokenizer.encode(doc) + [eos]
    # vocab 1024 has byte fallback, so every document decodes back exactly.
    for i in (0, tf.num_documents - 1):
        assert ds.tokenizer.decode(tf.document(i)[:-1]) == corpus.documents[i]


# ---------------------------------------------------------------- token file


def test_token_file_layout(token_file, tokenizer_512, corpus_dir):
    _, docs = corpus_dir
    tf = TokenFile(token_file.prefix)  # reopen from disk
    assert tf.dtype == np.uint16 and token_dtype(512) == np.uint16
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    assert tf.num_documents == len(docs)
    eos = tokenizer_512.eos_id
    pieces = []
    for i, doc in enumerate(docs):
        expected = tokenizer_512.encode(doc) + [eos]
        assert tf.document(i).tolist() == expected
        pieces.append(expected)
    flat = np.concatenate([np.asarray(p) for p in pieces])
    assert np.array_equal(np.asarray(tf.tokens), flat)
    meta = json.load(open(token_file.prefix + ".json"))
    assert meta["num_tokens"] == len(flat) and meta["vocab_size"] == 512
    assert meta["tokenizer_sha256"] == tokenizer_512.sha256


def test_corrupt_token_file_is_reported(token_file, tmp_path):
    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx.npy", ".json"):
        with open(token_file.prefix + ext, "rb") as src, open(prefix + ext, "wb") as dst:
            dst.write(src.read())
    TokenFile(prefix)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match="metadata says .* delete"):
        TokenFile(prefix)
    os.remove(prefix + ".json")
    with pytest.raises(DataError, match="cannot read token-file metadata"):
        TokenFile(prefix)


def test_token_file_tokenizer_mismatch(token_file, corpus_dir, tmp_path):
    d, _ = corpus_dir
    other = train_tokenizer(FileCorpus([str(d / "a.jsonl")]), 400, str(tmp_path / "o.model"))
    with pytest.raises(DataError, match="different tokenizer"):
        PackedDataset(token_file, other, 16)


# ---------------------------------------------------------------- packing and masks


def test_packing_windows_and_document_ids(token_file, tokenizer_512):
    s = 37
    ds = PackedDataset(token_file, tokenizer_512, s, document_masking=True)
    flat = np.asarray(token_file.tokens).astype(np.int64)
    assert len(ds) == (len(flat) - 1) // s
    # Reference document id of every token, from the document lengths.
    lengths = np.diff(np.asarray(token_file.doc_offsets))
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    # Plus the windows holding the ends of documents 1 and 3 (so boundaries are crossed).
    ends = [int(token_file.doc_offsets[k]) - 1 for k in (2, 4)]
    idx = [0, 5, len(ds) - 1, 5, 17] + [min(e // s, len(ds) - 1) for e in ends]
    b = ds.batch(idx)
    assert b.tokens.shape == (len(idx), s + 1) and b.tokens.dtype == torch.int64
    for row, i in enumerate(idx):
        window = slice(i * s, i * s + s + 1)
        assert b.tokens[row].tolist() == flat[window].tolist()
        assert b.doc_ids[row].tolist() == (doc_of[window] - doc_of[i * s]).tolist()
    assert torch.equal(b.inputs, b.tokens[:, :-1]) and torch.equal(b.targets, b.tokens[:, 1:])
    # A separator ends its document: the next token starts a new id.
    eos_pos = (b.tokens[:, :-1] == tokenizer_512.eos_id).nonzero().tolist()
    assert eos_pos, "test windows should cross at least one document boundary"
    for r, c in eos_pos:
        assert b.doc_ids[r, c + 1] == b.doc_ids[r, c] + 1
    assert PackedDataset(token_file, tokenizer_512, s).batch(idx).doc_ids is None
    with pytest.raises(IndexError):
        ds.batch([len(ds)])


def test_seq_len_longer_than_corpus(token_file, tokenizer_512):
    n = token_file.num_tokens
    PackedDataset(token_file, tokenizer_512, n - 1)  # exactly one sequence
    with pytest.raises(DataError, match=f"has {n} tokens.*model.seq_len"):
        PackedDataset(token_file, tokenizer_512, n)


def test_document_causal_mask_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 6, (3, 12), generator=gen)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(12), l)[:10] for l in lengths])
    mask = document_causal_mask(doc_ids)
    assert mask.shape == (3, 1, 10, 10) and mask.dtype == torch.bool
    for b in range(3):
        for i in range(10):
            for j in range(10):
                assert mask[b, 0, i, j] == (j <= i and doc_ids[b, i] == doc_ids[b, j])
    pos = position_ids_from_doc_ids(doc_ids)
    for b in range(3):
        for i in range(10):
            start = min(j for j in range(i + 1) if doc_ids[b, j] == doc_ids[b, i])
            assert pos[b, i] == i - start


def test_document_mask_equals_separate_attention():
    """Attention over a packed row with the mask = attention over each document alone."""
    torch.manual_seed(0)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])  # (1, S)
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64) for _ in range(3))  # (B, H, S, D)
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_ids))
    for d in doc_ids.unique():
        sel = (doc_ids[0] == d).nonzero().squeeze(1)
        alone = F.scaled_dot_product_attention(q[:, :, sel], k[:, :, sel], v[:, :, sel],
                                               is_causal=True)
        # float64, same maths on the same numbers: only summation-order rounding differs.
        torch.testing.assert_close(packed[:, :, sel], alone, rtol=1e-12, atol=1e-12)


def test_batch_helpers():
    tokens = torch.arange(12).view(3, 4)
    docs = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 0]])
    b = Batch(tokens, docs)
    assert Batch.cat([b.rows(0, 1), b.rows(1, 3)]).equal(b)
    assert b.to(torch.device("cpu")).equal(b)
    assert b.attention_mask().shape == (3, 1, 3, 3)
    assert b.position_ids().tolist() == [[0, 1, 0], [0, 0, 1], [0, 1, 2]]
    assert Batch(tokens).attention_mask() is None
    with pytest.raises(ValueError):
        Batch.cat([Batch(tokens), b])


# ---------------------------------------------------------------- build_dataset and its cache


def test_build_dataset_caches_and_reuses(corpus_dir, tmp_path, caplog):
    d, _ = corpus_dir
    kw = dict(train_files=[str(d / "a.jsonl")], tokenizer_model=None, cache_dir=str(tmp_path),
              document_masking=True, vocab_size=300, seq_len=32)
    with caplog.at_level(logging.INFO, logger="engine.data"):
        first = build_dataset(**kw)
        builds = [r for r in caplog.records if r.getMessage().startswith("building data cache")]
        assert len(builds) == 2  # tokenizer, then tokens
        caplog.clear()
        again = build_dataset(**kw)
        assert not [r for r in caplog.records if r.getMessage().startswith("building")]
    assert again.tokenizer.sha256 == first.tokenizer.sha256
    assert again.batch([0, 3]).equal(first.batch([0, 3]))
    entries = sorted(os.listdir(tmp_path))
    assert [e.split("-")[0] for e in entries if not e.endswith(".lock")] == ["tokenizer", "tokens"]
    assert not [e for e in entries if ".tmp-" in e]
    # A different vocabulary is a different cache entry; a pretrained model skips training.
    other = build_dataset(**{**kw, "vocab_size": 320})
    assert other.tokenizer.vocab_size == 320
    reuse = build_dataset(**{**kw, "tokenizer_model": first.tokenizer.path})
    assert reuse.batch([1]).equal(first.batch([1]))


def test_build_dataset_bad_settings(tmp_path, corpus_dir):
    d, _ = corpus_dir
    a_file = tmp_path / "file"
    a_file.write_text("x")
    kw = dict(train_files=[str(d / "a.jsonl")], tokenizer_model=None, cache_dir=str(tmp_path),
              document_masking=False, vocab_size=300, seq_len=32)
    for change, expected in [({"cache_dir": str(a_file)}, "is a file, not a directory"),
                             ({"vocab_size": 0}, "model.vocab_size must be a positive"),
                             ({"seq_len": True}, "model.seq_len must be a positive"),
                             ({"document_masking": "yes"}, "data.document_masking"),
                             ({"tokenizer_model": ""}, "data.tokenizer_model")]:
        with pytest.raises(DataError, match=expected):
            build_dataset(**{**kw, **change})
