"""The vector fast path of ``top_k`` scoring equals the general score loop and
a brute-force Gram in float64 (to 1e-12): partitions, checkpoints with weights, bf16 storage, a
partial last block, Grad-Cos; the block reader checks what the general reader checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dattri_llm import AttributionArguments, GradientStorageManager, TracInAttributor
from dattri_llm.attribution.engine import vector_scan
from dattri_llm.gradient import Factorized, Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store.format import StoreFormatError, write_meta
from dattri_llm.gradient.store.vector_reader import VectorBlockReader, vector_layers
from dattri_llm.gradient.store.writer import PartitionWriter

DIMS = {"fc1": 12, "fc2": 20}
D = sum(DIMS.values())


def layer(data: torch.Tensor) -> Materialized:
    d = data.shape[1]
    kw = {"_d": d, "proj_dim": d, "seed": 3, "source_layer_type": "nn.Linear"}
    return Materialized(data, "projected.mask", kw)


def record(step: int, vectors: torch.Tensor, hashes: list[str], ckpt: int = 0) -> GradientRecord:
    parts = torch.split(vectors, list(DIMS.values()), dim=1)
    grad = Gradient({n: layer(p.contiguous()) for n, p in zip(DIMS, parts)})
    return GradientRecord(step, hashes, grad, ckpt)


def randn(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def args(tmp_path: Path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)


def write(path: Path, rows: list[tuple[int, int, torch.Tensor, list[str]]], bf16=False) -> None:
    """``rows``: ``(step, checkpoint, vectors, hashes)`` records."""
    with GradientStorageManager(path) as store:
        for step, ckpt, vecs, hashes in rows:
            storage = None
            if bf16:
                vecs = vecs.to(torch.bfloat16)
                storage = {"dtype": "bfloat16", "capture_dtype": "float64", "layers": {}}
            store.write(record(step, vecs, hashes, ckpt), storage=storage)


def both_paths(tmp_path, train, test, monkeypatch, **kw):
    """``(fast, general)`` results of the same call; the fast one must really run."""
    calls = []
    real = vector_scan.run_vector_scan

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr("dattri_llm.attribution.base.run_vector_scan", spy)
    att_kw = {k: kw.pop(k) for k in ("normalized_grad", "checkpoint_weights") if k in kw}
    fast = TracInAttributor(args(tmp_path), **att_kw).attribute_from_cache(train, test, **kw)
    assert calls, "the fast path did not run"
    monkeypatch.setattr(vector_scan, "ENABLED", False)
    general = TracInAttributor(args(tmp_path), **att_kw).attribute_from_cache(train, test, **kw)
    assert len(calls) == 1
    return fast, general


def brute(train: torch.Tensor, test: torch.Tensor, cosine: bool) -> torch.Tensor:
    if cosine:
        train = train / train.norm(dim=1, keepdim=True)
        test = test / test.norm(dim=1, keepdim=True)
    return train @ test.T


def check_top(score, full: torch.Tensor, train_ids: list[str], k: int) -> None:
    """``score.top_k(k)`` equals sorting the brute-force agnostic matrix ``full`` (n, M)."""
    top = score.top_k(k)
    for j in range(full.shape[1]):
        vals, idx = full[:, j].sort(descending=True)
        assert top.proponent_hashes[j] == [train_ids[i] for i in idx[:k].tolist()]
        torch.testing.assert_close(top.proponent_scores[j].double(), vals[:k], rtol=1e-12, atol=0)
        vals, idx = full[:, j].sort()
        assert top.opponent_hashes[j] == [train_ids[i] for i in idx[:k].tolist()]
        torch.testing.assert_close(top.opponent_scores[j].double(), vals[:k], rtol=1e-12, atol=0)


def same(fast, general) -> None:
    assert fast.train_hashes == general.train_hashes
    assert fast.test_hashes == general.test_hashes
    assert fast.top_k_kept == general.top_k_kept and fast.num_train == general.num_train
    a, b = fast.scores.double(), general.scores.double()
    assert torch.equal(a.isnan(), b.isnan())
    torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cosine", [False, True])
@pytest.mark.parametrize("block_bytes", [None, 7 * D * 8])  # one block; 7-row blocks, partial
def test_fast_equals_general_and_brute_force(tmp_path, monkeypatch, cosine, block_bytes):
    if block_bytes is not None:
        monkeypatch.setattr(vector_scan, "_BLOCK_BYTES", block_bytes)
    tr, te = randn(45, 0), randn(6, 1)
    recs = [
        (s, 0, tr[i : i + 8], [f"t{j}" for j in range(i, min(i + 8, 45))])
        for s, i in enumerate(range(0, 45, 8))
    ]
    write(tmp_path / "train", recs)
    write(tmp_path / "test", [(0, 0, te, [f"q{j}" for j in range(6)])])
    fast, general = both_paths(
        tmp_path,
        tmp_path / "train",
        tmp_path / "test",
        monkeypatch,
        top_k=5,
        normalized_grad=cosine,
    )
    same(fast, general)
    check_top(fast, brute(tr, te, cosine), [f"t{j}" for j in range(45)], 5)


def test_partitions_checkpoints_weights(tmp_path, monkeypatch):
    """Two ranks, two checkpoint labels (each sample at both), TracIn weights."""
    monkeypatch.setattr(vector_scan, "_BLOCK_BYTES", 5 * D * 8)
    root = tmp_path / "train"
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    vecs = {c: randn(24, 10 + c) for c in (0, 1)}
    for r in (0, 1):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 2}, lambda e: None)
        for c in (0, 1):
            for s in range(2):
                lo = r * 12 + s * 6
                ids = [f"t{i}" for i in range(lo, lo + 6)]
                w.write(record(10 * c + s, vecs[c][lo : lo + 6], ids, c))
        w.close()
    te = {c: randn(4, 20 + c) for c in (0, 1)}
    with GradientStorageManager(tmp_path / "test") as store:
        for c in (0, 1):
            store.write(record(c, te[c], [f"q{j}" for j in range(4)], c))
    weights = [0.5, 2.0]
    fast, general = both_paths(
        tmp_path, root, tmp_path / "test", monkeypatch, top_k=4, checkpoint_weights=weights
    )
    same(fast, general)
    full = sum(weights[c] * vecs[c] @ te[c].T for c in (0, 1))
    check_top(fast, full, [f"t{i}" for i in range(24)], 4)


def test_bf16_storage(tmp_path, monkeypatch):
    tr, te = randn(30, 2), randn(5, 3)
    write(
        tmp_path / "train",
        [
            (s, 0, tr[s * 10 : s * 10 + 10], [f"t{j}" for j in range(s * 10, s * 10 + 10)])
            for s in range(3)
        ],
        bf16=True,
    )
    write(tmp_path / "test", [(0, 0, te, [f"q{j}" for j in range(5)])])
    fast, general = both_paths(
        tmp_path, tmp_path / "train", tmp_path / "test", monkeypatch, top_k=3
    )
    same(fast, general)
    assert fast.scores.dtype == torch.float64  # read back in the capture dtype
    check_top(fast, tr.to(torch.bfloat16).double() @ te.T, [f"t{j}" for j in range(30)], 3)


def test_layer_subset_and_checkpoint_filter(tmp_path, monkeypatch):
    tr, te = randn(16, 4), randn(3, 5)
    write(
        tmp_path / "train",
        [
            (0, 0, tr[:8], [f"t{j}" for j in range(8)]),
            (1, 1, tr[8:], [f"t{j}" for j in range(8, 16)]),
        ],
    )
    write(tmp_path / "test", [(0, 0, te, ["a", "b", "c"])])
    fast, general = both_paths(
        tmp_path,
        tmp_path / "train",
        tmp_path / "test",
        monkeypatch,
        top_k=2,
        layers=["fc2"],
        checkpoints=[0],
    )
    same(fast, general)
    check_top(fast, tr[:8, 12:] @ te[:, 12:].T, [f"t{j}" for j in range(8)], 2)


def test_factorized_store_takes_the_general_path(tmp_path):
    kw = {"in_features": 3, "out_features": 2, "bias": False}
    with GradientStorageManager(tmp_path / "s") as store:
        a, g = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(4, 2, 2, dtype=torch.float64)
        grad = Gradient({"l": Factorized(a, g, "nn.Linear", kw)})
        store.write(GradientRecord(0, list("abcd"), grad))
    store = GradientStorageManager(tmp_path / "s")
    assert vector_layers(store.schema, None) is None


def test_reader_refuses_a_corrupted_shard(tmp_path):
    write(tmp_path / "train", [(0, 0, randn(8, 6), [f"t{j}" for j in range(8)])])
    store = GradientStorageManager(tmp_path / "train")
    shard = store.records()[0].path
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # a bit of the last tensor
    shard.write_bytes(bytes(data))
    layers = vector_layers(store.schema, None)
    with pytest.raises(StoreFormatError, match="CRC-32") as e:
        list(VectorBlockReader(store, layers).blocks([0]))
    assert str(shard) in str(e.value)
    shard.write_bytes(bytes(data[:-3]))  # truncated
    store = GradientStorageManager(tmp_path / "train", verify=False)
    with pytest.raises(StoreFormatError, match="truncated") as e:
        list(VectorBlockReader(store, layers).blocks([0]))
    assert str(shard) in str(e.value)


def test_reader_blocks_are_contiguous_and_exact(tmp_path):
    tr = randn(20, 7)
    write(
        tmp_path / "s",
        [
            (s, 0, tr[s * 5 : s * 5 + 5], [f"t{j}" for j in range(s * 5, s * 5 + 5)])
            for s in range(4)
        ],
    )
    store = GradientStorageManager(tmp_path / "s")
    reader = VectorBlockReader(store, vector_layers(store.schema, None), block_rows=8)
    blocks = [
        (b.num_rows, {k: v.clone() for k, v in b.layers.items()}, list(b.hashes))
        for b in reader.blocks(range(4))
    ]
    assert [n for n, _, _ in blocks] == [5, 5, 5, 5]  # 5 + 5 > 8: one record per block
    reader = VectorBlockReader(store, vector_layers(store.schema, None), block_rows=10)
    got = [
        (b.num_rows, torch.cat([b.layers["fc1"], b.layers["fc2"]], 1).clone())
        for b in reader.blocks(range(4))
    ]
    assert [n for n, _ in got] == [10, 10]
    assert torch.equal(torch.cat([g for _, g in got]), tr)
    assert all(b.layers["fc1"].is_contiguous() for b in reader.blocks([0]))


def test_gradient_index_reads_through_the_block_reader(tmp_path, monkeypatch):
    pytest.importorskip("faiss")
    from dattri_llm.attribution.index import GradientIndex

    tr, te = randn(30, 8), randn(4, 9)
    write(
        tmp_path / "train",
        [
            (s, 0, tr[s * 6 : s * 6 + 6], [f"t{j}" for j in range(s * 6, s * 6 + 6)])
            for s in range(5)
        ],
    )
    write(tmp_path / "test", [(0, 0, te, [f"q{j}" for j in range(4)])])

    calls = []
    real = GradientStorageManager.load_record

    def counted(self, *a, **k):
        calls.append(a)
        return real(self, *a, **k)

    monkeypatch.setattr(GradientStorageManager, "load_record", counted)
    GradientIndex.build(tmp_path / "train", tmp_path / "idx", metric="cosine")
    assert len(calls) <= 1  # the first record's widths; the vectors come in blocks
    monkeypatch.undo()
    got = GradientIndex.open(tmp_path / "idx").search(tmp_path / "test", k=4)
    top = got.top_k(4)
    want = brute(tr, te, True)
    for j in range(4):
        assert top.proponent_hashes[j] == [f"t{i}" for i in want[:, j].argsort(descending=True)[:4]]


def test_a_corrupted_shard_stops_scoring_through_the_read_ahead_thread(tmp_path):
    tr = randn(40, 11)
    write(
        tmp_path / "train",
        [
            (s, 0, tr[s * 8 : s * 8 + 8], [f"t{j}" for j in range(s * 8, s * 8 + 8)])
            for s in range(5)
        ],
    )
    write(tmp_path / "test", [(0, 0, randn(2, 12), ["a", "b"])])
    shard = GradientStorageManager(tmp_path / "train").records()[3].path
    data = bytearray(shard.read_bytes())
    data[-9] ^= 0x40
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreFormatError, match="CRC-32") as e:
        TracInAttributor(args(tmp_path)).attribute_from_cache(
            tmp_path / "train", tmp_path / "test", top_k=3
        )
    assert str(shard) in str(e.value)


def test_nan_sample_ranks_last_and_huge_top_k_is_every_sample(tmp_path, monkeypatch):
    """A store holding a NaN gradient (written with ``nonfinite="warn"``): the fast and the
    general path keep the same finite proponents and opponents as a sort of the brute-force
    matrix without that sample; ``top_k=10**12`` on the 16-sample store is every sample."""
    monkeypatch.setattr(vector_scan, "_BLOCK_BYTES", 5 * D * 8)
    tr, te = randn(16, 3), randn(4, 4)
    tr[3, 0] = float("nan")
    with GradientStorageManager(tmp_path / "train", nonfinite="warn") as store:
        with pytest.warns(UserWarning, match="'t3'.*Written anyway"):
            for s, i in enumerate(range(0, 16, 8)):
                store.write(record(s, tr[i : i + 8], [f"t{j}" for j in range(i, i + 8)]))
    write(tmp_path / "test", [(0, 0, te, [f"q{j}" for j in range(4)])])
    ok = [i for i in range(16) if i != 3]
    for k in (3, 10**12):
        with pytest.warns(UserWarning, match="'t3' has a NaN score"):
            fast, general = both_paths(
                tmp_path, tmp_path / "train", tmp_path / "test", monkeypatch, top_k=k
            )
        monkeypatch.setattr(vector_scan, "ENABLED", True)
        same(fast, general)
        assert fast.top_k_kept == min(k, 16) and "t3" not in fast.train_hashes
        check_top(fast, brute(tr[ok], te, False), [f"t{i}" for i in ok], min(k, 15))
