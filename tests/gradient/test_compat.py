"""Train and test captured incompatibly: refused before scoring, with
an error that names the difference and both stores."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    InMemoryGradientSource,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient.compat import (
    CaptureFacts,
    IncompatibleGradientsError,
    check_compatible,
    facts_of,
)
from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.ops.projection import ProjectionConfig


class Net(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.fc = nn.Linear(6, hidden)
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def data(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 13, (n, 5), generator=torch.Generator().manual_seed(seed))


def offload(model, path, x, config=None) -> None:
    fm = GradientStorageManager(path)
    hm = HookManager(model, config, callbacks=[OffloadCallback(file_manager=fm)])
    with hm.collect(deregister_on_exit=True):
        (model(x) ** 2).sum().backward()


def tracin(tmp_path, train="train", test="test", **kw):
    args = AttributionArguments(output_dir=str(tmp_path / "out"))
    return TracInAttributor(args).attribute_from_cache(tmp_path / train, tmp_path / test, **kw)


def mask(seed: int = 0, dim: int = 16) -> HookManagerConfig:
    return HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=dim, seed=seed))


def test_compatible_stores_score_as_before(tmp_path):
    torch.manual_seed(0)
    model = Net()
    offload(model, tmp_path / "train", data(4, 1), mask())
    offload(model, tmp_path / "test", data(2, 2), mask())
    assert tracin(tmp_path).scores.shape == (4, 2)


def test_different_projection_seed_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Net()
    offload(model, tmp_path / "train", data(4, 1), mask(seed=0))
    offload(model, tmp_path / "test", data(2, 2), mask(seed=1))
    with pytest.raises(IncompatibleGradientsError, match=r"seed: 0 vs 1") as e:
        tracin(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "train") in msg and str(tmp_path / "test") in msg
    assert "same HookManagerConfig" in msg and "layer 'fc'" in msg


def test_different_projection_size_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Net()
    offload(model, tmp_path / "train", data(4, 1), mask(dim=16))
    offload(model, tmp_path / "test", data(2, 2), mask(dim=9))
    with pytest.raises(IncompatibleGradientsError, match=r"proj_dim: 16 vs 9"):
        tracin(tmp_path)


def test_projected_train_and_unprojected_test_are_refused(tmp_path):
    """Used to raise "shape '[64, 9]' is invalid" from deep inside the scoring."""
    torch.manual_seed(0)
    model = Net()
    offload(model, tmp_path / "train", data(4, 1), mask())
    offload(model, tmp_path / "test", data(2, 2))
    with pytest.raises(
        IncompatibleGradientsError,
        match=r"layer 'fc' is nn.Linear projected \(mask: proj_dim 16, seed 0\) in train but "
        r"nn.Linear \(no projection\) in test",
    ):
        tracin(tmp_path)


def test_different_layer_shapes_are_refused_naming_the_layer(tmp_path):
    """Used to raise 'mat1 and mat2 shapes cannot be multiplied', naming nothing."""
    torch.manual_seed(0)
    offload(Net(hidden=8), tmp_path / "train", data(4, 1))
    offload(Net(hidden=5), tmp_path / "test", data(2, 2))
    with pytest.raises(IncompatibleGradientsError, match=r"layer 'fc' .*out_features: 8 vs 5"):
        tracin(tmp_path)
    # scoring only the layers that agree is still possible (two models: other weights, on
    # purpose, which the weights check would refuse)
    args = AttributionArguments(output_dir=str(tmp_path / "out"), check_weights=False)
    score = TracInAttributor(args).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", layers=["emb"]
    )
    assert score.scores.shape == (4, 2)


def test_in_memory_sources_are_checked_too(tmp_path):
    torch.manual_seed(0)

    def capture(model, x, config=None):
        cb = CaptureCallback(keep_all=True)
        hm = HookManager(model, config, callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            (model(x) ** 2).sum().backward()
        return InMemoryGradientSource(cb.records)

    att = TracInAttributor(AttributionArguments(output_dir=str(tmp_path)))
    train, test = capture(Net(), data(3, 1)), capture(Net(hidden=4), data(2, 2))
    with pytest.raises(IncompatibleGradientsError, match=r"train source.*test source"):
        att.attribute_sources(train, test)


def test_a_store_mixing_two_captures_is_refused(tmp_path):
    torch.manual_seed(0)
    offload(Net(hidden=8), tmp_path / "train", data(4, 1))
    fm = GradientStorageManager(tmp_path / "train", mode="append")
    model = Net(hidden=5)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=fm)])
    with hm.collect(deregister_on_exit=True):
        (model(data(2, 3)) ** 2).sum().backward()
    offload(Net(hidden=8), tmp_path / "test", data(2, 2))
    with pytest.raises(IncompatibleGradientsError, match="mixes incompatible captures") as e:
        tracin(tmp_path)
    assert "000000000.safetensors" in str(e.value) and "000000001.safetensors" in str(e.value)


def test_metadata_and_dtype_are_recorded_but_do_not_refuse(tmp_path):
    """A preconditioned (e.g. LESS) train store against a raw test store: the attributor decides."""
    torch.manual_seed(0)
    model = Net()
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        (model(data(3, 1)) ** 2).sum().backward()
    (rec,) = cb.records
    pre = GradientRecord(0, rec.hashes, rec.gradient, 0, {"preconditioner": "adam", "lr": 0.1})
    with GradientStorageManager(tmp_path / "train") as store:
        store.write(pre)
    offload(model.double(), tmp_path / "test", data(2, 2))
    from dattri_llm import DiskGradientSource

    facts = DiskGradientSource(tmp_path / "train").capture_facts()
    assert facts.metadata == {"preconditioner": "adam", "lr": 0.1} and facts.dtype == "float32"
    assert DiskGradientSource(tmp_path / "test").capture_facts().dtype == "float64"
    assert tracin(tmp_path).scores.shape == (3, 2)

    class RawOnly(TracInAttributor):
        def check_compatible(self, train: CaptureFacts, test: CaptureFacts) -> None:
            super().check_compatible(train, test)
            if train.metadata.get("preconditioner") != test.metadata.get("preconditioner"):
                raise IncompatibleGradientsError("preconditioned train vs raw test")

    with pytest.raises(IncompatibleGradientsError, match="preconditioned train vs raw test"):
        RawOnly(AttributionArguments(output_dir=str(tmp_path))).attribute_from_cache(
            tmp_path / "train", tmp_path / "test"
        )


def test_check_compatible_function_and_ignore():
    torch.manual_seed(0)
    a = facts_of(_grad(Net(hidden=4)), source="A")
    b = facts_of(_grad(Net(hidden=4)), source="B")
    check_compatible(a, b)
    assert a.fingerprint == b.fingerprint
    model = Net(hidden=4)
    model.ln.eps = 1e-3
    c = facts_of(_grad(model), source="C")
    with pytest.raises(IncompatibleGradientsError, match=r"layer 'ln' .*eps: 1e-05 vs 0.001"):
        check_compatible(a, c)
    check_compatible(a, c, ignore=["eps"])
    assert a.fingerprint != c.fingerprint


def _grad(model):
    cb = CaptureCallback()
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        (model(data(2, 0)) ** 2).sum().backward()
    return cb.record.gradient
