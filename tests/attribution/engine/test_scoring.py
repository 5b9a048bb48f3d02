"""Scoring at scale: chunks from a memory budget, top-k streaming, resumable scoring (float64).

References: the full matrix of the same attributor (itself checked against torch.func brute
force in the attributor tests), and here once more a brute-force Grad-Dot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dattri_llm import (
    AttributionArguments,
    AttributionScore,
    AttributionTask,
    EKFACAttributor,
    GradientStorageManager,
    TracInAttributor,
)
from dattri_llm.attribution.engine.scoring import ScoreLoop
from tests.helpers.reference import assert_same_formula
from tests.helpers.scoring import capture, lm_loss, make_model, samples


def args(tmp_path, **kw) -> AttributionArguments:
    kw.setdefault("show_progress", False)
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A train store (24 samples, batches of 3) and a test store (5 queries)."""
    root = tmp_path_factory.mktemp("scale")
    model = make_model()
    train, test = samples(24, 1), samples(5, 2)
    capture(model, GradientStorageManager(root / "train"), train, 3)
    capture(model, GradientStorageManager(root / "test"), test, 5)
    return root, model, train, test


def brute_force(model: nn.Module, train: list[dict], test: list[dict]) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p: dict, ids: torch.Tensor) -> torch.Tensor:
        return lm_loss(lambda x: functional_call(model, p, (x,)), {"input_ids": ids[None]})

    g = vmap(grad(one), in_dims=(None, 0))

    def flat(ds: list[dict]) -> torch.Tensor:
        gs = g(params, torch.stack([d["input_ids"] for d in ds]))
        return torch.cat([gs[k].reshape(len(ds), -1) for k in params], dim=1)

    return flat(train) @ flat(test).T


def same_top_k(a, b, k: int) -> None:
    ta, tb = a.top_k(k), b.top_k(k)
    assert ta.test_hashes == tb.test_hashes
    assert ta.proponent_hashes == tb.proponent_hashes
    assert ta.opponent_hashes == tb.opponent_hashes
    assert torch.allclose(ta.proponent_scores, tb.proponent_scores, rtol=1e-12, atol=0)
    assert torch.allclose(ta.opponent_scores, tb.opponent_scores, rtol=1e-12, atol=0)


# ---- chunks from the memory budget ------------------------------------------------------------
def test_chunks_follow_the_budget_and_stay_exact(stores, tmp_path, monkeypatch):
    root, model, train, test = stores
    ref = brute_force(model, train, test)
    counts = {}
    orig = ScoreLoop.score_chunk

    def counting(self, blocks):
        counts[self.att.args.score_memory_gb] = counts.get(self.att.args.score_memory_gb, 0) + 1
        return orig(self, blocks)

    monkeypatch.setattr(ScoreLoop, "score_chunk", counting)
    out = {}
    for gb in (1e-6, 1.0):  # one row per chunk, or every record joined into one chunk
        s = TracInAttributor(args(tmp_path, score_memory_gb=gb)).attribute_from_cache(
            root / "train", root / "test"
        )
        out[gb] = s.query(train, test)
        err = float((out[gb] - ref).abs().max() / ref.abs().max())
        assert err < 1e-12, (gb, err)
    assert counts[1e-6] == 8  # never below one record (3 rows) per chunk
    assert counts[1.0] == 1
    with pytest.raises(ValueError, match="score_memory_gb"):
        AttributionArguments(score_memory_gb=0)


def test_the_test_side_join_releases_each_layer_of_the_blocks_as_it_goes(monkeypatch):
    """The join of the test blocks frees a layer's block copies before the next layer is joined
    (peak: the joined side plus one layer, not twice the side) and equals concatenate."""
    import weakref

    from dattri_llm.attribution.engine import blocks as blocks_mod
    from dattri_llm.gradient.gradient import Factorized, Gradient, GradientBlock

    def block(seed: int) -> GradientBlock:
        gen = torch.Generator().manual_seed(seed)
        layers = {
            name: Factorized(
                torch.randn(2, 3 + seed, 4, generator=gen),  # other token counts: padded
                torch.randn(2, 3 + seed, 5, generator=gen),
                "nn.Linear",
                {"in_features": 4, "out_features": 5, "bias": False},
            )
            for name in ("l1", "l2", "l3")
        }
        return GradientBlock(seed, Gradient(layers), [f"h{seed}a", f"h{seed}b"])

    ref = Gradient.concatenate([block(s).gradient for s in range(3)])
    blocks = [block(s) for s in range(3)]
    alive = {n: [weakref.ref(b.gradient.layers[n].a) for b in blocks] for n in ("l1", "l2", "l3")}
    seen = []
    orig = blocks_mod.concat_layer

    def watching(parts):
        seen.append({n: sum(r() is not None for r in refs) for n, refs in alive.items()})
        return orig(parts)

    monkeypatch.setattr(blocks_mod, "concat_layer", watching)
    joined = blocks_mod.join_releasing(blocks, ["l1", "l2", "l3"])
    assert blocks == []
    # when l2 is joined, l1's block copies are gone (the parts of l2 are still held)
    assert seen[1]["l1"] == 0 and seen[2]["l2"] == 0 and seen[2]["l3"] == 3
    for n in ("l1", "l2", "l3"):
        assert torch.equal(joined.layers[n].a, ref.layers[n].a)
        assert torch.equal(joined.layers[n].g, ref.layers[n].g)


