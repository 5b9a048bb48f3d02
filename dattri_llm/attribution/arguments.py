"""``AttributionArguments``: run options of every attributor (usable with ``HfArgumentParser``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dattri_llm.utils.progress import check_show

__all__ = ["AttributionArguments"]

_COLLATES = ("stack", "pad")


@dataclass
class AttributionArguments:
    """Options shared by the attributors.

    Only plain types are used, so ``transformers.HfArgumentParser(AttributionArguments)``
    builds a command line from it. A custom collate function can be passed to
    ``attribute(..., collate_fn=...)``.

    Attributes:
        output_dir: Where :meth:`AttributionScore.save` writes by default (created lazily, only
            when something is saved).
        per_device_train_batch_size: Train samples per forward/backward of the live path.
        per_device_eval_batch_size: Test samples per forward/backward of the live path.
        use_cpu: Compute on the CPU even when CUDA is available.
        seed: Seed set before a live run (random layers such as dropout are off anyway: the
            live probe runs the model in eval mode).
        dataloader_num_workers: Worker processes of the live path's ``DataLoader``.
        dataloader_drop_last: Drop the last incomplete batch (off: every sample is scored).
        dataloader_collate: ``"stack"`` (``torch.utils.data.default_collate``) or ``"pad"``
            (right-pad the first axis of every tensor field to the longest in the batch with
            ``dataloader_pad_value``; ``labels`` with ``-100``, ``attention_mask`` with ``0``).
        dataloader_pad_value: Fill value of the ``"pad"`` collate.
        score_block_size: At most this many train rows and this many test columns are scored
            in one call of ``score_block`` (a cap; the train rows are chosen from
            ``score_memory_gb``).
        score_memory_gb: Memory budget of the score loop, in GiB. Consecutive train blocks are
            joined into chunks of as many rows as fit beside the prepared test gradients (the
            chunk's gradients, one layer of them materialized at a time, the score rows), so
            the dense test side is read once per chunk; test layers are materialized once only
            while they fit in half of it. Default 1 GiB: with many queries a larger budget
            trades memory for time (GPT-2 4x256, 1024 train x 64 queries: 2.0x a plain step
            and 2.3 GB peak at 2 GiB, 2.4x and 1.5 GB at 1 GiB); with few it changes nothing
            (4x512, 64 x 16: 1.46x at 1 and at 4 GiB); see docs/benchmarks/scoring.md.
        resumable: Checkpoint the partial scores of ``attribute_from_cache`` after every
            scored chunk under ``output_dir/scoring_checkpoints/`` (safetensors + JSON,
            atomic), and resume an identical call that was interrupted; the checkpoint is
            removed when the call returns (see ``dattri_llm.attribution.engine.resume``).
        distributed_scoring: Under an initialised ``torch.distributed`` group of several ranks,
            split the train side of every ``attribute*`` call across the ranks and merge the
            results (every rank must make the call; see
            ``dattri_llm.attribution.engine.distributed``). ``False``: each process scores
            everything it is given by itself (e.g. rank 0 alone, the others waiting).
        distributed_timeout_s: How long a split call waits for every rank to join it before
            failing with an error naming the missing ranks.
        show_progress: Progress bars on standard error: ``None`` (default, tqdm's
            convention) only when it is a terminal, so CI logs and redirected runs carry none;
            ``True`` always; ``False`` never.
        live_cache_gb: Live runs keep the streamed train gradients in memory up to this many
            GiB, so an attributor that reads the train set several times (K-FAC covariances,
            EK-FAC eigenvalues, then scoring) runs one forward/backward pass over it instead
            of one per read. Past the budget the cache is dropped and the train set is
            streamed again for each read. ``0`` disables it.
        check_weights: Refuse, from stores, test gradients captured at weights that match
            none of the train checkpoint labels they are scored against (every record carries
            a fingerprint of its weights; see docs/guides/capturing.md, "Checkpoint labels").
            ``False`` scores across weights on purpose.
    """

    output_dir: str = "attribution_output"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    use_cpu: bool = False
    seed: int = 42
    dataloader_num_workers: int = 0
    dataloader_drop_last: bool = False
    dataloader_collate: str = "stack"
    dataloader_pad_value: int = 0
    score_block_size: int = 1024
    score_memory_gb: float = 1.0
    resumable: bool = False
    distributed_scoring: bool = True
    distributed_timeout_s: float = 300.0
    show_progress: bool | None = None
    live_cache_gb: float = 2.0
    check_weights: bool = True

    def __post_init__(self) -> None:
        for name in (
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "score_block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"AttributionArguments.{name} must be a positive int, got {value!r}."
                )
        if self.dataloader_num_workers < 0:
            raise ValueError(
                "AttributionArguments.dataloader_num_workers must be >= 0, got "
                f"{self.dataloader_num_workers!r}."
            )
        if self.dataloader_collate not in _COLLATES:
            raise ValueError(
                f"AttributionArguments.dataloader_collate must be one of {_COLLATES}"
                f", got {self.dataloader_collate!r}; pass a callable as "
                "attribute(..., collate_fn=...) for anything else."
            )
        # budgets are turned into byte counts: a finite number of GiB (inf has no byte count)
        if not (self.score_memory_gb > 0 and math.isfinite(self.score_memory_gb)):
            raise ValueError(
                "AttributionArguments.score_memory_gb must be a finite number of GiB > 0, got "
                f"{self.score_memory_gb!r}."
            )
        if not (self.live_cache_gb >= 0 and math.isfinite(self.live_cache_gb)):
            raise ValueError(
                "AttributionArguments.live_cache_gb must be a finite number of GiB >= 0 (0: no "
                f"cache), got {self.live_cache_gb!r}."
            )
        check_show(self.show_progress, "AttributionArguments.show_progress")
        for name in (
            "use_cpu",
            "dataloader_drop_last",
            "resumable",
            "distributed_scoring",
        ):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"AttributionArguments.{name} must be True or False, got {value!r} "
                    f"({type(value).__name__})."
                )

    @property
    def device(self) -> torch.device:
        """Where scores are computed: CUDA (this process's ``LOCAL_RANK``) unless ``use_cpu``."""
        if self.use_cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
