"""Optimizers warm-started on a tiny LM and the preconditioned capture of its gradients."""

from __future__ import annotations

import torch

from dattri_llm import HookManager
from dattri_llm.gradient.callbacks import CaptureCallback
from tests.helpers.trajectory import (
    lm_batch,
    lm_sample_losses,
    make_lm,
)

LAYERS = ["emb", "norm", "fc"]  # "head" shares emb.weight: one tied layer under "emb"


OPTIMIZERS = {
    # name: (factory(model) -> optimizer, warm-up steps)
    "sgd_plain_wd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, weight_decay=0.02), 2),
    "sgd_momentum_dampening_wd": (
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.02
        ),
        3,
    ),
    "sgd_nesterov_wd": (
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01
        ),
        3,
    ),
    "sgd_momentum_first_step": (
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.5),
        0,
    ),
    "sgd_maximize": (
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.5, weight_decay=0.01, maximize=True
        ),
        2,
    ),
    "adam_coupled_wd": (
        lambda m: torch.optim.Adam(
            m.parameters(), lr=0.01, betas=(0.8, 0.95), eps=1e-4, weight_decay=0.05
        ),
        3,
    ),
    "adam_maximize": (
        lambda m: torch.optim.Adam(m.parameters(), lr=0.01, betas=(0.7, 0.9), maximize=True),
        2,
    ),
    "adamw_amsgrad": (
        lambda m: torch.optim.AdamW(
            m.parameters(), lr=0.01, betas=(0.85, 0.9), eps=1e-3, weight_decay=0.1, amsgrad=True
        ),
        4,
    ),
    "adamw_first_step": (
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, betas=(0.7, 0.9), eps=1e-5),
        0,
    ),
    "adamw_param_groups": (
        lambda m: torch.optim.AdamW(
            [
                {"params": [m.emb.weight, m.fc.weight, m.fc.bias]},
                {
                    "params": [m.norm.weight, m.norm.bias],
                    "lr": 0.03,
                    "betas": (0.5, 0.8),
                    "eps": 1e-2,
                    "weight_decay": 0.3,
                },
            ],
            lr=0.01,
            betas=(0.9, 0.99),
            eps=1e-6,
            weight_decay=0.01,
        ),
        3,
    ),
}


def warm_started(name: str, seed: int = 0):
    model = make_lm(seed)
    factory, warm = OPTIMIZERS[name]
    opt = factory(model)
    for i in range(warm):  # real steps with varying batch sizes (moments of mixed scale)
        b = lm_batch(2 + i, seed=100 + i)
        opt.zero_grad()
        (lm_sample_losses(model(**b), b["input_ids"]).sum() / (1 + i)).backward()
        opt.step()
    opt.zero_grad()
    return model, opt


def capture(model, opt, batch, config=None, reduction="sum", **hm_kw):
    cb = CaptureCallback()
    hm = HookManager(model, config=config, callbacks=[cb], optimizer=opt, **hm_kw)
    with hm.collect():
        losses = lm_sample_losses(model(**batch), batch["input_ids"])
        (losses.sum() if reduction == "sum" else losses.mean()).backward()
    hm.remove()
    return cb.pop()


def raw_then_mapped(model, opt, batch, **hm_kw):
    """Two records of one manager: inside ``raw_gradients()``, then mapped."""
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb], optimizer=opt, **hm_kw)
    with hm.collect():
        with hm.raw_gradients():
            lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
        lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
    hm.remove()
    return cb.records
