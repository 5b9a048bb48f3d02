"""GradientIndex: exact search equals TracIn's top-k and a brute-force top-k,
approximate kinds reach a recall, stale / factorized stores are refused, partitions merge
exactly, the CLI round-trips, and nothing on disk is pickled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dattri_llm import (
    AttributionArguments,
    DiskGradientSource,
    GradientStorageManager,
    TracInAttributor,
)
from dattri_llm.attribution.index import (
    GradientIndex,
    IndexFormatError,
    NotVectorError,
    StaleIndexError,
)
from dattri_llm.cli import main
from dattri_llm.gradient import Factorized, Gradient, GradientRecord
from dattri_llm.gradient.compat import IncompatibleGradientsError
from dattri_llm.gradient.store.format import write_meta
from dattri_llm.gradient.store.writer import PartitionWriter
from tests.helpers.index import (
    DIMS,
    clustered,
    faiss_bytes,
    gen,
    record,
    train_vectors,
    write,
)

faiss = pytest.importorskip("faiss")


def args(tmp_path: Path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


def same_top(a, b, k: int, atol: float = 1e-5) -> None:
    ta, tb = a.top_k(k), b.top_k(k)
    assert ta.test_hashes == tb.test_hashes
    assert ta.proponent_hashes == tb.proponent_hashes
    assert ta.opponent_hashes == tb.opponent_hashes
    torch.testing.assert_close(
        ta.proponent_scores.double(), tb.proponent_scores.double(), rtol=1e-5, atol=atol
    )
    torch.testing.assert_close(
        ta.opponent_scores.double(), tb.opponent_scores.double(), rtol=1e-5, atol=atol
    )


@pytest.fixture
def stores(tmp_path):
    train, test = train_vectors(60), train_vectors(5, seed=1)
    write(tmp_path / "train", train)
    write(tmp_path / "test", test, prefix="q")
    return tmp_path, train, test


# ---- exact search ------------------------------------------------------------------------------
@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_flat_search_equals_brute_force_and_tracin(stores, metric):
    root, train, test = stores
    k = 5
    index = GradientIndex.build(root / "train", root / "idx", metric=metric)
    assert index.kind == "flat" and index.dim == 32 and len(index) == 60
    scores = GradientIndex.open(root / "idx").search(root / "test", k=k)
    assert scores.top_k_kept == k and scores.num_train == 60
    # brute force over the concatenated vectors, written out
    a, b = train, test
    if metric == "cosine":
        a, b = a / a.norm(dim=1, keepdim=True), b / b.norm(dim=1, keepdim=True)
    full = b @ a.T  # (M, N)
    top_v, top_i = full.topk(k, dim=1)
    bot_v, bot_i = full.topk(k, dim=1, largest=False)
    got = scores.top_k(k)
    assert got.test_hashes == [f"q{j}" for j in range(5)]
    assert got.proponent_hashes == [[f"t{i}" for i in row] for row in top_i.tolist()]
    assert got.opponent_hashes == [[f"t{i}" for i in row] for row in bot_i.tolist()]
    torch.testing.assert_close(got.proponent_scores.double(), top_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.opponent_scores.double(), bot_v, rtol=1e-5, atol=1e-5)
    # and TracIn's streamed top-k (Grad-Dot / Grad-Cos)
    att = TracInAttributor(args(root), normalized_grad=metric == "cosine")
    same_top(scores, att.attribute_from_cache(root / "train", root / "test", top_k=k), k)
    # query() of kept entries
    h = got.proponent_hashes[0][0]
    assert scores.query([h], ["q0"]).item() == pytest.approx(got.proponent_scores[0, 0].item())
    assert scores.top_k(2).proponent_hashes == [r[:2] for r in got.proponent_hashes]


@pytest.mark.parametrize("metric", ["dot", "cosine"])
@pytest.mark.parametrize("given", ["sequence", "mapping"])
def test_rows_at_several_steps_and_checkpoints_are_summed_like_tracin(tmp_path, metric, given):
    vecs = train_vectors(24)
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(record(0, vecs[:8], [f"t{i}" for i in range(8)], checkpoint=0))
        store.write(record(1, vecs[8:16], [f"t{i}" for i in range(4, 12)], checkpoint=1))
        store.write(record(2, vecs[16:24], [f"t{i}" for i in range(12, 20)], checkpoint=1))
    write(tmp_path / "test", train_vectors(3, seed=5), prefix="q")
    weights = [0.5, 2.0]
    by_label = weights if given == "sequence" else {1: 2.0, 0: 0.5}  # a mapping: w_c by label
    GradientIndex.build(tmp_path / "train", tmp_path / "idx", metric, checkpoint_weights=by_label)
    opened = GradientIndex.open(tmp_path / "idx")
    saved = weights if given == "sequence" else {"1": 2.0, "0": 0.5}
    assert opened.meta["checkpoint_weights"] == saved
    got = opened.search(tmp_path / "test", k=4)
    att = TracInAttributor(args(tmp_path), normalized_grad=metric == "cosine")
    att.checkpoint_weights = weights
    want = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=4)
    same_top(got, want, 4)
    assert got.num_train == 20
    steps = dict(zip(got.train_hashes, got.train_steps))
    assert all(steps.get(f"t{i}", -1) == -1 for i in range(4, 8))  # several steps: -1


@pytest.mark.parametrize(
    ("metric", "repeats"), [("cosine", None), ("cosine", "sum"), ("dot", None), ("dot", "mean")]
)
def test_a_sample_repeated_under_one_label_combines_like_the_attributors_default(
    tmp_path, metric, repeats
):
    """Two epochs under one label: a cosine index averages a sample's normalized rows
    (Grad-Cos's default ``repeats="mean"``), a dot index sums them; ``repeats=`` overrides."""
    vecs = train_vectors(20, seed=7)
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(record(0, vecs[:8], [f"t{i}" for i in range(8)]))
        store.write(record(1, vecs[8:16], [f"t{i}" for i in range(4, 12)]))  # t4..t7 again
        store.write(record(2, vecs[16:20], [f"t{i}" for i in range(4)], checkpoint=1))
    queries = train_vectors(3, seed=8)
    write(tmp_path / "test", queries, prefix="q")
    GradientIndex.build(tmp_path / "train", tmp_path / "idx", metric, repeats=repeats)
    index = GradientIndex.open(tmp_path / "idx")
    rule = repeats or ("mean" if metric == "cosine" else "sum")
    assert index.repeats == rule
    got = index.search(tmp_path / "test", k=12)
    assert got.repeats == rule
    # brute force, written out: per label, the sum or the mean of each sample's rows
    rows = {0: [(i, vecs[i]) for i in range(8)] + [(i - 4, vecs[i]) for i in range(8, 16)]}
    rows[1] = [(i, vecs[16 + i]) for i in range(4)]
    want = torch.zeros(12, queries.shape[1], dtype=torch.float64)
    for items in rows.values():
        per = torch.zeros_like(want)
        n = torch.zeros(12, dtype=torch.float64)
        for i, v in items:
            per[i] += v / v.norm() if metric == "cosine" else v
            n[i] += 1
        want += per / n.clamp_min(1).unsqueeze(1) if rule == "mean" else per
    q = queries / queries.norm(dim=1, keepdim=True) if metric == "cosine" else queries
    full = q @ want.T  # (3, 12)
    top = got.top_k(12)
    for j in range(3):
        order = full[j].argsort(descending=True)
        assert top.proponent_hashes[j] == [f"t{i}" for i in order.tolist()]
        torch.testing.assert_close(
            top.proponent_scores[j].double(), full[j, order], rtol=1e-5, atol=1e-5
        )
    # and Grad-Cos / Grad-Dot (TracIn over the labels) with the same rule: its default for
    # the default index
    att = TracInAttributor(args(tmp_path), normalized_grad=metric == "cosine", repeats=repeats)
    with pytest.warns(UserWarning, match="occur several times under one checkpoint label"):
        want_top = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=12)
    assert want_top.repeats == rule
    same_top(got, want_top, 12)


