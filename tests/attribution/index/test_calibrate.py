"""An ``ivf`` build measures its recall@10 on held-out vectors and, with ``target_recall``,
picks the smallest ``nprobe`` (a power of two, or ``nlist``) that reaches it; ``kind="auto"``
does so at 0.95. The recall is checked against a float64 brute-force top-10 written here."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from dattri_llm.attribution.index import GradientIndex
from dattri_llm.attribution.index import kinds as K
from dattri_llm.attribution.index.calibrate import CALIBRATION_K, calibration_rows
from tests.helpers.index import clustered, faiss_bytes, write

faiss = pytest.importorskip("faiss")

D = 32  # tests.helpers.index.DIMS


def low_rank(n: int, rank: int, noise: float, seed: int) -> torch.Tensor:
    """``n`` vectors near a fixed ``rank``-dimensional subspace of the 32 numbers."""
    basis = torch.randn(rank, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, rank, generator=g, dtype=torch.float64)
    return z @ basis + noise * torch.randn(n, D, generator=g, dtype=torch.float64)


def unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def held_out_recall(index: GradientIndex, x: torch.Tensor, nprobe: int) -> float:
    """Recall@10 of the held-out rows (leave-one-out), both directions, the lower; float64
    brute force as the reference, the index's own FAISS part searched at ``nprobe``."""
    (part, *_), entry = index._parts[0], index.meta["parts"][0]
    assert entry["params"]["pq_m"] is None  # IVF-Flat: FAISS's scores are the exact ones
    rows = calibration_rows(len(x), entry["params"])
    u = unit(x) if index.metric == "cosine" else x
    base = faiss.downcast_index(part)
    base.nprobe = nprobe
    out = []
    for sign in (1.0, -1.0):
        exact = sign * (u[rows] @ u.T)
        exact[torch.arange(len(rows)), torch.as_tensor(rows)] = -torch.inf  # itself left out
        kth = exact.topk(CALIBRATION_K, dim=1).values[:, -1:]
        q = np.ascontiguousarray(sign * u[rows].numpy(), dtype=np.float32)
        _, ids = base.search(q, CALIBRATION_K + 1)
        hits = 0
        for j, found in enumerate(ids):
            got = [i for i in found.tolist() if i != rows[j]][:CALIBRATION_K]
            hits += int((exact[j, got] >= kth[j] - 1e-6).sum())
        out.append(hits / (CALIBRATION_K * len(rows)))
    return min(out)


@pytest.fixture(scope="module")
def flat_ivf(tmp_path_factory):
    """An IVF-Flat index of 3000 low-rank vectors calibrated to 0.9."""
    root = tmp_path_factory.mktemp("cal")
    x = low_rank(3000, 12, 0.05, seed=1)
    write(root / "train", x, batch=500)
    index = GradientIndex.build(
        root / "train", root / "idx", "cosine", "ivf", nlist=64, target_recall=0.9
    )
    return root, x, index


