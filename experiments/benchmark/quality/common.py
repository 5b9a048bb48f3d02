"""Shared pieces of the quality benchmark: the ``Setting`` contract, seeding, environment."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from experiments.benchmark.utils.env import RESULTS_DIR  # noqa: F401  (re-exported)

REPO_ROOT = Path(__file__).resolve().parents[3]
CACHE_DIR = REPO_ROOT / "experiments" / "benchmark" / "results" / "cache"


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (the same calls as dattri's training scripts)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class TupleDataset(Dataset):
    """Dataset of ``(x, y)`` tuples over two stacked tensors (what dattri's loaders expect)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if len(x) != len(y):
            raise ValueError(f"TupleDataset: x has {len(x)} rows but y has {len(y)}.")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


@dataclass
class Setting:
    """Everything the harness needs to know about one benchmark setting.

    Attributes:
        name: Setting id (``digits-lr`` ...); also the cache key prefix.
        train: Training set as ``TupleDataset`` (dattri's retrain / attributors read it).
        test: Test set, same layout.
        make_model: Builds a fresh (untrained) model.
        train_func: ``(dataloader, seed=None, **kw) -> nn.Module``, dattri's retrain contract.
        target: ``(model, dataloader) -> (n_test,)`` per-sample target (the test loss).
        loss_sum: ``(model, batch_dict) -> scalar`` summed per-sample loss (dattri_llm's
            ``AttributionTask`` contract: a sum, so per-sample gradients are per-sample losses).
        make_loss_single: ``model -> f(params, (x, y)) -> scalar``, a ``torch.func``-style loss
            over ``model`` for dattri's ``AttributionTask`` (one unbatched sample, or a batch ->
            mean). It must call the task's own model (dattri's EK-FAC hooks that instance).
        batch_size: Training batch size (the loader handed to dattri's retrain functions).
        checkpoint_epochs: Epochs at which the full-data run stores checkpoints (TracIn).
        lr: Learning rate per stored checkpoint (TracIn weights).
        weight_decay: L2 coefficient of the training objective (damping of the exact IF).
        config: Free-form description recorded in the output (part of the cache key).
        model_spec: ``{"module", "factory", "kwargs"}``: how a *separate* interpreter (the
            kronfluence venv) rebuilds the model; the module may import only torch/numpy.
        task_kind: ``"classification"`` (``x -> logits (B, C)``, ``y (B,)``) or ``"lm"``
            (``x (B, T) -> logits (B, T, V)``, ``y (B, T)``; per-sample loss = mean token CE).
        checkpoint_weights: TracIn weight per stored checkpoint (default: ``lr`` each).
        target_sum: Optional test-side function, same contract as ``loss_sum`` (summed over
            the batch); ``None`` = ``loss_sum`` (dattri_llm's ``AttributionTask.target_func``).
        make_target_single: Optional test-side ``make_loss_single`` (dattri's
            ``AttributionTask.target_func``); ``None`` = ``make_loss_single``.
        trajectory: The optimizer family of ``train_func`` (``"adamw"`` or ``"sgd"``) when its
            loop takes ``observer=`` and ``mask_index=`` (the trajectory methods and the
            trajectory-specific LOO); ``""``: not wired.
        make_optimizer: Optional ``model -> optimizer`` that builds ``train_func``'s optimizer
            (its parameter groups), so a recorded ``optimizer.state_dict()`` loads onto a fresh
            model (LESS's frozen form); ``None``: one AdamW group over ``model.parameters()``.
    """

    name: str
    train: TupleDataset
    test: TupleDataset
    make_model: Callable[[], nn.Module]
    train_func: Callable[..., nn.Module]
    target: Callable[[nn.Module, Any], torch.Tensor]
    loss_sum: Callable[[nn.Module, dict], torch.Tensor]
    make_loss_single: Callable[[nn.Module], Callable[[dict, Any], torch.Tensor]]
    batch_size: int
    checkpoint_epochs: list[int] = field(default_factory=list)
    lr: float = 0.0
    weight_decay: float = 0.0
    config: dict = field(default_factory=dict)
    #: ``train_func(..., return_checkpoints=True)`` returns ``(model, [state dicts])``.
    supports_trajectory: bool = True
    model_spec: dict = field(default_factory=dict)
    task_kind: str = "classification"
    checkpoint_weights: list[float] | None = None
    target_sum: Callable[[nn.Module, dict], torch.Tensor] | None = None
    make_target_single: Callable[[nn.Module], Callable[[dict, Any], torch.Tensor]] | None = None
    trajectory: str = ""
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None

    def tracin_weights(self, n: int) -> list[float]:
        """TracIn weights of the ``n`` stored checkpoints (the learning rate at each)."""
        if self.checkpoint_weights is not None:
            if len(self.checkpoint_weights) != n:
                raise ValueError(
                    f"{self.name}: {len(self.checkpoint_weights)} checkpoint_weights for {n} "
                    "checkpoints; give one weight per stored checkpoint."
                )
            return list(self.checkpoint_weights)
        return [self.lr] * n


class TrainObserver:
    """Watches a setting's own training loop (``train_func(..., observer=...)``), e.g. to run it
    under a ``HookManager`` and record what the trajectory methods read. The loop calls
    :meth:`run` once (a context around the whole loop), then per update ``step`` (0-based)
    :meth:`before_backward` with the batch's train-set indices and tensors, before its forward,
    and :meth:`after_step` right after ``optimizer.step()``. The default does nothing."""

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """A context manager entered around the training loop."""
        return contextlib.nullcontext()

    def before_backward(self, step: int, index: torch.Tensor, batch: dict) -> None:
        """Before the forward of update ``step``; ``batch = {"x", "y"}``."""

    def after_step(self, step: int) -> None:
        """Right after ``optimizer.step()`` of update ``step``."""


def loader_batches(dataloader: Any) -> Any:
    """Yield the ``(x, y)`` batches of a loader over a (``Subset`` of a) ``TupleDataset``.

    The batches follow the loader's own ``batch_sampler`` (so its shuffling, seeded by the
    global torch RNG, is kept) but are gathered with one tensor index instead of a per-item
    collate: 20-50x faster for these small models. Any other loader is iterated as is.
    """
    for _, x, y in loader_index_batches(dataloader):
        yield x, y


def loader_index_batches(dataloader: Any, mask_index: int | None = None) -> Any:
    """As :func:`loader_batches`, with each batch's train-set indices: ``(idx, x, y)``.

    ``idx`` is ``None`` for a loader that is not over a (``Subset`` of a) ``TupleDataset``.
    ``mask_index`` drops that train-set index from every batch it falls in (trajectory-specific
    LOO); the other batches are exactly the unmasked run's.
    """
    ds, base = dataloader.dataset, None
    if isinstance(ds, torch.utils.data.Subset) and isinstance(ds.dataset, TupleDataset):
        base, remap = ds.dataset, torch.as_tensor(list(ds.indices), dtype=torch.long)
    elif isinstance(ds, TupleDataset):
        base, remap = ds, None
    if base is None or dataloader.batch_sampler is None:
        if mask_index is not None:
            raise ValueError("mask_index needs a loader over a (Subset of a) TupleDataset.")
        for x, y in dataloader:
            yield None, x, y
        return
    for idx in dataloader.batch_sampler:
        idx = torch.as_tensor(idx, dtype=torch.long)
        if remap is not None:
            idx = remap[idx]
        if mask_index is not None:
            idx = idx[idx != int(mask_index)]
        yield idx, base.x[idx], base.y[idx]


def as_dicts(ds: TupleDataset) -> list[dict[str, torch.Tensor]]:
    """dattri_llm samples: one dict per item, with an ``index`` field so hashes are unique."""
    return [
        {"x": ds.x[i], "y": ds.y[i], "index": torch.tensor(i, dtype=torch.long)}
        for i in range(len(ds))
    ]


def environment() -> dict[str, Any]:
    """Versions, threads and machine facts recorded next to every result."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
    }
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("dattri", "dattri_llm", "scikit-learn", "transformers", "scipy"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    return info
