"""Compact storage (``OffloadCallback`` defaults), ``keep_token_factors`` and ``storage_dtype``.

* A store written with the defaults holds every layer in the smaller of its two exact forms
  (sizes computed here from the captured tensors, independently of the library's choice).
* Its TracIn / Grad-Cos scores equal those of a store that keeps every factor (float64,
  ``<= 1e-12``), on a model with Embedding, Linear, LayerNorm and Conv1d layers.
* Token granularity (and a K-FAC fit on a compact store without recorded covariances) is
  refused naming the option; with ``keep_token_factors=True`` it works.
* ``storage_dtype="bfloat16"`` halves the tensor bytes, reads back as float32, is recorded in
  ``meta.json`` / the shard headers / ``dattri-llm inspect``, and ranks like float32.
* A store without the new header fields (what earlier versions wrote) still reads.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

from dattri_llm import (
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    KFACAttributor,
    OffloadCallback,
    ProjectionConfig,
    TracInAttributor,
)
from dattri_llm.gradient import Factorized, Materialized, Shared
from dattri_llm.gradient.store import FORMAT_VERSION
from dattri_llm.gradient.store.format import decode_schema
from tests.helpers.reference import assert_same_formula
from tests.helpers.store import E, Net, V, args


def logra() -> HookManagerConfig:
    p = ProjectionConfig("logra", proj_dim=4, seed=0)
    return HookManagerConfig(projection={"emb": p, "fc": p, "ln": None, "conv": p, "out": p})


def loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return (model(ids) ** 2).sum()


def batches(seed: int, lengths=(2, 9, 3, 12)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (2, t), generator=g) for t in lengths]


def capture(model, data, path=None, config=None, **offload):
    """Write ``data`` to a store at ``path`` (if given); return the in-memory records too."""
    cap = CaptureCallback(keep_all=True)
    cbs = [cap]
    if path is not None:
        cbs.append(OffloadCallback(file_manager=GradientStorageManager(path), **offload))
    hm = HookManager(model, config or HookManagerConfig(), callbacks=cbs)
    with hm.collect():
        for x in data:
            model.zero_grad(set_to_none=True)
            loss(model, x).backward()
    hm.remove()
    return cap.records


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def leaf_bytes(lg) -> tuple[int, int]:
    """(bytes of the factors, bytes of the dense per-sample gradient) of one captured layer."""
    sites = lg.sites if isinstance(lg, Shared) else [lg]
    factors = sum(
        s.a.numel() * s.a.element_size() + s.g.numel() * s.g.element_size()
        if isinstance(s, Factorized)
        else s.data.numel() * s.data.element_size()
        for s in sites
    )
    dense = lg.materialize().data
    return factors, dense.numel() * dense.element_size()


def stored_layer_bytes(store: GradientStorageManager) -> list[dict[str, int]]:
    """Per record, the bytes of each layer's tensors in its shard."""
    out = []
    for info in store.records():
        with safe_open(str(info.path), framework="pt") as f:
            header = decode_schema(f.metadata()["dattri_llm"], info.path)  # tables resolved
            per = {}
            for i, spec in enumerate(header["layers"]):
                keys = [k for k in f.keys() if k.split(".")[0] == str(i)]  # noqa: SIM118
                per[spec["name"]] = sum(_nbytes(f, k) for k in keys)
            out.append(per)
    return out


def _nbytes(f, key: str) -> int:
    t = f.get_tensor(key)
    return t.numel() * t.element_size()


