"""K-FAC / EK-FAC per expert on fused MoE expert layers, against the formulas written out.

Each expert is preconditioned with its own ``(G_e ⊗ A_e + λ I)^{-1}`` (K-FAC) or its own
eigenbasis with corrected eigenvalues (EK-FAC), both built here from explicit loops over the
routed slots and explicit ``torch.kron`` matrices; per-sample gradients come from one backward
pass per sample. Models as in ``tests/gradient/layers/test_moe.py`` (float64, eager experts).
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import HookManager, HookManagerConfig
from dattri_llm.gradient.callbacks import CaptureCallback, KroneckerCovarianceCallback
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.kronecker import (
    KroneckerCovariances,
    KroneckerFactors,
    eigendecompose,
    fit_eigenvalue_correction,
)
from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.layers.moe import split_expert_factor
from tests.helpers.moe import E, V, build, loss_fn, synthetic
from tests.helpers.reference import per_sample_loop_grads, rel_err

TOL = 1e-10
EXPERTS = HookManagerConfig(linear_io=[r".*\.experts"])


def _capture(model, x, callbacks=(), capture_style="factorized"):
    cb = CaptureCallback(keep_all=True)
    cfg = HookManagerConfig(linear_io=[r".*\.experts"], capture_style=capture_style)
    hm = HookManager(model, cfg, callbacks=[cb, *callbacks])
    with hm.collect():
        loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    return cb.records[0].gradient


def _matrix_form(grads: dict, name: str, kw: dict) -> torch.Tensor:
    """``(B, E, K, D')`` per-expert matrices ``[W_e | b_e]`` from loop gradients."""
    w = grads[name]
    if kw["transposed"]:
        w = w.transpose(-1, -2)
    if kw.get("bias"):
        w = torch.cat([w, grads[f"{name}_bias"].unsqueeze(-1)], -1)
    return w


def _explicit_covariances(lg, n: int) -> tuple[list, list]:
    """``A_e`` (mean over expert e's slots with g a^T != 0) and ``G_e`` (sum / N), by loops."""
    feat, ids = split_expert_factor(lg.a, lg.module_kwargs)
    k, d = lg.g.shape[-1], feat.shape[-1]
    a_list, g_list = [], []
    for e in range(E):
        a_e = torch.zeros(d, d, dtype=torch.float64)
        g_e = torch.zeros(k, k, dtype=torch.float64)
        count = 0
        for b in range(ids.shape[0]):
            for s in range(ids.shape[1]):
                f, g = feat[b, s], lg.g[b, s]
                if ids[b, s] == e and f.abs().sum() > 0 and g.abs().sum() > 0:
                    a_e += torch.outer(f, f)
                    g_e += torch.outer(g, g)
                    count += 1
        a_list.append(a_e / max(count, 1))
        g_list.append(g_e / n)
    return a_list, g_list


def _explicit_preconditioners(a_list, g_list, train_m, kind: str, lam: float) -> list:
    """Per expert, the dense ``(K D', K D')`` damped inverse of K-FAC or EK-FAC."""
    out = []
    for e, (a_e, g_e) in enumerate(zip(a_list, g_list)):
        if kind == "kfac":
            f = torch.kron(g_e, a_e)
            out.append(torch.linalg.inv(f + lam * torch.eye(f.shape[0], dtype=f.dtype)))
            continue
        _, q_a = torch.linalg.eigh(a_e)
        _, q_g = torch.linalg.eigh(g_e)
        q = torch.kron(q_g, q_a)
        m = train_m[:, e].reshape(train_m.shape[0], -1)  # vec(M_{n,e}), row-major
        corrected = (m @ q).pow(2).mean(0)
        out.append(q @ torch.diag(1.0 / (corrected + lam)) @ q.T)
    return out


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_expert_kfac_ekfac_scores_vs_explicit_kron(family: str, kind: str) -> None:
    model = build(family, seed=2)
    gen = torch.Generator().manual_seed(3)
    x_train, x_test = torch.randint(0, V, (5, 5), generator=gen), torch.randint(0, V, (2, 5))
    train, test = _capture(model, x_train), _capture(model, x_test)
    fit = eigendecompose(KroneckerCovariances().accumulate([train]), warn_skipped=False)
    if kind == "ekfac":
        fit = fit_eigenvalue_correction(fit, [train])
    lam = 1e-2
    pre = fit.precondition(test, damping=lam)
    g_train = per_sample_loop_grads(model, loss_fn, x_train)
    g_test = per_sample_loop_grads(model, loss_fn, x_test)
    got = torch.zeros(2, 5, dtype=torch.float64)
    want = torch.zeros(2, 5, dtype=torch.float64)
    assert len(train.layers) == 4
    for name, lg in train.layers.items():
        kw = lg.module_kwargs
        m_train, m_test = _matrix_form(g_train, name, kw), _matrix_form(g_test, name, kw)
        got += pre.layers[name].data @ m_train.reshape(5, -1).T
        a_list, g_list = _explicit_covariances(lg, 5)
        for e, p in enumerate(_explicit_preconditioners(a_list, g_list, m_train, kind, lam)):
            want += m_test[:, e].reshape(2, -1) @ p @ m_train[:, e].reshape(5, -1).T
    assert rel_err(got, want) < TOL


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_unreached_expert_is_damping_only_and_fits_round_trip(kind: str, tmp_path) -> None:
    """Expert 3 gets no slot in the fit data: A_3 = G_3 = 0, so its block is M_3 / λ."""
    train_lg = synthetic(torch.randint(0, 3, (6, 4)), seed=0)
    test_lg = synthetic(torch.tensor([[3, 3, 0, 1], [2, 3, 1, 0]]), seed=1)
    train, test = Gradient({"x": train_lg}), Gradient({"x": test_lg})
    covs = KroneckerCovariances().accumulate([train])
    assert covs.layers["x"].block_tokens.tolist()[3] == 0.0
    covs.save(tmp_path / "cov")
    back = KroneckerCovariances.load(tmp_path / "cov")
    for key in ("a_sum", "g_sum", "block_tokens"):
        assert torch.equal(getattr(back.layers["x"], key), getattr(covs.layers["x"], key))
    fit = eigendecompose(back, warn_skipped=False)
    if kind == "ekfac":
        fit = fit_eigenvalue_correction(fit, [train])
        # the dense route (materialised gradients) equals the per-slot rotation of the factors
        dense = fit_eigenvalue_correction(fit, [Gradient({"x": train_lg.materialize()})])
        assert rel_err(dense.layers["x"].corrected, fit.layers["x"].corrected) < TOL
    fit.save(tmp_path / "fit")
    loaded = KroneckerFactors.load(tmp_path / "fit")
    rule = get_rule("moe.experts")
    kw = train_lg.module_kwargs
    m_train = rule.materialize(train_lg.a, train_lg.g, kw).reshape(6, 4, 2, 3)
    m_test = rule.materialize(test_lg.a, test_lg.g, kw).reshape(2, 4, 2, 3)
    a_list, g_list = _explicit_covariances(train_lg, 6)
    assert float(a_list[3].abs().max()) == 0 and float(g_list[3].abs().max()) == 0
    for relative in (False, True):
        lam = 0.1
        if relative:  # λ = damping x the mean eigenvalue of the whole layer (every expert)
            lam = 0.1 * float(fit.layers["x"].eigenvalues().mean())
        p = _explicit_preconditioners(a_list, g_list, m_train, kind, lam)
        want = torch.stack([m_test[:, e].reshape(2, -1) @ p[e] for e in range(4)], 1)
        for f, q in ((fit, test), (loaded, test), (fit, Gradient({"x": test_lg.materialize()}))):
            got = f.precondition(q, damping=0.1, relative=relative).layers["x"].data
            assert rel_err(got, want.reshape(2, -1)) < TOL
            block3 = got.reshape(2, 4, 2, 3)[:, 3]
            assert rel_err(block3, m_test[:, 3] / lam) < TOL  # damping only
    with pytest.raises(ValueError, match="singular"):
        fit.precondition(test, damping=0.0)


@pytest.mark.parametrize("style", ["factorized", "materialized"])
def test_covariance_callback_equals_store_covariances(style: str) -> None:
    model = build("mixtral", seed=4)
    x = torch.randint(0, V, (4, 5), generator=torch.Generator().manual_seed(5))
    cb = KroneckerCovarianceCallback()
    _capture(model, x, callbacks=[cb], capture_style=style)
    ref = KroneckerCovariances().accumulate([_capture(model, x)])
    assert set(cb.covariances.layers) == set(ref.layers) and len(ref.layers) == 4
    for name, c in ref.layers.items():
        got = cb.covariances.layers[name]
        assert rel_err(got.a_sum, c.a_sum) < 1e-12 and rel_err(got.g_sum, c.g_sum) < 1e-12
        assert torch.equal(got.block_tokens, c.block_tokens)
        assert (got.num_tokens, got.num_samples) == (c.num_tokens, c.num_samples)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_attributor_store_and_callback_fits_vs_explicit(kind: str, tmp_path) -> None:
    """K-FAC / EK-FAC attributors end to end (store fit, then a callback's covariances)."""
    from dattri_llm import (
        AttributionArguments,
        AttributionTask,
        EKFACAttributor,
        KFACAttributor,
    )

    model = build("qwen3_moe", seed=6)
    gen = torch.Generator().manual_seed(1)
    train = [{"input_ids": torch.randint(0, V, (4,), generator=gen)} for _ in range(4)]
    test = [{"input_ids": torch.randint(0, V, (4,), generator=gen)} for _ in range(2)]
    cls = KFACAttributor if kind == "kfac" else EKFACAttributor
    task = AttributionTask(lambda m, b: loss_fn(m, b["input_ids"]), model)
    lam = 1e-2

    def run(sub: str, **kwargs):
        args = AttributionArguments(
            output_dir=str(tmp_path / sub), use_cpu=True, show_progress=False
        )
        att = cls(args, task=task)
        out = att.attribute(train, test, hook_config=EXPERTS, damping=lam, relative=False, **kwargs)
        return out.query(train, test)

    got = run("store")
    x_train = torch.stack([d["input_ids"] for d in train])
    lg = _capture(model, x_train)
    cb = KroneckerCovarianceCallback()
    _capture(model, x_train, callbacks=[cb])
    assert rel_err(run("callback", covariances=cb), got) < TOL

    g_train = per_sample_loop_grads(model, loss_fn, x_train)
    g_test = per_sample_loop_grads(model, loss_fn, torch.stack([d["input_ids"] for d in test]))
    want = torch.zeros(4, 2, dtype=torch.float64)
    for name, layer in lg.layers.items():
        kw = layer.module_kwargs
        m_train, m_test = _matrix_form(g_train, name, kw), _matrix_form(g_test, name, kw)
        a_list, g_list = _explicit_covariances(layer, 4)
        for e, p in enumerate(_explicit_preconditioners(a_list, g_list, m_train, kind, lam)):
            want += m_train[:, e].reshape(4, -1) @ p @ m_test[:, e].reshape(2, -1).T
    assert rel_err(got, want) < TOL


def test_mixed_covariances_mix_per_expert_means() -> None:
    """``mix``: every per-expert mean is ``(1 - m)`` train ``+ m`` query (an empty one is 0)."""
    from dattri_llm.attribution.kronecker.mixture import mixed_covariances

    train_lg = synthetic(torch.randint(0, 3, (6, 4)), seed=2)
    query_lg = synthetic(torch.randint(1, 4, (3, 4)), seed=3)
    a_t, g_t = _explicit_covariances(train_lg, 6)
    a_q, g_q = _explicit_covariances(query_lg, 3)
    train = KroneckerCovariances().accumulate([Gradient({"x": train_lg})])
    query = KroneckerCovariances().accumulate([Gradient({"x": query_lg})])
    mixed = mixed_covariances(train, query, 0.25).layers["x"]
    for e in range(4):
        assert rel_err(mixed.a_mean()[e], 0.75 * a_t[e] + 0.25 * a_q[e]) < TOL
        assert rel_err(mixed.g_sum[e] / mixed.num_samples, 0.75 * g_t[e] + 0.25 * g_q[e]) < TOL
