"""Every attributor on a projected store, against written-out formulas.

* ``"dense"`` / ``"sparse"`` / ``"mask"`` vectors: K-FAC and EK-FAC fit each layer's exact
  Fisher ``F_l = (1/N) sum_i v_il v_il^T`` and score ``sum_l v_test^T (F_l + λ I)^{-1} v_train``
  (absolute ``λ``, or ``damping * tr(F_l) / P`` relative), from the store or from
  ``KroneckerCovarianceCallback`` covariances.
* ``"logra"`` factors: K-FAC in the projected space (``A`` / ``G`` of the projected factors,
  ``F̂ = G ⊗ A`` inverted with ``torch.linalg.inv``), EK-FAC with the explicit eigenbasis
  ``Q_G ⊗ Q_A`` and empirical eigenvalues; from a factor-keeping store, and from covariances
  captured under the same projection scoring a compact store; a compact store without the
  covariances it records at capture is refused naming ``keep_token_factors``.
* TracIn / Grad-Cos on every projected store equal the inner products of the stored vectors.
* ``GradientIndex.search(preconditioner=...)`` with the fitted inverse gives the attributor's
  ``top_k``.

All in float64; the tolerance is ``1e-10`` relative.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    CaptureCallback,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    KroneckerCovarianceCallback,
    OffloadCallback,
    ProjectedFisherAttributor,
    ProjectionConfig,
    TracInAttributor,
)
from tests.helpers.reference import rel_err as rel
from tests.helpers.store import Net, V, args

pytestmark = pytest.mark.usefixtures("f64")

TOL = 1e-10
VECTOR_STYLES = ("dense", "sparse", "mask")
LOGRA_LAYERS = ("emb", "fc", "conv", "out")


def config(style: str) -> HookManagerConfig:
    if style == "logra":
        p = ProjectionConfig("logra", proj_dim_in=2, proj_dim_out=3, seed=3)
        return HookManagerConfig(projection={"emb": p, "fc": p, "ln": None, "conv": p, "out": p})
    return HookManagerConfig(projection=ProjectionConfig(style, proj_dim=5, seed=4))


def batches(seed: int, lengths) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (3, t), generator=g) for t in lengths]


def capture(model, data, path, cfg, extra=(), **offload) -> list:
    """Write ``data`` to a store at ``path``; return the in-memory records."""
    cap = CaptureCallback(keep_all=True)
    cbs = [cap, OffloadCallback(file_manager=GradientStorageManager(path), **offload), *extra]
    hm = HookManager(model, cfg, callbacks=cbs)
    with hm.collect():
        for x in data:
            model.zero_grad(set_to_none=True)
            (model(x) ** 2).sum().backward()
    hm.remove()
    return cap.records


def vectors(records, name: str) -> torch.Tensor:
    """``(N, P)``: one layer's per-sample vector (row-major matrix form) over the records."""
    return torch.cat([r.gradient.layers[name].materialize().data for r in records])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Net().double()


def setup(tmp_path, model, style, extra=(), **offload):
    train = capture(
        model, batches(0, (5, 9, 3)), tmp_path / "train", config(style), extra, **offload
    )
    test = capture(model, batches(1, (4,)), tmp_path / "test", config(style), **offload)
    return train, test


# ---- vector projections: the exact projected Fisher ---------------------------------------------
def projected_fisher_scores(train, test, damping: float, relative: bool) -> torch.Tensor:
    """``sum_l v_test^T (F_l + λ I)^{-1} v_train``, ``F_l = (1/N) sum_i v_i v_i^T``: ``(N, M)``."""
    total = 0
    for name in train[0].gradient.layer_names:
        v_tr, v_te = vectors(train, name), vectors(test, name)
        n, p = v_tr.shape
        fisher = v_tr.T @ v_tr / n
        lam = damping * torch.trace(fisher) / p if relative else damping
        total = total + v_tr @ torch.linalg.inv(fisher + lam * torch.eye(p)) @ v_te.T
    return total


