"""A 2-process gloo K-FAC / EK-FAC fit of a fused-expert layer equals the single-process fit.

Exercises the per-expert accumulators under ``torch.distributed`` (``A_e``, ``G_e``, the
per-expert slot counts, EK-FAC eigenvalues): each rank sees half of the samples, and an expert
that only one rank's samples reach must still be fitted alike on both.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import expect_ok, init_group, run_ranks

pytestmark = pytest.mark.distributed


def _data() -> list:
    from dattri_llm.gradient.gradient import Gradient
    from tests.helpers.moe import synthetic

    # rank 0's samples reach experts 0-2 only, rank 1's experts 1-3
    ids = [torch.randint(0, 3, (4, 5), generator=torch.Generator().manual_seed(0))]
    ids.append(torch.randint(1, 4, (4, 5), generator=torch.Generator().manual_seed(1)))
    return [Gradient({"x": synthetic(i, seed=r)}) for r, i in enumerate(ids)]


def _fit(grads: list) -> tuple:
    from dattri_llm.gradient.kronecker import (
        KroneckerCovariances,
        eigendecompose,
        fit_eigenvalue_correction,
    )

    cov = KroneckerCovariances().accumulate(grads)
    kfac = eigendecompose(cov, warn_skipped=False)
    return cov, kfac, fit_eigenvalue_correction(kfac, grads)


def _worker(rank: int, world: int, workdir: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_group(rank, world, workdir)
    try:
        cov, kfac, ekfac = _fit([_data()[rank]])
        cov.save(os.path.join(out, f"cov{rank}"))
        kfac.save(os.path.join(out, f"kfac{rank}"))
        ekfac.save(os.path.join(out, f"ekfac{rank}"))
    finally:
        dist.destroy_process_group()


def test_two_process_expert_fit_equals_single(tmp_path) -> None:
    from dattri_llm.gradient.kronecker import KroneckerCovariances, KroneckerFactors
    from tests.helpers.reference import rel_err

    expect_ok(run_ranks(_worker, 2, tmp_path / "ranks", str(tmp_path)))
    grads = _data()
    cov, kfac, ekfac = _fit(grads)
    test = grads[1]
    single = cov.layers["x"]
    assert single.block_tokens.tolist()[0] > 0 and single.block_tokens.tolist()[3] > 0
    for rank in (0, 1):
        got = KroneckerCovariances.load(tmp_path / f"cov{rank}").layers["x"]
        assert rel_err(got.a_sum, single.a_sum) < 1e-12
        assert rel_err(got.g_sum, single.g_sum) < 1e-12
        assert torch.equal(got.block_tokens, single.block_tokens)
        assert got.num_samples == single.num_samples == 8
        for stem, fit in (("kfac", kfac), ("ekfac", ekfac)):
            dfit = KroneckerFactors.load(tmp_path / f"{stem}{rank}")
            for lam in (1e-3, 1.0):
                x = dfit.precondition(test, lam).layers["x"].data
                y = fit.precondition(test, lam).layers["x"].data
                assert rel_err(x, y) < 1e-10