def test_the_chosen_nprobe_is_the_smallest_that_reaches_the_target(flat_ivf):
    _, x, index = flat_ivf
    record = index.meta["parts"][0]["calibration"]
    chosen = index.params["nprobe"]
    assert chosen == record["nprobe"] == index.meta["parts"][0]["params"]["nprobe"]
    assert 1 < chosen < 64 and chosen & (chosen - 1) == 0  # a power of two, not every list
    assert [s["nprobe"] for s in record["sweep"]] == [2**j for j in range(chosen.bit_length())]
    reached = held_out_recall(index, x, chosen)
    assert reached >= 0.9 and record["reached"] is True
    assert reached == pytest.approx(record["recall"], abs=1e-12)
    assert index.expected_recall == pytest.approx(reached, abs=1e-12)
    assert held_out_recall(index, x, chosen // 2) < 0.9  # the next smaller one does not
    assert record["queries"] == 128 and record["k"] == 10 and record["target_recall"] == 0.9


def test_reopen_keeps_the_calibration_and_search_overrides_still_work(flat_ivf):
    root, _, index = flat_ivf
    write(root / "test", low_rank(20, 12, 0.05, seed=5), prefix="q")
    again = GradientIndex.open(root / "idx")
    assert again.expected_recall == index.expected_recall
    assert again.meta["parts"] == index.meta["parts"]
    assert json.loads((root / "idx" / "index.json").read_text())["expected_recall"] == (
        index.expected_recall
    )
    assert f"expected_recall={index.expected_recall:.3f}" in repr(again)
    default = again.search(root / "test", k=10).top_k(10)
    same = again.search(root / "test", k=10, nprobe=index.params["nprobe"]).top_k(10)
    every = again.search(root / "test", k=10, nprobe=64).top_k(10)  # all lists: exact
    one = again.search(root / "test", k=10, nprobe=1).top_k(10)
    assert default.proponent_hashes == same.proponent_hashes
    assert one.proponent_hashes != every.proponent_hashes  # the override is applied


def test_auto_reaches_its_target_on_fresh_queries_where_a_fixed_fraction_did_not(
    tmp_path, monkeypatch
):
    # the old rule, nprobe = max(8, nlist / 16), reached 0.88 here; calibrated: 0.96
    monkeypatch.setattr(K, "AUTO_FLAT_MAX", 1000)
    x, q = low_rank(20000, 12, 0.05, seed=1), low_rank(200, 12, 0.05, seed=2)
    write(tmp_path / "train", x, batch=2000)
    write(tmp_path / "test", q, prefix="q")
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "cosine")
    assert index.kind == "ivf" and index.params["pq_m"] == 8
    assert index.expected_recall >= K.AUTO_TARGET_RECALL
    top = index.search(tmp_path / "test", k=10).top_k(10).proponent_hashes
    exact = (unit(q) @ unit(x).T).topk(10, dim=1).indices.tolist()
    recall = np.mean([len({f"t{i}" for i in e} & set(t)) / 10 for t, e in zip(top, exact)])
    assert recall >= 0.94


def test_an_unreachable_target_warns_and_the_named_fixes_reach_it(tmp_path):
    x = low_rank(2000, 12, 0.05, seed=1)
    write(tmp_path / "train", x, batch=500)
    pq = {"nlist": 16, "pq_m": 8, "pq_bits": 4, "rerank": 1}
    with pytest.warns(UserWarning, match=r"reached recall@10 0\.\d+ .*nprobe = nlist = 16.*"
                      r"target_recall=0.999.*pq_m=None.*kind='flat'"):  # fmt: skip
        short = GradientIndex.build(
            tmp_path / "train", tmp_path / "pq", "cosine", "ivf", target_recall=0.999, **pq
        )
    record = short.meta["parts"][0]["calibration"]
    assert record["reached"] is False and record["nprobe"] == 16
    assert [s["nprobe"] for s in record["sweep"]] == [1, 2, 4, 8, 16]  # each once
    assert short.expected_recall == record["recall"] < 0.999
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exact_lists = GradientIndex.build(
            tmp_path / "train", tmp_path / "ivf", "cosine", "ivf", nlist=16, target_recall=0.999
        )
        flat = GradientIndex.build(tmp_path / "train", tmp_path / "flat", "cosine", "flat")
    assert exact_lists.expected_recall >= 0.999
    assert flat.expected_recall == 1.0


def test_the_calibration_is_deterministic_under_the_seed(tmp_path):
    write(tmp_path / "train", low_rank(2000, 12, 0.05, seed=1), batch=300)
    params = {"nlist": 16, "train_size": 1000, "target_recall": 0.9, "seed": 4}
    a = GradientIndex.build(tmp_path / "train", tmp_path / "a", "dot", "ivf", **params)
    b = GradientIndex.build(
        tmp_path / "train", tmp_path / "b", "dot", "ivf", block_rows=77, **params
    )

    assert a.meta["parts"] == b.meta["parts"] and faiss_bytes(a) == faiss_bytes(b)
    assert a.expected_recall == b.expected_recall and "calibration" in a.meta["parts"][0]
    rows = calibration_rows(2000, a.meta["parts"][0]["params"])
    assert rows.tolist() == calibration_rows(2000, b.meta["parts"][0]["params"]).tolist()
    other = calibration_rows(2000, {**a.meta["parts"][0]["params"], "seed": 5})
    assert rows.tolist() != other.tolist()
    trained = K.training_rows(2000, a.meta["parts"][0]["params"])
    assert trained is not None and not set(rows.tolist()) & set(trained.tolist())  # held out