@pytest.mark.parametrize("style", VECTOR_STYLES)
@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_vector_store_kfac_ekfac_is_the_exact_projected_fisher(tmp_path, model, style, cls):
    cov = KroneckerCovarianceCallback()
    train, test = setup(tmp_path, model, style, extra=[cov])
    assert all(lg.layer_type == f"projected.{style}" for lg in train[0].gradient.layers.values())
    att = cls(args(tmp_path))
    for damping, relative in ((1e-3, False), (0.1, True), (None, None)):
        got = att.attribute_from_cache(
            tmp_path / "train", tmp_path / "test", damping=damping, relative=relative
        ).scores
        want = projected_fisher_scores(train, test, damping or 0.1, relative is not False)
        assert got.dtype == torch.float64
        assert rel(got, want) <= TOL, (style, damping, relative)
    # covariances accumulated at capture give the same fit (EK-FAC still reads the store)
    from_cov = cls(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3, covariances=cov
    )
    assert rel(from_cov.scores, projected_fisher_scores(train, test, 1e-3, False)) <= TOL
    # the fit is one P x P matrix per layer, as the docstring says (G = 1, A = F)
    fit = att.factors[0].layers["fc"]
    assert tuple(fit.q_g.shape) == (1, 1) and tuple(fit.q_a.shape) == (5, 5)
    # and it survives save / load
    att.save_factors(tmp_path / "fit")
    loaded = cls(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3, factors=tmp_path / "fit"
    )
    assert rel(loaded.scores, from_cov.scores) <= TOL


def test_projected_fisher_fitted_on_a_separate_store(tmp_path, model):
    """A fit from another store (``fit`` then ``factors=``) uses that store's Fisher."""
    train, test = setup(tmp_path, model, "sparse")
    fit_records = capture(model, batches(3, (6, 2, 7, 4)), tmp_path / "fit", config("sparse"))
    att = KFACAttributor(args(tmp_path))
    fit = att.fit(tmp_path / "fit")
    got = att.attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3, factors=fit
    ).scores
    want = 0
    for name in train[0].gradient.layer_names:
        v_fit = vectors(fit_records, name)
        fisher = v_fit.T @ v_fit / len(v_fit)
        inv = torch.linalg.inv(fisher + 1e-3 * torch.eye(len(fisher)))
        want = want + vectors(train, name) @ inv @ vectors(test, name).T
    assert rel(got, want) <= TOL
    assert rel(projected_fisher_scores(train, test, 1e-3, False), want) > 1e-3  # not the train F


def test_projected_fisher_is_not_the_diagonal_or_gradient_dot(tmp_path, model):
    """The exact Fisher differs from the old diagonal fallback and from Grad-Dot / λ."""
    train, test = setup(tmp_path, model, "dense")
    exact = projected_fisher_scores(train, test, 1e-3, False)
    diag = 0
    for name in train[0].gradient.layer_names:
        v_tr, v_te = vectors(train, name), vectors(test, name)
        diag = diag + (v_tr / (v_tr.pow(2).mean(0) + 1e-3)) @ v_te.T
    assert rel(diag, exact) > 1e-2
    got = KFACAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3
    )
    assert rel(got.scores, exact) <= TOL


# ---- logra: K-FAC / EK-FAC in the projected space -----------------------------------------------
def logra_factors(records, name: str):
    """Per-sample projected matrices ``(N, k, d)``, the K-FAC ``A`` ``(d, d)`` and ``G``."""
    mats, a_sum, g_sum, n_tok, n = [], 0, 0, 0, 0
    for r in records:
        lg = r.gradient.layers[name]
        a, g = lg.a, lg.g  # (B, T, d), (B, T, k): the projected factors
        mats.append(torch.einsum("btk,btd->bkd", g, a))
        keep = (g != 0).any(-1) & (a != 0).any(-1)  # positions carrying gradient
        a_sum = a_sum + a[keep].T @ a[keep]
        g_sum = g_sum + g[keep].T @ g[keep]
        n_tok += int(keep.sum())
        n += a.shape[0]
    return torch.cat(mats), a_sum / n_tok, g_sum / n


