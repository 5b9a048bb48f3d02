"""``ExactHessian``: the Hessian-vector products equal the explicit Hessian's block.

On a model with an embedding, a LayerNorm, linears and a head tied to the embedding, the
operator applied to the identity equals the explicit (``torch.autograd.functional.hessian``)
Hessian of the recorded step's batch loss at the recorded parameters, restricted to the captured
coordinates — all of them, or a ``"mask"`` projection's.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from dattri_llm import (
    REGISTER_ALL,
    HookManagerConfig,
    ParameterSnapshotCallback,
    ProjectionConfig,
    TrajectorySnapshots,
)
from dattri_llm.attribution.trajectory.curvature import ExactHessian
from dattri_llm.gradient.hooks import HookManager
from tests.helpers.trajectory import DT, lm_batch, lm_sample_losses, make_lm


def loss(model, batch):
    ids = batch["input_ids"]
    return lm_sample_losses(model(ids), ids).sum()


@pytest.mark.parametrize("projection", [None, ProjectionConfig("mask", proj_dim=7, seed=3)])
def test_operator_equals_the_explicit_hessian_block(tmp_path, projection):
    model = make_lm()
    config = HookManagerConfig(linear_io=REGISTER_ALL, projection=projection)
    snaps = TrajectorySnapshots(tmp_path / "traj")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hm = HookManager(model, config, [ParameterSnapshotCallback(model, snaps)])
    with hm.collect(deregister_on_exit=True):
        for step in range(2):
            batch = lm_batch(3, seed=10 + step)
            snaps.save_batch(step, batch)
            opt.zero_grad()
            loss(model, batch).backward()
            opt.step()
    hessian = ExactHessian(model, snaps, loss, config)
    layouts = hessian.layouts()
    layers = list(layouts)
    op = hessian.operator(1, layers, DT, "cpu")
    width = sum(layouts[n].num_coords for n in layers)
    got = op(torch.eye(width, dtype=DT))
    # explicit: the Hessian over every parameter, then its captured block
    theta, _ = snaps.load_parameters(1)
    batch = snaps.load_batch(1)
    names = [n for n, _ in model.named_parameters()]
    sizes = [theta[n].numel() for n in names]

    def f(flat):
        params = dict(
            zip(names, (t.reshape(theta[n].shape) for n, t in zip(names, flat.split(sizes))))
        )
        ids = batch["input_ids"]
        return lm_sample_losses(functional_call(model, params, (ids,)), ids).sum()

    full = torch.autograd.functional.hessian(f, torch.cat([theta[n].reshape(-1) for n in names]))
    offsets = dict(zip(names, torch.tensor([0, *sizes]).cumsum(0).tolist()))
    by_id = {id(p): n for n, p in model.named_parameters()}
    index = []
    for n in layers:
        lay = layouts[n]
        where = {
            pn: (torch.arange(p.numel()).reshape(p.shape) + offsets[by_id[id(p)]]).to(DT)
            for pn, p in lay.params
        }
        index.append(lay.gather(where).long())
    index = torch.cat(index)
    ref = full[index][:, index]
    assert torch.allclose(got, ref, rtol=0, atol=1e-12 * float(ref.abs().max()))
    assert float(ref.abs().max()) > 0


def test_refuses_dropout(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.1), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="dropout"):
        ExactHessian(model, tmp_path / "traj", lambda m, b: m(b).sum())
