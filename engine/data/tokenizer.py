"""SentencePiece tokenizer: training on a ``Corpus`` and a small typed wrapper.

Our tokenizers round-trip text exactly (``decode(encode(t)) == t``), which code and
whitespace-heavy text need: no Unicode normalisation, no whitespace folding, no dummy
prefix, ``"\\n"`` as a piece of its own (so line ends are piece boundaries and a document
can be tokenized in line-aligned chunks), and whitespace-only pieces for indentation.
Characters never seen in training fall back to UTF-8 byte pieces when the vocabulary has
room for the 256 byte pieces (``vocab_size >= 1024``); smaller vocabularies map them to
``<unk>`` instead, so the budget goes to merges.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
from typing import Any, Iterator, List, Optional, Sequence

import sentencepiece as spm

from engine.data.corpus import Corpus
from engine.data.errors import DataError
from engine.validate import check_int

__all__ = ["Tokenizer", "train_tokenizer", "DEFAULT_TOKENIZER_MAX_BYTES", "SENTENCEPIECE_VERSION"]

log = logging.getLogger(__name__)

SENTENCEPIECE_VERSION: str = getattr(spm, "__version__", "unknown")
# Tokenizer training reads at most this much text (the first bytes of the corpus, in order).
DEFAULT_TOKENIZER_MAX_BYTES = 64 * 1024 * 1024
# Byte-fallback pieces take 256 slots; below this vocabulary size they would crowd out merges.
_BYTE_FALLBACK_MIN_VOCAB = 1024
# SentencePiece skips training sentences longer than max_sentence_length bytes; we cut
# long lines into pieces of this many characters instead (4 bytes/char worst case fits).
_MAX_LINE_CHARS = 4096
_MAX_SENTENCE_BYTES = 4 * _MAX_LINE_CHARS


class Tokenizer:
    """A loaded SentencePiece model.

    ``separator_id`` is the token written between documents: EOS, or BOS when the model
    has no EOS.
    """

    def __init__(self, model_path: str, setting: str = "data.tokenizer_model") -> None:
        path = os.path.abspath(os.path.expanduser(model_path))
        where = f"{setting} = {model_path!r}"
        if not os.path.exists(path):
            raise DataError(f"{where} does not exist: fix the path, or set it to null to train "
                            "a tokenizer on the training data")
        if os.path.isdir(path):
            raise DataError(f"{where} is a directory: give the .model file inside it")
        try:
            with open(path, "rb") as f:
                proto = f.read()
        except OSError as e:
            raise DataError(f"{where} cannot be read ({e.strerror}): fix its permissions") from None
        if not proto:
            raise DataError(f"{where} is an empty file: give a SentencePiece .model file")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(proto)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises plain RuntimeError/OSError
            raise DataError(f"{where} is not a SentencePiece model ({e}); give the .model file "
                            "written by sentencepiece training") from None
        self.path = path
        self.sha256 = hashlib.sha256(proto).hexdigest()
        self.vocab_size: int = self._sp.vocab_size()
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self.unk_id: int = self._sp.unk_id()
        self.pad_id: int = self._sp.pad_id()

    @property
    def separator_id(self) -> int:
        for tid in (self.eos_id, self.bos_id):
            if 0 <= tid < self.vocab_size:
                return tid
        raise DataError(f"tokenizer {self.path} defines neither an EOS nor a BOS piece, so documents "
                        "cannot be separated; train it with eos_id set or set data.tokenizer_model "
                        "to null")

    def check_vocab_size(self, model_vocab_size: int) -> None:
        """Raise unless the tokenizer's vocabulary is exactly ``model.vocab_size``."""
        if self.vocab_size != model_vocab_size:
            raise DataError(
                f"tokenizer {self.path} has {self.vocab_size} pieces but model.vocab_size is "
                f"{model_vocab_size}: set model.vocab_size to {self.vocab_size}, or set "
                "data.tokenizer_model to null to train a tokenizer of the model's size")

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode(self, ids: Any) -> str:
        """Text of a sequence of ids (a list, numpy array or 1-D tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"cannot decode ids {bad[:5]} (of {len(bad)} out of range): tokenizer "
                            f"{self.path} has ids 0..{self.vocab_size - 1}")
        return self._sp.decode(ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _training_lines(corpus: Corpus, max_bytes: int) -> Iterator[str]:
    """Non-empty lines of the corpus, long ones cut, until ``max_bytes`` of UTF-8 are read."""
    total = 0
    for _, chunk in corpus.chunks():
        for line in chunk.split("\n"):
            for start in range(0, len(line), _MAX_LINE_CHARS):
                piece = line[start:start + _MAX_LINE_CHARS]
                if not piece.strip("\r"):
                    continue
                total += len(piece.encode("utf-8")) + 1
                if total > max_bytes:
                    return
                yield piece


def _explain_training_error(err: Exception, vocab_size: int, corpus: Corpus) -> DataError:
    msg = str(err)
    m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", msg)
    if m:
        return DataError(
            f"model.vocab_size = {vocab_size} is too small for a tokenizer of {corpus.describe()}: "
            f"it needs at least {m.group(2)} pieces (one per character seen, plus special pieces); "
            f"raise model.vocab_size to at least {m.group(2)} or set data.tokenizer_model")
    m = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg)
    if m:
        return DataError(
            f"model.vocab_size = {vocab_size} is too large for {corpus.describe()}: SentencePiece "
            f"can learn at most {m.group(2)} pieces from it; lower model.vocab_size to at most "
            f"{m.group(2)}, add more text to data.train_files, or set data.tokenizer_model")
    return DataError(f"SentencePiece training on {corpus.describe()} with vocab_size {vocab_size} "
                     f"failed: {msg}")


def train_tokenizer(corpus: Corpus, vocab_size: int, out_path: str, *, model_type: str = "bpe",
                    byte_fallback: Optional[bool] = None,
                    max_bytes: int = DEFAULT_TOKENIZER_MAX_BYTES, num_threads: int = 1) -> Tokenizer:
    """Train a SentencePiece model of exactly ``vocab_size`` pieces and write it to ``out_path``.

    Deterministic for a given corpus and settings (single-threaded by default).
    Ids: 0 ``<unk>``, 1 ``<s>`` (BOS), 2 ``</s>`` (EOS), 3 ``"\\n"``; no pad piece.
    """
    check_int("model.vocab_size", vocab_size, minimum=1, error=DataError)
    if model_type not in ("bpe", "unigram"):
        raise DataError(f"tokenizer model_type must be 'bpe' or 'unigram', got {model_type!r}")
    if byte_fallback is None:
        byte_fallback = vocab_size >= _BYTE_FALLBACK_MIN_VOCAB
    lines = _training_lines(corpus, max_bytes)
    first = next(lines, None)
    if first is None:
        raise DataError(f"{corpus.describe()} holds no text to train a tokenizer on; "
                        "add text to data.train_files")

    def all_lines() -> Iterator[str]:
        yield first
        yield from lines

    log.info("training a %d-piece %s tokenizer on %s", vocab_size, model_type, corpus.describe())
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=all_lines(), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=False, byte_fallback=byte_fallback,
            user_defined_symbols=["\n"], allow_whitespace_only_pieces=True, split_digits=True,
            character_coverage=0.9999, max_sentence_length=_MAX_SENTENCE_BYTES,
            num_threads=num_threads, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    except RuntimeError as e:
        raise _explain_training_error(e, vocab_size, corpus) from None
    with open(out_path, "wb") as f:
        f.write(model.getvalue())
    return Tokenizer(out_path, setting="trained tokenizer")