def logra_scores(train, test, kind: str, damping: float, relative: bool) -> torch.Tensor:
    total = 0
    for name in LOGRA_LAYERS:
        m_tr, a, g = logra_factors(train, name)
        m_te = torch.cat([r.gradient.layers[name].materialize().data for r in test])
        v_tr, v_te = m_tr.reshape(len(m_tr), -1), m_te.reshape(len(m_te), -1)
        if kind == "kfac":
            fhat = torch.kron(g, a)  # row-major vec(g a^T) = g ⊗ a
            mean_eig = torch.trace(g) * torch.trace(a) / fhat.shape[0]
        else:
            q = torch.kron(torch.linalg.eigh(g)[1], torch.linalg.eigh(a)[1])
            lam_emp = ((v_tr @ q) ** 2).mean(0)  # empirical eigenvalues in Q_G ⊗ Q_A
            fhat = q @ torch.diag(lam_emp) @ q.T
            mean_eig = lam_emp.mean()
        lam = damping * mean_eig if relative else damping
        inv = torch.linalg.inv(fhat + lam * torch.eye(fhat.shape[0]))
        total = total + v_tr @ inv @ v_te.T
    return total


@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_logra_factor_store_is_kfac_in_the_projected_space(tmp_path, model, cls):
    cov = KroneckerCovarianceCallback()
    train, test = setup(tmp_path, model, "logra", extra=[cov], keep_token_factors=True)
    assert train[0].gradient.layers["fc"].layer_type == "projected.logra"
    att = cls(args(tmp_path))
    for damping, relative in ((1e-3, False), (0.1, True)):
        with pytest.warns(UserWarning, match="'ln'"):  # the unprojected LayerNorm is skipped
            got = att.attribute_from_cache(
                tmp_path / "train",
                tmp_path / "test",
                damping=damping,
                relative=relative,
                refit=True,
            )
        want = logra_scores(train, test, cls.kind, damping, relative)
        assert rel(got.scores, want) <= TOL, (damping, relative)
    # the compact store (each layer its projected (k, d) gradient) with the covariances that
    # were captured under the same projection gives the same scores
    capture(model, batches(0, (5, 9, 3)), tmp_path / "compact", config("logra"))
    capture(model, batches(1, (4,)), tmp_path / "ctest", config("logra"))
    compact = GradientStorageManager(tmp_path / "compact")
    assert not hasattr(next(iter(compact.iter_blocks())).gradient.layers["fc"], "a")
    with pytest.warns(UserWarning, match="'ln'"):
        got = cls(args(tmp_path)).attribute_from_cache(
            tmp_path / "compact", tmp_path / "ctest", damping=1e-3, covariances=cov
        )
    assert rel(got.scores, logra_scores(train, test, cls.kind, 1e-3, False)) <= TOL


def test_compact_logra_store_without_covariances_is_refused_naming_the_fix(tmp_path, model):
    """A compact store scores from the covariances it recorded (``test_recorded.py``); one
    that holds none (written before they were recorded) is refused."""
    setup(tmp_path, model, "logra")
    (tmp_path / "train" / "kronecker_statistics.safetensors").unlink()
    for cls in (KFACAttributor, EKFACAttributor):
        with pytest.raises(
            ValueError,
            match=r"keep_token_factors=True.*KroneckerCovariance.*ProjectedFisherAttributor",
        ):
            cls(args(tmp_path)).attribute_from_cache(tmp_path / "train", tmp_path / "test")


def test_covariances_of_another_projection_are_refused(tmp_path, model):
    cov = KroneckerCovarianceCallback()
    capture(model, batches(0, (5,)), tmp_path / "raw", HookManagerConfig(), [cov])
    setup(tmp_path, model, "dense")
    with pytest.raises(
        ValueError, match=r"projected.dense \(1, 5\), the fit nn.Linear.*projection"
    ):
        KFACAttributor(args(tmp_path)).attribute_from_cache(
            tmp_path / "train", tmp_path / "test", covariances=cov
        )


# ---- first-order methods on every projected store -----------------------------------------------
@pytest.mark.parametrize("style", ["logra", *VECTOR_STYLES])
@pytest.mark.parametrize("keep", [False, True])
def test_tracin_and_grad_cos_on_every_projected_store(tmp_path, model, style, keep):
    train, test = setup(tmp_path, model, style, keep_token_factors=keep)
    names = train[0].gradient.layer_names
    f_tr = torch.cat([vectors(train, n) for n in names], 1)
    f_te = torch.cat([vectors(test, n) for n in names], 1)
    dot = TracInAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test"
    )
    assert rel(dot.scores, f_tr @ f_te.T) <= TOL
    cos = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(
        tmp_path / "train", tmp_path / "test"
    )
    unit = lambda f: f / f.norm(dim=1, keepdim=True)  # noqa: E731
    assert rel(cos.scores, unit(f_tr) @ unit(f_te).T) <= TOL


