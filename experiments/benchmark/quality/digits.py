"""digits-LR and digits-MLP: stand-ins for dattri's MNIST-10 LR / MLP benchmarks.

Data: ``sklearn.datasets.load_digits()`` (bundled, 8x8 images), ``X / 16``; train = the first
1000 images, test = the next 500. Models: logistic regression 64 -> 10 and an MLP
64-128-64-10 (ReLU). Training follows dattri's ``train_mnist_lr`` / ``train_mnist_mlp`` shape
(SGD, cross-entropy, a fixed number of epochs over the loader it is handed, seeded init) with
an L2 term (``weight_decay``) so the LR objective is strongly convex and the exact-Hessian
influence function is well defined. The target is the per-sample test cross-entropy, as in
dattri's ``loss_mnist_lr``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from experiments.benchmark.quality.common import (
    Setting,
    TrainObserver,
    TupleDataset,
    loader_batches,
    loader_index_batches,
    seed_all,
)

N_TRAIN, N_TEST = 1000, 500


def load_digits_tensors(dtype: torch.dtype = torch.float32) -> tuple[TupleDataset, TupleDataset]:
    """Train (first 1000) and test (next 500) digits, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=dtype) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    train = TupleDataset(x[:N_TRAIN].clone(), y[:N_TRAIN].clone())
    test = TupleDataset(
        x[N_TRAIN : N_TRAIN + N_TEST].clone(), y[N_TRAIN : N_TRAIN + N_TEST].clone()
    )
    return train, test


class LogisticRegression(nn.Module):
    """Multinomial logistic regression 64 -> 10."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class MLP(nn.Module):
    """MLP 64-128-64-10 with ReLU (dattri's MNIST MLP shape, scaled to 8x8 inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.fc3 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


HPARAMS: dict[str, dict[str, Any]] = {
    "digits-lr": {"model": LogisticRegression, "lr": 0.5, "epochs": 150, "wd": 1e-3},
    "digits-mlp": {"model": MLP, "lr": 0.1, "epochs": 60, "wd": 1e-3},
}


def make_setting(name: str, dtype: torch.dtype = torch.float32) -> Setting:
    """Build the ``digits-lr`` or ``digits-mlp`` setting."""
    if name not in HPARAMS:
        raise ValueError(
            f"make_setting: unknown digits setting {name!r}; use one of {list(HPARAMS)}."
        )
    hp = HPARAMS[name]
    train, test = load_digits_tensors(dtype)
    # SGD (the benchmark's); "adamw" exists for the tests of the trajectory adapters only
    adamw = hp.get("optimizer", "sgd") == "adamw"
    optimizer_class = torch.optim.AdamW if adamw else torch.optim.SGD
    batch_size = 64
    n_ckpt = 4
    ckpt_epochs = [round(hp["epochs"] * (k + 1) / n_ckpt) for k in range(n_ckpt)]

    def make_model() -> nn.Module:
        return hp["model"]().to(dtype)

    def train_func(
        dataloader: Any,
        seed: int | None = None,
        return_checkpoints: bool = False,
        mask_index: int | None = None,
        observer: TrainObserver | None = None,
        **_: Any,
    ) -> Any:
        """dattri's train contract. ``mask_index`` (trajectory-specific LOO): that train sample
        is dropped from every batch it falls in (the batch's mean loss is over the others),
        all else as in the unmasked run; ``observer`` watches the loop."""
        if seed is not None:
            seed_all(seed)
        model = make_model()
        opt = optimizer_class(model.parameters(), lr=hp["lr"], weight_decay=hp["wd"])
        ckpts, step = [], 0
        observer = observer or TrainObserver()
        model.train()
        with observer.run(model, opt):
            for epoch in range(1, hp["epochs"] + 1):
                for idx, x, y in loader_index_batches(dataloader, mask_index):
                    observer.before_backward(step, idx, {"x": x, "y": y})
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                    observer.after_step(step)
                    step += 1
                if return_checkpoints and epoch in ckpt_epochs:
                    ckpts.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        model.eval()
        return (model, ckpts) if return_checkpoints else model

    def target(model: nn.Module, dataloader: Any) -> torch.Tensor:
        model.eval()
        out = []
        with torch.no_grad():
            for x, y in loader_batches(dataloader):
                out.append(F.cross_entropy(model(x), y, reduction="none"))
        return torch.cat(out).detach().to(torch.float64)

    def loss_sum(model: nn.Module, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")

    def make_loss_single(model: nn.Module) -> Any:
        def loss_single(params: dict, data: Any) -> torch.Tensor:
            x, y = data
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        return loss_single

    return Setting(
        name=name,
        train=train,
        test=test,
        make_model=make_model,
        train_func=train_func,
        target=target,
        loss_sum=loss_sum,
        make_loss_single=make_loss_single,
        batch_size=batch_size,
        checkpoint_epochs=ckpt_epochs,
        lr=hp["lr"],
        weight_decay=hp["wd"],
        model_spec={
            "module": "experiments.benchmark.quality.digits",
            "factory": hp["model"].__name__,
            "kwargs": {},
        },
        task_kind="classification",
        trajectory="adamw" if adamw else "sgd",
        config={
            "data": "sklearn load_digits, X/16, train=[0,1000), test=[1000,1500)",
            "model": hp["model"].__name__,
            "optimizer": f"{optimizer_class.__name__}(lr={hp['lr']}, weight_decay={hp['wd']})",
            "epochs": hp["epochs"],
            "batch_size": batch_size,
            "checkpoint_epochs": ckpt_epochs,
            "dtype": str(dtype),
        },
    )
