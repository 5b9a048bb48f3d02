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
from tests.reference import flat, per_sample_grads, rel_err


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
