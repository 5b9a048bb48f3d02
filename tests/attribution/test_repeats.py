"""Repeats: a train sample seen several times under one checkpoint label, for every method.

A loop captured over three epochs without relabelling stores every sample three times under
checkpoint 0, and a paragraph that occurs twice in the data six times. Each method combines a
sample's rows under one label by its ``repeats`` rule (``"mean"`` for a cosine, ``"sum"``
otherwise) and sums the labels; every path (full matrix, streamed top-k over the store index,
the vector scan, a source without an index) is checked against the formula written here.
"""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    AttributionArguments,
    DVEmbAttributor,
    GradientStorageManager,
    LESSAttributor,
    ProjectedFisherAttributor,
    TracInAttributor,
)
from dattri_llm.gradient.gradient import Gradient, GradientBlock, GradientRecord, Materialized

D, EPOCHS = 6, 3
KW = {"normalized_shape": [3], "eps": 1e-5, "weight": True, "bias": True}
# per epoch, two batches; "p" (the repeated paragraph) is in both
BATCHES = [["p", "s1", "s2"], ["s3", "s4", "p"]]


def vectors() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    base = {
        h: torch.randn(D, generator=g, dtype=torch.float64) for h in ["p", "s1", "s2", "s3", "s4"]
    }
    queries = torch.randn(2, D, generator=g, dtype=torch.float64)
    base["p"] = queries[0] + 0.8 * torch.randn(D, generator=g, dtype=torch.float64)
    base["s1"] = queries[0] + 0.3 * torch.randn(D, generator=g, dtype=torch.float64)
    return base, queries


def train_rows(relabel: bool = False) -> list[tuple[int, int, list[str], torch.Tensor]]:
    """``(step, checkpoint, hashes, (n, D))`` records: epochs 0-2 under label 0, one under 1.

    ``relabel``: every row gets its own hash (``h@step``), the per-occurrence reference.
    """
    base, _ = vectors()
    g = torch.Generator().manual_seed(5)
    out = []
    step = 0
    for epoch in range(EPOCHS + 1):
        ckpt = 0 if epoch < EPOCHS else 1
        for names in BATCHES:
            rows = torch.stack(
                [base[h] + 0.4 * torch.randn(D, generator=g, dtype=torch.float64) for h in names]
            )
            hashes = [f"{h}@{step}" if relabel else h for h in names]
            out.append((step, ckpt, hashes, rows))
            step += 1
    return out


def write(path, records, metadata=None) -> str:
    with GradientStorageManager(path) as store:
        for step, ckpt, hashes, rows in records:
            grad = Gradient({"v": Materialized(rows, "nn.LayerNorm", KW)})
            store.write(
                GradientRecord(step, hashes, grad, checkpoint=ckpt, metadata=metadata or {})
            )
    return str(path)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("repeats")
    _, queries = vectors()
    return {
        "train": write(root / "train", train_rows()),
        "unique": write(root / "unique", train_rows(relabel=True)),
        # the queries at both train checkpoints: a Fisher fit per checkpoint meets its own
        "test": write(root / "test", [(0, c, ["q0", "q1"], queries) for c in (0, 1)]),
    }


def args(tmp_path, **kw) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False, **kw
    )


def brute(per_row, rule: str) -> dict[str, torch.Tensor]:
    """``sum over labels of (sum | mean over the sample's rows under the label)`` of row scores.

    ``per_row``: ``[(hash, checkpoint, (M,) score)]``.
    """
    groups: dict[tuple[str, int], list[torch.Tensor]] = {}
    for h, c, s in per_row:
        groups.setdefault((h, c), []).append(s)
    out: dict[str, torch.Tensor] = {}
    for (h, _), rows in groups.items():
        part = torch.stack(rows).sum(0)
        out[h] = out.get(h, 0) + (part / len(rows) if rule == "mean" else part)
    return out


def tracin_rows(cosine: bool) -> list:
    _, q = vectors()
    out = []
    for _, ckpt, hashes, rows in train_rows():
        s = rows @ q.T
        if cosine:
            s = s / rows.norm(dim=1, keepdim=True) / q.norm(dim=1)
        out += [(h, ckpt, s[i]) for i, h in enumerate(hashes)]
    return out


def check_full(score, ref) -> None:
    ids, m = score.agnostic_matrix()
    assert sorted(ids) == sorted(ref)
    for i, h in enumerate(ids):
        assert torch.allclose(m[i], ref[h], rtol=1e-12, atol=1e-12), h


def check_full_and_top(att, stores, ref, match: str) -> None:
    """The full matrix and the streamed top-2 of ``att`` over the repeated store equal ``ref``."""
    with pytest.warns(UserWarning, match=match):
        check_full(att.attribute_from_cache(stores["train"], stores["test"]), ref)
    with pytest.warns(UserWarning):
        check_top(att.attribute_from_cache(stores["train"], stores["test"], top_k=2), ref, 2)


