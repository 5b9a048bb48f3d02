"""K-FAC / EK-FAC from a store written with ``OffloadCallback``'s defaults (compact storage).

The compact store writes long-sequence layers densely and records each layer's Kronecker sums
at capture; a fit over it must score exactly as one over a store that keeps every factor
(``keep_token_factors=True``), which reads ``A`` and ``G`` from the factors themselves:

* the specification's flow on a tiny GPT-2 built from its config (transformers' ``Conv1D``,
  tied embeddings) and on a Linear / LayerNorm / Conv1d net, over several steps, K-FAC and
  EK-FAC, every damping form, ``non_kronecker`` ``"skip"`` and ``"diagonal"``;
* several checkpoints, and records written without statistics (appended with
  ``keep_token_factors=True``) next to covered ones;
* ``"logra"`` projection (K-FAC in the projected space) and vector projections;
* what stays refused names the fix: ``tokens="all"`` on dense layers, a capture that
  materialized a layer before the store saw it.

The reference is the factor store's fit, itself checked against written-out Kronecker formulas
in ``test_kfac.py`` / ``test_projected.py``; here a brute-force K-FAC (``torch.kron`` of the
covariances computed in the test from the captured factors) pins the compact store directly.
All in float64; the tolerance is ``1e-10`` relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dattri_llm import (
    EKFACAttributor,
    GradientStorageManager,
    HookManagerConfig,
    KFACAttributor,
    ProjectionConfig,
)
from tests.helpers.reference import rel_err as rel
from tests.helpers.store import Net, V, args, capture_to_store

pytestmark = pytest.mark.usefixtures("f64")

TOL = 1e-10
CLASSES = [KFACAttributor, EKFACAttributor]


def batches(seed: int, lengths, rows: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (rows, t), generator=g) for t in lengths]


def capture(model, data, path, cfg=None, checkpoint=0, mode="create", **offload) -> list:
    """Write ``data`` to the store at ``path`` (opened with ``mode``); return the records."""
    store = GradientStorageManager(path, mode=mode)
    return capture_to_store(model, data, store, cfg, checkpoint, **offload)


def layer_kinds(path) -> set[str]:
    return {
        type(lg).__name__
        for b in GradientStorageManager(path).iter_blocks()
        for lg in b.gradient.layers.values()
    }


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return Net().double()


def both_stores(tmp_path, model, train, test, cfg=None):
    """A compact train store, a factor-keeping one and a test store of the same capture."""
    records = capture(model, train, tmp_path / "compact", cfg)
    capture(model, train, tmp_path / "factors", cfg, keep_token_factors=True)
    capture(model, test, tmp_path / "test", cfg)
    return records


def scores(cls, tmp_path, store, **kw):
    built = ("non_kronecker", "tokens")
    att = cls(args(tmp_path), **{k: v for k, v in kw.items() if k in built})
    call = {k: v for k, v in kw.items() if k not in built}
    return att.attribute_from_cache(tmp_path / store, tmp_path / "test", **call).scores


# ---- the specification's flow ------------------------------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("non_kronecker", ["skip", "diagonal"])
def test_default_store_scores_as_the_factor_store(tmp_path, net, cls, non_kronecker):
    both_stores(tmp_path, net, batches(0, (2, 9, 3, 12)), batches(7, (4, 10)))
    assert layer_kinds(tmp_path / "compact") == {"Factorized", "Materialized"}
    for damping, relative in ((1e-3, False), (0.1, True), (None, None)):
        kw = {"non_kronecker": non_kronecker, "damping": damping, "relative": relative}
        if non_kronecker == "skip":
            with pytest.warns(UserWarning, match="'emb'"):
                got = scores(cls, tmp_path, "compact", **kw)
            with pytest.warns(UserWarning, match="'emb'"):
                want = scores(cls, tmp_path, "factors", **kw)
        else:
            got = scores(cls, tmp_path, "compact", **kw)
            want = scores(cls, tmp_path, "factors", **kw)
        assert got.dtype == torch.float64
        assert rel(got, want) <= TOL, (damping, relative)


def kfac_reference(records, test_records, layers, damping: float) -> torch.Tensor:
    """``sum_l m_test^T (G ⊗ A + λ I)^{-1} m_train``, ``A``, ``G`` from the captured factors."""
    total = 0
    for name in layers:
        pairs = [(r.gradient.layers[name].a, r.gradient.layers[name].g) for r in records]
        n = sum(a.shape[0] for a, _ in pairs)
        aa = sum(torch.einsum("bti,btj->ij", a, a) for a, _ in pairs)
        gg = sum(torch.einsum("bti,btj->ij", g, g) for _, g in pairs)
        tokens = sum(int(((g != 0).any(-1) & (a != 0).any(-1)).sum()) for a, g in pairs)
        fisher = torch.kron(gg / n, aa / tokens)
        m_tr = torch.cat([r.gradient.layers[name].materialize().data for r in records])
        m_te = torch.cat([r.gradient.layers[name].materialize().data for r in test_records])
        inv = torch.linalg.inv(fisher + damping * torch.eye(len(fisher)))
        total = total + m_tr @ inv @ m_te.T
    return total


def test_default_store_kfac_equals_the_written_out_formula(tmp_path, net):
    records = both_stores(tmp_path, net, batches(0, (3, 12, 9)), batches(7, (5,)))
    test = capture(net, batches(7, (5,)), tmp_path / "t2")
    want = kfac_reference(records, test, ["fc", "conv", "out"], 1e-3)
    with pytest.warns(UserWarning, match="'emb'"):
        got = scores(KFACAttributor, tmp_path, "compact", damping=1e-3)
    assert rel(got, want) <= TOL


def tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=16,
        n_embd=8,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).double().eval()


class LMLoss(nn.Module):
    """``model(ids)`` as the summed LM loss (the capture function squares its output)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=ids, labels=ids)
        return out.loss.sqrt() * len(ids) ** 0.5


