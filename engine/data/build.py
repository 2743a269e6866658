"""``build_dataset``: from the ``data`` config fields to a ``PackedDataset``, cached on disk.

Steps, each cached under ``cache_dir`` and built by one process while the others wait
(``engine.data.cache``):

1. the corpus: ``data.train_files``, or the embedded default (Python standard-library
   sources) when it is null;
2. the tokenizer: ``data.tokenizer_model``, or one trained on the corpus with exactly
   ``model.vocab_size`` pieces (cache key: corpus fingerprint, vocab size, trainer
   settings, SentencePiece version);
3. the token file (cache key: corpus fingerprint and tokenizer hash);
4. packing into ``seq_len + 1`` windows, optionally with document ids.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional, Sequence

from engine.data.cache import cache_key, cached_build, default_cache_dir
from engine.data.corpus import DEFAULT_EMBEDDED_MAX_BYTES, Corpus, FileCorpus, StdlibCorpus
from engine.data.errors import DataError
from engine.data.packing import PackedDataset
from engine.data.tokenizer import DEFAULT_TOKENIZER_MAX_BYTES, SENTENCEPIECE_VERSION, Tokenizer, train_tokenizer
from engine.data.tokens import FORMAT_VERSION, TokenFile, write_token_file
from engine.validate import check_int

__all__ = ["build_dataset", "build_tokenizer"]

log = logging.getLogger(__name__)
# One-time builds a user waits for (the launcher shows this logger at INFO by default).
build_log = logging.getLogger("engine.build")


def _timed(what: str, where: str, build: Callable[[str], object]) -> Callable[[str], object]:
    """``build`` wrapped to say, before and after, what it builds and how long it took."""
    def run(tmp: str) -> object:
        build_log.info("building %s (once; cached in %s) ...", what, where)
        t0 = time.perf_counter()
        out = build(tmp)
        build_log.info("built %s in %.1f s", what, time.perf_counter() - t0)
        return out
    return run

_TOKENIZER_FILE = "tokenizer.model"
_TOKENS_PREFIX = "tokens"


def build_tokenizer(corpus: Corpus, vocab_size: int, cache_dir: str, *,
                    max_bytes: int = DEFAULT_TOKENIZER_MAX_BYTES,
                    lock_timeout_s: float = 3600.0) -> Tokenizer:
    """A tokenizer trained on ``corpus`` with ``vocab_size`` pieces, trained once and cached."""
    key = cache_key({"what": "tokenizer", "corpus": corpus.fingerprint(), "vocab_size": vocab_size,
                     "max_bytes": max_bytes, "sentencepiece": SENTENCEPIECE_VERSION,
                     "recipe": 1})
    entry, _ = cached_build(
        os.path.join(cache_dir, f"tokenizer-{key}"),
        _timed(f"the tokenizer ({vocab_size} pieces)", cache_dir,
               lambda tmp: train_tokenizer(corpus, vocab_size, os.path.join(tmp, _TOKENIZER_FILE),
                                           max_bytes=max_bytes)),
        lock_timeout_s=lock_timeout_s)
    return Tokenizer(os.path.join(entry, _TOKENIZER_FILE), setting="cached tokenizer")


def _token_file(corpus: Corpus, tokenizer: Tokenizer, cache_dir: str,
                lock_timeout_s: float) -> TokenFile:
    key = cache_key({"what": "tokens", "corpus": corpus.fingerprint(),
                     "tokenizer": tokenizer.sha256, "format": FORMAT_VERSION})
    entry, _ = cached_build(
        os.path.join(cache_dir, f"tokens-{key}"),
        # Encoding is per-chunk and order-preserving, so threads do not change the result;
        # one process per machine builds, so it may use the cores.
        _timed("the token file", cache_dir,
               lambda tmp: write_token_file(os.path.join(tmp, _TOKENS_PREFIX), corpus, tokenizer,
                                            num_threads=min(16, os.cpu_count() or 1))),
        lock_timeout_s=lock_timeout_s)
    tokens = TokenFile(os.path.join(entry, _TOKENS_PREFIX))
    tokens.check_tokenizer(tokenizer)
    return tokens


def build_dataset(*, train_files: Optional[Sequence[str]], tokenizer_model: Optional[str],
                  cache_dir: Optional[str], document_masking: bool, vocab_size: int, seq_len: int,
                  embedded_max_bytes: int = DEFAULT_EMBEDDED_MAX_BYTES,
                  tokenizer_max_bytes: int = DEFAULT_TOKENIZER_MAX_BYTES,
                  lock_timeout_s: float = 3600.0) -> PackedDataset:
    """The packed training dataset described by the ``data`` config section.

    train_files: ``data.train_files`` (None = embedded default corpus).
    tokenizer_model: ``data.tokenizer_model`` (None = train one of ``vocab_size`` pieces).
    cache_dir: ``data.cache_dir`` (None = ``~/.cache/engine/data``).
    vocab_size, seq_len: ``model.vocab_size`` and ``model.seq_len``.
    embedded_max_bytes: size cap of the embedded default corpus.
    tokenizer_max_bytes: how much text tokenizer training reads.

    Safe to call from every rank at once: each cache entry is built by one process.
    """
    for name, value in (("model.vocab_size", vocab_size), ("model.seq_len", seq_len)):
        check_int(name, value, minimum=1, error=DataError)
    if not isinstance(document_masking, bool):
        raise DataError(f"data.document_masking must be true or false, got {document_masking!r}")
    if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir):
        raise DataError(f"data.cache_dir must be a directory path or null, got {cache_dir!r}")
    cache_root = os.path.abspath(os.path.expanduser(cache_dir)) if cache_dir else default_cache_dir()
    if os.path.exists(cache_root) and not os.path.isdir(cache_root):
        raise DataError(f"data.cache_dir = {cache_root} is a file, not a directory: "
                        "point it at a directory")

    corpus: Corpus = (StdlibCorpus(embedded_max_bytes) if train_files is None
                      else FileCorpus(train_files))
    if tokenizer_model is not None:
        if not isinstance(tokenizer_model, str) or not tokenizer_model:
            raise DataError(f"data.tokenizer_model must be a path or null, got {tokenizer_model!r}")
        tokenizer = Tokenizer(tokenizer_model)
        tokenizer.check_vocab_size(vocab_size)
    else:
        tokenizer = build_tokenizer(corpus, vocab_size, cache_root, max_bytes=tokenizer_max_bytes,
                                    lock_timeout_s=lock_timeout_s)
    tokens = _token_file(corpus, tokenizer, cache_root, lock_timeout_s)
    dataset = PackedDataset(tokens, tokenizer, seq_len, document_masking)
    log.info("dataset: %s, %d tokens in %d documents, %d sequences of %d tokens",
             corpus.describe(), tokens.num_tokens, tokens.num_documents, len(dataset), seq_len)
    return dataset
