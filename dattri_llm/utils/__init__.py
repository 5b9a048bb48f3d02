"""Generic helpers: sample hashing, ``module_kwargs`` builders, guarded distributed calls."""

from __future__ import annotations

from dattri_llm.utils.distributed import get_rank, get_world_size, is_distributed
from dattri_llm.utils.hashing import hash_batch, hash_sample

__all__ = ["hash_sample", "hash_batch", "get_rank", "get_world_size", "is_distributed"]