def test_a_train_source_is_indexed_with_its_own_layers_and_checkpoints(tmp_path):
    """A ``DiskGradientSource`` that selects layers and a checkpoint label gives the index of
    that selection (the scores of TracIn reading the same source), not of the whole store;
    build arguments naming another selection are refused, the same one accepted."""
    vecs = train_vectors(16)
    with GradientStorageManager(tmp_path / "train") as store:  # t0..t7 under labels 0 and 1
        store.write(record(0, vecs[:8], [f"t{i}" for i in range(8)], checkpoint=0))
        store.write(record(1, vecs[8:], [f"t{i}" for i in range(8)], checkpoint=1))
    write(tmp_path / "test", train_vectors(3, seed=5), prefix="q")
    source = DiskGradientSource(tmp_path / "train", layers=["fc1"], checkpoints=[0])
    index = GradientIndex.build(source, tmp_path / "idx")
    assert index.layers == ["fc1"] and index.dim == 12 and index.meta["checkpoints"] == [0]
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=4)
    query = DiskGradientSource(tmp_path / "test", layers=["fc1"])
    want = TracInAttributor(args(tmp_path)).attribute_sources(source, query, top_k=4)
    same_top(got, want, 4)
    for other in ({"layers": ["fc2"]}, {"checkpoints": [1]}, {"checkpoints": [0, 1]}):
        with pytest.raises(ValueError, match="give the selection once"):
            GradientIndex.build(source, tmp_path / "other", **other)
    same = GradientIndex.build(source, tmp_path / "same", layers=["fc1"], checkpoints=[0])
    assert same.layers == ["fc1"] and same.meta["checkpoints"] == [0]
    assert faiss_bytes(same) == faiss_bytes(index)
    every_label = DiskGradientSource(tmp_path / "train", layers=["fc1"])  # no label selected
    both = GradientIndex.build(every_label, tmp_path / "both")
    assert both.layers == ["fc1"] and both.meta["checkpoints"] is None and len(both) == 8