def check_top(score, ref, k: int) -> None:
    """The kept scores equal the formula, and the kept sets are the formula's extremes."""
    assert score.top_k_kept == k
    top = score.top_k(k)
    names = list(ref)
    full = torch.stack([ref[h] for h in names])
    for j in range(full.shape[1]):
        want = [names[i] for i in full[:, j].topk(k).indices.tolist()]
        assert top.proponent_hashes[j] == want
        for h, v in zip(top.proponent_hashes[j], top.proponent_scores[j].tolist()):
            assert v == pytest.approx(float(ref[h][j]), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("cosine", [False, True])
def test_tracin_default_rule_every_path(stores, tmp_path, cosine):
    rule = "mean" if cosine else "sum"
    ref = brute(tracin_rows(cosine), rule)
    att = TracInAttributor(args(tmp_path), normalized_grad=cosine)
    assert att.repeats_rule() == rule
    with pytest.warns(UserWarning, match=r"'p': 6 times under checkpoint 0.*repeats='" + rule):
        full = att.attribute_from_cache(stores["train"], stores["test"])
    assert full.repeats == rule
    assert any("several times under one checkpoint label" in w for w in full.warnings)
    assert full.occurrence_counts() == {"p": 6, "s1": 3, "s2": 3, "s3": 3, "s4": 3}
    assert full.occurrences("p") == {0: [0, 1, 2, 3, 4, 5], 1: [6, 7]}
    check_full(full, ref)
    if cosine:  # a cosine per label: the single-label part never exceeds 1
        _, m = full.agnostic_matrix(duplicates="sum")
        assert m.max() <= 2.0 + 1e-12  # two labels, each a mean of cosines
        one = att.attribute_from_cache(stores["train"], stores["test"], checkpoints=[0])
        assert one.agnostic_matrix()[1].abs().max() <= 1.0
    # streamed top-k: the vector scan, the general loop (resumable), a source without an index
    k = 2
    with pytest.warns(UserWarning):
        scan = att.attribute_from_cache(stores["train"], stores["test"], top_k=k)
    check_top(scan, ref, k)
    assert scan.occurrences("s1") == {0: [0, 2, 4], 1: [6]} and scan.repeats == rule
    loop = TracInAttributor(args(tmp_path, resumable=True), normalized_grad=cosine)
    with pytest.warns(UserWarning):
        resumed = loop.attribute_from_cache(stores["train"], stores["test"], top_k=k)
    check_top(resumed, ref, k)
    blocks = [
        GradientBlock(s, Gradient({"v": Materialized(r, "nn.LayerNorm", KW)}), h, c, {})
        for s, c, h, r in train_rows()
    ]
    _, q = vectors()
    test = [
        GradientBlock(0, Gradient({"v": Materialized(q, "nn.LayerNorm", KW)}), ["q0", "q1"], 0, {})
    ]
    with pytest.warns(UserWarning):
        src = att.attribute_sources(blocks, test, top_k=k)
    check_top(src, ref, k)
    assert src.occurrences("s1") == {0: [0, 2, 4], 1: [6]}


def test_tracin_rule_is_an_option(stores, tmp_path):
    ref = brute(tracin_rows(cosine=True), "sum")
    att = TracInAttributor(args(tmp_path), normalized_grad=True, repeats="sum")
    check_full_and_top(att, stores, ref, "repeats='sum'")
    # per call, normalized_grad decides the default rule of that call
    plain = TracInAttributor(args(tmp_path))
    with pytest.warns(UserWarning):
        s = plain.attribute_from_cache(stores["train"], stores["test"], normalized_grad=True)
    assert s.repeats == "mean" and plain.repeats_rule() == "sum"
    with pytest.raises(ValueError, match=r"TracInAttributor\(repeats=\) must be one of"):
        TracInAttributor(repeats="max")


@pytest.mark.parametrize("normalized", [False, True])
def test_fisher_rule_against_per_occurrence_scores(stores, tmp_path, normalized):
    """Each occurrence scored as its own sample (same rows, same fit), then combined."""
    rule = "mean" if normalized else "sum"
    att = ProjectedFisherAttributor(args(tmp_path), normalized_grad=normalized)
    assert att.repeats_rule() == rule
    each = att.attribute_from_cache(stores["unique"], stores["test"])
    rows = [
        (h.split("@")[0], c, each.scores[i])
        for i, (h, c) in enumerate(zip(each.train_hashes, each.train_checkpoints))
    ]
    check_full_and_top(att, stores, brute(rows, rule), "several times under one checkpoint label")


def test_less_sums_and_trajectory_methods_refuse_mean(stores, tmp_path):
    less = LESSAttributor(args(tmp_path))
    assert less.repeats_rule() == "sum"  # its learning-rate-weighted sum over steps
    bad = LESSAttributor(args(tmp_path), repeats="mean", pair_by="step")
    with pytest.raises(ValueError, match="pair_by='step' scores each step"):
        bad.attribute_from_cache(stores["train"], stores["test"])
    assert DVEmbAttributor(args(tmp_path)).repeats_rule() == "sum"
    assert (
        DVEmbAttributor(args(tmp_path), normalized_grad=True, method="forward").repeats_rule()
        == "sum"
    )
    with pytest.raises(ValueError, match=r"DVEmbAttributor\(repeats='mean'\).*Pass repeats='sum'"):
        DVEmbAttributor(args(tmp_path), repeats="mean")
    DVEmbAttributor(args(tmp_path), repeats="sum")  # the remedy works
