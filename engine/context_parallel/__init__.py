"""Context parallelism: one sequence split over CP ranks (head-tail order), attention across
the shards by ring (p2p KV rotation), Ulysses (all-to-all to heads) or both (hybrid).

- :mod:`.sharding`: which token positions a CP rank holds (head-tail: chunks i and 2C-1-i).
- :mod:`.layout`: the mode and the process groups one rank's attention talks over.
- :mod:`.attention`: :func:`context_parallel_attention`, the one call the model makes.
"""

from engine.context_parallel.layout import CP_MODES, CPLayout
from engine.context_parallel.sharding import head_tail_indices, shard_sequence

__all__ = ["CP_MODES", "CPLayout", "head_tail_indices", "shard_sequence"]