@pytest.mark.parametrize("live", [False, True])
def test_a_train_chunk_frees_its_blocks_layer_by_layer(stores, tmp_path, monkeypatch, live):
    """The score loop holds a chunk's blocks only in the list its join empties: when a layer is
    joined, the block copies of the layer joined before are gone (the budget counts a chunk's
    gradients once), from a store and live; the scores stay exact."""
    import weakref

    from dattri_llm.attribution.engine import blocks as blocks_mod

    root, model, train, test = stores
    previous: list[weakref.ref] = []
    alive_after: list[int] = []
    orig = blocks_mod.concat_layer

    def watching(parts):
        alive_after.append(sum(r() is not None for r in previous))
        previous[:] = [weakref.ref(p) for p in parts]
        return orig(parts)

    monkeypatch.setattr(blocks_mod, "concat_layer", watching)
    att = TracInAttributor(args(tmp_path, score_memory_gb=1.0, per_device_train_batch_size=3))
    if live:
        from dattri_llm import AttributionTask

        att.task = AttributionTask(lm_loss, model)
        score = att.attribute(train, test)
    else:
        score = att.attribute_from_cache(root / "train", root / "test")
    joins = len(alive_after)
    assert joins >= 3  # one chunk of several blocks, joined layer by layer (and the test side)
    assert alive_after[1:] == [0] * (joins - 1)
    ref = brute_force(model, train, test)
    assert float((score.query(train, test) - ref).abs().max() / ref.abs().max()) < 1e-12


# ---- top-k streaming ----------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 30])
def test_top_k_equals_sorting_the_full_matrix(stores, tmp_path, k):
    root, _, train, test = stores
    att = TracInAttributor(args(tmp_path, score_memory_gb=1e-6))
    full = att.attribute_from_cache(root / "train", root / "test")
    top = att.attribute_from_cache(root / "train", root / "test", top_k=k)
    kept = min(k, 24)  # beyond the train samples: every one
    assert top.top_k_kept == kept and top.num_train == 24
    same_top_k(top, full, kept)
    if kept > 1:
        same_top_k(top, full, kept - 1)
    if kept < 24:
        with pytest.raises(ValueError, match="top_k"):
            top.top_k(k + 1)
    else:  # everything was kept: any k is every sample
        same_top_k(top, full, 24)
        assert top.top_k(k + 1).proponent_hashes == top.top_k(24).proponent_hashes
    # kept entries equal the full matrix; the others are NaN (never a made-up number)
    q = top.query(top.train_hashes)
    f = full.query(top.train_hashes)
    ok = ~q.isnan()
    assert int(ok.sum(0).min()) >= kept
    assert_same_formula(q[ok], f[ok])
    # memory: at most 2k kept rows per query, not N
    assert top.scores.shape[0] <= min(24, 2 * k * len(test))
    back = AttributionScore.load(top.save(tmp_path / "saved"))
    same_top_k(back, full, kept)


