"""``Explorer``: a live query against a captured store ranks as ``attribute_from_cache`` does.

The reference is the library's stored road: the same prompt and completion captured into a
query store by ``dattri-llm capture`` and scored with ``attribute_from_cache(top_k=k)``, and,
independently, the Grad-Cos formula written here over the stored vectors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dattri_llm import AttributionArguments, Explorer, TracInAttributor
from dattri_llm.gradient.causal_lm import CaptureMismatchError
from dattri_llm.gradient.sources import DiskGradientSource
from tests.helpers.tiny_lm import QUERIES, captured_stores, corpus, save_tiny_lm

pytest.importorskip("transformers")
pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(model dir, train store, query store)``, captured with the command line."""
    return captured_stores(tmp_path_factory.mktemp("explorer"), corpus(n_per_topic=5))


def _load(model_dir: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model, AutoTokenizer.from_pretrained(model_dir)


def _vectors(store: Path) -> dict[str, torch.Tensor]:
    out = {}
    for b in DiskGradientSource(str(store)):
        n = len(b.hashes)
        parts = [lg.materialize().data.reshape(n, -1).double() for lg in b.gradient.layers.values()]
        out.update(zip(b.hashes, torch.cat(parts, dim=1)))
    return out


@pytest.mark.parametrize("method", ["grad-cos", "grad-dot"])
def test_top_k_equals_attribute_from_cache_and_the_formula(lm, tmp_path: Path, method) -> None:
    model_dir, train, query = lm
    model, tok = _load(model_dir)
    explorer = Explorer(model, tok, train, method=method)
    k = 7
    attributor = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path), show_progress=False),
        normalized_grad=method == "grad-cos",
    )
    ref = attributor.attribute_from_cache(str(train), str(query), top_k=k).top_k(k)
    col = {h: j for j, h in enumerate(ref.test_hashes)}
    train_vecs, query_vecs = _vectors(train), _vectors(query)
    ids = list(train_vecs)
    G = torch.stack([train_vecs[h] for h in ids])
    for q in QUERIES:
        got = explorer.attribute(q["prompt"], q["completion"], k=k)
        assert got.completion == q["completion"] and not got.generated
        j = col[got.query_id]  # the live query is the very sample the query store holds
        assert [r.id for r in got.results] == ref.proponent_hashes[j]
        scores = torch.tensor([r.score for r in got.results], dtype=torch.float64)
        # float32 sums in another order (one query, not a stack of three): round-off only
        tol = 1e-5 * float(scores.abs().max())
        torch.testing.assert_close(scores, ref.proponent_scores[j].double(), rtol=0, atol=tol)
        # the formula, from the stored vectors
        v = query_vecs[got.query_id]
        s = G @ v
        if method == "grad-cos":
            s = s / (G.norm(dim=1) * v.norm())
        best = s.topk(k)
        assert [r.id for r in got.results] == [ids[i] for i in best.indices.tolist()]
        torch.testing.assert_close(scores, best.values, rtol=0, atol=tol)
        assert [r.rank for r in got.results] == list(range(1, k + 1))
        assert all(r.text is not None for r in got.results)


