"""A 2-process gloo K-FAC / EK-FAC fit equals the single-process fit on all the data."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.distributed import expect_ok, init_group, run_ranks

pytestmark = pytest.mark.distributed

N, BATCH = 16, 4


def _data() -> tuple[nn.Module, list[dict], dict]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3)).double()
    x = torch.randn(N, 5, dtype=torch.float64)
    y = torch.randn(N, 3, dtype=torch.float64)
    batches = [{"x": x[i : i + BATCH], "y": y[i : i + BATCH]} for i in range(0, N, BATCH)]
    test = {
        "x": torch.randn(3, 5, dtype=torch.float64),
        "y": torch.randn(3, 3, dtype=torch.float64),
    }
    return model, batches, test


def _capture(model: nn.Module, batches: list[dict], callbacks: list) -> list:
    from dattri_llm import CaptureCallback, HookManager

    cap = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cap, *callbacks])
    with hm.collect():
        for b in batches:
            ((model(b["x"]) - b["y"]) ** 2).sum().backward()
    hm.remove()
    return cap.records


def _fit(records: list, callback_cov: object | None = None) -> tuple:
    from dattri_llm.gradient.kronecker import (
        KroneckerCovariances,
        eigendecompose,
        fit_eigenvalue_correction,
    )

    cov = callback_cov or KroneckerCovariances(non_kronecker="diagonal").accumulate(records)
    kfac = eigendecompose(cov, warn_skipped=False)
    return cov, kfac, fit_eigenvalue_correction(kfac, records)


def _worker(rank: int, world: int, workdir: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_group(rank, world, workdir)
    try:
        from dattri_llm.gradient.callbacks import KroneckerCovarianceCallback

        model, batches, _ = _data()
        mine = batches[rank::world]
        cb = KroneckerCovarianceCallback(non_kronecker="diagonal")
        records = _capture(model, mine, [cb])
        cov, kfac, ekfac = _fit(records)
        cov.save(os.path.join(out, f"cov{rank}"))
        kfac.save(os.path.join(out, f"kfac{rank}"))
        ekfac.save(os.path.join(out, f"ekfac{rank}"))
        _, _, ekfac_cb = _fit(records, cb.covariances)
        ekfac_cb.save(os.path.join(out, f"ekfac_cb{rank}"))
    finally:
        dist.destroy_process_group()


def test_two_process_fit_equals_single(tmp_path):
    from dattri_llm.gradient import Gradient, ops
    from dattri_llm.gradient.kronecker import KroneckerCovariances, KroneckerFactors

    expect_ok(run_ranks(_worker, 2, tmp_path / "ranks", str(tmp_path)))
    model, batches, test = _data()
    records = _capture(model, batches, [])
    cov, kfac, ekfac = _fit(records)
    train = Gradient.concatenate([r.gradient for r in records])
    test_g = _capture(model, [test], [])[0].gradient

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).abs().max() / y.abs().max())

    for rank in (0, 1):
        dcov = KroneckerCovariances.load(tmp_path / f"cov{rank}")
        for name, c in cov.layers.items():
            assert rel(dcov.layers[name].a_sum, c.a_sum) < 1e-12
            assert rel(dcov.layers[name].g_sum, c.g_sum) < 1e-12
            assert dcov.layers[name].num_samples == c.num_samples == N
        assert rel(dcov.diagonal["2"].sq_sum, cov.diagonal["2"].sq_sum) < 1e-12
        for stem, single in (("kfac", kfac), ("ekfac", ekfac), ("ekfac_cb", ekfac)):
            dfit = KroneckerFactors.load(tmp_path / f"{stem}{rank}")
            assert dfit.kind == single.kind and dfit.layer_names == single.layer_names
            for lam in (1e-3, 1.0):
                got = ops.cross_dot(dfit.precondition(test_g, lam), train)
                ref = ops.cross_dot(single.precondition(test_g, lam), train)
                assert rel(got, ref) < 1e-9
    # both ranks hold the very same basis (rank 0's eigenvectors are broadcast)
    f0, f1 = (KroneckerFactors.load(tmp_path / f"ekfac{r}") for r in (0, 1))
    for name in f0.layers:
        assert torch.equal(f0.layers[name].q_a, f1.layers[name].q_a)
        assert torch.equal(f0.layers[name].corrected, f1.layers[name].corrected)
