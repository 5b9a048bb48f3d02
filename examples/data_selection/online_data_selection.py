"""Online data selection: drop the batch samples least aligned with validation, inside the step.

A tiny byte-level GPT-2 (random init, from a config) trains on a mix of *clean* sequences
(windows of Python's own documentation, ``pydoc_data.topics``, shipped with Python) and
*noisy* ones (random bytes, 25%); the validation set is clean text. After 20 warm-up steps a
:class:`DataSelectionCallback` scores every training sample's
gradient against the mean validation gradient (Grad-Dot, reference refreshed every step) and
removes the lowest-scoring quarter of each batch from ``param.grad`` before
``optimizer.step()``. The script checks the claim "as if they were never in the batch" against
a copy of the model given only the kept samples, and that the dropped samples are noisy far
more often than the 25% a random choice would give.

Run (CPU, a few seconds; needs the transformers extra)::

    OMP_NUM_THREADS=1 python examples/data_selection/online_data_selection.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    REGISTER_ALL,
    CaptureCallback,
    DataSelectionCallback,
    HookManager,
    HookManagerConfig,
    hash_batch,
)

VOCAB, T, B, STEPS, WARMUP = 256, 32, 8, 40, 20


def _corpus() -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.tensor(list(text), dtype=torch.long)


CORPUS = _corpus()


def clean(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random ``T``-byte windows of the documentation text."""
    starts = torch.randint(0, len(CORPUS) - T, (n,), generator=gen)
    return torch.stack([CORPUS[s : s + T] for s in starts.tolist()])


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss, mean over the batch (here in float64: Hugging Face's own loss casts
    the logits to float32, which would hide the float64 exactness check)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg).double()
    twin = copy.deepcopy(model)  # copied before hooks exist (a deep copy would carry them)
    config = HookManagerConfig(linear_io=REGISTER_ALL)  # every parameter must be hooked
    val = clean(8, gen)

    def val_gradient():
        """Per-sample validation gradients at the current weights (training is paused)."""
        cb = CaptureCallback()
        hm = HookManager(model, config=config, callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            lm_loss(model, val).backward()
        return cb.pop().gradient

    selector = DataSelectionCallback(
        reference=val_gradient, score="dot", drop_fraction=0.25, renormalize=True,
        warmup_steps=WARMUP,
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    hm = HookManager(model, config=config, callbacks=[selector])
    noisy_dropped = dropped = 0
    with hm.collect():
        for step in range(STEPS):
            noisy = torch.rand(B, generator=gen) < 0.25
            ids = torch.where(
                noisy[:, None], torch.randint(0, VOCAB, (B, T), generator=gen), clean(B, gen)
            )
            if step == WARMUP:
                twin.load_state_dict(model.state_dict())
            opt.zero_grad()
            lm_loss(model, ids).backward()  # the callback edits .grad at the end of backward
            if step < WARMUP:
                opt.step()
                continue
            rec = selector.history[-1]
            hashes = hash_batch({"input_ids": ids})
            if step == WARMUP:  # the claim: .grad is the mean-loss gradient of the kept rows
                keep = [hashes.index(h) for h in rec.kept_hashes]
                lm_loss(twin, ids[keep]).backward()
                ref = dict(twin.named_parameters())
                err = max(
                    float((p.grad - ref[n].grad).abs().max() / ref[n].grad.abs().max())
                    for n, p in model.named_parameters()
                )
                print(f"step {step}: max relative error vs the kept rows alone: {err:.1e}")
                assert err < 1e-10, err
            opt.step()
            rows = [hashes.index(h) for h in rec.dropped_hashes]
            dropped += len(rows)
            noisy_dropped += int(noisy[rows].sum())
            if step % 5 == 4:
                with torch.no_grad():
                    vloss = float(lm_loss(model, val))
                print(f"step {step}: validation loss {vloss:.4f}")
    hm.remove()
    share = noisy_dropped / dropped
    print(f"{noisy_dropped}/{dropped} dropped samples were noisy ({share:.0%}; random: 25%)")
    assert len(selector.history) == STEPS - WARMUP and dropped == (STEPS - WARMUP) * (B // 4)
    assert share > 0.35, share


if __name__ == "__main__":
    main()