def test_generated_completion_is_greedy_and_attributed(lm) -> None:
    model_dir, train, _ = lm
    model, tok = _load(model_dir)
    explorer = Explorer(model, tok, train, max_new_tokens=4)
    got = explorer.attribute("cat kitten", None, k=3)
    assert got.generated
    ids = tok("cat kitten", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert got.completion == tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    again = explorer.attribute("cat kitten", got.completion, k=3)
    assert [(r.id, r.score) for r in again.results] == [(r.id, r.score) for r in got.results]
    assert explorer.attribute("cat", "purr", k=10**6).results  # k beyond the store is clamped


def test_other_model_layers_projection_or_dtype_are_refused_by_name(lm, tmp_path: Path) -> None:
    model_dir, train, _ = lm
    model, tok = _load(model_dir)
    other, _ = _load(save_tiny_lm(tmp_path / "other", seed=3))
    half, _ = _load(model_dir, torch.bfloat16)
    for kwargs, name in (
        ({"model": other}, "model: "),
        ({"layers": ["transformer.h.*"]}, "layers: "),
        ({"projection": "sparse:128"}, "projection: "),
        ({"model": half}, "dtype: 'float32' vs 'bfloat16'"),
    ):
        args = {"model": model, "tokenizer": tok, "train_store": train, **kwargs}
        with pytest.raises(CaptureMismatchError, match=name):
            Explorer(**args)
    with pytest.raises(ValueError, match="capture.json"):
        Explorer(model, tok, tmp_path)  # not a capture
    explorer = Explorer(model, tok, train)
    with pytest.raises(ValueError, match="k must be"):
        explorer.attribute("cat", "purr", k=0)
    with pytest.raises(ValueError, match="completion"):
        explorer.attribute("cat", "", k=1)


def test_index_search_gives_the_same_top_k(lm, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    from dattri_llm import GradientIndex

    model_dir, train, _ = lm
    model, tok = _load(model_dir)
    index = GradientIndex.build(str(train), str(tmp_path / "index"), metric="cosine")
    scan = Explorer(model, tok, train)
    indexed = Explorer(model, tok, train, index=index)
    for q in QUERIES:
        a = scan.attribute(q["prompt"], q["completion"], k=5)
        b = indexed.attribute(q["prompt"], q["completion"], k=5)
        assert [r.id for r in a.results] == [r.id for r in b.results]
        for x, y in zip(a.results, b.results):
            assert abs(x.score - y.score) < 1e-4


def test_the_hook_manager_is_built_once_and_answers_stay_exact(lm, tmp_path: Path, monkeypatch):
    from dattri_llm.gradient.hooks import HookManager

    built = []
    init = HookManager.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(HookManager, "__init__", counted)
    model_dir, train, query = lm
    model, tok = _load(model_dir)
    k = 5
    attributor = TracInAttributor(
        AttributionArguments(output_dir=str(tmp_path), show_progress=False), normalized_grad=True
    )
    ref = attributor.attribute_from_cache(str(train), str(query), top_k=k).top_k(k)
    col = {h: j for j, h in enumerate(ref.test_hashes)}
    built.clear()
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    with Explorer(model, tok, train) as explorer:
        assert built == []  # nothing is hooked before the first query
        first = [explorer.attribute(q["prompt"], q["completion"], k=k) for q in QUERIES]
        again = [explorer.attribute(q["prompt"], q["completion"], k=k) for q in QUERIES]
        assert len(built) == 1  # six queries, one manager
        for a, b in zip(first, again):  # a reused manager leaves nothing behind a query
            assert [(r.id, r.score) for r in a.results] == [(r.id, r.score) for r in b.results]
            j = col[a.query_id]
            assert [r.id for r in a.results] == ref.proponent_hashes[j]
            got = torch.tensor([r.score for r in a.results], dtype=torch.float64)
            tol = 1e-5 * float(got.abs().max())
            torch.testing.assert_close(got, ref.proponent_scores[j].double(), rtol=0, atol=tol)
            assert a.exact and a.expected_recall is None
        explorer.attribute("cat", None, k=2)  # generation runs with the hooks up, inactive
        assert len(built) == 1
    # closed: the model carries no hook of the explorer's; a later query builds them anew
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks_before
    b = explorer.attribute(QUERIES[0]["prompt"], QUERIES[0]["completion"], k=k)
    assert len(built) == 2 and [r.id for r in b.results] == [r.id for r in first[0].results]
    explorer.close()


def test_answers_through_an_approximate_index_say_so(lm, tmp_path: Path) -> None:
    pytest.importorskip("faiss")
    from dattri_llm import GradientIndex

    model_dir, train, _ = lm
    model, tok = _load(model_dir)
    n = Explorer(model, tok, train).num_train
    ivf = GradientIndex.build(str(train), tmp_path / "ivf", metric="cosine", kind="ivf", nlist=1)
    flat = GradientIndex.build(str(train), tmp_path / "flat", metric="cosine", kind="flat")
    q = QUERIES[0]
    exact = Explorer(model, tok, train).attribute(q["prompt"], q["completion"], k=n)
    got = Explorer(model, tok, train, index=ivf).attribute(q["prompt"], q["completion"], k=n)
    # the build measured its recall on held-out vectors: the answer passes it on
    assert got.exact is False and got.expected_recall == ivf.expected_recall is not None
    # one list probed: here every sample is found, so the ranking is the scan's all the same
    assert [r.id for r in got.results] == [r.id for r in exact.results]
    assert Explorer(model, tok, train, index=flat).attribute(q["prompt"], q["completion"]).exact
    ivf.meta["expected_recall"] = 0.97  # the figure comes from the index, not a constant
    got = Explorer(model, tok, train, index=ivf).attribute(q["prompt"], q["completion"], k=3)
    assert got.exact is False and got.expected_recall == 0.97