def test_top_k_sums_a_sample_over_checkpoints_and_duplicates(tmp_path):
    """Rows of one sample at two checkpoints (and a duplicated item) are summed before ranking."""
    model = make_model()
    train = samples(9, 3)
    train.insert(3, dict(train[2]))  # a duplicated item: one identity, two rows in one batch
    test = samples(3, 4)
    st = GradientStorageManager(tmp_path / "train")
    capture(model, st, train, 4, ckpt=0)
    model2 = make_model(seed=5)
    st2 = GradientStorageManager(tmp_path / "train", mode="append")
    capture(model2, st2, train[::-1], 3, ckpt=1)  # other batching and order at checkpoint 1
    for m, c in ((model, 0), (model2, 1)):
        q = GradientStorageManager(tmp_path / "test", mode="append" if c else "create")
        capture(m, q, test, 3, ckpt=c)
    att = TracInAttributor(args(tmp_path, score_memory_gb=1e-6), checkpoint_weights=[1.0, 0.5])
    full = att.attribute_from_cache(tmp_path / "train", tmp_path / "test")
    for k in (1, 2, 4):
        with pytest.warns(UserWarning, match="more than once"):
            top = att.attribute_from_cache(tmp_path / "train", tmp_path / "test", top_k=k)
        assert top.num_train == 9
        with pytest.warns(UserWarning, match="occurs 2 times"):
            same_top_k(top, full, k)


def test_live_top_k_and_other_attributors(stores, tmp_path):
    root, model, train, test = stores
    task = AttributionTask(lm_loss, model)
    att = TracInAttributor(args(tmp_path, per_device_train_batch_size=4), task=task)
    full = att.attribute(train, test)
    same_top_k(att.attribute(train, test, top_k=4), full, 4)
    huge = att.attribute(train, test, top_k=10**12)  # every one of the 24 samples
    assert huge.top_k_kept == 24
    same_top_k(huge, full, 24)
    ek = EKFACAttributor(args(tmp_path))
    full = ek.attribute_from_cache(root / "train", root / "test")
    same_top_k(ek.attribute_from_cache(root / "train", root / "test", top_k=2), full, 2)
    huge = ek.attribute_from_cache(root / "train", root / "test", top_k=10**12)  # general loop
    assert huge.top_k_kept == 24
    same_top_k(huge, full, 24)
    with pytest.raises(ValueError, match="top_k must be"):
        att.attribute(train, test, top_k=0)