# ---- the fitted inverse folded into a GradientIndex ---------------------------------------------
@pytest.mark.parametrize("cls", [KFACAttributor, EKFACAttributor])
def test_index_search_with_the_fitted_inverse_equals_the_attributor_top_k(tmp_path, model, cls):
    pytest.importorskip("faiss")
    from dattri_llm import GradientIndex

    setup(tmp_path, model, "sparse")
    att = cls(args(tmp_path))
    k = 3
    want = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", damping=1e-3, top_k=k)
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", kind="flat")
    got = index.search(tmp_path / "test", k=k, preconditioner=att.preconditioner(damping=1e-3))
    a, b = got.top_k(k), want.top_k(k)
    assert a.proponent_hashes == b.proponent_hashes
    assert a.opponent_hashes == b.opponent_hashes
    assert rel(a.proponent_scores, b.proponent_scores) <= 1e-5  # FAISS: float32
    # the fitted attributor itself: its default damping (0.1 x mean eigenvalue)
    default = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=k)
    got = index.search(tmp_path / "test", k=k, preconditioner=att)
    assert got.top_k(k).proponent_hashes == default.top_k(k).proponent_hashes
    # a fit over other layers than the indexed ones is refused
    sub = GradientIndex.build(tmp_path / "train", tmp_path / "idx2", kind="flat", layers=["fc"])
    with pytest.raises(ValueError, match=r"preconditioner covers layers.*layers=\[\.\.\.\]"):
        sub.search(tmp_path / "test", k=k, preconditioner=att.preconditioner())
    # the attributor itself fits over the indexed layers, as attribute_from_cache(layers=) does
    got = sub.search(tmp_path / "test", k=k, preconditioner=att).top_k(k)
    want = att.attribute_from_cache(
        tmp_path / "train", tmp_path / "test", layers=["fc"], top_k=k
    ).top_k(k)
    assert got.proponent_hashes == want.proponent_hashes
    assert rel(got.proponent_scores, want.proponent_scores) <= 1e-5


# ---- positions without gradient do not enter a projected fit ------------------------------------
def test_positions_without_gradient_leave_the_logra_covariances_unchanged(tmp_path):
    """Padding that carries no gradient changes no layer's ``A``, ``G`` or token count.

    A ``logra`` embedding keeps its projected one-hot rows ``R[idx]`` on the row side: nonzero
    even where the output gradient (the column factor ``g C``) is zero, so the covariances must
    count a position only where both factors are nonzero.
    """
    torch.manual_seed(1)
    model = nn.Sequential(nn.Embedding(V, 4), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    p = ProjectionConfig("logra", proj_dim_in=2, proj_dim_out=3, seed=5)
    cfg = HookManagerConfig(projection=p)
    ids = torch.randint(0, V, (3, 6), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([ids, torch.zeros(3, 4, dtype=torch.long)], 1)  # 4 pad positions

    def covariances(x: torch.Tensor) -> KroneckerCovarianceCallback:
        cov = KroneckerCovarianceCallback()
        hm = HookManager(model, cfg, callbacks=[cov])
        with hm.collect():
            model.zero_grad(set_to_none=True)
            (model(x)[:, : ids.shape[1]] ** 2).sum().backward()  # the pads carry no loss
        hm.remove()
        return cov.covariances

    plain, pad = covariances(ids), covariances(padded)
    for name in ("0", "1", "3"):
        a, b = plain.layers[name], pad.layers[name]
        assert a.num_tokens == b.num_tokens == ids.numel(), name
        assert rel(b.a_sum, a.a_sum) <= TOL and rel(b.g_sum, a.g_sum) <= TOL, name


# ---- ProjectedFisherAttributor: the exact Fisher of every layer, on any store form ---------------
def exact_fisher_scores(train, test, layers, damping: float) -> torch.Tensor:
    """``sum_l m_test^T (F_l + λ I)^{-1} m_train`` over flattened matrix forms, explicit F."""
    total = 0
    for name in layers:
        m_tr, m_te = vectors(train, name), vectors(test, name)
        fisher = m_tr.T @ m_tr / len(m_tr)
        inv = torch.linalg.inv(fisher + damping * torch.eye(len(fisher)))
        total = total + m_tr @ inv @ m_te.T
    return total


@pytest.mark.parametrize("keep", [False, True])
def test_projected_fisher_attributor_on_a_logra_store(tmp_path, model, keep):
    """Compact (k x d gradients) or factor-keeping: the exact (k d) x (k d) Fisher per layer."""
    train, test = setup(tmp_path, model, "logra", keep_token_factors=keep)
    att = ProjectedFisherAttributor(args(tmp_path))
    got = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", damping=1e-3)
    names = train[0].gradient.layer_names  # the unprojected LayerNorm too (12 numbers)
    assert rel(got.scores, exact_fisher_scores(train, test, names, 1e-3)) <= TOL
    # on a vector store it is what K-FAC does
    setup(tmp_path / "v", model, "dense")
    a = ProjectedFisherAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "v" / "train", tmp_path / "v" / "test"
    )
    b = KFACAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "v" / "train", tmp_path / "v" / "test"
    )
    assert rel(a.scores, b.scores) <= TOL


