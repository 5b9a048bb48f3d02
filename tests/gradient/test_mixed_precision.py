"""Capture under bfloat16 autocast and with bfloat16 weights (what LLM training runs use).

bfloat16 has an 8-bit mantissa, so the references are loose on purpose: the per-sample
gradients must sum to autograd's own batch gradient of the same run (same precision, same
casts: ~1e-2), and stay close to the float32 per-sample gradients (~1e-2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager
from dattri_llm.gradient import ops
from tests.helpers.reference import flat, per_sample_grads, rel_err


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 16)
        self.fc = nn.Linear(16, 32)
        self.ln = nn.LayerNorm(32)
        self.out = nn.Linear(32, 8)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["input_ids"]).float() ** 2).sum()


@pytest.mark.parametrize("mode", ["autocast", "bf16_weights"])
def test_bfloat16_capture_sums_to_autograd_and_tracks_float32(mode: str) -> None:
    torch.manual_seed(0)
    ref_model = Net()
    ids = torch.randint(0, 17, (6, 5))
    ref = flat(per_sample_grads(ref_model, loss_fn, {"input_ids": ids}))  # float32
    model = Net()
    model.load_state_dict(ref_model.state_dict())
    if mode == "bf16_weights":
        model = model.to(torch.bfloat16)
    cb = CaptureCallback()
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = loss_fn(model, {"input_ids": ids})
        loss.backward()
    g = cb.pop().gradient
    assert g.layers["fc"].a.dtype == torch.bfloat16  # the precision autograd itself used
    # the per-sample gradients of each layer sum to autograd's batch gradient of this run
    dense = g.materialize()
    for name in ("fc", "ln", "out"):
        module = getattr(model, name)
        for pname, per_sample in dense.layers[name].parameters().items():
            want = getattr(module, pname).grad.float()
            assert rel_err(per_sample.float().sum(0), want) < 2e-2, (name, pname)
    # and the per-sample Gram stays close to the float32 one
    assert rel_err(ops.cross_dot(g, g).float(), ref @ ref.T) < 2e-2


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_bfloat16_norm_statistics_are_computed_in_float32(norm: str) -> None:
    """A bf16 norm input far from zero mean: its statistics in bf16 would be wrong by O(1).

    The reference normalises the very same bf16 input in float64 and contracts it with the
    output gradient (the loss is linear in the output, so that gradient is known exactly).
    """
    torch.manual_seed(0)
    b, t, d = 3, 4, 32
    layer = nn.LayerNorm(d) if norm == "layer" else nn.RMSNorm(d, eps=1e-6)
    layer = nn.Sequential(layer.to(torch.bfloat16))
    x = (50 + 0.05 * torch.randn(b, t, d)).to(torch.bfloat16).requires_grad_()
    w = torch.randn(b, t, d).to(torch.bfloat16)
    cb = CaptureCallback()
    hm = HookManager(layer, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        (layer(x).float() * w.float()).sum().backward()
    got = cb.pop().gradient.materialize().layers[next(iter(hm.layer_names))].parameters()
    x64 = x.detach().double()
    if norm == "layer":
        mean = x64.mean(-1, keepdim=True)
        var = x64.var(-1, unbiased=False, keepdim=True)
        xhat = (x64 - mean) / torch.sqrt(var + layer[0].eps)
    else:
        xhat = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + layer[0].eps)
    want = (w.double() * xhat).sum(1)  # (B, d): per-sample gradient of the weight
    assert rel_err(got["weight"].double(), want) < 2e-2
