"""dattri 0.3.0's own attributors on the same reference checkpoints.

* TracIn / Grad-Dot / Grad-Cos: ``dattri.algorithm.TracInAttributor``. As shipped it projects
  every per-sample gradient to 512 dims (``DEFAULT_PROJECTOR_KWARGS``); the "unprojected" rows
  set ``projector_kwargs = None`` after construction (same maths as dattri_llm's Grad-Dot).
* TRAK-k: ``TRAKAttributor`` over k models each trained on a random half of the train set
  (seeds disjoint from the ground-truth seeds), projected to 512 dims.
* IF-explicit (digits-LR only: the explicit Hessian) with ``regularization = weight_decay``,
  the full train set in one batch (so it is the exact Hessian of the mean loss).
* IF-EKFAC: ``IFAttributorEKFAC`` on every ``nn.Linear``, damping swept.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.data import DataLoader, Subset

from experiments.benchmark.quality.methods import Context, Method, Skipped
from experiments.benchmark.quality.methods.reference import MAX_EXACT_PARAMS

TRAK_SEED = 777_000


def _task(ctx: Context, checkpoints: Any) -> Any:
    from dattri.task import AttributionTask

    model = ctx.model()
    make_target = ctx.setting.make_target_single
    return AttributionTask(
        loss_func=ctx.setting.make_loss_single(model),
        model=model,
        checkpoints=checkpoints,
        target_func=None if make_target is None else make_target(model),
    )


def _loaders(ctx: Context, bs: int = 100) -> tuple[DataLoader, DataLoader]:
    return (
        DataLoader(ctx.setting.train, batch_size=bs, shuffle=False),
        DataLoader(ctx.setting.test, batch_size=bs, shuffle=False),
    )


def tracin(normalized: bool = False, trajectory: bool = False, projected: bool = False) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm.tracin import DEFAULT_PROJECTOR_KWARGS, TracInAttributor

        ckpts = ctx.trajectory if trajectory else [ctx.final]
        weights = torch.tensor(
            ctx.setting.tracin_weights(len(ckpts)) if trajectory else [1.0] * len(ckpts)
        )
        attributor = TracInAttributor(
            _task(ctx, ckpts),
            weight_list=weights,
            normalized_grad=normalized,
            projector_kwargs=copy.deepcopy(DEFAULT_PROJECTOR_KWARGS),
        )
        if not projected:
            attributor.projector_kwargs = None
        train, test = _loaders(ctx)
        return attributor.attribute(train, test)

    return fn


def half_models(ctx: Context, k: int) -> list[dict]:
    """k models trained on random halves of the train set (cached on the context)."""
    have = ctx.extra.setdefault("half_models", [])
    n = len(ctx.setting.train)
    while len(have) < k:
        i = len(have)
        idx = np.random.default_rng(TRAK_SEED + i).choice(n, n // 2, replace=False)
        loader = DataLoader(
            Subset(ctx.setting.train, idx), batch_size=ctx.setting.batch_size, shuffle=True
        )
        model = ctx.setting.train_func(loader, seed=TRAK_SEED + i)
        have.append({key: v.detach().clone() for key, v in model.state_dict().items()})
    return have[:k]


def trak(k: int) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm.trak import TRAKAttributor

        ckpts = [ctx.final] if k == 0 else half_models(ctx, k)
        model = ctx.model()

        def correct_probability(params: dict, data: Any) -> torch.Tensor:
            x, y = data
            logits = functional_call(model, params, (x.unsqueeze(0),))
            return torch.exp(-F.cross_entropy(logits, y.unsqueeze(0)))

        attributor = TRAKAttributor(
            _task(ctx, ckpts),
            correct_probability_func=correct_probability,
            projector_kwargs={"proj_dim": 512, "device": "cpu"},
        )
        train, test = _loaders(ctx)
        attributor.cache(train)
        return attributor.attribute(test)

    return fn


def if_explicit(ctx: Context) -> torch.Tensor:
    from dattri.algorithm import IFAttributorExplicit

    n_params = sum(p.numel() for p in ctx.model().parameters())
    if n_params > MAX_EXACT_PARAMS:
        raise Skipped(f"{n_params} parameters: explicit Hessian too large")
    attributor = IFAttributorExplicit(
        _task(ctx, ctx.final), regularization=ctx.setting.weight_decay
    )
    full = DataLoader(ctx.setting.train, batch_size=len(ctx.setting.train), shuffle=False)
    attributor.cache(full)
    train, test = _loaders(ctx)
    return attributor.attribute(train, test)


def if_ekfac(damping: float) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm import IFAttributorEKFAC

        attributor = IFAttributorEKFAC(_task(ctx, ctx.final), damping=damping)
        train, test = _loaders(ctx)
        attributor.cache(train)
        return attributor.attribute(train, test)

    return fn


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    """dattri's rows; a language model gets the TracIn family only (TRAK's probability
    function and the explicit / EK-FAC IF setups here are written for classifiers)."""
    out = [
        Method("Grad-Dot (unprojected)", "dattri 0.3.0", tracin(), "projector disabled"),
        Method("Grad-Dot (as shipped, proj 512)", "dattri 0.3.0", tracin(projected=True)),
        Method("Grad-Cos (unprojected)", "dattri 0.3.0", tracin(normalized=True)),
        Method("TracIn (4 ckpts, unprojected)", "dattri 0.3.0", tracin(trajectory=True)),
    ]
    if not classifier:
        for m in out:
            m.quiet = True
        return out
    out += [
        Method("TRAK-1 (final model)", "dattri 0.3.0", trak(0), "proj 512"),
        Method(
            f"TRAK-{2 if quick else 5} (half-data models)",
            "dattri 0.3.0",
            trak(2 if quick else 5),
            "proj 512",
        ),
        Method("IF-explicit", "dattri 0.3.0", if_explicit, "regularization = weight decay"),
    ]
    for d in (1e-3,) if quick else (1e-4, 1e-3, 1e-2):
        out.append(Method(f"IF-EKFAC (damping={d})", "dattri 0.3.0", if_ekfac(d)))
    for m in out:
        m.quiet = True
    return out
