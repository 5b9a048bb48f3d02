"""GradientIndex build and search split across 2 gloo ranks (partition i on rank i % 2) give the
files and the top-k of a one-process build and search."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.distributed import expect_ok, init_group, run_ranks

pytestmark = pytest.mark.distributed
faiss = pytest.importorskip("faiss")
REPO = str(Path(__file__).resolve().parents[3])
KINDS = (
    ("flat", "flat", {}),
    ("ivf", "ivf", {"nlist": 4, "train_size": 150, "seed": 7}),
    ("ivfpq", "ivf", {"nlist": 4, "train_size": 150, "pq_m": 8, "pq_bits": 4, "rerank": 3}),
)


def _top(index, test: str) -> dict:
    t = index.search(test, k=6).top_k(6)
    return {
        "pro": t.proponent_hashes,
        "opp": t.opponent_hashes,
        "pro_s": t.proponent_scores.tolist(),
        "opp_s": t.opponent_scores.tolist(),
    }


def _worker(rank: int, world: int, workdir: str, root: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    sys.path.insert(0, REPO)
    init_group(rank, world, workdir)
    try:
        import warnings

        from dattri_llm.attribution.index import GradientIndex

        warnings.simplefilter("ignore")
        for name, kind, params in KINDS:
            index = GradientIndex.build(
                os.path.join(root, "train"), os.path.join(root, f"dist_{name}"), "cosine", kind,
                block_rows=7, **params,
            )  # fmt: skip
            got = _top(index, os.path.join(root, "test"))
            with open(os.path.join(root, f"{name}_r{rank}.json"), "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_two_rank_build_and_search_equal_one_process(tmp_path):
    from dattri_llm.attribution.index import GradientIndex
    from tests.helpers.index import faiss_bytes, train_vectors, two_rank_store, write

    two_rank_store(tmp_path / "train")
    write(tmp_path / "test", train_vectors(6, seed=11), prefix="q")
    expect_ok(run_ranks(_worker, 2, tmp_path / "ranks", str(tmp_path)))
    for name, kind, params in KINDS:
        one = GradientIndex.build(tmp_path / "train", tmp_path / name, "cosine", kind, **params)
        split = GradientIndex.open(tmp_path / f"dist_{name}")
        assert split.meta["parts"] == one.meta["parts"]
        assert faiss_bytes(split) == faiss_bytes(one)
        for entry in one.meta["parts"]:  # IVF-PQ: each rank renamed its parts' re-rank files
            if "rerank_file" in entry:
                a, b = (
                    tmp_path / name / entry["rerank_file"],
                    split.directory / entry["rerank_file"],
                )
                assert a.read_bytes() == b.read_bytes()
        want = _top(one, str(tmp_path / "test"))
        for rank in (0, 1):
            got = json.loads((tmp_path / f"{name}_r{rank}.json").read_text())
            assert got == want, (name, rank)