def test_default_store_keeps_the_smaller_form_of_every_layer(tmp_path):
    model = Net()
    records = capture(model, batches(0), tmp_path / "s")
    store = GradientStorageManager(tmp_path / "s")
    stored = stored_layer_bytes(store)
    assert len(stored) == len(records)
    chose = set()
    for rec, per in zip(records, stored):
        for name, lg in rec.gradient.layers.items():
            factors, dense = leaf_bytes(lg)
            assert per[name] <= 1.1 * min(factors, dense), (name, per[name], factors, dense)
            chose.add(per[name] == factors)
    assert chose == {True, False}  # short batches keep factors, long ones are dense
    # the per-layer choice is recorded in every shard header and meta.json
    with safe_open(str(store.records()[-1].path), framework="pt") as f:
        storage = decode_schema(f.metadata()["dattri_llm"], store.records()[-1].path)["storage"]
    assert storage["layers"]["fc"] == "dense" and storage["capture_dtype"] == "float32"
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["version"] == FORMAT_VERSION and meta["storage"]["compact"] is True


def test_logra_default_store_is_the_projected_gradient(tmp_path):
    model = Net()
    cfg = logra()
    records = capture(model, batches(1, (16, 16)), tmp_path / "s", cfg)
    per = stored_layer_bytes(GradientStorageManager(tmp_path / "s"))[0]
    for name, lg in records[0].gradient.layers.items():
        factors, dense = leaf_bytes(lg)
        assert per[name] <= 1.1 * min(factors, dense), name
    assert sum(per.values()) < 0.5 * sum(
        leaf_bytes(lg)[0] for lg in records[0].gradient.layers.values()
    )


@pytest.mark.parametrize("normalized", [False, True])
def test_compact_scores_equal_the_factorized_store(tmp_path, f64, normalized):
    torch.manual_seed(0)
    model = Net()
    for name, keep in (("compact", False), ("factors", True)):
        capture(model, batches(0), tmp_path / f"train-{name}", keep_token_factors=keep)
    capture(model, batches(5, (3, 10)), tmp_path / "test")
    kinds = {
        type(lg).__name__
        for b in GradientStorageManager(tmp_path / "train-compact").iter_blocks()
        for lg in b.gradient.layers.values()
    }
    assert kinds == {"Factorized", "Materialized"}
    scores = {
        name: TracInAttributor(args(tmp_path), normalized_grad=normalized)
        .attribute_from_cache(tmp_path / f"train-{name}", tmp_path / "test")
        .scores
        for name in ("compact", "factors")
    }
    assert scores["compact"].dtype == torch.float64
    assert rel(scores["compact"], scores["factors"]) <= 1e-12


def test_token_level_needs_keep_token_factors(tmp_path, f64):
    model = Net()
    data = batches(0, (9, 12))
    capture(model, data, tmp_path / "compact")
    capture(model, data, tmp_path / "factors", keep_token_factors=True)
    capture(model, batches(5, (3,)), tmp_path / "test")
    att = TracInAttributor(args(tmp_path))
    with pytest.raises(ValueError, match=r"OffloadCallback\(keep_token_factors=True\)"):
        att.attribute_from_cache(
            tmp_path / "compact", tmp_path / "test", attribution_granularity="token"
        )
    tok = att.attribute_from_cache(
        tmp_path / "factors", tmp_path / "test", attribution_granularity="token"
    )
    sample = att.attribute_from_cache(tmp_path / "compact", tmp_path / "test")
    assert rel(tok.scores, sample.scores) <= 1e-10  # token scores summed = sample scores
    # a K-FAC fit from a compact store that recorded no covariances (written before the store
    # recorded them: its statistics file removed here) is refused naming the option too
    (tmp_path / "compact" / "kronecker_statistics.safetensors").unlink()
    with pytest.raises(ValueError, match=r"keep_token_factors=True"):
        KFACAttributor(args(tmp_path)).attribute_from_cache(tmp_path / "compact", tmp_path / "test")