def test_without_a_target_the_given_nprobe_is_measured_only(tmp_path, monkeypatch):
    monkeypatch.setattr(K, "AUTO_FLAT_MAX", 1000)
    write(tmp_path / "train", low_rank(2000, 12, 0.05, seed=1), batch=500)
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "cosine", nprobe=3)
    record = index.meta["parts"][0]["calibration"]
    assert index.params["nprobe"] == 3 and index.params["target_recall"] is None
    assert [s["nprobe"] for s in record["sweep"]] == [3] and record["reached"] is None
    assert 0 < index.expected_recall == record["recall"] <= 1


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9"])
def test_target_recall_is_checked(bad):
    with pytest.raises(ValueError, match=r"target_recall must be a recall@10 in \(0, 1\]"):
        K.resolve_params("ivf", 1000, D, {"target_recall": bad})


def test_target_recall_and_nprobe_are_not_both_given():
    with pytest.raises(ValueError, match="give one of them, not both"):
        K.resolve_params("ivf", 1000, D, {"target_recall": 0.9, "nprobe": 4})
    assert K.resolve("auto", 10**7, D, {})[1]["target_recall"] == K.AUTO_TARGET_RECALL


def test_cli_build_reports_the_expected_recall(tmp_path, capsys):
    from dattri_llm.cli import main

    write(tmp_path / "train", low_rank(1000, 12, 0.05, seed=1), batch=500)
    argv = ["index", "build", str(tmp_path / "train"), "-o", str(tmp_path / "idx")]
    assert main([*argv, "--kind", "ivf", "--nlist", "16", "--target-recall", "0.9"]) == 0
    index = GradientIndex.open(tmp_path / "idx")
    assert index.params["target_recall"] == 0.9
    assert f"expected recall@10 {index.expected_recall:.3f}" in capsys.readouterr().out
    assert main([*argv, "--overwrite", "--target-recall", "1.5"]) != 0
    assert "--target-recall" in capsys.readouterr().err


# ---- the record itself, against references written here ---------------------------------------
def documented_rows(n: int, params: dict) -> np.ndarray:
    """The calibration rows by the documented rule: ``calibration_queries`` distinct rows drawn
    by ``default_rng([seed, 1])`` from the rows outside the training sample (when enough)."""
    size = min(n, params["calibration_queries"])
    pool = np.arange(n)
    if params["train_size"] < n:
        trained = np.random.default_rng(params["seed"]).choice(n, params["train_size"], False)
        if n - len(trained) >= size:
            pool = np.setdiff1d(pool, trained)
    return np.sort(np.random.default_rng([params["seed"], 1]).choice(pool, size, replace=False))


def direction_recalls(index: GradientIndex, x: torch.Tensor, rows: np.ndarray) -> list[float]:
    """Recall@10 of the proponents and of the opponents (leave-one-out, ties found), float64
    brute force, the part searched at its recorded ``nprobe``; the tolerance is relative."""
    (part, *_), entry = index._parts[0], index.meta["parts"][0]
    base = faiss.downcast_index(part)
    base.nprobe = entry["params"]["nprobe"]
    out = []
    for sign in (1.0, -1.0):
        exact = sign * (x[rows] @ x.T)
        exact[torch.arange(len(rows)), torch.as_tensor(rows)] = -torch.inf
        top = exact.topk(CALIBRATION_K, dim=1).values
        _, ids = base.search(np.ascontiguousarray(sign * x[rows].numpy(), np.float32), 11)
        hits = 0
        for j, found in enumerate(ids):
            got = [i for i in found.tolist() if i != rows[j]][:CALIBRATION_K]
            hits += int((exact[j, got] >= top[j, -1] - 1e-5 * top[j, 0].abs()).sum())
        out.append(hits / (CALIBRATION_K * len(rows)))
    return out


