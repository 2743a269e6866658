"""Data pipeline: SentencePiece tokenizer, memory-mapped token files, packed sequences and
step-deterministic, DP-aware batches.

Entry points: ``build_dataset`` (from the ``data`` config fields) and
``GlobalBatchSampler`` (the global batch at each step and each DP rank's share).
See docs/data.md.
"""

from engine.data.build import build_dataset, build_tokenizer
from engine.data.cache import default_cache_dir
from engine.data.corpus import DEFAULT_EMBEDDED_MAX_BYTES, Corpus, FileCorpus, StdlibCorpus, check_train_files
from engine.data.errors import DataError
from engine.data.packing import Batch, PackedDataset, document_causal_mask, position_ids_from_doc_ids
from engine.data.sampler import (
                                GlobalBatchSampler,
                                accumulation_steps,
                                batch_at,
                                dp_slice,
                                epoch_permutation,
                                microbatches,
                                sample_indices,
)
from engine.data.tokenizer import Tokenizer, train_tokenizer
from engine.data.tokens import TokenFile, token_dtype, write_token_file

__all__ = [
    "build_dataset", "build_tokenizer", "default_cache_dir",
    "Corpus", "FileCorpus", "StdlibCorpus", "check_train_files", "DEFAULT_EMBEDDED_MAX_BYTES",
    "DataError",
    "Batch", "PackedDataset", "document_causal_mask", "position_ids_from_doc_ids",
    "GlobalBatchSampler", "accumulation_steps", "batch_at", "dp_slice", "epoch_permutation",
    "microbatches", "sample_indices",
    "Tokenizer", "train_tokenizer",
    "TokenFile", "token_dtype", "write_token_file",
]
