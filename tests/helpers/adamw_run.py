"""A recorded AdamW run on the small MLP and the AdamW-influence oracles read from it.

Shared by the AdamW-influence, loss-reduction and scoring tests.
"""

from __future__ import annotations

import torch

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    GradientStorageManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
    ParameterSnapshotCallback,
    TrajectorySnapshots,
)
from tests.helpers.trajectory import (
    DT,
    Hyper,
    capture_queries,
    make_mlp,
    record_mlp_run,
    rel_err,
)

SCHEDULE = [[0, 1, 2], [3, 4, 5], [6, 7, 0], [8, 9, 3]]


N, Q = 10, 3


CONFIGS = {
    "adamw": (
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1),
        Hyper("adam", 0.0, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, decoupled=True),
    ),
    "adam_coupled_wd": (
        lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.85, 0.9), eps=1e-5, weight_decay=0.05),
        Hyper("adam", 0.0, beta1=0.85, beta2=0.9, eps=1e-5, weight_decay=0.05, decoupled=False),
    ),
    "adamw_amsgrad": (
        lambda ps: torch.optim.AdamW(
            ps, lr=1e-3, betas=(0.7, 0.9), eps=1e-6, weight_decay=0.05, amsgrad=True
        ),
        Hyper("adam", 0.0, beta1=0.7, beta2=0.9, eps=1e-6, weight_decay=0.05, amsgrad=True),
    ),
}


SMALL_LRS = [2e-3, 1.5e-3, 1.5e-3, 1e-3]


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 4, generator=g, dtype=DT)
    Y = torch.randint(0, 3, (N,), generator=g)
    XQ = torch.randn(Q, 4, generator=g, dtype=DT)
    YQ = torch.randint(0, 3, (Q,), generator=g)
    WX = torch.randn(25, 4, generator=g, dtype=DT)
    WY = torch.randint(0, 3, (25,), generator=g)
    return (X, Y, XQ, YQ), (WX, WY, 40)  # a long warm-up: mature moments


def args(tmp_path):
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


def make_run(
    tmp_path,
    name: str,
    lrs=SMALL_LRS,
    reduction="sum",
    clip_factors=None,
    config: HookManagerConfig | None = None,
    snapshots: bool = False,
    offload_kw: dict | None = None,
):
    factory, hyper = CONFIGS[name]
    model = make_mlp(seed=1)
    opt = factory(model.parameters())
    (X, Y, XQ, YQ), warm = data()
    snaps = TrajectorySnapshots(tmp_path / "traj") if snapshots else None

    def callbacks_for(m, o):
        store = GradientStorageManager(tmp_path / "train", fsync=False)
        rec = OptimizerStateCallback(m, o)
        cbs = [OffloadCallback(file_manager=store, **(offload_kw or {})), rec]
        if snaps is not None:
            cbs.append(ParameterSnapshotCallback(m, snaps))
        return cbs, {"rec": rec}

    def on_step(t, m, batch):
        if snaps is not None:
            snaps.save_batch(t, batch)

    run = record_mlp_run(
        model,
        opt,
        hyper,
        (X, Y, XQ, YQ),
        SCHEDULE,
        lrs,
        callbacks_for,
        manager_kw={"config": config} if config is not None else None,
        reduction=reduction,
        clip_factors=clip_factors,
        warm=warm,
        on_step=on_step,
    )
    capture_queries(
        model,
        GradientStorageManager(tmp_path / "query", fsync=False),
        XQ,
        YQ,
        **({"config": config} if config is not None else {}),
    )
    run.extra["dynamics"] = run.extra["rec"].dynamics()
    run.extra["snaps"] = snaps
    return run


def library(run, tmp_path, **kw):
    att = AdamWInfluenceAttributor(args(tmp_path), loss_reduction=run.reduction, **kw)
    return att.attribute_from_cache(
        tmp_path / "train", tmp_path / "query", dynamics=run.extra["dynamics"]
    )


def occurrences(score, run) -> dict[tuple[int, int], torch.Tensor]:
    """``{(sample index, step): (Q,)}`` in the query order of ``run.qids``."""
    cols = [score.test_hashes.index(h) for h in run.qids]
    out = {}
    for i, (h, s) in enumerate(zip(score.train_hashes, score.train_steps)):
        out[(run.ids.index(h), s)] = score.scores[i, cols]
    return out


def compare_occurrences(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    keys = sorted(ref)
    return rel_err(torch.stack([got[k] for k in keys]), torch.stack([ref[k] for k in keys]))