def test_multi_partition_merge_is_exact(tmp_path):
    root = tmp_path / "train"
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    vecs = train_vectors(40)
    for r in (0, 1):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 2}, lambda e: None)
        for s in range(2):
            lo = r * 20 + s * 10
            w.write(record(s, vecs[lo : lo + 10], [f"t{i}" for i in range(lo, lo + 10)]))
        w.close()
    write(tmp_path / "test", train_vectors(4, seed=9), prefix="q")
    index = GradientIndex.build(root, tmp_path / "idx")
    assert [p["partition"] for p in index.meta["parts"]] == ["rank_0", "rank_1"]
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=6)
    want = TracInAttributor(args(tmp_path)).attribute_from_cache(root, tmp_path / "test", top_k=6)
    same_top(got, want, 6)
    # the winners come from both partitions
    winners = {h for row in got.top_k(6).proponent_hashes for h in row}
    assert any(int(h[1:]) < 20 for h in winners) and any(int(h[1:]) >= 20 for h in winners)


def test_a_real_masked_capture_matches_tracin(tmp_path):
    from torch import nn

    from dattri_llm import HookManager, HookManagerConfig, OffloadCallback
    from dattri_llm.gradient.ops import ProjectionConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(13, 6), nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    config = HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=10, seed=2))
    for name, n, seed in (("train", 24, 1), ("test", 4, 2)):
        x = torch.randint(0, 13, (n, 5), generator=gen(seed))
        fm = GradientStorageManager(tmp_path / name)
        hm = HookManager(model, config, callbacks=[OffloadCallback(file_manager=fm)])
        with hm.collect(deregister_on_exit=True):
            (model(x) ** 2).sum().backward()
    for metric in ("dot", "cosine"):
        index = GradientIndex.build(tmp_path / "train", tmp_path / metric, metric)
        got = index.search(tmp_path / "test", k=3)
        att = TracInAttributor(args(tmp_path), normalized_grad=metric == "cosine")
        same_top(got, att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=3), 3)


# ---- approximate kinds -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,params,search",
    [
        ("ivf", {"nlist": 16}, {"nprobe": 8}),
        ("ivf", {"nlist": 16, "pq_m": 8, "rerank": 8}, {"nprobe": 8}),
        ("hnsw", {"M": 16, "efConstruction": 64}, {"ef_search": 128}),
    ],
)
def test_approximate_kinds_reach_recall(tmp_path, kind, params, search):
    train = clustered(2000, 20, 32, seed=0)
    queries = clustered(20, 20, 32, seed=1)
    write(tmp_path / "train", train, batch=100)
    write(tmp_path / "test", queries, prefix="q")
    GradientIndex.build(tmp_path / "train", tmp_path / "idx", "cosine", kind, **params)
    index = GradientIndex.open(tmp_path / "idx")
    assert index.kind == kind
    got = index.search(tmp_path / "test", k=10, **search).top_k(10)
    a = train / train.norm(dim=1, keepdim=True)
    b = queries / queries.norm(dim=1, keepdim=True)
    exact = (b @ a.T).topk(10, dim=1).indices.tolist()
    hits = [len({f"t{i}" for i in e} & set(g)) for e, g in zip(exact, got.proponent_hashes)]
    assert sum(hits) / (10 * len(exact)) >= 0.9


def test_auto_is_flat_for_a_small_store_and_parameters_are_checked(stores):
    root, _, _ = stores
    assert GradientIndex.build(root / "train", root / "a").kind == "flat"
    with pytest.raises(ValueError, match=r"kind='hnsw' takes M, efConstruction, efSearch"):
        GradientIndex.build(root / "train", root / "b", kind="hnsw", nlist=3)
    with pytest.raises(ValueError, match="metric must be one of"):
        GradientIndex.build(root / "train", root / "b", metric="l2")
    with pytest.raises(ValueError, match="pq_m=5 must divide the vector dimension 32"):
        GradientIndex.build(root / "train", root / "b", kind="ivf", nlist=1, pq_m=5)
    with pytest.raises(ValueError, match="already holds an index"):
        GradientIndex.build(root / "train", root / "a")
    GradientIndex.build(root / "train", root / "a", kind="hnsw", overwrite=True)
    assert GradientIndex.open(root / "a").kind == "hnsw"