def test_projected_fisher_attributor_refusals_and_index(tmp_path, model):
    pytest.importorskip("faiss")
    from dattri_llm import GradientIndex

    train, test = setup(tmp_path, model, "logra")
    with pytest.raises(
        ValueError, match=r"layer 'ln' \(nn.LayerNorm\) has 12.*max_dim=8.*projection"
    ):
        ProjectedFisherAttributor(args(tmp_path), max_dim=8).attribute_from_cache(
            tmp_path / "train", tmp_path / "test"
        )
    # the refusal's remedies: leave the layer out, or raise max_dim
    rest = [n for n in LOGRA_LAYERS if n != "ln"]
    got = ProjectedFisherAttributor(args(tmp_path), max_dim=8).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", layers=rest, damping=1e-3
    )
    assert rel(got.scores, exact_fisher_scores(train, test, rest, 1e-3)) <= TOL
    got = ProjectedFisherAttributor(args(tmp_path), max_dim=12).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3
    )
    names = train[0].gradient.layer_names
    assert rel(got.scores, exact_fisher_scores(train, test, names, 1e-3)) <= TOL
    with pytest.raises(ValueError, match=r"covariances.*KFACAttributor"):
        ProjectedFisherAttributor(args(tmp_path)).fit(
            tmp_path / "train", covariances=KroneckerCovarianceCallback()
        )
    # the compact logra store is indexable; the fitted inverse folds into the search
    att = ProjectedFisherAttributor(args(tmp_path))
    want = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=3)
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", kind="flat")
    got = index.search(tmp_path / "test", k=3, preconditioner=att.preconditioner())
    assert got.top_k(3).proponent_hashes == want.top_k(3).proponent_hashes
    assert got.top_k(3).opponent_hashes == want.top_k(3).opponent_hashes


def test_projected_fisher_attributor_on_an_unprojected_model_with_a_param_grad_layer(
    tmp_path, model
):
    """Unprojected small layers (and a ``param_grad`` one) get their exact block Fisher."""
    cfg = HookManagerConfig(linear_io=["fc", "conv", "out"], param_grad=["ln"])

    def singles(seed, lengths):  # param_grad needs batches of one
        return [x[i : i + 1] for x in batches(seed, lengths) for i in range(len(x))]

    train = capture(model, singles(0, (5, 9, 3)), tmp_path / "train", cfg)
    test = capture(model, singles(1, (4,)), tmp_path / "test", cfg)
    assert train[0].gradient.layers["ln"].layer_type == "param_grad"
    got = ProjectedFisherAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", damping=1e-3
    )
    names = ("fc", "ln", "conv", "out")
    assert rel(got.scores, exact_fisher_scores(train, test, names, 1e-3)) <= TOL