# ---- resumable scoring ------------------------------------------------------------------------
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import torch
    from dattri_llm import AttributionArguments, TracInAttributor
    from dattri_llm.attribution.engine import resume, scoring

    kill_after, where, top_k = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    top_k = None if top_k == "none" else int(top_k)
    saved = {{"n": 0}}
    orig = resume.atomic_write

    def write(path, data, fsync=False):
        if where == "mid-write" and path.name == "progress.json":
            saved["n"] += 1
            if saved["n"] > kill_after:
                os.kill(os.getpid(), signal.SIGKILL)  # the part is written, progress is not
        orig(path, data, fsync=fsync)
        if where == "after" and path.name == "progress.json":
            saved["n"] += 1
            if saved["n"] >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)

    resume.atomic_write = write
    chunks = {{"n": 0}}
    score_chunk = scoring.ScoreLoop.score_chunk

    def counting(self, blocks):
        chunks["n"] += 1
        return score_chunk(self, blocks)

    scoring.ScoreLoop.score_chunk = counting
    args = AttributionArguments(output_dir={out!r}, use_cpu=True, show_progress=False,
                                score_memory_gb=1e-6, resumable=True)
    s = TracInAttributor(args).attribute_from_cache({train!r}, {test!r}, top_k=top_k)
    s.save({result!r})
    print("CHUNKS", chunks["n"])
    """
)


def _run_child(tmp_path, stores, kill_after: int, where: str, top_k) -> subprocess.CompletedProcess:
    root = stores[0]
    code = _CHILD.format(
        repo=str(Path(__file__).resolve().parents[3]),
        out=str(tmp_path / "out"),
        train=str(root / "train"),
        test=str(root / "test"),
        result=str(tmp_path / "result"),
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", code, str(kill_after), where, str(top_k)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("where", "top_k"), [("after", "none"), ("mid-write", "none"), ("after", 3)]
)
def test_sigkill_then_rerun_gives_the_uninterrupted_result(stores, tmp_path, where, top_k):
    root = stores[0]
    killed = _run_child(tmp_path, stores, 3, where, top_k)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    ckpt = tmp_path / "out" / "scoring_checkpoints"
    assert any(ckpt.rglob("progress.json"))
    done = _run_child(tmp_path, stores, 10**6, "none", top_k)
    assert done.returncode == 0, done.stderr
    chunks = int(done.stdout.split("CHUNKS")[1])
    assert chunks == 8 - 3  # the three checkpointed chunks are not scored again
    assert not ckpt.exists() or not any(ckpt.iterdir())  # removed once the result is returned
    resumed = AttributionScore.load(tmp_path / "result")
    att = TracInAttributor(args(tmp_path / "ref", score_memory_gb=1e-6))  # the same call
    full = att.attribute_from_cache(root / "train", root / "test", top_k=None)
    if top_k == "none":
        assert resumed.train_hashes == full.train_hashes
        assert_same_formula(resumed.scores, full.scores)
    else:
        same_top_k(resumed, full, top_k)


def test_a_changed_call_does_not_resume(stores, tmp_path):
    root = stores[0]
    killed = _run_child(tmp_path, stores, 2, "after", "none")
    assert killed.returncode == -signal.SIGKILL
    a = args(tmp_path, score_memory_gb=1e-6, resumable=True)
    chunks = []
    orig = ScoreLoop.score_chunk
    ScoreLoop.score_chunk = lambda self, b: (chunks.append(1), orig(self, b))[1]
    try:
        s = TracInAttributor(a, normalized_grad=True).attribute_from_cache(
            root / "train", root / "test"
        )
    finally:
        ScoreLoop.score_chunk = orig
    assert len(chunks) == 8  # another fingerprint: scored from the start
    ref = TracInAttributor(args(tmp_path), normalized_grad=True).attribute_from_cache(
        root / "train", root / "test"
    )
    assert torch.allclose(s.scores, ref.scores, rtol=1e-12, atol=1e-15)


def test_progress_bar_counts_samples(stores, tmp_path, capsys):
    root = stores[0]
    TracInAttributor(args(tmp_path, show_progress=True)).attribute_from_cache(
        root / "train", root / "test"
    )
    err = capsys.readouterr().err
    assert "sample/s" in err and "/24" in err  # a rate over samples and their total (ETA)
    _, model, train, test = stores
    task = AttributionTask(lm_loss, model)
    TracInAttributor(args(tmp_path, show_progress=True), task=task).attribute(train, test)
    err = capsys.readouterr().err
    assert "train ckpt 0" in err and "sample/s" in err and "/24" in err  # live, too


def test_trajectory_attributors_reduce_to_top_k(tmp_path):
    """AdamW-influence: a sample at two steps is summed; top_k is a reduction of the result."""
    from dattri_llm import AdamWInfluenceAttributor
    from tests.helpers.adamw_run import library, make_run

    run = make_run(tmp_path, "adamw")
    full = library(run, tmp_path)
    for k in (1, 3):
        att = AdamWInfluenceAttributor(args(tmp_path), loss_reduction=run.reduction)
        top = att.attribute_from_cache(
            tmp_path / "train", tmp_path / "query", dynamics=run.extra["dynamics"], top_k=k
        )
        assert top.top_k_kept == k and top.num_train == 10
        same_top_k(top, full, k)


def test_a_partly_factorized_test_side_gets_chunks_as_wide_as_the_queries(
    stores, tmp_path, monkeypatch
):
    """Test layers the budget leaves factorized are re-materialized for every chunk, so chunks
    take about as many rows as test columns, unless one layer of such a chunk would exceed
    ``_REMATERIALIZE_LAYER`` (fresh pages then cost more). Scores are exact either way."""
    from dattri_llm.attribution.engine import prepared, scoring

    root, model, train, test = stores
    ref = brute_force(model, train, test)
    row_bytes = 88 * 8  # head: 7 x 11 weights + 11 biases, float64: the largest layer's row
    monkeypatch.setattr(prepared, "_DENSE_TEST_SHARE", 0.0)  # no test layer densified
    monkeypatch.setattr(scoring, "_LAYER_BUFFER", row_bytes)  # one allocator-friendly row
    monkeypatch.setattr(scoring, "_REMATERIALIZE", 1)
    seen = []
    orig = ScoreLoop.chunk_rows

    def spy(self, block):
        rows = orig(self, block)
        seen.append((rows, self.test_for(block).dense, self.test_for(block).num_rows))
        return rows

    monkeypatch.setattr(ScoreLoop, "chunk_rows", spy)
    for cap, want in ((10 * row_bytes, len(test)), (row_bytes, 3)):  # 3: one record's rows
        monkeypatch.setattr(scoring, "_REMATERIALIZE_LAYER", cap)
        seen.clear()
        s = TracInAttributor(args(tmp_path, score_memory_gb=1.0)).attribute_from_cache(
            root / "train", root / "test"
        )
        assert not seen[0][1] and seen[0][2] == len(test)  # the test side is factorized
        assert {r for r, _, _ in seen} == {want}, (cap, seen[:3])
        err = float((s.query(train, test) - ref).abs().max() / ref.abs().max())
        assert err < 1e-12, (cap, err)