# ---- refusals ---------------------------------------------------------------------------------
def test_a_changed_store_is_refused(stores):
    root, _, _ = stores
    GradientIndex.build(root / "train", root / "idx")
    with GradientStorageManager(root / "train", mode="append") as store:
        store.write(record(99, train_vectors(2, seed=7), ["new0", "new1"]))
    with pytest.raises(StaleIndexError, match=r"index\.jsonl changed.*rebuild"):
        GradientIndex.open(root / "idx")


def test_a_factorized_store_is_refused(tmp_path):
    fac = Factorized(
        torch.randn(4, 3, 5), torch.randn(4, 3, 2), "nn.Linear",
        {"in_features": 5, "out_features": 2, "bias": False, "_k": 2, "_d": 5},
    )  # fmt: skip
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(GradientRecord(0, [f"t{i}" for i in range(4)], Gradient({"lin": fac})))
    with pytest.raises(NotVectorError, match=r"'lin' \(nn\.Linear\).*factorized.*capture_style"):
        GradientIndex.build(tmp_path / "train", tmp_path / "idx")


def test_an_incompatible_test_capture_is_refused(stores, tmp_path):
    root, _, _ = stores
    write(tmp_path / "other", train_vectors(3, seed=2), prefix="q", seed=4)  # another seed
    index = GradientIndex.build(root / "train", root / "idx")
    with pytest.raises(IncompatibleGradientsError, match="seed: 3 vs 4"):
        index.search(tmp_path / "other", k=3)


def test_in_memory_queries_are_checked_against_the_index_capture(stores):
    """Queries given as blocks (no store facts to read) are checked on their first block: the
    same capture scores as the store, another projection seed and no block at all are refused."""
    root, train, test = stores
    index = GradientIndex.build(root / "train", root / "idx")
    want = (test @ train.T).topk(3, dim=1)
    got = index.search([record(0, test, [f"q{i}" for i in range(5)])], k=3).top_k(3)
    assert got.proponent_hashes == [[f"t{i}" for i in row] for row in want.indices.tolist()]
    torch.testing.assert_close(got.proponent_scores.double(), want.values, rtol=1e-5, atol=1e-5)
    other = [record(0, test, [f"q{i}" for i in range(5)], seed=4)]
    with pytest.raises(IncompatibleGradientsError, match="seed: 3 vs 4"):
        index.search(other, k=3)
    with pytest.raises(ValueError, match="the test source yielded no gradients"):
        index.search([], k=3)


def test_not_an_index_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    with pytest.raises(IndexFormatError, match="has no index.json"):
        GradientIndex.open(tmp_path / "x")


def test_preconditioner_is_folded_into_the_queries(stores):
    root, train, test = stores
    p = torch.diag(torch.linspace(0.5, 2.0, 32, dtype=torch.float64))
    index = GradientIndex.build(root / "train", root / "idx")
    got = index.search(root / "test", k=3, preconditioner=p).top_k(3)
    want = (test @ p @ train.T).topk(3, dim=1)
    assert got.proponent_hashes == [[f"t{i}" for i in r] for r in want.indices.tolist()]
    with pytest.raises(ValueError, match=r"preconditioner must be a \(32, 32\) matrix"):
        index.search(root / "test", k=3, preconditioner=torch.eye(3))


