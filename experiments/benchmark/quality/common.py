"""Shared pieces of the quality benchmark: the ``Setting`` contract, seeding, the settings'
data and losses, and the training loop they share."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
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
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


@dataclass
class Setting:
    """One benchmark setting: dattri's retrain contract ``train_func(loader, seed,
    return_checkpoints, mask_index, observer)`` (``mask_index``: that sample masked out of its
    batches), the per-test-sample ``target``, dattri_llm's summed and dattri's ``torch.func``
    losses, how kronfluence's venv rebuilds the model, and the ``config`` keying the cache."""

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
    model_spec: dict = field(default_factory=dict)
    task_kind: str = "classification"
    checkpoint_weights: list[float] | None = None
    target_sum: Callable[[nn.Module, dict], torch.Tensor] | None = None
    make_target_single: Callable[[nn.Module], Callable[[dict, Any], torch.Tensor]] | None = None
    trajectory: str = ""
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None

    def tracin_weights(self, n: int) -> list[float]:
        """TracIn weights of the ``n`` stored checkpoints (the learning rate at each)."""
        return list(self.checkpoint_weights or [self.lr] * n)


class TrainObserver:
    """Watches a setting's training loop: a context around it, then per 0-based update the
    batch's train indices and tensors before its forward, and the end of its step."""

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return contextlib.nullcontext()

    def before_backward(self, step: int, index: torch.Tensor, batch: dict) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass


def loader_batches(dataloader: Any) -> list[torch.Tensor]:
    """The train indices of each batch of a loader over a (``Subset`` of a) ``TupleDataset``, in
    its own (seeded) order: gathered with one index, 20-50x faster than its collate."""
    ds = dataloader.dataset
    remap = torch.as_tensor(list(ds.indices)) if isinstance(ds, torch.utils.data.Subset) else None
    batches = [torch.as_tensor(idx, dtype=torch.long) for idx in dataloader.batch_sampler]
    return batches if remap is None else [remap[idx] for idx in batches]


def as_dicts(ds: TupleDataset) -> list[dict[str, torch.Tensor]]:
    """dattri_llm samples: one dict per item, with an ``index`` field so hashes are unique."""
    return [
        {"x": ds.x[i], "y": ds.y[i], "index": torch.tensor(i, dtype=torch.long)}
        for i in range(len(ds))
    ]


# ---- the settings' data, losses and training loop ------------------------------------------
def draw_blocks(ids: torch.Tensor, lo: int, hi: int, n: int, rng: Any, block: int) -> TupleDataset:
    """``n`` non-overlapping ``block + 1``-token chunks of ``ids[lo:hi]`` (``x = chunk[:-1]``,
    ``y = chunk[1:]``)."""
    starts = np.arange(lo, hi - block - 1, block + 1)
    pick = np.sort(rng.choice(starts, n, replace=False))
    chunks = torch.stack([ids[s : s + block + 1] for s in pick.tolist()])
    return TupleDataset(chunks[:, :-1].clone(), chunks[:, 1:].clone())


def per_sample_ce(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B,) mean next-token cross-entropy per block."""
    return F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)


def lm_functions(measure: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict:
    """A language-model setting's losses: per-sample mean token CE on the train side,
    ``measure(CE)`` on the test side (``None``: the CE itself)."""
    m = measure or (lambda ce: ce)

    def target(model: nn.Module, dataloader: Any) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            out = [m(per_sample_ce(model, x, y)) for x, y in dataloader]
        return torch.cat(out).detach().to(torch.float64)

    def single(model: nn.Module, f: Callable) -> Callable:
        def fn(params: dict, data: Any) -> torch.Tensor:
            x, y = data
            if x.dim() == 1:
                x, y = x[None], y[None]
            return f(per_sample_ce(lambda i: functional_call(model, params, (i,)), x, y)).mean()

        return fn

    out = {"target": target, "make_loss_single": lambda model: single(model, lambda ce: ce)}
    out["loss_sum"] = lambda model, b: per_sample_ce(model, b["x"], b["y"]).sum()
    out |= {"task_kind": "lm", "trajectory": "adamw"}
    if measure is not None:
        out["target_sum"] = lambda model, b: measure(per_sample_ce(model, b["x"], b["y"])).sum()
        out["make_target_single"] = lambda model: single(model, measure)
    return out


def train_func_of(train: TupleDataset, run: Callable) -> Callable[..., Any]:
    """dattri's train contract for a loader over the train set or a ``Subset`` of it:
    ``run(loader, subset indices, seed) -> (model, optimizer, train indices per 1-based step,
    lr_at(step), loss(model, x, y), steps after which to keep the state dict)``."""

    def train_func(
        dataloader: Any, seed: int | None = None, return_checkpoints: bool = False,
        mask_index: int | None = None, observer: TrainObserver | None = None, **_: Any,
    ) -> Any:  # fmt: skip
        ds, subset = dataloader.dataset, torch.arange(len(train))
        if isinstance(ds, torch.utils.data.Subset):
            subset = torch.as_tensor(sorted(int(i) for i in ds.indices), dtype=torch.long)
        if mask_index is not None and not bool((subset == int(mask_index)).any()):
            raise ValueError(f"mask_index={mask_index} is not a member of the training subset.")
        model, opt, batches, lr_at, loss, ckpt_steps = run(dataloader, subset, int(seed or 0))
        ckpts, observer = [], observer or TrainObserver()
        model.train()
        with observer.run(model, opt):
            for step, idx in enumerate(batches, 1):
                for group in opt.param_groups:
                    group["lr"] = lr_at(step)
                if mask_index is not None:
                    idx = idx[idx != int(mask_index)]
                if len(idx) == 0:
                    continue
                x, y = train.x[idx], train.y[idx]
                observer.before_backward(step - 1, idx, {"x": x, "y": y})
                value = loss(model, x, y)
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()
                observer.after_step(step - 1)
                if step in ckpt_steps:
                    ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        model.eval()
        return (model, ckpts) if return_checkpoints else model

    return train_func