@pytest.mark.parametrize("cls", CLASSES)
def test_tiny_gpt2_default_store_scores_as_the_factor_store(tmp_path, cls):
    model = LMLoss(tiny_gpt2())
    both_stores(tmp_path, model, batches(0, (12, 16, 14), rows=3), batches(7, (9,)))
    assert "Materialized" in layer_kinds(tmp_path / "compact")
    with pytest.warns(UserWarning, match="left out of the preconditioner"):
        got = scores(cls, tmp_path, "compact", damping=1e-3)
    with pytest.warns(UserWarning, match="left out of the preconditioner"):
        want = scores(cls, tmp_path, "factors", damping=1e-3)
    assert rel(got, want) <= TOL


# ---- several checkpoints, covered and uncovered records ------------------------------------------
@pytest.mark.parametrize("cls", CLASSES)
def test_several_checkpoints_and_records_without_statistics(tmp_path, net, cls):
    """Checkpoint 1 is appended by a factor-keeping capture: its records carry no statistics."""
    train = {0: batches(0, (12, 3)), 1: batches(1, (9, 2, 11))}
    test = batches(7, (4,))
    for c, data in train.items():
        mode = "create" if c == 0 else "append"
        capture(net, data, tmp_path / "compact", checkpoint=c, mode=mode)
        capture(net, data, tmp_path / "factors", checkpoint=c, mode=mode, keep_token_factors=True)
        capture(net, test, tmp_path / "test", checkpoint=c, mode=mode)
    # a third checkpoint: compact for its first batch, factor-keeping for the second
    capture(net, batches(2, (12,)), tmp_path / "compact", checkpoint=2, mode="append")
    capture(
        net,
        batches(2, (12,)),
        tmp_path / "factors",
        checkpoint=2,
        mode="append",
        keep_token_factors=True,
    )
    for path in ("compact", "factors"):
        capture(
            net,
            batches(3, (5,)),
            tmp_path / path,
            checkpoint=2,
            mode="append",
            keep_token_factors=True,
        )
    capture(net, test, tmp_path / "test", checkpoint=2, mode="append")
    stats = GradientStorageManager(tmp_path / "compact").kronecker_statistics()
    assert sorted(stats.covariances) == [0, 1, 2] and len(stats.covered) == 6
    for damping in (1e-3, None):
        with pytest.warns(UserWarning, match="'emb'"):
            got = scores(cls, tmp_path, "compact", damping=damping)
        with pytest.warns(UserWarning, match="'emb'"):
            want = scores(cls, tmp_path, "factors", damping=damping)
        assert rel(got, want) <= TOL, damping


# ---- projections -------------------------------------------------------------------------------
def logra() -> HookManagerConfig:
    p = ProjectionConfig("logra", proj_dim_in=2, proj_dim_out=3, seed=3)
    return HookManagerConfig(projection={"emb": p, "fc": p, "ln": None, "conv": p, "out": p})


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("style", ["logra", "dense", "mask"])
def test_projected_default_store_scores_as_the_factor_store(tmp_path, net, cls, style):
    cfg = (
        logra()
        if style == "logra"
        else HookManagerConfig(projection=ProjectionConfig(style, proj_dim=5, seed=4))
    )
    both_stores(tmp_path, net, batches(0, (5, 16, 9)), batches(1, (4,)), cfg)
    if style == "logra":  # the projected layers are held as their (k, d) gradients
        assert "Materialized" in layer_kinds(tmp_path / "compact")
    stats = GradientStorageManager(tmp_path / "compact").kronecker_statistics()
    held = {n for cov in stats.covariances.values() for n in cov.layers}
    # a vector's exact Fisher is read from the stored vectors: nothing is recorded for it
    assert held == ({"emb", "fc", "conv", "out"} if style == "logra" else set())
    for damping in (1e-3, None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unprojected LayerNorm is skipped (logra)
            got = scores(cls, tmp_path, "compact", damping=damping)
            want = scores(cls, tmp_path, "factors", damping=damping)
        assert rel(got, want) <= TOL, damping


# ---- what stays refused --------------------------------------------------------------------------
def test_tokens_all_on_a_dense_layer_is_refused_naming_the_fix(tmp_path, net):
    both_stores(tmp_path, net, batches(0, (12,)), batches(1, (4,)))
    with pytest.raises(
        ValueError, match=r"tokens='gradient'.*KroneckerCovarianceCallback\(tokens='all'\)"
    ):
        scores(KFACAttributor, tmp_path, "compact", tokens="all")
    # the fix that is named works: the factor store, or covariances counted over every token
    with pytest.warns(UserWarning, match="'emb'"):
        KFACAttributor(args(tmp_path), tokens="all").attribute_from_cache(
            tmp_path / "factors", tmp_path / "test"
        )


def test_a_layer_materialized_at_capture_is_refused_naming_the_fix(tmp_path, net):
    cfg = HookManagerConfig(capture_style="materialized")
    capture(net, batches(0, (12,)), tmp_path / "compact", cfg)
    capture(net, batches(1, (4,)), tmp_path / "test", cfg)
    assert GradientStorageManager(tmp_path / "compact").kronecker_statistics().covered == set()
    with pytest.raises(
        ValueError, match=r"capture_style='factorized'.*KroneckerCovarianceCallback"
    ):
        KFACAttributor(args(tmp_path)).attribute_from_cache(tmp_path / "compact", tmp_path / "test")
