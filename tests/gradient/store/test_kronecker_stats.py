"""The Kronecker statistics a compact store records beside its records.

* The recorded sums are ``sum a aᵀ``, ``sum g gᵀ`` over the counted tokens and the token and
  sample counts, computed here from the captured factors with ``einsum``; the file holds
  the lower triangles of ``A`` and ``G`` (``(D² + K²) / 2`` numbers) per layer, whatever the
  number of samples; vector layers and
  materialized-at-capture records get none.
* Several capture contexts, ``mode="append"`` and ``"overwrite"``: the sums and the records
  they cover stay in step.
* A covered record that is gone (quarantined by ``repair``) makes that checkpoint's sums unused,
  with a warning, and the fit then refuses the dense layers instead of scoring wrongly; a
  corrupted file or one whose counts do not match its records is refused naming the file.
* ``storage_dtype="bfloat16"``: the sums are those of the stored (cast) factors.
"""

from __future__ import annotations

import json

import pytest
import torch

from dattri_llm import (
    GradientStorageManager,
    HookManagerConfig,
    KFACAttributor,
    ProjectionConfig,
)
from dattri_llm.gradient.kronecker import KroneckerCovariances
from dattri_llm.gradient.store import StoreFormatError
from dattri_llm.gradient.store.kronecker_stats import statistics_view
from tests.helpers.reference import rel_err as rel
from tests.helpers.store import Net, V, args, capture_to_store

FILE = "kronecker_statistics.safetensors"
KRON = ("fc", "conv", "out")


def batches(seed: int, lengths, rows: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (rows, t), generator=g) for t in lengths]


capture = capture_to_store