# ---- files and CLI -----------------------------------------------------------------------------
def test_cli_round_trip_and_no_pickle_on_disk(stores, capsys):
    root, _, _ = stores
    code = main(
        ["index", "build", str(root / "train"), "-o", str(root / "idx"), "--metric", "cosine"]
    )
    assert code == 0, capsys.readouterr().err
    code = main(
        ["index", "search", str(root / "idx"), "--test", str(root / "test"), "--k", "4",
         "--out", str(root / "scores")]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    from dattri_llm import AttributionScore

    got = AttributionScore.load(root / "scores")
    att = TracInAttributor(args(root), normalized_grad=True)
    same_top(got, att.attribute_from_cache(root / "train", root / "test", top_k=4), 4)
    meta = json.loads((root / "idx" / "index.json").read_text())
    assert meta["format"] == "dattri_llm.gradient_index" and meta["version"] == 2
    assert meta["metric"] == "cosine" and meta["layers"] == list(DIMS) and meta["dims"] == [12, 20]
    for f in (root / "idx").iterdir():
        data = f.read_bytes()
        assert not data.startswith(b"\x80"), f"{f} looks like a pickle"
        if f.suffix == ".json":
            json.loads(data)
        else:
            assert f.suffix == ".faiss"
            faiss.read_index(str(f))
    assert main(["index", "search", str(root / "nope"), "--test", str(root / "test"),
                 "--out", str(root / "s2")]) != 0  # fmt: skip


# ---- non-finite vectors and sizes ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "hnsw"])
def test_non_finite_train_or_query_vectors_are_refused(tmp_path, kind):
    """FAISS has no order for NaN: the build refuses the sample, the search the query."""
    train = train_vectors(24)
    train[9, 4] = float("nan")
    with GradientStorageManager(tmp_path / "train", nonfinite="warn") as store:
        with pytest.warns(UserWarning, match="'t9'"):
            for s, i in enumerate(range(0, 24, 8)):
                store.write(record(s, train[i : i + 8], [f"t{j}" for j in range(i, i + 8)]))
    with pytest.raises(ValueError, match=r"train vector of sample 't9' is not finite"):
        GradientIndex.build(tmp_path / "train", tmp_path / "idx", kind=kind)
    write(tmp_path / "ok", train_vectors(24))
    index = GradientIndex.build(tmp_path / "ok", tmp_path / "idx", kind=kind)
    test = train_vectors(3, seed=1)
    test[1, 0] = float("inf")
    with GradientStorageManager(tmp_path / "test", nonfinite="warn") as store:
        with pytest.warns(UserWarning, match="'q1'"):
            store.write(record(0, test, ["q0", "q1", "q2"]))
    with pytest.raises(ValueError, match=r"query vector of sample 'q1' is not finite"):
        index.search(tmp_path / "test", k=3)


def test_huge_k_and_block_rows_are_clamped_to_the_store(stores):
    root, train, test = stores
    index = GradientIndex.build(root / "train", root / "idx", block_rows=10**12)
    scores = index.search(root / "test", k=10**12)
    assert scores.top_k_kept == 60 and scores.num_train == 60
    full = test @ train.T  # (M, N): every sample, sorted
    got = scores.top_k(10**12)
    order = full.argsort(dim=1, descending=True)
    assert got.proponent_hashes == [[f"t{i}" for i in row] for row in order.tolist()]
    torch.testing.assert_close(
        got.proponent_scores.double(), full.gather(1, order), rtol=1e-5, atol=1e-5
    )
    same_top(scores, index.search(root / "test", k=60), 60)


# ---- a fitted Fisher folded into the search ------------------------------------------------------
def _fisher_stores(tmp_path: Path) -> Path:
    """A ``"mask"`` capture of a small LM at two checkpoints (weights far apart), train and test."""
    from tests.helpers.kronecker import dataset, make_model, offload

    first, second = make_model(), make_model()
    with torch.no_grad():
        for p in second.parameters():
            p.mul_(3.0)
    for c, model in enumerate((first, second)):
        mode = "create" if c == 0 else "append"
        for name, data in (("train", dataset(10, 1)), ("test", dataset(4, 2))):
            offload(model, data, tmp_path / name, config=_MASK, checkpoint=c, mode=mode)
    return tmp_path


def _mask_config():
    from dattri_llm import HookManagerConfig
    from dattri_llm.gradient.ops import ProjectionConfig

    return HookManagerConfig(
        linear_io=["fc", "head"], projection=ProjectionConfig("mask", proj_dim=5, seed=4)
    )


_MASK = _mask_config()


def _same_top_exact(got, want, k: int) -> None:
    """Ids equal; scores equal to FAISS's float32 round-off."""
    a, b = got.top_k(k), want.top_k(k)
    assert a.test_hashes == b.test_hashes
    assert a.proponent_hashes == b.proponent_hashes
    assert a.opponent_hashes == b.opponent_hashes
    for x, y in ((a.proponent_scores, b.proponent_scores), (a.opponent_scores, b.opponent_scores)):
        scale = float(y.abs().max())
        torch.testing.assert_close(x.double(), y.double(), rtol=1e-5, atol=1e-5 * scale)


def _moment():
    from dattri_llm import SecondMoment

    g = gen(11)
    # one v per captured (masked) coordinate
    v = {name: torch.rand(5, generator=g, dtype=torch.float64) + 0.1 for name in ("fc", "head")}
    return SecondMoment(v, eps=1e-3)


def _fisher_classes():
    from dattri_llm import EKFACAttributor, KFACAttributor, ProjectedFisherAttributor

    return [KFACAttributor, EKFACAttributor, ProjectedFisherAttributor]


@pytest.mark.parametrize("cls", _fisher_classes())
@pytest.mark.parametrize("option", ["default", "damping", "second_moment", "mix"])
def test_search_with_a_fitted_attributor_equals_its_top_k(tmp_path, cls, option):
    """Every option the attributor takes; the index over checkpoint 1 of a two-checkpoint store,
    searched after the attributor was fitted on both (its checkpoint-0 fit must not be used)."""
    from dattri_llm import ProjectedFisherAttributor

    if option == "mix" and cls is ProjectedFisherAttributor:
        pytest.skip("ProjectedFisherAttributor has no mix option")
    root = _fisher_stores(tmp_path)
    kw = {"damping": {"damping": 1e-3}, "second_moment": {"second_moment": _moment()}}
    kw["mix"] = {"mix": 0.5}
    att = cls(args(root), **kw.get(option, {}))
    att.attribute_from_cache(root / "train", root / "test")  # a fit per checkpoint, held
    k = 4
    index = GradientIndex.build(root / "train", root / "idx", kind="flat", checkpoints=[1])
    got = index.search(root / "test", k=k, preconditioner=att)
    fresh = cls(args(root), **kw.get(option, {}))
    want = fresh.attribute_from_cache(root / "train", root / "test", checkpoints=[1], top_k=k)
    _same_top_exact(got, want, k)
    # a fresh attributor, never fitted, is fitted by the search alike
    again = index.search(root / "test", k=k, preconditioner=cls(args(root), **kw.get(option, {})))
    _same_top_exact(again, want, k)
    if option == "damping" or option == "default":
        # the fitted inverse of checkpoint 1 with a call's damping
        pre = att.preconditioner(damping=0.3, relative=True, checkpoint=1)
        got = index.search(root / "test", k=k, preconditioner=pre)
        want = fresh.attribute_from_cache(
            root / "train", root / "test", checkpoints=[1], top_k=k, damping=0.3, relative=True
        )
        _same_top_exact(got, want, k)


def test_search_refuses_what_a_fitted_attributor_cannot_score_and_its_remedies_work(tmp_path):
    from dattri_llm import EKFACAttributor

    root = _fisher_stores(tmp_path)
    k = 3
    tr, te = root / "train", root / "test"
    one = GradientIndex.build(tr, root / "one", kind="flat", checkpoints=[1])
    # normalized_grad: the train side's P-norms are not in the index
    cos = EKFACAttributor(args(root), normalized_grad=True)
    with pytest.raises(ValueError, match=r"normalized_grad=True.*attribute_from_cache"):
        one.search(te, k=k, preconditioner=cos)
    cos.attribute_from_cache(tr, te, checkpoints=[1], top_k=k)  # the remedy: it scores
    att = EKFACAttributor(args(root))
    want = att.attribute_from_cache(tr, te, checkpoints=[1], top_k=k)
    # a cosine index
    unit = GradientIndex.build(tr, root / "cos", "cosine", kind="flat", checkpoints=[1])
    with pytest.raises(ValueError, match=r"metric='cosine'.*metric='dot'"):
        unit.search(te, k=k, preconditioner=att)
    # an index summed over both checkpoints, each with its own Fisher
    both = GradientIndex.build(tr, root / "both", kind="flat")
    with pytest.raises(ValueError, match=r"checkpoints \[0, 1\].*checkpoints=\[c\]"):
        both.search(DiskGradientSource(te, checkpoints=[1]), k=k, preconditioner=att)
    # checkpoint weights the attributor does not apply
    weighted = GradientIndex.build(
        tr, root / "w", kind="flat", checkpoints=[1], checkpoint_weights=[1.0, 2.0]
    )
    with pytest.raises(ValueError, match="without checkpoint_weights"):
        weighted.search(te, k=k, preconditioner=att)
    # the remedies of all three: a dot index of one checkpoint, without weights
    _same_top_exact(one.search(te, k=k, preconditioner=att), want, k)
    # a fitted inverse of another checkpoint
    att.fit(DiskGradientSource(tr, checkpoints=[0]))
    pre0 = att.preconditioner(checkpoint=0)
    with pytest.raises(ValueError, match=r"checkpoint 0.*preconditioner\(checkpoint=1\)"):
        one.search(te, k=k, preconditioner=pre0)
    att.fit(DiskGradientSource(tr, checkpoints=[1]))
    _same_top_exact(one.search(te, k=k, preconditioner=att.preconditioner(checkpoint=1)), want, k)


# ---- refusals whose remedies work ---------------------------------------------------------------
def test_a_test_store_of_several_checkpoints_and_both_remedies(tmp_path):
    vecs = train_vectors(16)
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(record(0, vecs[:8], [f"t{i}" for i in range(8)], checkpoint=0))
        store.write(record(1, vecs[8:], [f"t{i}" for i in range(8)], checkpoint=1))
    queries = train_vectors(6, seed=2)
    with GradientStorageManager(tmp_path / "test") as store:
        store.write(record(0, queries[:3], ["q0", "q1", "q2"], checkpoint=0))
        store.write(record(1, queries[3:], ["q0", "q1", "q2"], checkpoint=1))
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx")
    with pytest.raises(ValueError, match=r"DiskGradientSource\(test_store, checkpoints=\[c\]\)"):
        index.search(tmp_path / "test", k=3)
    tracin = TracInAttributor(args(tmp_path))
    # remedy 1: one checkpoint's queries (against the vectors summed over both checkpoints)
    query = DiskGradientSource(tmp_path / "test", checkpoints=[1])
    got = index.search(query, k=3)
    want = tracin.attribute_sources(DiskGradientSource(tmp_path / "train"), query, top_k=3)
    same_top(got, want, 3)
    # remedy 2: one index per checkpoint, searched with the whole test store
    for c in (0, 1):
        one = GradientIndex.build(tmp_path / "train", tmp_path / f"idx{c}", checkpoints=[c])
        got = one.search(tmp_path / "test", k=3)
        want = tracin.attribute_from_cache(
            tmp_path / "train", tmp_path / "test", checkpoints=[c], top_k=3
        )
        same_top(got, want, 3)


def _logra_store(model, path, lengths, seed: int, **config) -> None:
    from dattri_llm import HookManager, HookManagerConfig, OffloadCallback
    from dattri_llm.gradient.ops import ProjectionConfig
    from tests.helpers.store import V

    p = ProjectionConfig("logra", proj_dim_in=4, proj_dim_out=4, seed=3)
    cfg = HookManagerConfig(projection=p, linear_io=["fc", "out"], **config)
    g = gen(seed)
    fm = GradientStorageManager(path)
    hm = HookManager(model, cfg, callbacks=[OffloadCallback(file_manager=fm)])
    with hm.collect(deregister_on_exit=True):
        for t in lengths:
            model.zero_grad(set_to_none=True)
            (model(torch.randint(0, V, (3, t), generator=g)) ** 2).sum().backward()
    fm.close()


@pytest.fixture
def net():
    from tests.helpers.store import Net

    torch.manual_seed(0)
    return Net().double()


def test_a_compact_logra_query_store_of_short_queries_is_searched(tmp_path, net):
    """Short queries are stored as per-token factors (smaller than k x d): they are
    materialized for the search, as TracIn's inner products do."""
    _logra_store(net, tmp_path / "train", (12, 12, 12), seed=0)
    _logra_store(net, tmp_path / "test", (1,), seed=1)
    block = next(iter(DiskGradientSource(tmp_path / "test")))
    assert all(type(lg).__name__ == "Factorized" for lg in block.gradient.layers.values())
    got = GradientIndex.build(tmp_path / "train", tmp_path / "idx").search(tmp_path / "test", k=3)
    want = TracInAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", top_k=3
    )
    same_top(got, want, 3)