def test_the_record_is_each_directions_recall_on_the_documented_held_out_rows(tmp_path):
    """Small dot products (a relative tolerance, not an absolute one), an offset that makes the
    two directions' recalls differ, and exactly ``calibration_queries`` rows outside the training
    sample: the queries are all of them, distinct, and each direction is reported as measured."""
    x = 1e-3 * (low_rank(2000, 12, 0.05, seed=1) + 0.6)
    write(tmp_path / "train", x, batch=500)
    params = {"nlist": 16, "nprobe": 1, "train_size": 1872, "seed": 3}
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "dot", "ivf", **params)
    entry = index.meta["parts"][0]
    record = entry["calibration"]
    rows = documented_rows(2000, entry["params"])
    trained = np.random.default_rng(3).choice(2000, 1872, replace=False)
    assert set(rows.tolist()) == set(range(2000)) - set(trained.tolist())  # every held-out row
    assert calibration_rows(2000, entry["params"]).tolist() == rows.tolist()
    for train_size, queries in ((1000, 128), (1900, 120), (2000, 300)):  # a draw from a pool
        other = {**entry["params"], "train_size": train_size, "calibration_queries": queries}
        drawn = calibration_rows(2000, other)
        assert drawn.tolist() == documented_rows(2000, other).tolist()
        assert len(set(drawn.tolist())) == queries  # distinct rows
    pro, opp = direction_recalls(index, x, rows)
    assert abs(pro - opp) > 0.02 and max(pro, opp) < 0.99  # the check can tell them apart
    assert record["proponents"] == pytest.approx(pro, abs=1e-12)
    assert record["opponents"] == pytest.approx(opp, abs=1e-12)
    assert record["recall"] == index.expected_recall == min(record["proponents"], opp)
    assert set(record) == {"k", "queries", "target_recall", "nprobe", "recall", "proponents",
                           "opponents", "reached", "sweep"}  # fmt: skip
    assert record["queries"] == 128 and record["nprobe"] == 1 and record["reached"] is None


def test_a_target_of_one_stops_at_the_first_nprobe_that_finds_every_neighbour(tmp_path):
    """A recall equal to the target reaches it: the sweep stops there, without a warning."""
    write(tmp_path / "train", clustered(1000, 4, D, seed=1), batch=500)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index = GradientIndex.build(
            tmp_path / "train", tmp_path / "idx", "dot", "ivf", nlist=16, target_recall=1.0
        )
    record = index.meta["parts"][0]["calibration"]
    sweep = [(s["nprobe"], s["recall"]) for s in record["sweep"]]
    assert sweep[-1] == (8, 1.0) and all(r < 1.0 for _, r in sweep[:-1])  # 8 of the 16 lists
    assert index.params["nprobe"] == record["nprobe"] == 8 and record["reached"] is True


@pytest.mark.parametrize("n", [1, 2, 8])
def test_a_part_of_few_vectors_measures_its_recall_at_k_below_its_size(tmp_path, n):
    """Leave-one-out leaves ``n - 1`` neighbours: recall@``min(10, n - 1)``; one vector: none."""
    write(tmp_path / "train", clustered(n, 2, D, seed=1), batch=8)
    index = GradientIndex.build(tmp_path / "train", tmp_path / "idx", "dot", "ivf", nlist=1)
    entry = index.meta["parts"][0]
    if n == 1:
        assert "calibration" not in entry and index.expected_recall is None
        return
    record = entry["calibration"]
    assert record["k"] == n - 1 and record["queries"] == n
    assert record["recall"] == index.expected_recall == 1.0  # one list: the search is exact
