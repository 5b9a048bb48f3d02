"""The trajectory methods on projected stores.

* DVEmb with a learning-rate schedule and the empirical Fisher works in the projected space:
  its scores equal the product formula written out on the stored (projected) rows,
  ``q^T (prod_{k>t} (I - η_k sum_{i in B_k} s_i s_i^T)) η_t s_z`` (float64, ``1e-10``).
* What needs per-coordinate quantities is refused on a ``"dense"`` / ``"sparse"`` /
  ``"logra"`` store, naming the layers and the fix: AdamW-influence (Adam's moments), DVEmb
  with recorded dynamics (per-parameter hyper-parameters) or an ``ExactHessian``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    AdamWInfluenceAttributor,
    CaptureCallback,
    DVEmbAttributor,
    ExactHessian,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerStateCallback,
    ProjectionConfig,
    TrajectorySnapshots,
)
from tests.helpers.store import args

LR = 0.2
STEPS = 3
F64 = torch.float64


def projected(style: str) -> HookManagerConfig:
    if style == "logra":
        return HookManagerConfig(projection=ProjectionConfig("logra", proj_dim=4, seed=2))
    return HookManagerConfig(projection=ProjectionConfig(style, proj_dim=6, seed=2))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def train(tmp_path, cfg, adam=False, record=False, name="train"):
    """A short run (same seed, same data every call): store, records, dynamics, model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = (torch.optim.Adam if adam else torch.optim.SGD)(model.parameters(), lr=LR)
    cap = CaptureCallback(keep_all=True)
    cbs = [cap, OffloadCallback(file_manager=GradientStorageManager(tmp_path / name))]
    rec = OptimizerStateCallback(model, opt) if record else None
    hm = HookManager(model, cfg, callbacks=cbs + ([rec] if rec else []))
    g = torch.Generator().manual_seed(1)
    with hm.collect():
        for t in range(STEPS):
            batch = {
                "x": torch.randn(4, 4, generator=g, dtype=F64),
                "y": torch.randint(0, 3, (4,), generator=g),
            }
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
            if rec is not None:
                rec.record_post(t)
    hm.remove()
    return cap.records, (rec.dynamics() if rec else None), model


def queries(tmp_path, model, cfg) -> list:
    cap = CaptureCallback(keep_all=True)
    off = OffloadCallback(file_manager=GradientStorageManager(tmp_path / "q"))
    hm = HookManager(model, cfg, callbacks=[cap, off])
    g = torch.Generator().manual_seed(7)
    with hm.collect():
        model.zero_grad()
        x, y = torch.randn(2, 4, generator=g, dtype=F64), torch.randint(0, 3, (2,), generator=g)
        loss_fn(model, {"x": x, "y": y}).backward()
    hm.remove()
    return cap.records


def rows(record) -> torch.Tensor:
    return record.gradient.flatten()


@pytest.mark.parametrize("style", ["dense", "sparse", "logra"])
def test_dvemb_with_a_schedule_is_dvemb_in_the_projected_space(tmp_path, style):
    records, _, model = train(tmp_path, projected(style))
    (qrec,) = queries(tmp_path, model, projected(style))
    score = DVEmbAttributor(args(tmp_path), learning_rate=LR, loss_reduction="sum")
    got = score.attribute_from_cache(tmp_path / "train", tmp_path / "q")
    shares = [rows(r) for r in records]
    p = shares[0].shape[1]
    q = rows(qrec)
    want = []
    for t, s_t in enumerate(shares):
        emb = LR * s_t.T  # (P, B): each sample's removal push at step t
        for k in range(t + 1, STEPS):
            emb = (torch.eye(p, dtype=F64) - LR * shares[k].T @ shares[k]) @ emb
        want.append((q @ emb).T)
    want = torch.cat(want)
    assert got.scores.dtype == F64
    assert got.train_steps == [t for t in range(STEPS) for _ in range(4)]
    assert float((got.scores - want).norm() / want.norm()) <= 1e-10


def test_adamw_influence_on_a_mixing_projection_is_refused(tmp_path):
    _, dyn, model = train(tmp_path, HookManagerConfig(), adam=True, record=True, name="raw")
    train(tmp_path, projected("sparse"), adam=True)
    queries(tmp_path, model, projected("sparse"))
    att = AdamWInfluenceAttributor(args(tmp_path), dynamics=dyn, loss_reduction="sum")
    with pytest.raises(ValueError, match=r"projected.sparse.*Adam's moments.*'mask'"):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "q")


@pytest.mark.parametrize("style", ["dense", "logra"])
def test_dvemb_per_coordinate_quantities_on_a_mixing_projection_are_refused(tmp_path, style):
    _, dyn, model = train(tmp_path, HookManagerConfig(), record=True, name="raw")
    train(tmp_path, projected(style))
    queries(tmp_path, model, projected(style))
    att = DVEmbAttributor(args(tmp_path), loss_reduction="sum")
    with pytest.raises(ValueError, match=rf"projected.{style}.*hyper-parameters.*'mask'"):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "q", dynamics=dyn)
    hess = ExactHessian(model, TrajectorySnapshots(tmp_path / "snaps"), loss_fn)
    att = DVEmbAttributor(args(tmp_path), learning_rate=LR, loss_reduction="sum", curvature=hess)
    with pytest.raises(ValueError, match=rf"projected.{style}.*Hessian's entries.*'mask'"):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "q")
