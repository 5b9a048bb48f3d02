"""IVF-PQ re-ranking from the part's memory-mapped re-rank file (index format 2): the file holds
the indexed vectors, the returned scores are exact inner products (float64 brute force), a
full short list gives the exact top-k, a damaged file is refused by name, and a format-1 index
(IndexRefineFlat inside the FAISS file) is still read and ranks the same."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dattri_llm.attribution.index import GradientIndex, IndexFormatError
from tests.helpers.index import train_vectors, write

faiss = pytest.importorskip("faiss")

PQ = {"nlist": 4, "pq_m": 8, "pq_bits": 4, "train_size": 200}


@pytest.fixture
def built(tmp_path):
    train, test = train_vectors(300, seed=2), train_vectors(7, seed=5)
    write(tmp_path / "train", train, batch=32)
    write(tmp_path / "test", test, prefix="q")
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "cosine", "ivf", **PQ)
    return tmp_path, train, test, index


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def test_rerank_file_holds_the_indexed_vectors(built):
    root, train, _, index = built
    entry = index.meta["parts"][0]
    path = root / "idx" / entry["rerank_file"]
    assert path.name == "part_0.vectors.f32" and path.stat().st_size == 300 * 32 * 4
    rows = np.fromfile(path, dtype=np.float32).reshape(300, 32)
    hashes = json.loads((root / "idx" / entry["samples_file"]).read_text())["hashes"]
    want = unit(train)[[int(h[1:]) for h in hashes]]
    torch.testing.assert_close(torch.from_numpy(rows).double(), want, rtol=0, atol=1e-6)
    # the PQ file is small: the vectors are not inside it
    assert entry["bytes"] < path.stat().st_size
    assert not list((root / "idx").glob(".*"))  # the spill file was renamed, not left


def test_scores_are_exact_and_a_full_short_list_is_the_exact_top_k(built):
    root, train, test, _ = built
    index = GradientIndex.open(root / "idx")
    exact = unit(test) @ unit(train).T  # float64 brute force
    for kw in ({}, {"nprobe": 1, "rerank": 2}):
        got = index.search(root / "test", k=5, **kw).top_k(5)
        for q, (ids, vals) in enumerate(zip(got.proponent_hashes, got.proponent_scores)):
            want = exact[q, [int(h[1:]) for h in ids]]
            torch.testing.assert_close(vals.double(), want, rtol=0, atol=1e-5)
    full = index.search(root / "test", k=5, nprobe=4, rerank=60).top_k(5)  # 300 candidates
    top, bottom = exact.topk(5, dim=1), exact.topk(5, dim=1, largest=False)
    assert full.proponent_hashes == [[f"t{i}" for i in r] for r in top.indices.tolist()]
    assert full.opponent_hashes == [[f"t{i}" for i in r] for r in bottom.indices.tolist()]
    torch.testing.assert_close(full.proponent_scores.double(), top.values, rtol=0, atol=1e-5)
    torch.testing.assert_close(full.opponent_scores.double(), bottom.values, rtol=0, atol=1e-5)


def test_a_truncated_or_missing_rerank_file_is_named(built):
    root, *_ = built
    path = root / "idx" / "part_0.vectors.f32"
    data = path.read_bytes()
    path.write_bytes(data[:-4])
    with pytest.raises(IndexFormatError, match=r"part_0\.vectors\.f32 holds .* truncated"):
        GradientIndex.open(root / "idx")
    path.unlink()
    with pytest.raises(IndexFormatError, match=r"part_0\.vectors\.f32 is missing"):
        GradientIndex.open(root / "idx")


def test_a_format_1_index_is_still_read(built):
    """Rewrite the part as format 1 wrote it (IndexRefineFlat over the same trained IVF-PQ)."""
    root, *_ = built
    d = root / "idx"
    v2 = GradientIndex.open(d).search(root / "test", k=4, rerank=3).top_k(4)
    meta = json.loads((d / "index.json").read_text())
    entry = meta["parts"][0]
    rows = np.fromfile(d / entry["rerank_file"], dtype=np.float32).reshape(300, 32)
    base = faiss.clone_index(faiss.read_index(str(d / entry["faiss"])))
    base.reset()
    old = faiss.IndexRefineFlat(base)
    old.add(rows)
    faiss.write_index(old, str(d / entry["faiss"]))
    (d / entry.pop("rerank_file")).unlink()
    meta["version"] = 1
    (d / "index.json").write_text(json.dumps(meta))
    v1 = GradientIndex.open(d).search(root / "test", k=4, rerank=3).top_k(4)
    assert v1.proponent_hashes == v2.proponent_hashes
    assert v1.opponent_hashes == v2.opponent_hashes
    torch.testing.assert_close(v1.proponent_scores, v2.proponent_scores, rtol=1e-5, atol=1e-6)


def test_auto_above_the_flat_limit_is_fast_scan_ivf_pq_with_exact_scores(tmp_path, monkeypatch):
    from dattri_llm.attribution.index import kinds
    from tests.helpers.index import clustered

    monkeypatch.setattr(kinds, "AUTO_FLAT_MAX", 1000)  # 2000 x 32 numbers: above it
    train, queries = clustered(2000, 20, 32, seed=0), clustered(20, 20, 32, seed=1)
    write(tmp_path / "train", train, batch=100)
    write(tmp_path / "test", queries, prefix="q")
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "cosine")
    assert index.kind == "ivf" and index.meta["requested_kind"] == "auto"
    assert {k: index.params[k] for k in ("nlist", "pq_m", "pq_bits", "rerank")} == {
        "nlist": 44,  # sqrt(2000)
        "pq_m": 8,  # D / 4
        "pq_bits": 4,
        "rerank": 25,
    }
    assert isinstance(faiss.downcast_index(index._parts[0][0]), faiss.IndexIVFPQFastScan)
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=10).top_k(10)
    exact = unit(queries) @ unit(train).T
    for q, (ids, vals) in enumerate(zip(got.proponent_hashes, got.proponent_scores)):
        torch.testing.assert_close(
            vals.double(), exact[q, [int(h[1:]) for h in ids]], rtol=0, atol=1e-5
        )
    # every list probed and every vector in the short list: the exact top-k (the defaults'
    # recall on real gradients is benchmarked, docs/benchmarks/index.md)
    full = index.search(tmp_path / "test", k=10, nprobe=44, rerank=200).top_k(10)
    want = exact.topk(10, dim=1)  # values: ties at float32 round-off may swap two samples
    torch.testing.assert_close(full.proponent_scores.double(), want.values, rtol=0, atol=1e-5)
    same = [
        set(g) == {f"t{i}" for i in w} for g, w in zip(full.proponent_hashes, want.indices.tolist())
    ]
    assert sum(same) >= len(same) - 2


def test_fast_scan_wants_an_even_pq_m(built):
    root, *_ = built
    with pytest.raises(ValueError, match=r"pq_m=1 with pq_bits=4 .* must be even"):
        GradientIndex.build(root / "train", root / "odd", "dot", "ivf", nlist=2, pq_m=1, pq_bits=4)


def test_cli_builds_a_fast_scan_index(built, capsys):
    from dattri_llm.cli import main

    root, *_ = built
    argv = ["index", "build", str(root / "train"), "-o", str(root / "cli"), "--kind", "ivf"]
    argv += ["--nlist", "4", "--pq-m", "8", "--pq-bits", "4", "--rerank", "3"]
    assert main(argv) == 0, capsys.readouterr().err
    index = GradientIndex.open(root / "cli")
    assert index.params["pq_bits"] == 4 and index.params["rerank"] == 3
    assert isinstance(faiss.downcast_index(index._parts[0][0]), faiss.IndexIVFPQFastScan)
    assert (root / "cli" / "part_0.vectors.f32").stat().st_size == 300 * 32 * 4