def test_keep_token_factors_by_layer_and_validation(tmp_path):
    model = Net()
    capture(model, batches(0, (12,)), tmp_path / "s", keep_token_factors=["fc"])
    (block,) = GradientStorageManager(tmp_path / "s").iter_blocks()
    assert isinstance(block.gradient.layers["fc"], Factorized)
    assert isinstance(block.gradient.layers["ln"], Materialized)
    with pytest.raises(TypeError, match="keep_token_factors"):
        OffloadCallback(file_manager=tmp_path / "x", keep_token_factors="fc")
    with pytest.raises(ValueError, match="storage_dtype.*bfloat16"):
        OffloadCallback(file_manager=tmp_path / "x", storage_dtype="int8")


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def test_bf16_storage_halves_bytes_and_keeps_the_ranking(tmp_path, capsys):
    torch.manual_seed(0)
    model = Net()
    cfg = logra()
    data = [
        torch.randint(0, V, (8, 10), generator=torch.Generator().manual_seed(i)) for i in range(5)
    ]
    for dt in ("float32", "bfloat16"):
        capture(model, data, tmp_path / dt, cfg, storage_dtype=dt)
        capture(model, data[:1], tmp_path / f"test-{dt}", cfg, storage_dtype=dt)
    sizes = {
        dt: sum(sum(p.values()) for p in stored_layer_bytes(GradientStorageManager(tmp_path / dt)))
        for dt in ("float32", "bfloat16")
    }
    assert sizes["bfloat16"] * 2 == sizes["float32"]
    (block, *_) = GradientStorageManager(tmp_path / "bfloat16").iter_blocks()
    assert block.gradient.dtype == torch.float32  # reads are cast back to the capture dtype
    s = {
        dt: TracInAttributor(args(tmp_path))
        .attribute_from_cache(tmp_path / dt, tmp_path / f"test-{dt}")
        .scores
        for dt in ("float32", "bfloat16")
    }
    rho = min(
        spearman(s["bfloat16"][:, q], s["float32"][:, q]) for q in range(s["float32"].shape[1])
    )
    assert rho >= 0.99, rho
    from dattri_llm.cli import main

    assert main(["inspect", str(tmp_path / "bfloat16")]) == 0
    assert '"storage_dtype": "bfloat16"' in capsys.readouterr().out


def test_a_store_without_storage_fields_still_reads(tmp_path, f64):
    """What earlier writers produced: records written as given, no ``storage`` header."""
    model = Net()
    records = capture(model, batches(0, (12,)))
    with GradientStorageManager(tmp_path / "old") as store:
        store.write(records[0])
    (block,) = GradientStorageManager(tmp_path / "old").iter_blocks()
    assert isinstance(block.gradient.layers["fc"], Factorized)
    got = block.gradient.layers["fc"].materialize().data
    assert_same_formula(got, records[0].gradient.layers["fc"].materialize().data)


class Tied(nn.Module):
    """An embedding tied to the LM head: one parameter, two sites (a ``Shared`` layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.fc = nn.Linear(E, E)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(ids))))


def test_tied_layer_compact_scores_equal_the_factorized_store(tmp_path, f64):
    torch.manual_seed(0)
    model = Tied()
    records = capture(model, batches(0, (12,)), tmp_path / "compact")
    capture(model, batches(0, (12,)), tmp_path / "factors", keep_token_factors=True)
    capture(model, batches(5, (3, 10)), tmp_path / "test")
    (name,) = [n for n, lg in records[0].gradient.layers.items() if isinstance(lg, Shared)]
    factors, dense = leaf_bytes(records[0].gradient.layers[name])
    assert dense < factors  # the summed dense gradient is the smaller form here
    (block,) = GradientStorageManager(tmp_path / "compact").iter_blocks()
    assert isinstance(block.gradient.layers[name], Materialized)
    per = stored_layer_bytes(GradientStorageManager(tmp_path / "compact"))[0]
    assert per[name] <= 1.1 * dense
    got, want = (
        TracInAttributor(args(tmp_path))
        .attribute_from_cache(tmp_path / d, tmp_path / "test")
        .scores
        for d in ("compact", "factors")
    )
    assert rel(got, want) <= 1e-12
