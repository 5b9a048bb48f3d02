"""``index="auto"``: a small store is scanned, a large one searched through a cached index.

The cache is keyed by the store's content: a second explorer opens the index the first built,
and its answers equal the scan's (a flat index over a small store: exact).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dattri_llm import Explorer
from dattri_llm.attribution.index import cache
from dattri_llm.gradient.store import GradientStorageManager
from tests.helpers.tiny_lm import QUERIES, captured_stores, corpus

pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("faiss")


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> tuple[Path, Path]:
    """``(model dir, train store)``, captured with the command line."""
    model_dir, train, _ = captured_stores(tmp_path_factory.mktemp("auto"), corpus(n_per_topic=4))
    return model_dir, train


def _load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def test_a_small_store_is_scanned(lm) -> None:
    model_dir, train = lm
    model, tok = _load(model_dir)
    explorer = Explorer(model, tok, train, index="auto")
    assert explorer.index is None and explorer.exact
    assert not Path(f"{train}.index").exists()


def test_a_large_store_is_indexed_once_and_reopened(lm, tmp_path: Path, monkeypatch) -> None:
    from dattri_llm import GradientIndex

    model_dir, train = lm
    store = tmp_path / "train"
    shutil.copytree(train, store)
    model, tok = _load(model_dir)
    monkeypatch.setattr(cache, "SCAN_MAX_NUMBERS", 0)  # this store counts as large
    builds = []
    build = GradientIndex.build.__func__

    def counted(cls, *args, **kwargs):
        builds.append(kwargs)
        return build(cls, *args, **kwargs)

    monkeypatch.setattr(GradientIndex, "build", classmethod(counted))
    first = Explorer(model, tok, store, index="auto")
    fingerprint = GradientStorageManager(str(store)).fingerprint()
    where = cache.index_directory(store, "cosine", fingerprint)
    assert first.index.directory == where and where.parent == tmp_path / "train.index"
    assert len(builds) == 1 and builds[0]["kind"] == "auto" and first.index.kind == "flat"
    assert sorted(p.name for p in where.parent.iterdir()) == [where.name]  # no leftover
    second = Explorer(model, tok, store, index="auto", method="grad-cos")
    assert len(builds) == 1 and second.index.directory == where  # opened, not rebuilt
    dot = Explorer(model, tok, store, index="auto", method="grad-dot")
    assert len(builds) == 2 and dot.index.metric == "dot"
    scan = Explorer(model, tok, store)
    for q in QUERIES:
        a = scan.attribute(q["prompt"], q["completion"], k=5)
        b = second.attribute(q["prompt"], q["completion"], k=5)
        assert [r.id for r in a.results] == [r.id for r in b.results] and b.exact
        torch.testing.assert_close(
            torch.tensor([r.score for r in b.results]),
            torch.tensor([r.score for r in a.results]),
            rtol=0,
            atol=1e-5,
        )
    # a damaged cache (an interrupted build: no index.json) is built again, in place
    (where / "index.json").unlink()
    again = Explorer(model, tok, store, index="auto")
    assert len(builds) == 3 and again.index.directory == where


def test_another_store_content_gets_another_index_directory(lm) -> None:
    _, train = lm
    fp = GradientStorageManager(str(train)).fingerprint()
    other = {**fp, "rows": fp["rows"] + 1}
    a = cache.index_directory(train, "cosine", fp)
    assert a != cache.index_directory(train, "cosine", other)
    assert a != cache.index_directory(train, "dot", fp)
    assert a == cache.index_directory(str(train) + "/", "cosine", fp)


def test_a_store_is_indexed_above_either_bound() -> None:
    n, d = cache.SCAN_MAX_SAMPLES, cache.SCAN_MAX_NUMBERS
    assert not cache.wants_index(n, 1)
    assert cache.wants_index(n + 1, 1)  # many narrow samples: a scan reads each
    assert not cache.wants_index(1, d)
    assert cache.wants_index(1, d + 1)
