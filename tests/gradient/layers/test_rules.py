"""Every layer rule against torch.func per-sample gradients, in every routing mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Factorized, Materialized, ops
from tests.helpers.reference import flat, per_sample_grads, rel_err


def _hf_conv1d() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    del transformers
    return Conv1D(4, 5)


def _ids(b: int) -> torch.Tensor:
    x = torch.randint(0, 13, (b, 6))
    x[:, 0] = 1  # padding_idx positions must get no gradient
    return x


CASES = {
    "linear2d": (lambda: nn.Linear(5, 4), lambda b: torch.randn(b, 5)),
    "linear2d_nobias": (lambda: nn.Linear(5, 4, bias=False), lambda b: torch.randn(b, 5)),
    "linear3d": (lambda: nn.Linear(5, 4), lambda b: torch.randn(b, 6, 5)),
    "linear4d_nobias": (lambda: nn.Linear(5, 3, bias=False), lambda b: torch.randn(b, 2, 3, 5)),
    "hf_conv1d": (_hf_conv1d, lambda b: torch.randn(b, 6, 5)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), lambda b: torch.randn(b, 3, 9)),
    "conv1d_nobias_dil": (
        lambda: nn.Conv1d(2, 3, 2, dilation=2, bias=False),
        lambda b: torch.randn(b, 2, 8),
    ),
    "conv2d": (
        lambda: nn.Conv2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        lambda b: torch.randn(b, 3, 7, 6),
    ),
    "conv2d_same_reflect": (
        lambda: nn.Conv2d(2, 3, 3, padding="same", padding_mode="reflect"),
        lambda b: torch.randn(b, 2, 5, 5),
    ),
    "conv3d": (
        lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1),
        lambda b: torch.randn(b, 2, 4, 5, 3),
    ),
    "convT1d": (
        lambda: nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1),
        lambda b: torch.randn(b, 3, 5),
    ),
    "convT2d": (
        lambda: nn.ConvTranspose2d(3, 2, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        lambda b: torch.randn(b, 3, 4, 5),
    ),
    "convT3d_nobias": (
        lambda: nn.ConvTranspose3d(2, 2, 2, stride=2, bias=False),
        lambda b: torch.randn(b, 2, 2, 3, 2),
    ),
    "embedding": (lambda: nn.Embedding(13, 4, padding_idx=1), _ids),
    "layernorm": (lambda: nn.LayerNorm(6), lambda b: torch.randn(b, 5, 6) * 2 + 1),
    "layernorm_2d_shape": (lambda: nn.LayerNorm((3, 4)), lambda b: torch.randn(b, 2, 3, 4)),
    "layernorm_nobias": (lambda: nn.LayerNorm(6, bias=False), lambda b: torch.randn(b, 5, 6)),
    "rmsnorm": (lambda: nn.RMSNorm(6, eps=1e-6), lambda b: torch.randn(b, 5, 6)),
    "rmsnorm_default_eps": (lambda: nn.RMSNorm(6), lambda b: torch.randn(b, 5, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), lambda b: torch.randn(b, 4, 5)),
    "instancenorm1d": (lambda: nn.InstanceNorm1d(3, affine=True), lambda b: torch.randn(b, 3, 6)),
    "instancenorm2d": (
        lambda: nn.InstanceNorm2d(3, affine=True),
        lambda b: torch.randn(b, 3, 4, 4),
    ),
}


class Wrap(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(batch["x"])
    return (torch.sin(out) + 0.5 * out**2).sum()


def _perturb(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # non-trivial norm weights / biases


def capture(model: nn.Module, x: torch.Tensor, **cfg) -> Factorized | Materialized:
    cb = CaptureCallback()
    hm = HookManager(model, config=HookManagerConfig(**cfg), callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        model.zero_grad()
        loss_fn(model, {"x": x}).backward()
    return cb.pop().gradient


def setup(case: str, dtype: torch.dtype, b: int = 3):
    make_layer, make_x = CASES[case]
    torch.manual_seed(0)
    model = Wrap(make_layer()).to(dtype)
    _perturb(model)
    x1, x2 = make_x(b), make_x(b + 1)
    if x1.is_floating_point():
        x1, x2 = x1.to(dtype), x2.to(dtype)
    return model, x1, x2


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_exact_float64(case: str) -> None:
    model, x1, x2 = setup(case, torch.float64)
    g1, g2 = capture(model, x1), capture(model, x2)
    ref1 = per_sample_grads(model, loss_fn, {"x": x1})
    ref2 = per_sample_grads(model, loss_fn, {"x": x2})
    # materialize -> per-parameter shapes
    lg = g1.layers["layer"]
    params = lg.materialize().parameters()
    assert sorted(params) == sorted(k.split(".")[-1] for k in ref1)
    for name, got in params.items():
        assert rel_err(got, ref1[f"layer.{name}"]) < 1e-10, name
    r1, r2 = flat(ref1), flat(ref2)
    # the flattened matrix form is a permutation of the parameter coordinates
    assert torch.allclose(g1.flatten().norm(dim=1), r1.norm(dim=1), rtol=1e-10)
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-10, mode
        assert rel_err(ops.pairwise_dot(g1, mode=mode), r1 @ r1.T) < 1e-10, mode
        assert rel_err(ops.grad_norm_sq(g1, mode=mode), (r1 * r1).sum(1)) < 1e-10, mode
        per_tok = ops.cross_dot_per_token(g1, g2, mode=mode)
        assert per_tok.shape[:1] == (3,) and per_tok.shape[2] == 4
        assert rel_err(per_tok.sum(1), r1 @ r2.T) < 1e-10, mode
    # factorized x materialized sides
    m2 = g2.materialize()
    assert rel_err(ops.cross_dot(g1, m2), r1 @ r2.T) < 1e-10
    assert rel_err(ops.cross_dot(m2, g1), r2 @ r1.T) < 1e-10
    assert rel_err(ops.cross_dot_per_token(g1, m2).sum(1), r1 @ r2.T) < 1e-10
    assert rel_err(ops.dot(g1, g1), (r1 * r1).sum(1)) < 1e-10
    cos = g1.similarity(g2, metric="cosine")
    ref_cos = (r1 @ r2.T) / (r1.norm(dim=1)[:, None] * r2.norm(dim=1)[None])
    assert rel_err(cos, ref_cos) < 1e-10


@pytest.mark.parametrize("case", ["linear3d", "conv2d", "embedding", "layernorm", "convT2d"])
@pytest.mark.parametrize("style", ["materialized", "auto"])
def test_capture_styles_agree(case: str, style: str) -> None:
    model, x1, x2 = setup(case, torch.float64)
    ref = ops.cross_dot(capture(model, x1), capture(model, x2))
    got = ops.cross_dot(
        capture(model, x1, capture_style=style), capture(model, x2, capture_style=style)
    )
    assert rel_err(got, ref) < 1e-12


@pytest.mark.parametrize(
    "case", ["linear3d", "hf_conv1d", "conv2d", "embedding", "rmsnorm", "groupnorm", "convT1d"]
)
def test_layer_float32(case: str) -> None:
    model, x1, x2 = setup(case, torch.float32)
    g1, g2 = capture(model, x1), capture(model, x2)
    r1 = flat(per_sample_grads(model, loss_fn, {"x": x1}))
    r2 = flat(per_sample_grads(model, loss_fn, {"x": x2}))
    for mode in ("factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-4


def test_embedding_padding_idx_rows_get_nothing() -> None:
    model, x1, _ = setup("embedding", torch.float64)
    w = capture(model, x1).layers["layer"].materialize().parameters()["weight"]
    assert torch.all(w[:, 1] == 0)
