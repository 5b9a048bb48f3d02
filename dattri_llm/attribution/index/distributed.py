"""``GradientIndex`` under ``torch.distributed``: build and search split by partition.

Under an initialised process group every rank calls ``build`` / ``search`` alike (as scoring):

* **Build.** Partition ``i`` (store order) is built by rank ``i % world``, which reads only the
  records holding a sample its partitions own (a sample's rows may lie in other partitions:
  they are read too, so its vector is complete). Rank 0 clears an old index first; the ranks
  exchange their parts' entries (JSON bytes, no pickle), rank 0 writes ``index.json`` and every
  rank then opens the whole index. The files are the ones a one-process build writes.
* **Search.** Rank ``r`` searches the partitions ``i % world == r``; the per-rank top-k are
  all-gathered and merged (the top-k of disjoint sets is the top-k of their top-k), so every
  rank returns the same result, equal to a one-process search.

Limits: every rank opens every partition's FAISS file (the memory of the whole index per rank;
only the work is split), and a rank that fails during the build is not announced to the
others (they wait in the exchange until the process group's timeout), unlike scoring's checks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from dattri_llm.attribution.ranking import rank
from dattri_llm.utils.distributed import barrier, get_rank, get_world_size, is_distributed

__all__ = ["active", "mine", "rows_to_read", "gather_entries", "merge_ranks", "barrier"]


def active() -> bool:
    """Whether a process group with more than one rank is initialised."""
    return is_distributed() and get_world_size() > 1


def mine(count: int) -> set[int]:
    """The partition numbers (of ``count``) this rank builds and searches."""
    if not active():
        return set(range(count))
    rank, world = get_rank(), get_world_size()
    return {i for i in range(count) if i % world == rank}


def rows_to_read(rows: Sequence[tuple[int, str, Any]], owner: dict[str, str], parts: set[str]):
    """The records holding at least one sample owned by ``parts`` (store order kept)."""
    return [r for r in rows if any(owner[h] in parts for h in r[2].hashes)]


def gather_entries(local: list[tuple[int, dict]]) -> list[dict]:
    """Every rank's ``(partition number, index.json entry)``, merged in partition order."""
    if not active():
        return [e for _, e in sorted(local, key=lambda t: t[0])]
    from dattri_llm.attribution.engine.distributed import all_gather_bytes

    every = []
    for blob in all_gather_bytes(json.dumps(local).encode()):
        every += [(int(i), e) for i, e in json.loads(blob)]
    return [e for _, e in sorted(every, key=lambda t: t[0])]


def merge_ranks(vals: torch.Tensor, ids: torch.Tensor, k: int, largest: bool) -> tuple:
    """The global top-``k`` of every rank's ``(M, <= k)`` values and global ids."""
    if not active():
        return vals, ids
    from dattri_llm.attribution.engine.distributed import all_gather_tensors

    v = torch.cat(all_gather_tensors(vals.to(torch.float32)), 1)
    i = torch.cat(all_gather_tensors(ids.to(torch.long)), 1)
    top, pos = rank(v, k, largest)
    return top, i.gather(1, pos)
