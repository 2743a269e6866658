"""The tokenized corpus on disk: a flat memory-mapped token array plus document offsets.

Files of one token file with prefix ``P``:

- ``P.bin``: every token of every document back to back, each document followed by the
  tokenizer's separator (EOS); raw little-endian ``uint16`` when the vocabulary fits in
  16 bits, ``uint32`` otherwise. Read through ``numpy.memmap``, so opening costs nothing
  and each rank pages in only the sequences it reads.
- ``P.idx.npy``: ``int64`` offsets, shape ``(num_documents + 1,)``: document ``d`` is
  ``tokens[offsets[d]:offsets[d + 1]]`` (its separator included); ``offsets[-1]`` is the
  token count.
- ``P.json``: metadata (format version, dtype, vocab size, counts, tokenizer hash,
  separator id, a description of the source).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Dict, List

import numpy as np

from engine.data.corpus import Corpus
from engine.data.errors import DataError
from engine.data.tokenizer import Tokenizer

__all__ = ["TokenFile", "TokenFileMeta", "token_dtype", "write_token_file", "FORMAT_VERSION"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Chunks encoded per SentencePiece call (a batch call amortises the Python overhead).
_ENCODE_BATCH = 64


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds ids ``0 .. vocab_size - 1``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True)
class TokenFileMeta:
    format_version: int
    dtype: str
    vocab_size: int
    num_tokens: int
    num_documents: int
    tokenizer_sha256: str
    separator_id: int
    source: str


class _Writer:
    """Appends documents to ``P.bin`` and records their offsets."""

    def __init__(self, f, dtype: np.dtype, separator_id: int) -> None:
        self.f, self.dtype, self.sep = f, dtype, separator_id
        self.offsets: List[int] = [0]
        self.pos = 0
        self.open_doc = -1  # corpus index of the document being written, -1 = none
        self.open_len = 0

    def add(self, doc: int, ids: List[int]) -> None:
        if doc != self.open_doc:
            self.close_doc()
            self.open_doc = doc
        if ids:
            np.asarray(ids, dtype=self.dtype).tofile(self.f)
            self.pos += len(ids)
            self.open_len += len(ids)

    def close_doc(self) -> None:
        if self.open_len:  # documents with no tokens (empty text) leave no trace
            np.asarray([self.sep], dtype=self.dtype).tofile(self.f)
            self.pos += 1
            self.offsets.append(self.pos)
        self.open_doc, self.open_len = -1, 0


def write_token_file(prefix: str, corpus: Corpus, tokenizer: Tokenizer,
                     num_threads: int = 1) -> "TokenFile":
    """Tokenize ``corpus`` with ``tokenizer`` into the files at ``prefix`` and open them."""
    dtype = token_dtype(tokenizer.vocab_size)
    sep = tokenizer.separator_id
    log.info("tokenizing %s into %s.bin", corpus.describe(), prefix)
    with open(prefix + ".bin", "wb") as f:
        writer = _Writer(f, dtype, sep)
        batch: List[Any] = []

        def flush() -> None:
            encoded = tokenizer.encode_batch([text for _, text in batch], num_threads=num_threads)
            for (doc, _), ids in zip(batch, encoded):
                writer.add(doc, ids)
            batch.clear()

        for item in corpus.chunks():
            batch.append(item)
            if len(batch) >= _ENCODE_BATCH:
                flush()
        flush()
        writer.close_doc()
    offsets = np.asarray(writer.offsets, dtype=np.int64)  # (num_documents + 1,)
    if len(offsets) == 1:
        raise DataError(f"{corpus.describe()} produced no tokens: every document is empty; "
                        "put text in data.train_files")
    np.save(prefix + ".idx.npy", offsets)
    meta = TokenFileMeta(format_version=FORMAT_VERSION, dtype=dtype.name,
                         vocab_size=tokenizer.vocab_size, num_tokens=int(offsets[-1]),
                         num_documents=len(offsets) - 1, tokenizer_sha256=tokenizer.sha256,
                         separator_id=sep, source=corpus.describe())
    with open(prefix + ".json", "w") as meta_file:
        json.dump(asdict(meta), meta_file, indent=1)
    return TokenFile(prefix)


class TokenFile:
    """A token file opened read-only; validates its three parts against each other."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        fix = f"delete the files {prefix}.* (or their cache directory) so they are rebuilt"
        try:
            with open(prefix + ".json") as f:
                raw: Dict[str, Any] = json.load(f)
            self.meta = TokenFileMeta(**raw)
        except (OSError, ValueError, TypeError) as e:
            raise DataError(f"cannot read token-file metadata {prefix}.json ({e}); {fix}") from None
        m = self.meta
        if m.format_version != FORMAT_VERSION:
            raise DataError(f"{prefix}.json has format version {m.format_version}, this engine "
                            f"reads version {FORMAT_VERSION}; {fix}")
        self.dtype = np.dtype(m.dtype)
        expected = m.num_tokens * self.dtype.itemsize
        size = os.path.getsize(prefix + ".bin") if os.path.isfile(prefix + ".bin") else -1
        if size != expected or m.num_tokens <= 0:
            raise DataError(f"{prefix}.bin has {size} bytes, its metadata says {m.num_tokens} "
                            f"{m.dtype} tokens ({expected} bytes); {fix}")
        try:
            self.doc_offsets = np.load(prefix + ".idx.npy", mmap_mode="r")  # (num_documents + 1,)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read the document index {prefix}.idx.npy ({e}); {fix}") from None
        off = self.doc_offsets
        if (off.shape != (m.num_documents + 1,) or off[0] != 0 or off[-1] != m.num_tokens):
            raise DataError(f"{prefix}.idx.npy does not match {prefix}.json "
                            f"({m.num_documents} documents, {m.num_tokens} tokens); {fix}")
        self.tokens = np.memmap(prefix + ".bin", dtype=self.dtype, mode="r",
                                shape=(m.num_tokens,))  # (num_tokens,)

    @property
    def num_tokens(self) -> int:
        return self.meta.num_tokens

    @property
    def num_documents(self) -> int:
        return self.meta.num_documents

    def document(self, index: int) -> np.ndarray:
        """Tokens of document ``index``, its trailing separator included."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range 0..{self.num_documents - 1}")
        return np.asarray(self.tokens[self.doc_offsets[index]:self.doc_offsets[index + 1]])

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Raise unless this file was written by ``tokenizer``."""
        if self.meta.tokenizer_sha256 != tokenizer.sha256:
            raise DataError(f"{self.prefix}.bin was tokenized with a different tokenizer than "
                            f"{tokenizer.path}; delete {self.prefix}.* so it is rebuilt")