def reference_sums(records, name: str) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(sum a aᵀ, sum g gᵀ, counted tokens, samples)`` of one layer, from its factors.

    A conv layer's factors are its im2col patches; a position counts where both factors are
    nonzero (``tokens="gradient"``).
    """
    aa = gg = 0
    tokens = samples = 0
    for r in records:
        lg = r.gradient.layers[name]
        a, g = lg.a.double(), lg.g.double()
        keep = ((g != 0).any(-1) & (a != 0).any(-1)).double()
        aa = aa + torch.einsum("bt,bti,btj->ij", keep, a, a)
        gg = gg + torch.einsum("bt,bti,btj->ij", keep, g, g)
        tokens += int(keep.sum())
        samples += a.shape[0]
    return aa, gg, tokens, samples


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Net()


def test_recorded_sums_are_those_of_the_captured_factors(tmp_path, model):
    records = capture(model, batches(0, (2, 12, 9)), tmp_path / "s")
    store = GradientStorageManager(tmp_path / "s")
    stats = store.kronecker_statistics()
    assert stats.covered == frozenset(range(len(store)))
    cov = stats.covariances[0]
    assert set(cov.layers) == set(KRON) and set(cov.skipped) == {"emb", "ln"}
    for name in KRON:
        aa, gg, tokens, samples = reference_sums(records, name)
        layer = cov.layers[name]
        assert layer.a_sum.dtype == torch.float64
        assert rel(layer.a_sum, aa) <= 1e-6 and rel(layer.g_sum, gg) <= 1e-6, name
        assert (layer.num_tokens, layer.num_samples) == (tokens, samples), name
    # the lower triangles of A and G: D (D + 1) / 2 + K (K + 1) / 2 float64 numbers per layer,
    # whatever the number of samples
    tri = lambda t: t.shape[-1] * (t.shape[-1] + 1) // 2  # noqa: E731
    numbers = sum(tri(layer.a_sum) + tri(layer.g_sum) for layer in cov.layers.values())
    size = (tmp_path / "s" / FILE).stat().st_size
    assert numbers * 8 <= size <= numbers * 8 + 4096
    capture(model, batches(1, (12,) * 6), tmp_path / "more")
    # 12 samples in 6 records instead of 6 in 3: only the header's list of records grows
    assert 0 <= (tmp_path / "more" / FILE).stat().st_size - size <= 3 * 64


def test_what_is_not_recorded(tmp_path, model):
    capture(model, batches(0, (12,)), tmp_path / "factors", keep_token_factors=True)
    assert not (tmp_path / "factors" / FILE).exists()
    # vectors: their exact Fisher is read from the stored vectors
    cfg = HookManagerConfig(projection=ProjectionConfig("dense", proj_dim=5, seed=0))
    capture(model, batches(0, (12,)), tmp_path / "dense", cfg)
    assert not (tmp_path / "dense" / FILE).exists()
    # a record whose Kronecker layer was materialized at capture cannot be covered
    records = capture(
        model, batches(0, (12,)), tmp_path / "m", HookManagerConfig(capture_style="materialized")
    )
    assert statistics_view(records[0].gradient) is None
    assert not (tmp_path / "m" / FILE).exists()
    # records written without statistics= (earlier stores) have none
    with GradientStorageManager(tmp_path / "plain") as store:
        store.write(records[0])
    assert GradientStorageManager(tmp_path / "plain").kronecker_statistics().covered == set()


def test_capture_contexts_append_and_overwrite_keep_sums_and_records_in_step(tmp_path, model):
    first, second = batches(0, (12, 3)), batches(1, (9,))
    store = GradientStorageManager(tmp_path / "s")
    records = capture(model, first, store)
    records += capture(model, second, store)  # a second context of the same manager
    records += capture(
        model, batches(2, (11,)), GradientStorageManager(tmp_path / "s", mode="append")
    )
    appended = GradientStorageManager(tmp_path / "s", mode="append")
    records += capture(model, batches(3, (4,)), appended, checkpoint=1)
    stats = GradientStorageManager(tmp_path / "s").kronecker_statistics()
    assert len(stats.covered) == len(records) == 5
    for c, recs in ((0, records[:4]), (1, records[4:])):
        aa, gg, tokens, samples = reference_sums(recs, "fc")
        layer = stats.covariances[c].layers["fc"]
        assert rel(layer.a_sum, aa) <= 1e-6 and rel(layer.g_sum, gg) <= 1e-6
        assert (layer.num_tokens, layer.num_samples) == (tokens, samples)
    # overwrite: the sums of the deleted records go with them
    new = capture(
        model, batches(4, (10,)), GradientStorageManager(tmp_path / "s", mode="overwrite")
    )
    stats = GradientStorageManager(tmp_path / "s").kronecker_statistics()
    assert sorted(stats.covariances) == [0] and len(stats.covered) == 1
    assert stats.covariances[0].layers["fc"].num_samples == len(new[0].hashes)


def test_a_covered_record_gone_leaves_the_sums_unused_and_the_fit_refused(tmp_path, model):
    capture(model, batches(0, (12, 10)), tmp_path / "s")
    capture(model, batches(1, (4,)), tmp_path / "test")
    shard = GradientStorageManager(tmp_path / "s").records()[1].path
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit: repair moves the shard to quarantine/
    shard.write_bytes(bytes(data))
    GradientStorageManager.repair(tmp_path / "s")
    store = GradientStorageManager(tmp_path / "s")
    assert len(store) == 1
    with pytest.warns(UserWarning, match=r"no longer holds.*not used"):
        assert store.kronecker_statistics().covered == set()
    with pytest.warns(UserWarning, match="no longer holds"):
        with pytest.raises(ValueError, match=r"factors are gone.*keep_token_factors=True"):
            KFACAttributor(args(tmp_path)).attribute_from_cache(tmp_path / "s", tmp_path / "test")


def test_a_damaged_or_foreign_file_is_refused_naming_it(tmp_path, model):
    capture(model, batches(0, (12,)), tmp_path / "s")
    capture(model, batches(1, (12, 3)), tmp_path / "other")
    path = tmp_path / "s" / FILE
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(StoreFormatError, match=FILE):
        GradientStorageManager(tmp_path / "s").kronecker_statistics()
    # another store's sums over the same record keys: the sample counts disagree
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "other" / FILE), framework="pt") as f:
        meta = json.loads(f.metadata()["dattri_llm"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    from dattri_llm.gradient.store.binary_index import read_partition

    (e,), _ = read_partition(tmp_path / "s")
    meta["checkpoints"]["0"]["records"] = [[e["step"], e["checkpoint"], e["crc32"], e["bytes"]]]
    save_file(tensors, str(path), metadata={"dattri_llm": json.dumps(meta)})
    with pytest.raises(StoreFormatError, match=r"count 4 samples.*hold 2"):
        GradientStorageManager(tmp_path / "s").kronecker_statistics()


def test_bf16_store_sums_are_those_of_the_stored_factors(tmp_path, model):
    data = batches(0, (12, 3, 9))
    for name, keep in (("compact", False), ("factors", True)):
        capture(model, data, tmp_path / name, storage_dtype="bfloat16", keep_token_factors=keep)
    recorded = GradientStorageManager(tmp_path / "compact").kronecker_statistics().covariances[0]
    from_factors = KroneckerCovariances().accumulate(
        GradientStorageManager(tmp_path / "factors").iter_blocks()
    )
    for name in KRON:
        a, b = recorded.layers[name], from_factors.layers[name]
        assert rel(a.a_sum, b.a_sum) <= 1e-12 and rel(a.g_sum, b.g_sum) <= 1e-12, name
        assert (a.num_tokens, a.num_samples) == (b.num_tokens, b.num_samples)


def test_merge_refuses_sums_that_do_not_add_up(model):
    one = KroneckerCovariances()
    one.update_factors(
        "x",
        [(torch.ones(1, 2, 3), torch.ones(1, 2, 4))],
        "nn.Linear",
        {"in_features": 3, "out_features": 4},
        1,
    )
    other = KroneckerCovariances()
    other.update_factors(
        "x",
        [(torch.ones(1, 2, 5), torch.ones(1, 2, 4))],
        "nn.Linear",
        {"in_features": 5, "out_features": 4},
        1,
    )
    with pytest.raises(ValueError, match=r"layer 'x'.*different models or projections"):
        one.merge(other)
    with pytest.raises(ValueError, match=r"tokens='all'"):
        one.merge(KroneckerCovariances(tokens="all"))
    twice = KroneckerCovariances().merge(one).merge(one)
    assert torch.equal(twice.layers["x"].a_sum, 2 * one.layers["x"].a_sum)
    assert twice.layers["x"].num_tokens == 2 * one.layers["x"].num_tokens == 4


def test_a_store_mixing_captures_is_refused_by_name_not_by_its_statistics(tmp_path):
    """Two models with another width under one layer name, appended to one store: the sums
    cannot be merged, and the store's own check (which names the shards) refuses it."""
    from dattri_llm import EKFACAttributor
    from dattri_llm.gradient.compat import IncompatibleGradientsError

    def mlp(width: int) -> torch.nn.Module:
        torch.manual_seed(width)
        return torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)
        )

    x = [torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    capture_to_store(mlp(8), x[:1], tmp_path / "train")
    capture_to_store(mlp(5), x[1:], GradientStorageManager(tmp_path / "train", mode="append"))
    capture_to_store(mlp(8), x[:1], tmp_path / "test")
    with pytest.raises(IncompatibleGradientsError, match="mixes incompatible captures"):
        EKFACAttributor(args(tmp_path)).attribute_from_cache(tmp_path / "train", tmp_path / "test")
