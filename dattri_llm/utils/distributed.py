"""Guarded ``torch.distributed`` helpers: every function works without an initialised group."""

from __future__ import annotations

import atexit
import time

import torch
import torch.distributed as dist

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "barrier",
    "all_reduce_sum",
    "settle_collectives_at_exit",
]

#: Seconds the interpreter waits (GIL released) at exit once this process ran a collective.
EXIT_GRACE_S = 0.2
_EXIT_GRACE_REGISTERED = [False]


def settle_collectives_at_exit() -> None:
    """Let the backend's worker threads drop finished collectives before the interpreter exits.

    Why: gloo's worker thread releases its reference to a finished collective (and with it
    the Python tensors it wrote) *after* the caller's ``wait()`` returned, and that release
    takes the GIL. When the process ends right after its last collective (a torchrun script
    that scores and exits), the thread can reach the GIL only once the interpreter is
    finalizing; Python then ends the thread inside a ``noexcept`` destructor and the process
    aborts (SIGABRT, "terminate called without an active exception", seen on torch 2.13 with
    2-3 gloo ranks on 2 cores). A pause at exit with the GIL released lets the thread finish
    first. Registered once per process, by the library's own collectives.
    """
    if not _EXIT_GRACE_REGISTERED[0]:
        _EXIT_GRACE_REGISTERED[0] = True
        atexit.register(time.sleep, EXIT_GRACE_S)


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
        settle_collectives_at_exit()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (no-op without a process group).

    gloo has no float64 reduction on some builds of old torch versions; the tensor is reduced
    in its own dtype, which every supported torch handles for float32/float64.
    """
    if is_distributed() and get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        settle_collectives_at_exit()
    return tensor