def test_a_factorized_train_store_and_both_remedies(tmp_path, net):
    _logra_store(net, tmp_path / "short", (2, 2, 2), seed=0)  # factors: smaller than k x d
    _logra_store(net, tmp_path / "test", (6,), seed=1)
    with pytest.raises(NotVectorError, match="capture_style='materialized'.*layers="):
        GradientIndex.build(tmp_path / "short", tmp_path / "idx")
    tracin = TracInAttributor(args(tmp_path))
    # remedy 1: capture the train store materialized
    _logra_store(net, tmp_path / "dense", (2, 2, 2), seed=0, capture_style="materialized")
    got = GradientIndex.build(tmp_path / "dense", tmp_path / "idx").search(tmp_path / "test", k=3)
    same_top(got, tracin.attribute_from_cache(tmp_path / "dense", tmp_path / "test", top_k=3), 3)
    # remedy 2: leave the factorized layers out (here: index the unprojected LayerNorm alone)
    from dattri_llm import HookManager, HookManagerConfig, OffloadCallback

    cfg = HookManagerConfig(linear_io=["fc"], param_grad=["ln"])
    for name, n in (("mixed", 4), ("q", 2)):
        fm = GradientStorageManager(tmp_path / name)
        hm = HookManager(net, cfg, callbacks=[OffloadCallback(file_manager=fm)])
        with hm.collect(deregister_on_exit=True):
            for i in range(n):
                net.zero_grad(set_to_none=True)
                ids = torch.randint(0, 11, (1, 2), generator=gen(i + 10 * n))
                (net(ids) ** 2).sum().backward()
        fm.close()
    with pytest.raises(NotVectorError, match="'fc'"):
        GradientIndex.build(tmp_path / "mixed", tmp_path / "idx2")
    index = GradientIndex.build(tmp_path / "mixed", tmp_path / "idx2", layers=["ln"])
    got = index.search(tmp_path / "q", k=2)
    want = tracin.attribute_from_cache(tmp_path / "mixed", tmp_path / "q", layers=["ln"], top_k=2)
    same_top(got, want, 2)


