"""digits-LR and digits-MLP: scikit-learn's digits (first 1000 train, next 500 test, ``X / 16``),
logistic regression 64 -> 10 and an MLP 64-128-64-10, SGD with an L2 term (so the LR
objective is strongly convex and the exact influence function well defined); stand-ins for
dattri's MNIST LR / MLP settings. Target: the per-sample test cross-entropy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from experiments.benchmark.quality.common import (
    Setting,
    TupleDataset,
    loader_batches,
    seed_all,
    train_func_of,
)

N_TRAIN, N_TEST = 1000, 500


def LogisticRegression() -> nn.Module:  # noqa: N802 - the setting's model names
    """Multinomial logistic regression 64 -> 10."""
    return nn.Sequential(nn.Linear(64, 10))


def MLP() -> nn.Module:  # noqa: N802
    """MLP 64-128-64-10 with ReLU (dattri's MNIST MLP shape, scaled to 8x8 inputs)."""
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


HPARAMS: dict[str, dict[str, Any]] = {
    "digits-lr": {"model": LogisticRegression, "lr": 0.5, "epochs": 150, "wd": 1e-3},
    "digits-mlp": {"model": MLP, "lr": 0.1, "epochs": 60, "wd": 1e-3},
}


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def make_setting(name: str) -> Setting:
    """Build the ``digits-lr`` or ``digits-mlp`` setting."""
    from sklearn.datasets import load_digits

    hp = HPARAMS[name]
    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    train = TupleDataset(x[:N_TRAIN].clone(), y[:N_TRAIN].clone())
    test = TupleDataset(
        x[N_TRAIN : N_TRAIN + N_TEST].clone(), y[N_TRAIN : N_TRAIN + N_TEST].clone()
    )
    # SGD (the benchmark's); "adamw" exists for the tests of the trajectory adapters only
    optimizer_class = torch.optim.AdamW if hp.get("optimizer") == "adamw" else torch.optim.SGD
    ckpt_epochs = [round(hp["epochs"] * (k + 1) / 4) for k in range(4)]

    def run(loader: Any, subset: torch.Tensor, seed: int) -> tuple:
        seed_all(seed)
        model = hp["model"]()
        opt = optimizer_class(model.parameters(), lr=hp["lr"], weight_decay=hp["wd"])
        # every epoch's batches drawn up front: training takes nothing from the global RNG
        epochs = [loader_batches(loader) for _ in range(hp["epochs"])]
        ckpt_steps = [sum(map(len, epochs[:e])) for e in ckpt_epochs]
        batches = [idx for epoch in epochs for idx in epoch]
        return model, opt, batches, lambda step: hp["lr"], _loss, ckpt_steps

    def target(model: nn.Module, dataloader: Any) -> torch.Tensor:
        model.eval()
        with torch.no_grad():
            out = [F.cross_entropy(model(xb), yb, reduction="none") for xb, yb in dataloader]
        return torch.cat(out).detach().to(torch.float64)

    def make_loss_single(model: nn.Module) -> Any:
        def loss_single(params: dict, data: Any) -> torch.Tensor:
            xb, yb = data
            return F.cross_entropy(functional_call(model, params, (xb,)), yb)

        return loss_single

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=hp["model"],
        train_func=train_func_of(train, run),
        target=target,
        loss_sum=lambda model, b: F.cross_entropy(model(b["x"]), b["y"], reduction="sum"),
        make_loss_single=make_loss_single,
        batch_size=64,
        checkpoint_epochs=ckpt_epochs,
        lr=hp["lr"],
        weight_decay=hp["wd"],
        model_spec={
            "module": "experiments.benchmark.quality.digits",
            "factory": hp["model"].__name__,
            "kwargs": {},
        },
        trajectory="adamw" if optimizer_class is torch.optim.AdamW else "sgd",
        config={
            "data": "sklearn load_digits, X/16, train=[0,1000), test=[1000,1500)",
            "model": f"{hp['model'].__name__} (nn.Sequential)",
            "optimizer": f"{optimizer_class.__name__}(lr={hp['lr']}, weight_decay={hp['wd']})",
            "epochs": hp["epochs"],
            "batch_size": 64,
            "checkpoint_epochs": ckpt_epochs,
            "dtype": "torch.float32",
        },
    )
