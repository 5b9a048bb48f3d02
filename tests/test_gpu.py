"""CUDA checks (marked ``gpu``: skipped without CUDA; run on a lent GPU machine).

Every path that runs on CPU must give the same numbers on CUDA: capture (plain and
preconditioned), scoring from a store on the GPU, and the trajectory methods on a run recorded on
the GPU. float64 throughout, so agreement is to rounding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AdamWInfluenceAttributor,
    AttributionArguments,
    CaptureCallback,
    DVEmbAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    LESSAttributor,
    OffloadCallback,
    OptimizerStateCallback,
    TracInAttributor,
)

pytestmark = pytest.mark.gpu
DT = torch.float64


class TinyLM(nn.Module):
    """Embedding, LayerNorm, two linears and a head tied to the embedding."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(ids))
        return self.head(self.out(torch.tanh(self.fc(h))))


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def data(n: int, seed: int, length: int = 7) -> torch.Tensor:
    return torch.randint(0, 11, (n, length), generator=torch.Generator().manual_seed(seed))


def run(device: str, root, precondition: bool = False) -> dict:
    """A short AdamW run recorded on ``device``; returns its stores and dynamics."""
    torch.manual_seed(0)
    model = TinyLM().to(device, DT)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.95), weight_decay=0.1)
    x = data(12, 1).to(device)
    for s in range(2):  # warm start
        opt.zero_grad()
        lm_loss(model, {"input_ids": x[4 * s : 4 * s + 4]}).backward()
        opt.step()
    rec = OptimizerStateCallback(model, opt)
    store = GradientStorageManager(root / f"train-{device}")
    cbs = [OffloadCallback(file_manager=store), rec]
    cfg = HookManagerConfig(linear_io=REGISTER_ALL)
    hm = HookManager(model, cfg, cbs, optimizer=opt if precondition else None)
    with hm.collect(deregister_on_exit=True):
        for s in range(3):
            opt.zero_grad()
            lm_loss(model, {"input_ids": x[4 * s : 4 * s + 4]}).backward()
            opt.step()
            rec.record_post(s)
    q = GradientStorageManager(root / f"query-{device}")
    hq = HookManager(model, cfg, [OffloadCallback(file_manager=q)])
    with hq.collect(deregister_on_exit=True):
        model.zero_grad()
        lm_loss(model, {"input_ids": data(3, 2).to(device)}).backward()
    return {"train": root / f"train-{device}", "query": root / f"query-{device}", "rec": rec}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu() - b.cpu()).norm() / b.cpu().norm().clamp_min(1e-300))


def test_capture_on_cuda_equals_cpu() -> None:
    torch.manual_seed(0)
    cpu = TinyLM().to(DT)
    gpu = TinyLM().to("cuda", DT)
    gpu.load_state_dict(cpu.state_dict())
    x = data(5, 3)
    out = {}
    for name, model, dev in (("cpu", cpu, "cpu"), ("cuda", gpu, "cuda")):
        cb = CaptureCallback()
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), [cb])
        with hm.collect(deregister_on_exit=True):
            lm_loss(model, {"input_ids": x.to(dev)}).backward()
        out[name] = cb.pop()
    assert out["cpu"].hashes == out["cuda"].hashes
    assert rel(out["cuda"].gradient.flatten(), out["cpu"].gradient.flatten()) < 1e-12


def test_trajectory_methods_on_cuda_equal_cpu(tmp_path) -> None:
    cpu, gpu = run("cpu", tmp_path), run("cuda", tmp_path)
    for cls, kw in ((AdamWInfluenceAttributor, {}), (DVEmbAttributor, {"learning_rate": 0.02})):
        scores = {}
        for name, r, use_cpu in (("cpu", cpu, True), ("cuda", gpu, False)):
            args = AttributionArguments(output_dir=str(tmp_path / "s"), use_cpu=use_cpu)
            extra = {"dynamics": r["rec"].dynamics()} if cls is AdamWInfluenceAttributor else kw
            att = cls(args, loss_reduction="sum")  # lm_loss sums
            scores[name] = att.attribute_from_cache(r["train"], r["query"], **extra).scores
        assert rel(scores["cuda"], scores["cpu"]) < 1e-9, cls.__name__


def test_less_and_tracin_on_cuda_equal_cpu(tmp_path) -> None:
    cpu, gpu = run("cpu", tmp_path, True), run("cuda", tmp_path / "g", True)
    s = {}
    for name, r, use_cpu in (("cpu", cpu, True), ("cuda", gpu, False)):
        args = AttributionArguments(output_dir=str(tmp_path / "s"), use_cpu=use_cpu)
        s[name] = LESSAttributor(args).attribute_from_cache(r["train"], r["query"]).scores
    assert rel(s["cuda"], s["cpu"]) < 1e-9
    a = AttributionArguments(output_dir=str(tmp_path / "s"), use_cpu=False)
    b = AttributionArguments(output_dir=str(tmp_path / "s"), use_cpu=True)
    raw = run("cpu", tmp_path / "raw")
    on_gpu = TracInAttributor(a).attribute_from_cache(raw["train"], raw["query"]).scores
    on_cpu = TracInAttributor(b).attribute_from_cache(raw["train"], raw["query"]).scores
    assert rel(on_gpu, on_cpu) < 1e-12