def test_a_moved_store_and_a_stale_index_and_their_remedies(stores):
    root, _, _ = stores
    GradientIndex.build(root / "train", root / "idx")
    (root / "train").rename(root / "moved")
    with pytest.raises(FileNotFoundError, match=r"GradientIndex.open\(index_dir, store=\.\.\.\)"):
        GradientIndex.open(root / "idx")
    index = GradientIndex.open(root / "idx", store=root / "moved")
    want = TracInAttributor(args(root)).attribute_from_cache(root / "moved", root / "test", top_k=3)
    same_top(index.search(root / "test", k=3), want, 3)
    with GradientStorageManager(root / "moved", mode="append") as store:
        store.write(record(99, train_vectors(2, seed=7), ["new0", "new1"]))
    with pytest.raises(StaleIndexError, match=r"overwrite=True"):
        GradientIndex.open(root / "idx", store=root / "moved")
    GradientIndex.build(root / "moved", root / "idx", overwrite=True)
    want = TracInAttributor(args(root)).attribute_from_cache(root / "moved", root / "test", top_k=3)
    same_top(GradientIndex.open(root / "idx").search(root / "test", k=3), want, 3)


def test_a_callable_preconditioner_as_the_shape_refusal_offers(stores):
    root, train, test = stores
    index = GradientIndex.build(root / "train", root / "idx")
    p = torch.diag(torch.linspace(0.5, 2.0, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"or pass a callable on the \(M, 32\) queries"):
        index.search(root / "test", k=3, preconditioner=torch.eye(3))
    got = index.search(root / "test", k=3, preconditioner=lambda q: q @ p).top_k(3)
    want = (test @ p @ train.T).topk(3, dim=1)
    assert got.proponent_hashes == [[f"t{i}" for i in r] for r in want.indices.tolist()]


def test_three_partitions_of_unequal_sizes_merge_to_every_exact_score(tmp_path):
    """Each partition's local ids are offset by every partition before it (not only the last
    one): with k the whole store, every kept score is TracIn's, on the right sample."""
    root = tmp_path / "train"
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    sizes = [7, 13, 10]
    vecs = train_vectors(sum(sizes))
    lo = 0
    for r, n in enumerate(sizes):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 3}, lambda e: None)
        w.write(record(0, vecs[lo : lo + n], [f"t{i}" for i in range(lo, lo + n)]))
        w.close()
        lo += n
    write(tmp_path / "test", train_vectors(3, seed=9), prefix="q")
    index = GradientIndex.build(root, tmp_path / "idx")
    assert len(index.meta["parts"]) == 3
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=sum(sizes))
    want = TracInAttributor(args(tmp_path)).attribute_from_cache(root, tmp_path / "test")
    ids, full = want.agnostic_matrix()
    assert sorted(got.train_hashes) == sorted(ids)
    for q in got.test_hashes:
        col = got.query(ids, [q]).flatten().double()
        ref = full[:, want.test_hashes.index(q)].double()
        torch.testing.assert_close(col, ref, rtol=1e-5, atol=1e-5)


def test_an_ivf_search_that_finds_fewer_than_k_keeps_only_exact_scores(tmp_path):
    """One list of many visited: faiss pads with id -1 and a finite stand-in value. No padded
    entry may land on a sample: every kept score is that sample's exact score."""
    train = clustered(400, 8, 32, seed=0)
    queries = clustered(4, 8, 32, seed=1)
    write(tmp_path / "train", train, batch=100)
    write(tmp_path / "test", queries, prefix="q")
    GradientIndex.build(tmp_path / "train", tmp_path / "idx", "dot", "ivf", nlist=16)
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=200, nprobe=1)
    exact = queries.double() @ train.double().T
    kept = 0
    for q in got.test_hashes:
        col = got.query(got.train_hashes, [q]).flatten().double()
        for h, v in zip(got.train_hashes, col.tolist()):
            if v == v:  # NaN: not kept for this query
                kept += 1
                assert v == pytest.approx(float(exact[int(q[1:]), int(h[1:])]), rel=1e-4, abs=1e-4)
    assert 0 < kept < 2 * 200 * len(got.test_hashes)  # fewer than k found: padding was there
