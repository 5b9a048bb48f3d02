"""One checkpoint label over changing weights is reported.

A loop that trains while it offloads, with ``HookManager.checkpoint`` never set, stores every
step under checkpoint 0; Grad-Dot / Grad-Cos then read all of them as gradients at one set of
weights. Every record carries a fingerprint of its weights, and the score loop warns when one
pairing key spans several.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY, weights_fingerprint

X = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def capture(net: nn.Module, path, train: bool, label_steps: bool = False, epochs: int = 2) -> None:
    store = GradientStorageManager(path, fsync=False)
    hm = HookManager(
        net,
        HookManagerConfig(linear_io=REGISTER_ALL),
        callbacks=[OffloadCallback(file_manager=store)],
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with hm.collect(deregister_on_exit=True):
        for epoch in range(epochs):
            for i in range(0, 8, 4):
                if label_steps:
                    hm.checkpoint = epoch * 2 + i // 4
                net(X[i : i + 4]).pow(2).sum().backward()
                if train:
                    opt.step()
                opt.zero_grad()
    store.close()


def score(train_dir, test_dir) -> None:
    args = AttributionArguments(use_cpu=True, show_progress=False)
    TracInAttributor(args, normalized_grad=True).attribute_from_cache(train_dir, test_dir)


def test_fingerprint_follows_the_weights() -> None:
    net = model()
    layers = {"0": dict(net[0].named_parameters()), "2": dict(net[2].named_parameters())}
    first = weights_fingerprint(layers)
    assert first == weights_fingerprint(layers) and first.startswith("0:")
    with torch.no_grad():
        net[2].bias.add_(1e-6)
    assert weights_fingerprint(layers) != first
    assert weights_fingerprint({}) is None


def test_records_carry_the_fingerprint_of_their_weights() -> None:
    net = model()
    cap = CaptureCallback(keep_all=True)
    hm = HookManager(net, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with hm.collect():
        for step in range(3):
            net(X).sum().backward()
            if step == 1:
                opt.step()
            opt.zero_grad()
    prints = [r.metadata[METADATA_KEY] for r in cap.records]
    assert prints[0] == prints[1] != prints[2]


def test_training_under_one_label_warns_and_names_the_fix(tmp_path) -> None:
    capture(model(), tmp_path / "train", train=True)
    capture(model(), tmp_path / "test", train=False, epochs=1)
    with pytest.warns(
        UserWarning, match=r"train gradients of checkpoint 0.*HookManager\.checkpoint"
    ):
        score(tmp_path / "train", tmp_path / "test")


def test_test_side_over_changing_weights_warns(tmp_path) -> None:
    capture(model(), tmp_path / "train", train=False)
    capture(model(), tmp_path / "test", train=True, epochs=1)
    with pytest.warns(UserWarning, match=r"test gradients of checkpoint 0.*different weights"):
        score(tmp_path / "train", tmp_path / "test")


@pytest.mark.parametrize("label_steps", [False, True])
def test_fixed_weights_or_labelled_steps_do_not_warn(tmp_path, label_steps) -> None:
    capture(model(), tmp_path / "train", train=label_steps, label_steps=label_steps)
    capture(model(), tmp_path / "test", train=False, epochs=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*different weights")
        score(tmp_path / "train", tmp_path / "test")
