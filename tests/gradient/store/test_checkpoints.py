"""``label_weights``: the weights each checkpoint label of a store stands for."""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm import GradientStorageManager, HookManager, OffloadCallback
from dattri_llm.gradient.hooks.fingerprint import weights_fingerprint
from dattri_llm.gradient.store.checkpoints import (
    declare_capture,
    declare_checkpoint,
    declared_labels,
    label_weights,
    read_checkpoints_file,
)


def _capture(tmp_path, train_label_1: bool):
    """Label 0 at fixed weights; label 1 over two steps with an update between them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    store = GradientStorageManager(tmp_path / "s")
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(6, 3, dtype=torch.float64)
    prints = []
    with hm.collect(deregister_on_exit=True):
        for label, steps in ((0, 2), (1, 2)):
            hm.checkpoint = label
            for s in range(steps):
                opt.zero_grad()
                model(x[3 * s : 3 * s + 3]).pow(2).sum().backward()
                if label == 1 and train_label_1:
                    opt.step()
            prints.append(weights_fingerprint(hm.layer_parameters()))
    return store, prints


def test_fixed_weights_stand_for_their_fingerprint_and_a_trained_label_is_unknown(tmp_path):
    store, prints = _capture(tmp_path, train_label_1=True)
    weights = label_weights(store)
    assert weights[0] == {prints[0]}
    assert weights[1] is None  # two steps at different weights, nothing declared
    assert label_weights(store, checkpoints=[1]) == {1: None}


def test_a_declared_label_stands_for_its_declared_weights(tmp_path):
    store, prints = _capture(tmp_path, train_label_1=True)
    declare_capture(store.save_dir, per_sample_loss="sum")
    declare_checkpoint(store.save_dir, 1, prints[1], global_step=4)
    assert declared_labels(store.save_dir) == {1: prints[1]}
    assert label_weights(store) == {0: {prints[0]}, 1: {prints[1]}}
    data = read_checkpoints_file(store.save_dir)
    assert data["per_sample_loss"] == "sum" and data["checkpoints"]["1"]["global_step"] == 4
    # the store still opens and reads as before
    assert len(GradientStorageManager(store.save_dir)) == 4
