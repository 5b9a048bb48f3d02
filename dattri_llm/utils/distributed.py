"""Guarded ``torch.distributed`` helpers: every function works without an initialised group."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["is_distributed", "get_rank", "get_world_size", "barrier", "all_reduce_sum"]


def is_distributed() -> bool:
    """True when a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Rank of this process (0 without a process group)."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """Number of processes (1 without a process group)."""
    return dist.get_world_size() if is_distributed() else 1


def barrier() -> None:
    """Synchronise all ranks (no-op without a process group)."""
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (no-op without a process group).

    gloo has no float64 reduction on some builds of old torch versions; the tensor is reduced
    in its own dtype, which every supported torch handles for float32/float64.
    """
    if is_distributed() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
