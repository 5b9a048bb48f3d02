"""Configuration checked at construction: each mistake is refused (or
accepted, where that is friendlier) with a message naming the argument and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
)
from dattri_llm.gradient.streaming import GradientStreamer, pad_collate


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_offload_callback_accepts_a_store_path(tmp_path) -> None:
    model = mlp()
    cb = OffloadCallback(file_manager=str(tmp_path / "store"))
    assert isinstance(cb.file_manager, GradientStorageManager)
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        model(torch.randn(3, 3)).pow(2).sum().backward()
    assert len(GradientStorageManager(tmp_path / "store")) == 1
    with pytest.raises(TypeError, match=r"file_manager.*GradientStorageManager or a directory"):
        OffloadCallback(file_manager={"dir": "x"})


@pytest.mark.parametrize("config", ["linear_io", {"linear_io": ["0"]}, REGISTER_ALL])
def test_hook_manager_config_must_be_a_config(config) -> None:
    with pytest.raises(
        TypeError, match=r"config.*must be a HookManagerConfig.*HookManagerConfig\("
    ):
        HookManager(mlp(), config=config)


def test_exclude_patterns_that_match_nothing_are_errors() -> None:
    with pytest.raises(ValueError, match=r"exclude patterns \['fc2'\] match no module"):
        HookManager(mlp(), config=HookManagerConfig(exclude=["fc2"]))
    hm = HookManager(mlp(), config=HookManagerConfig(exclude="0"))  # one pattern, not characters
    assert hm.layer_names == ["2"]
    hm.remove()


@pytest.mark.parametrize("selector", ["all", "ALL", "*"])
def test_select_all_words_point_to_register_all(selector: str) -> None:
    with pytest.raises(ValueError, match="REGISTER_ALL"):
        HookManager(mlp(), config=HookManagerConfig(linear_io=selector))


@pytest.mark.parametrize("selector", [True, 3, [0, 2]])
def test_selectors_of_the_wrong_type_are_type_errors(selector) -> None:
    with pytest.raises(TypeError, match=r"HookManagerConfig.linear_io.*REGISTER_ALL"):
        HookManagerConfig(linear_io=selector)


@pytest.mark.parametrize("field", ["check_coverage", "include_frozen"])
def test_boolean_flags_must_be_booleans(field: str) -> None:
    with pytest.raises(TypeError, match=f"HookManagerConfig.{field} must be True or False"):
        HookManagerConfig(**{field: "yes"})


def test_frozen_model_says_its_parameters_do_not_require_grad() -> None:
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match=r"none of the model's parameters require grad"):
        HookManager(model)
    with pytest.raises(ValueError, match=r"model itself is one Linear.*nn.Sequential"):
        HookManager(nn.Linear(3, 2))


def test_use_cpu_and_other_flags_must_be_booleans() -> None:
    for field in ("use_cpu", "dataloader_drop_last", "show_progress"):
        with pytest.raises(
            TypeError, match=f"AttributionArguments.{field} must be (None .*)?True or False"
        ):
            AttributionArguments(**{field: "yes"})


@pytest.mark.parametrize("field", ["score_memory_gb", "live_cache_gb"])
def test_memory_budgets_are_finite_numbers_of_gib(field: str) -> None:
    """A budget becomes a byte count: ``inf`` has none (it died in ``int()`` before)."""
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match=f"AttributionArguments.{field} must be a finite"):
            AttributionArguments(**{field: bad})
    assert getattr(AttributionArguments(**{field: 1e3}), field) == 1e3


@pytest.mark.parametrize("field", ["bf16", "fp16", "fsdp"])
def test_unused_training_fields_are_gone(field: str) -> None:
    with pytest.raises(TypeError):
        AttributionArguments(**{field: True})


def _loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return model(batch["x"].float()).pow(2).sum()


def test_ragged_samples_point_to_pad_collate() -> None:
    data = [{"x": torch.randn(n, 3)} for n in (2, 3)]
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"different lengths.*dataloader_collate='pad'"):
        list(GradientStreamer(model, data, _loss, batch_size=2))
    blocks = list(GradientStreamer(model, data, _loss, batch_size=2, collate_fn=pad_collate()))
    assert blocks[0].gradient.batch_size == 2


def test_python_list_items_say_to_format_for_torch() -> None:
    data = [{"x": [[0.1, 0.2, 0.3]]}, {"x": [[0.3, 0.2, 0.1]]}]
    with pytest.raises(TypeError, match=r"Python lists.*with_format\('torch'\)"):
        list(GradientStreamer(nn.Sequential(nn.Linear(3, 2)), data, _loss, batch_size=2))


def test_hf_dataset_without_torch_format_says_so() -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"x": [[[0.1, 0.2, 0.3]], [[0.3, 0.2, 0.1]]]})
    with pytest.raises(TypeError, match=r"datasets.Dataset formatted as None.*'torch'"):
        GradientStreamer(nn.Sequential(nn.Linear(3, 2)), ds, _loss, batch_size=2)
    blocks = list(
        GradientStreamer(
            nn.Sequential(nn.Linear(3, 2)), ds.with_format("torch"), _loss, batch_size=2
        )
    )
    assert blocks[0].gradient.batch_size == 2
