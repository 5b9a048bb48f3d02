"""GradientIndex.build streams the store: an index built in many small
blocks is the index built in one go (same FAISS bytes, same top-k and scores), for every kind,
on a multi-partition store whose samples repeat across steps and partitions."""

from __future__ import annotations

import numpy as np
import pytest

from dattri_llm.attribution.index import GradientIndex
from dattri_llm.attribution.index import kinds as K
from dattri_llm.attribution.index.vectors import train_parts
from tests.helpers.index import faiss_bytes, train_vectors, two_rank_store, write
from tests.helpers.reference import assert_same_formula

faiss = pytest.importorskip("faiss")

KINDS = [
    ("flat", {}),
    ("ivf", {"nlist": 4, "train_size": 150, "seed": 7}),
    ("ivf", {"nlist": 4, "train_size": 180, "pq_m": 8, "pq_bits": 4, "rerank": 3}),
    ("hnsw", {"M": 8, "efConstruction": 20}),
]


@pytest.mark.parametrize("kind,params", KINDS)
def test_small_blocks_give_the_one_go_index(tmp_path, kind, params):
    root = tmp_path / "train"
    two_rank_store(root)
    write(tmp_path / "test", train_vectors(6, seed=11), prefix="q")
    small = GradientIndex.build(root, tmp_path / "small", "cosine", kind, block_rows=7, **params)
    big = GradientIndex.build(root, tmp_path / "big", "cosine", kind, block_rows=10**6, **params)
    assert [p["samples"] for p in small.meta["parts"]] == [240, 210]
    assert small.meta["parts"] == big.meta["parts"]
    assert faiss_bytes(small) == faiss_bytes(big)
    # and the in-memory build the library made before streaming: all vectors, then make_index
    store = small.store
    *_, (_, _, _, parts) = train_parts(
        store, small.layers, "cosine", None, lambda c: 1.0, repeats=small.repeats
    )
    for (rel, pv), entry, got in zip(parts.items(), small.meta["parts"], faiss_bytes(big)):
        assert rel == entry["partition"]
        ref = K.make_index(kind, small.dim, entry["params"], pv.matrix(small.dim))
        assert faiss_bytes(type(small)(small.directory, small.meta, store, [(ref,)])) == [got]
    for index in (small, big):
        assert not list(index.directory.glob(".*"))  # no spill or temporary file left
    a = GradientIndex.open(tmp_path / "small").search(tmp_path / "test", k=8).top_k(8)
    b = GradientIndex.open(tmp_path / "big").search(tmp_path / "test", k=8).top_k(8)
    if kind == "hnsw":  # approximate either way: the same neighbours, nearly
        hits = [len(set(x) & set(y)) for x, y in zip(a.proponent_hashes, b.proponent_hashes)]
        assert sum(hits) >= 0.9 * 8 * len(hits)
        return
    assert a.proponent_hashes == b.proponent_hashes and a.opponent_hashes == b.opponent_hashes
    assert_same_formula(a.proponent_scores, b.proponent_scores)
    assert_same_formula(a.opponent_scores, b.opponent_scores)


def test_ivf_training_sample_is_the_seeded_rule():
    params = {"train_size": 5, "seed": 3}
    rows = K.training_rows(20, params)
    assert rows.tolist() == np.sort(np.random.default_rng(3).choice(20, 5, replace=False)).tolist()
    assert K.training_rows(5, params) is None  # all of a small partition


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_block_rows_is_checked(tmp_path, bad):
    write(tmp_path / "train", train_vectors(10))
    with pytest.raises(ValueError, match="block_rows must be a positive int"):
        GradientIndex.build(tmp_path / "train", tmp_path / "idx", block_rows=bad)


def test_cli_block_rows(tmp_path, capsys):
    from dattri_llm.cli import main

    write(tmp_path / "train", train_vectors(30))
    out = ["-o", str(tmp_path / "idx"), "--kind", "flat"]
    assert main(["index", "build", str(tmp_path / "train"), *out, "--block-rows", "1"]) == 0
    small = faiss_bytes(GradientIndex.open(tmp_path / "idx"))
    big = GradientIndex.build(tmp_path / "train", tmp_path / "big", kind="flat")
    assert small == faiss_bytes(big)
    capsys.readouterr()
    code = main(["index", "build", str(tmp_path / "train"), *out, "--block-rows", "0"])
    assert code != 0 and "--block-rows" in capsys.readouterr().err


def test_a_partition_smaller_than_nlist_gets_the_lists_it_can_train(tmp_path):
    """``nlist`` above a partition's ``n``: ``max(1, n // 39)`` lists (FAISS's 39 training
    points per list), ``nprobe`` clamped to them; ``nlist`` up to ``n`` and other kinds: as
    given. Built: each part's FAISS index has those lists, probes all of them, and so finds
    the exact top-k."""
    from dattri_llm.attribution.index.builder import part_params

    given = {"nlist": 300, "nprobe": 4}
    for n, lists in ((240, 6), (117, 3), (77, 1), (20, 1)):
        got = part_params("ivf", given, n)
        assert got == {"nlist": lists, "nprobe": min(4, lists)}, n
        assert type(got["nlist"]) is int
    assert part_params("ivf", given, 300) == given and part_params("flat", given, 20) == given
    assert given == {"nlist": 300, "nprobe": 4}  # the build's dict is not changed
    root = tmp_path / "train"
    two_rank_store(root)
    index = GradientIndex.build(root, tmp_path / "idx", "dot", "ivf", nlist=300, nprobe=256)
    assert index.params["nlist"] == 300 and index.meta["faiss_version"] == faiss.__version__
    for (part, *_), entry in zip(index._parts, index.meta["parts"]):
        lists = entry["samples"] // 39
        assert entry["params"]["nlist"] == entry["params"]["nprobe"] == lists
        assert faiss.downcast_index(part).nlist == faiss.downcast_index(part).nprobe == lists
    write(tmp_path / "test", train_vectors(6, seed=11), prefix="q")
    exact = GradientIndex.build(root, tmp_path / "flat", "dot", "flat")
    got = index.search(tmp_path / "test", k=5).top_k(5)
    want = exact.search(tmp_path / "test", k=5).top_k(5)
    assert got.proponent_hashes == want.proponent_hashes
    assert got.opponent_hashes == want.opponent_hashes
