"""Pack the token stream into fixed-length training sequences.

Documents are already concatenated with a separator (EOS) after each one in the token
file, so packing is arithmetic: sequence ``i`` is the ``seq_len + 1`` tokens starting at
``i * seq_len``. Consecutive sequences overlap by one token, so every token but the first
is a target exactly once per epoch; ``inputs = tokens[:, :-1]``, ``targets = tokens[:, 1:]``.

With document masking each sequence also carries document ids (``0, 0, 0, 1, 1, 2, ...``
numbered from 0 within the row). A separator belongs to the document it ends. The
attention mask lets a position see only earlier positions of its own document
(``document_causal_mask``); ``position_ids_from_doc_ids`` restarts positions at each
document for rotary embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

from engine.data.errors import DataError
from engine.data.tokenizer import Tokenizer
from engine.data.tokens import TokenFile
from engine.validate import check_int

__all__ = ["Batch", "PackedDataset", "document_causal_mask", "position_ids_from_doc_ids"]


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask ``(B, 1, S, S)`` from document ids ``(B, S)``.

    ``mask[b, 0, i, j]`` is True where query ``i`` may attend to key ``j``: ``j <= i`` and
    both in the same document. True = attend, the convention of
    ``torch.nn.functional.scaled_dot_product_attention``'s boolean ``attn_mask``; the
    singleton dim broadcasts over heads. Every row has at least its diagonal set.
    """
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must have shape (batch, seq), got {tuple(doc_ids.shape)}")
    s = doc_ids.shape[1]
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, S, S)
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()  # (S, S)
    return (same_doc & causal).unsqueeze(1)  # (B, 1, S, S)


def position_ids_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Positions ``(B, S)`` that restart at 0 where the document id changes."""
    if doc_ids.dim() != 2:
        raise ValueError(f"doc_ids must have shape (batch, seq), got {tuple(doc_ids.shape)}")
    b, s = doc_ids.shape
    idx = torch.arange(s, device=doc_ids.device).expand(b, s)  # (B, S)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # Index of the latest document start at or before each position.
    start = torch.cummax(torch.where(is_start, idx, torch.zeros_like(idx)), dim=1).values
    return idx - start


@dataclass(frozen=True)
class Batch:
    """Rows of packed sequences.

    tokens: ``(B, S + 1)`` int64. doc_ids: ``(B, S + 1)`` int64 per-row document ids, or None
    without document masking.
    """

    tokens: torch.Tensor
    doc_ids: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]  # (B, S)

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]  # (B, S)

    @property
    def input_doc_ids(self) -> Optional[torch.Tensor]:
        return None if self.doc_ids is None else self.doc_ids[:, :-1]  # (B, S)

    def attention_mask(self) -> Optional[torch.Tensor]:
        """``(B, 1, S, S)`` boolean document-causal mask for the inputs, None without masking."""
        ids = self.input_doc_ids
        return None if ids is None else document_causal_mask(ids)

    def position_ids(self) -> Optional[torch.Tensor]:
        """``(B, S)`` positions restarting per document, None without masking."""
        ids = self.input_doc_ids
        return None if ids is None else position_ids_from_doc_ids(ids)

    def rows(self, start: int, stop: int) -> "Batch":
        return Batch(self.tokens[start:stop],
                     None if self.doc_ids is None else self.doc_ids[start:stop])

    @staticmethod
    def cat(batches: Sequence["Batch"]) -> "Batch":
        tokens = torch.cat([b.tokens for b in batches])
        has_docs = [b.doc_ids is not None for b in batches]
        if any(has_docs) and not all(has_docs):
            raise ValueError("cannot concatenate batches with and without doc_ids")
        docs = [b.doc_ids for b in batches if b.doc_ids is not None]
        return Batch(tokens, torch.cat(docs) if all(has_docs) else None)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(self.tokens.to(device, non_blocking=non_blocking),
                     None if self.doc_ids is None
                     else self.doc_ids.to(device, non_blocking=non_blocking))

    def equal(self, other: "Batch") -> bool:
        if (self.doc_ids is None) != (other.doc_ids is None):
            return False
        same_docs = self.doc_ids is None or other.doc_ids is None or torch.equal(self.doc_ids, other.doc_ids)
        return torch.equal(self.tokens, other.tokens) and same_docs


class PackedDataset:
    """Fixed-length sequences over a ``TokenFile``, random access by sequence index."""

    def __init__(self, token_file: TokenFile, tokenizer: Tokenizer, seq_len: int,
                 document_masking: bool = False) -> None:
        check_int("model.seq_len", seq_len, minimum=1, error=DataError)
        token_file.check_tokenizer(tokenizer)
        self.token_file = token_file
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.document_masking = bool(document_masking)
        n = token_file.num_tokens
        self.num_sequences = (n - 1) // seq_len
        if self.num_sequences < 1:
            raise DataError(f"the corpus has {n} tokens ({token_file.meta.source}), fewer than "
                            f"model.seq_len + 1 = {seq_len + 1} needed for one training sequence; "
                            "add text to data.train_files or lower model.seq_len")

    def __len__(self) -> int:
        return self.num_sequences

    def sequence(self, index: int) -> np.ndarray:
        """Tokens ``(seq_len + 1,)`` of sequence ``index``."""
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} out of range 0..{self.num_sequences - 1}")
        start = index * self.seq_len
        return np.asarray(self.token_file.tokens[start:start + self.seq_len + 1])

    def batch(self, indices: Union[Sequence[int], np.ndarray]) -> Batch:
        """Stack the sequences ``indices`` (in that order) into a ``Batch``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)  # (B,)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_sequences):
            raise IndexError(f"sequence indices must lie in 0..{self.num_sequences - 1}")
        rows: List[np.ndarray] = [self.sequence(int(i)) for i in idx]
        width = self.seq_len + 1
        tokens = np.stack(rows).astype(np.int64) if rows else np.zeros((0, width), np.int64)
        doc_ids = None
        if self.document_masking:
            pos = idx[:, None] * self.seq_len + np.arange(width)  # (B, S + 1) token positions
            doc = np.searchsorted(self.token_file.doc_offsets, pos, side="right") - 1
            doc_ids = torch.from_numpy(doc - doc[:, :1])  # (B, S + 1), 0-based within a row
        return Batch(torch.from_numpy(tokens), doc_ids)
