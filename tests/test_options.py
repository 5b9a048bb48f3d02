"""One spelling per option, the other accepted as an alias; per-call options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient.gradient import Gradient, GradientBlock, Materialized
from dattri_llm.gradient.sources import InMemoryGradientSource
from dattri_llm.options import similarity_metric


def loss_fn(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def make() -> tuple[nn.Module, list[dict], list[dict]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    g = torch.Generator().manual_seed(1)
    data = [
        {"x": torch.randn(4, generator=g, dtype=torch.float64), "y": torch.tensor(i % 3)}
        for i in range(7)
    ]
    return model, data[:5], data[5:]


def args(tmp_path) -> AttributionArguments:
    return AttributionArguments(output_dir=str(tmp_path / "scores"), show_progress=False)


def capture(model, data, path) -> str:
    store = GradientStorageManager(path)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)])
    with hm.collect(deregister_on_exit=True):
        for i in range(0, len(data), 2):
            part = data[i : i + 2]
            batch = {k: torch.stack([d[k] for d in part]) for k in ("x", "y")}
            loss_fn(model, batch).backward()
    store.close()
    model.zero_grad(set_to_none=True)
    return str(path)


def test_normalized_grad_per_call_on_every_entry_point(tmp_path):
    model, train, test = make()
    task = AttributionTask(loss_fn, model)
    dot = TracInAttributor(args(tmp_path), task=task).attribute(train, test).query(train, test)
    cos = (
        TracInAttributor(args(tmp_path), task=task, normalized_grad=True)
        .attribute(train, test)
        .query(train, test)
    )
    assert not torch.allclose(dot, cos)

    att = TracInAttributor(args(tmp_path), task=task)  # constructor: Grad-Dot
    assert torch.allclose(att.attribute(train, test, normalized_grad=True).query(train, test), cos)
    # the per-call value did not stick: the next call is Grad-Dot again
    assert torch.allclose(att.attribute(train, test).query(train, test), dot)
    assert att.normalized_grad is False
    # both given: the call's value wins, for that call only
    att_cos = TracInAttributor(args(tmp_path), task=task, normalized_grad=True)
    got = att_cos.attribute(train, test, normalized_grad=False).query(train, test)
    assert torch.allclose(got, dot)
    assert torch.allclose(att_cos.attribute(train, test).query(train, test), cos)

    tr = capture(model, train, tmp_path / "train")
    te = capture(model, test, tmp_path / "test")
    att = TracInAttributor(args(tmp_path))

    def matrix(score):  # rows and columns in capture order (= train / test order)
        return score.agnostic_matrix()[1]

    assert torch.allclose(matrix(att.attribute_from_cache(tr, te, normalized_grad=True)), cos)
    assert torch.allclose(matrix(att.attribute_from_cache(tr, te)), dot)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        att.attribute_from_cache(tr, te, "sample", None, None, True)  # method options: keywords

    g = torch.Generator().manual_seed(3)
    blocks = [
        GradientBlock(0, Gradient({"l": Materialized(torch.randn(3, 4, generator=g), "nn.Linear",
                                                     {"in_features": 2, "out_features": 2})}),
                      [f"t{i}" for i in range(3)])
    ]  # fmt: skip
    q = [GradientBlock(0, Gradient({"l": Materialized(torch.randn(2, 4, generator=g),
                                                      "nn.Linear", blocks[0].gradient.layers["l"]
                                                      .module_kwargs)}), ["q0", "q1"])]  # fmt: skip
    src = InMemoryGradientSource
    a = att.attribute_sources(src(blocks), src(q), normalized_grad=True).scores
    x, y = blocks[0].gradient.layers["l"].data, q[0].gradient.layers["l"].data
    ref = (x / x.norm(dim=1, keepdim=True)) @ (y / y.norm(dim=1, keepdim=True)).T
    assert torch.allclose(a, ref, atol=1e-6)
    assert torch.allclose(att.attribute_sources(src(blocks), src(q)).scores, x @ y.T, atol=1e-6)


def test_normalized_grad_must_be_a_bool(tmp_path):
    model, train, test = make()
    with pytest.raises(TypeError, match=r"TracInAttributor\(normalized_grad=\) must be True"):
        TracInAttributor(args(tmp_path), normalized_grad="yes")
    att = TracInAttributor(args(tmp_path), task=AttributionTask(loss_fn, model))
    with pytest.raises(TypeError, match=r"attribute\(normalized_grad=\) must be True"):
        att.attribute(train, test, normalized_grad="cos")
    assert att.normalized_grad is False  # nothing left behind by the failed call
    dot = att.attribute(train, test).query(train, test)
    plain = TracInAttributor(args(tmp_path), task=AttributionTask(loss_fn, model))
    assert torch.allclose(dot, plain.attribute(train, test).query(train, test))


@pytest.mark.parametrize("alias", ["cos", "cosine"])
def test_similarity_cosine_and_its_alias(alias):
    g = torch.Generator().manual_seed(0)
    kw = {"in_features": 2, "out_features": 2}
    x = Gradient({"l": Materialized(torch.randn(3, 4, generator=g, dtype=torch.float64),
                                    "nn.Linear", kw)})  # fmt: skip
    y = Gradient({"l": Materialized(torch.randn(2, 4, generator=g, dtype=torch.float64),
                                    "nn.Linear", kw)})  # fmt: skip
    a, b = x.layers["l"].data, y.layers["l"].data
    ref = (a / a.norm(dim=1, keepdim=True)) @ (b / b.norm(dim=1, keepdim=True)).T
    assert torch.allclose(x.similarity(y, metric=alias), ref, rtol=1e-12)
    with pytest.raises(ValueError, match="metric must be 'dot' or 'cosine' \\(alias 'cos'\\)"):
        x.similarity(y, metric="cosinus")


def test_similarity_metric_spellings():
    assert similarity_metric("cos") == "cosine"
    assert similarity_metric("cosine") == "cosine"
    assert similarity_metric("dot") == "dot"
    with pytest.raises(ValueError, match="score must be"):
        similarity_metric("Cos", "score")
