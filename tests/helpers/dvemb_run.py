"""A recorded SGD run on the small MLP and DVEmb's explicit product formula over it.

Shared by the DVEmb, gradient-source, loss-reduction and TrackStar tests.
"""

from __future__ import annotations

import torch

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    OptimizerStateCallback,
    ParameterSnapshotCallback,
    TrajectorySnapshots,
)
from dattri_llm.attribution.dvemb import sampled_cross_entropy
from tests.helpers.trajectory import (
    DT,
    Hyper,
    capture_queries,
    make_mlp,
    record_mlp_run,
    rel_err,
    removal,
    shares,
)

SCHEDULE = [[0, 1, 2], [3, 4, 5], [6, 7, 0], [8, 9, 3]]


N, Q = 10, 3


LRS = [0.3, 0.25, 0.2, 0.2]


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 4, generator=g, dtype=DT)
    Y = torch.randint(0, 3, (N,), generator=g)
    XQ = torch.randn(Q, 4, generator=g, dtype=DT)
    YQ = torch.randint(0, 3, (Q,), generator=g)
    WX = torch.randn(25, 4, generator=g, dtype=DT)
    WY = torch.randint(0, 3, (25,), generator=g)
    return (X, Y, XQ, YQ), (WX, WY)


def args(tmp_path):
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


def make_run(
    tmp_path,
    opt_kw=None,
    lrs=LRS,
    warm: int = 0,
    reduction="sum",
    curvature_draws: int = 0,
    draws_as_micro_batches: bool = False,
    snapshots: bool = False,
    adam: bool = False,
    offload_kw: dict | None = None,
):
    opt_kw = dict(opt_kw or {})
    model = make_mlp(seed=2)
    if adam:
        opt = torch.optim.AdamW(model.parameters(), lr=lrs[0])
        hyper = Hyper("adam", 0.0)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lrs[0], **opt_kw)
        hyper = Hyper("sgd", 0.0, **opt_kw)
    (X, Y, XQ, YQ), (WX, WY) = data()
    snaps = TrajectorySnapshots(tmp_path / "traj") if snapshots else None
    curv = {"labels": []}

    def callbacks_for(m, o):
        store = GradientStorageManager(tmp_path / "train", fsync=False)
        rec = OptimizerStateCallback(m, o)
        cbs = [OffloadCallback(file_manager=store, **(offload_kw or {})), rec]
        if snaps is not None:
            cbs.append(ParameterSnapshotCallback(m, snaps))
        if curvature_draws:
            cstore = GradientStorageManager(tmp_path / "curv", fsync=False)
            acc = curvature_draws if draws_as_micro_batches else 1
            off = OffloadCallback(file_manager=cstore, gradient_accumulation_steps=acc)
            curv["hm"] = HookManager(m, callbacks=[off])
            curv["gen"] = torch.Generator().manual_seed(11)
        return cbs, {"rec": rec}

    def on_step(t, m, batch):
        if snaps is not None:
            snaps.save_batch(t, batch)
        if curvature_draws:
            # the Monte-Carlo Fisher capture: the loss at labels sampled from the model, each
            # sample repeated `curvature_draws` times (same identity, rows averaged)
            # (one batch with each row repeated, or one micro-batch per draw)
            hm, gen = curv["hm"], curv["gen"]
            if draws_as_micro_batches:
                parts = [batch["x"]] * curvature_draws
            else:
                parts = [batch["x"].repeat_interleave(curvature_draws, 0)]
            labels = []
            with hm.collect():
                for x in parts:
                    logits = m(x)
                    state = gen.get_state()
                    sampled_cross_entropy(logits, reduction=reduction, generator=gen).backward()
                    replay = torch.Generator().set_state(state)
                    probs = torch.softmax(logits.detach().double(), -1)
                    labels.append(torch.multinomial(probs, 1, generator=replay).squeeze(-1))
            curv["labels"].append(labels)
            m.zero_grad()

    run = record_mlp_run(
        model,
        opt,
        hyper,
        (X, Y, XQ, YQ),
        SCHEDULE,
        lrs,
        callbacks_for,
        reduction=reduction,
        warm=(WX, WY, warm) if warm else None,
        on_step=on_step,
    )
    if "hm" in curv:
        curv["hm"].remove()
    capture_queries(model, GradientStorageManager(tmp_path / "query", fsync=False), XQ, YQ)
    run.extra.update(dynamics=run.extra["rec"].dynamics(), snaps=snaps, labels=curv["labels"])
    run.extra["draws"] = curvature_draws
    return run


def occurrences(score, run) -> dict[tuple[int, int], torch.Tensor]:
    cols = [score.test_hashes.index(h) for h in run.qids]
    return {
        (run.ids.index(h), s): score.scores[i, cols]
        for i, (h, s) in enumerate(zip(score.train_hashes, score.train_steps))
    }


def compare(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    keys = sorted(ref)
    return rel_err(torch.stack([got[k] for k in keys]), torch.stack([ref[k] for k in keys]))


def product_formula(run, curvature=None):
    """``{(z, t): e_t(z)}`` by the paper's product formula with explicit P×P matrices."""
    T = len(run.schedule)
    P = run.flat.P
    I = torch.eye(P, dtype=DT)
    kap = [float(len(ix)) if run.reduction == "mean" else 1.0 for ix in run.schedule]
    H = []
    for k in range(T):
        V = shares(run, k) if curvature is None else curvature[k]
        H.append(kap[k] * V.T @ V)
    emb = {}
    for t, idx in enumerate(run.schedule):
        S = removal(run, shares(run, t))
        for i, z in enumerate(idx):
            e = run.lrs[t] * S[i]
            for k in range(t + 1, T):
                e = (I - run.lrs[k] * H[k]) @ e
            emb[(z, t)] = e
    return emb


def scores_of(emb: dict, q: torch.Tensor) -> dict:
    return {k: q @ e for k, e in emb.items()}
