"""K-FAC / EK-FAC maths against explicit oracles (``torch.kron`` + dense solves), float64."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Factorized, Gradient, ops
from dattri_llm.gradient.callbacks import KroneckerCovarianceCallback
from dattri_llm.gradient.kronecker import (
    KroneckerCovariances,
    KroneckerFactors,
    eigendecompose,
    fit_eigenvalue_correction,
)
from dattri_llm.gradient.sources import InMemoryGradientSource
from tests.helpers.kronecker import dense_scores, ekfac_fisher, io_oracle, kfac_ag, matrix_form
from tests.helpers.reference import assert_same_formula, per_sample_grads, rel_err

TOL = 1e-8


# ---- models and oracles ------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, seq: bool = False) -> None:
        super().__init__()
        self.seq = seq
        self.fc1 = nn.Linear(5, 6)
        self.fc2 = nn.Linear(6, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def mlp_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


def capture(model, loss_fn, batches, callbacks=(), **cfg):
    cap = CaptureCallback(keep_all=True)
    hm = HookManager(model, config=HookManagerConfig(**cfg), callbacks=[cap, *callbacks])
    with hm.collect():
        for batch in batches:
            model.zero_grad()
            loss_fn(model, batch).backward()
    hm.remove()
    return cap.records


def ours(records, kind, test_records=None, damping=1e-3, relative=False, **kw):
    cov = KroneckerCovariances(**kw).accumulate(InMemoryGradientSource(records))
    fit = eigendecompose(cov, warn_skipped=False)
    if kind == "ekfac":
        fit = fit_eigenvalue_correction(fit, InMemoryGradientSource(records))
    train = Gradient.concatenate([r.gradient for r in records])
    test = Gradient.concatenate([r.gradient for r in (test_records or records)])
    pre = fit.precondition(test, damping=damping, relative=relative)
    return fit, ops.cross_dot(pre, train.select_layers(pre.layer_names)), pre, train


@pytest.fixture
def mlp_setup():
    torch.set_default_dtype(torch.float64)
    model = MLP()
    n = 12
    x, y = torch.randn(n, 5), torch.randn(n, 3)
    batches = [{"x": x[i : i + 4], "y": y[i : i + 4]} for i in range(0, n, 4)]
    tx, ty = torch.randn(3, 5), torch.randn(3, 3)
    yield model, {"x": x, "y": y}, batches, [{"x": tx, "y": ty}]
    torch.set_default_dtype(torch.float32)


def mlp_oracle(model, full, test):
    rows = [{"x": full["x"][i : i + 1], "y": full["y"][i : i + 1]} for i in range(len(full["x"]))]
    ps = per_sample_grads(model, mlp_loss, full)
    pt = per_sample_grads(model, mlp_loss, test)
    out = {}
    for name, bias in (("fc1", "fc1.bias"), ("fc2", None)):
        a, g = kfac_ag(io_oracle(model, mlp_loss, rows, getattr(model, name)))
        out[name] = (
            a,
            g,
            matrix_form(ps, f"{name}.weight", bias),
            matrix_form(pt, f"{name}.weight", bias),
        )
    return out


# ---- tests -------------------------------------------------------------------------------------
def test_kfac_mlp_matches_kron_oracle(mlp_setup):
    model, full, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    orc = mlp_oracle(model, full, test[0])
    for lam in (1e-3, 0.5):
        _, score, _, _ = ours(records, "kfac", test_rec, damping=lam)
        ref = sum(dense_scores(torch.kron(g, a), te, tr, lam) for a, g, tr, te in orc.values())
        assert rel_err(score, ref) < TOL
    # the ordering is G ⊗ A for the row-major vec; A ⊗ G must give different numbers
    wrong = sum(dense_scores(torch.kron(a, g), te, tr, 1e-3) for a, g, tr, te in orc.values())
    assert rel_err(wrong, ref) > 1e-3


def test_ekfac_mlp_matches_eigenbasis_oracle(mlp_setup):
    model, full, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    orc = mlp_oracle(model, full, test[0])
    fit, score, _, _ = ours(records, "ekfac", test_rec, damping=1e-2)
    ref = sum(dense_scores(ekfac_fisher(a, g, tr), te, tr, 1e-2) for a, g, tr, te in orc.values())
    assert rel_err(score, ref) < TOL
    # relative damping: lambda = damping * mean eigenvalue of F̂, per layer
    _, score_rel, _, _ = ours(records, "ekfac", test_rec, damping=0.1, relative=True)
    ref_rel = 0
    for a, g, tr, te in orc.values():
        fisher = ekfac_fisher(a, g, tr)
        ref_rel = ref_rel + dense_scores(
            fisher, te, tr, 0.1 * float(torch.trace(fisher)) / fisher.shape[0]
        )
    assert rel_err(score_rel, ref_rel) < TOL
    assert fit.kind == "ekfac"


def test_kfac_relative_damping(mlp_setup):
    model, full, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    orc = mlp_oracle(model, full, test[0])
    _, score, _, _ = ours(records, "kfac", test_rec, damping=0.3, relative=True)
    ref = 0
    for a, g, tr, te in orc.values():
        fisher = torch.kron(g, a)
        ref = ref + dense_scores(fisher, te, tr, 0.3 * float(torch.trace(fisher)) / len(fisher))
    assert rel_err(score, ref) < TOL


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_sign_flip_invariance(mlp_setup, kind):
    model, _, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    fit, score, _, _ = ours(records, "kfac", test_rec)
    for eig in fit.layers.values():
        eig.q_a = eig.q_a * torch.where(torch.rand(eig.q_a.shape[1]) < 0.5, -1.0, 1.0)
        eig.q_g = eig.q_g * torch.where(torch.rand(eig.q_g.shape[1]) < 0.5, -1.0, 1.0)
    if kind == "ekfac":
        ref_fit = fit_eigenvalue_correction(
            eigendecompose(KroneckerCovariances().accumulate(records), warn_skipped=False), records
        )
        fit = fit_eigenvalue_correction(fit, records)
        assert torch.allclose(
            fit.layers["fc1"].corrected, ref_fit.layers["fc1"].corrected, rtol=1e-12, atol=0
        )
        _, score, _, _ = ours(records, "ekfac", test_rec)
    train = Gradient.concatenate([r.gradient for r in records])
    test_g = test_rec[0].gradient
    flipped = ops.cross_dot(fit.precondition(test_g, 1e-3), train)
    assert rel_err(flipped, score) < 1e-10


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_heavy_damping_tends_to_grad_dot(mlp_setup, kind):
    model, _, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    lam = 1e9
    _, score, _, train = ours(records, kind, test_rec, damping=lam)
    grad_dot = ops.cross_dot(test_rec[0].gradient, train)
    assert rel_err(score * lam, grad_dot) < 1e-6


def test_callback_equals_source_fit(mlp_setup):
    model, _, batches, _ = mlp_setup
    for style in ("factorized", "materialized"):
        cb = KroneckerCovarianceCallback()
        records = capture(model, mlp_loss, batches, callbacks=[cb], capture_style=style)
        ref = KroneckerCovariances().accumulate(capture(model, mlp_loss, batches))
        assert set(cb.covariances.layers) == {"fc1", "fc2"}
        for name, c in ref.layers.items():
            got = cb.covariances.layers[name]
            assert rel_err(got.a_sum, c.a_sum) < 1e-12 and rel_err(got.g_sum, c.g_sum) < 1e-12
            assert (got.num_tokens, got.num_samples) == (c.num_tokens, c.num_samples) == (12, 12)
        if style == "materialized":
            with pytest.raises(ValueError, match="materialized, so its K-FAC factors are gone"):
                KroneckerCovariances().accumulate(records)


def test_save_load_roundtrip(mlp_setup, tmp_path):
    model, _, batches, test = mlp_setup
    records, test_rec = capture(model, mlp_loss, batches), capture(model, mlp_loss, test)
    for kind in ("kfac", "ekfac"):
        fit, score, _, train = ours(records, kind, test_rec)
        fit.save(tmp_path / kind)
        back = KroneckerFactors.load(tmp_path / kind)
        assert back.kind == kind and back.layer_names == fit.layer_names
        for name, e in fit.layers.items():
            for key in ("q_a", "s_a", "q_g", "s_g", "corrected"):
                x, y = getattr(e, key), getattr(back.layers[name], key)
                assert (x is None and y is None) or torch.equal(x, y)
        again = ops.cross_dot(back.precondition(test_rec[0].gradient, 1e-3), train)
        assert_same_formula(again, score)
    cov = KroneckerCovariances().accumulate(records)
    cov.save(tmp_path / "cov")
    cov2 = KroneckerCovariances.load(tmp_path / "cov")
    assert torch.equal(cov2.layers["fc1"].a_sum, cov.layers["fc1"].a_sum)
    # validation: version and shapes
    meta_path = tmp_path / "kfac" / "kronecker_factors.json"
    meta = json.loads(meta_path.read_text())
    meta["version"] = 99
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="version 99"):
        KroneckerFactors.load(tmp_path / "kfac")
    meta["version"] = 1
    meta["layers"]["fc1"]["module_kwargs"]["in_features"] = 7
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shape"):
        KroneckerFactors.load(tmp_path / "kfac")
    assert not any(p.suffix in (".pt", ".pkl") for p in tmp_path.rglob("*"))
    assert os.path.exists(tmp_path / "kfac" / "kronecker_factors.safetensors")


def test_layer_mismatch_and_damping_errors(mlp_setup):
    model, _, batches, _ = mlp_setup
    records = capture(model, mlp_loss, batches)
    fit, *_ = ours(records, "kfac")
    g = records[0].gradient
    with pytest.raises(ValueError, match="fitted but absent"):
        fit.precondition(g.select_layers(["fc1"]))
    with pytest.raises(ValueError, match="damping"):
        fit.precondition(g, damping=-1.0)


def test_token_granularity_sums_to_sample_scores():
    torch.set_default_dtype(torch.float64)
    try:
        model = MLP()
        x, y = torch.randn(6, 4, 5), torch.randn(6, 4, 3)
        records = capture(model, mlp_loss, [{"x": x, "y": y}])
        fit, score, pre, train = ours(records, "ekfac")
        per_tok = ops.cross_dot_per_token(train, pre)  # (B_train, T, B_test)
        assert per_tok.shape == (6, 4, 6)
        assert rel_err(per_tok.sum(1), score.T) < 1e-12
    finally:
        torch.set_default_dtype(torch.float32)


def test_padding_tokens_are_not_counted():
    torch.set_default_dtype(torch.float64)
    try:
        kw = {"in_features": 3, "out_features": 2, "bias": False}
        short = Factorized(torch.randn(2, 3, 3), torch.randn(2, 3, 2), "nn.Linear", kw)
        long = Factorized(torch.randn(2, 5, 3), torch.randn(2, 5, 2), "nn.Linear", kw)
        joined = Gradient.concatenate([Gradient({"l": short}), Gradient({"l": long})])
        cov = KroneckerCovariances().accumulate([joined]).layers["l"]
        a_ref = sum(torch.einsum("btd,bte->de", f.a, f.a) for f in (short, long))
        assert cov.num_tokens == 16 and rel_err(cov.a_sum, a_ref) < 1e-14
        cov_all = KroneckerCovariances(tokens="all").accumulate([joined]).layers["l"]
        assert cov_all.num_tokens == 20
    finally:
        torch.set_default_dtype(torch.float32)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.head = nn.Linear(3 * 3 * 3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def conv_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum()


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_conv_im2col_against_oracle(kind):
    torch.set_default_dtype(torch.float64)
    try:
        model = ConvNet()
        x, y = torch.randn(10, 2, 6, 6), torch.randn(10, 2)
        tx, ty = torch.randn(2, 2, 6, 6), torch.randn(2, 2)
        records = capture(model, conv_loss, [{"x": x[:5], "y": y[:5]}, {"x": x[5:], "y": y[5:]}])
        test_rec = capture(model, conv_loss, [{"x": tx, "y": ty}])
        lam = 1e-2
        _, score, _, _ = ours(records, kind, test_rec, damping=lam)
        full, test = {"x": x, "y": y}, {"x": tx, "y": ty}
        rows = [{"x": x[i : i + 1], "y": y[i : i + 1]} for i in range(10)]
        ps, pt = per_sample_grads(model, conv_loss, full), per_sample_grads(model, conv_loss, test)

        def unfold(inp):  # independent im2col: (L, C*k*k), channel-major like weight.reshape
            return F.unfold(inp, 3, padding=1, stride=2)[0].T

        ref = 0
        for name, mod, unf in (("conv", model.conv, unfold), ("head", model.head, None)):
            a, g = kfac_ag(io_oracle(model, conv_loss, rows, mod, unfold=unf))
            tr = matrix_form(ps, f"{name}.weight", f"{name}.bias")
            te = matrix_form(pt, f"{name}.weight", f"{name}.bias")
            fisher = torch.kron(g, a) if kind == "kfac" else ekfac_fisher(a, g, tr)
            ref = ref + dense_scores(fisher, te, tr, lam)
        assert rel_err(score, ref) < TOL
    finally:
        torch.set_default_dtype(torch.float32)


class NormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.out = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(x))))


def test_non_kronecker_skip_warns_and_diagonal_is_exact():
    torch.set_default_dtype(torch.float64)
    try:
        model = NormMLP()
        x, y = torch.randn(8, 4), torch.randn(8, 2)
        records = capture(model, mlp_loss, [{"x": x, "y": y}])
        cov = KroneckerCovariances().accumulate(records)
        with pytest.warns(UserWarning, match="'ln'"):
            fit = eigendecompose(cov)
        assert fit.skipped == {"ln": "nn.LayerNorm"} and fit.layer_names == ["fc", "out"]
        g = records[0].gradient
        assert fit.precondition(g).layer_names == ["fc", "out"]
        # diagonal strategy: ln is preconditioned by the exact diagonal empirical Fisher
        cov_d = KroneckerCovariances(non_kronecker="diagonal").accumulate(records)
        fit_d = eigendecompose(cov_d)
        assert fit_d.layer_names == ["fc", "out", "ln"]
        ps = per_sample_grads(model, mlp_loss, {"x": x, "y": y})
        dense = torch.cat([ps["ln.weight"], ps["ln.bias"]], 1)
        diag = (dense**2).mean(0)
        pre = fit_d.precondition(g, damping=1e-2).layers["ln"].data
        assert rel_err(pre, dense / (diag + 1e-2)) < 1e-12
        # relative damping: the factor of the diagonal Fisher's mean entry
        pre_rel = fit_d.precondition(g, damping=0.3, relative=True).layers["ln"].data
        assert rel_err(pre_rel, dense / (diag + 0.3 * diag.mean())) < 1e-12
        assert rel_err(pre_rel, dense / (diag + 0.3)) > 1e-3  # the two dampings differ here
    finally:
        torch.set_default_dtype(torch.float32)


# ---- tiny GPT-2 (HF Conv1D path) ----------------------------------------------------------------
def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=8,
        n_embd=8,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(cfg).double().eval()


def gpt_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=ids).loss * len(ids)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_gpt2_conv1d_against_oracle(kind):
    model = _gpt2()
    torch.manual_seed(1)
    ids, tids = torch.randint(0, 40, (6, 7)), torch.randint(0, 40, (2, 7))
    records = capture(model, gpt_loss, [{"input_ids": ids[:3]}, {"input_ids": ids[3:]}])
    test_rec = capture(model, gpt_loss, [{"input_ids": tids}])
    lam = 1e-3
    fit, score, _, _ = ours(records, kind, test_rec, damping=lam)
    names = [
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
    ]
    assert sorted(fit.layers) == sorted(names)
    assert "transformer.wte" in fit.skipped and "transformer.h.0.ln_1" in fit.skipped
    rows = [{"input_ids": ids[i : i + 1]} for i in range(6)]

    # one-sample-at-a-time reference gradients (HF attention under vmap is not needed)
    def one_grads(batch_ids):
        out = []
        for i in range(len(batch_ids)):
            model.zero_grad()
            gpt_loss(model, {"input_ids": batch_ids[i : i + 1]}).backward()
            out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        return {k: torch.stack([o[k] for o in out]) for k in out[0]}

    ps, pt = one_grads(ids), one_grads(tids)
    # causal LM with labels=ids: the last position carries no gradient, so A averages over the
    # first T-1 positions of every sample
    mask = [torch.arange(7) < 6] * 6
    ref = 0
    for name in names:
        mod = model.get_submodule(name)
        a, g = kfac_ag(io_oracle(model, gpt_loss, rows, mod), token_mask=mask)
        tr = matrix_form(ps, f"{name}.weight", f"{name}.bias", transpose=True)
        te = matrix_form(pt, f"{name}.weight", f"{name}.bias", transpose=True)
        fisher = torch.kron(g, a) if kind == "kfac" else ekfac_fisher(a, g, tr)
        ref = ref + dense_scores(fisher, te, tr, lam)
    assert rel_err(score, ref) < TOL
