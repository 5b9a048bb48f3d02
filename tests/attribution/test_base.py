"""``BaseAttributor``'s entry points: a layer or checkpoint selection selects, or is refused."""

from __future__ import annotations

import pytest
import torch

from dattri_llm import (
    DiskGradientSource,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from tests.helpers.store import Net, V, args


def _store(model: Net, path, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    hm = HookManager(model, HookManagerConfig(), callbacks=[OffloadCallback(file_manager=path)])
    with hm.collect():
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            (model(torch.randint(0, V, (2, 5), generator=g)) ** 2).sum().backward()
    hm.remove()
    return str(path)


def test_layers_of_attribute_from_cache_select_or_are_refused(tmp_path):
    """``layers=`` beside a gradient source (not a store) was dropped without a word: every
    layer was scored, and a misspelt name passed."""
    torch.manual_seed(0)
    model = Net()
    train, test = _store(model, tmp_path / "train", 0), _store(model, tmp_path / "test", 1)
    att = TracInAttributor(args(tmp_path))
    only_fc = att.attribute_from_cache(train, test, layers=["fc"]).scores
    every = att.attribute_from_cache(train, test).scores
    assert not torch.allclose(only_fc, every)  # the selection matters here
    # a source yields what it was built to: a selection beside it is refused, naming the fix
    for kw in ({"layers": ["fc"]}, {"layers": ["no such layer"]}, {"checkpoints": [0]}):
        with pytest.raises(ValueError, match=r"attribute_from_cache\((layers|checkpoints)=\).*"
                           r"DiskGradientSource\(store, layers=\.\.\."):  # fmt: skip
            att.attribute_from_cache(DiskGradientSource(train), test, **kw)
    # the fix it names gives the selection's scores
    built = att.attribute_from_cache(
        DiskGradientSource(train, layers=["fc"]), DiskGradientSource(test, layers=["fc"])
    ).scores
    assert torch.equal(built, only_fc)
    # a name the store does not hold is refused, the stored name offered first
    with pytest.raises(KeyError, match=r"\['model.fc'\] are not in the store.*closest.*\['fc'"):
        att.attribute_from_cache(train, test, layers=["model.fc"])
    assert "fc" in GradientStorageManager(train).layer_names
