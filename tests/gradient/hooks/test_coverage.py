"""Coverage of what receives gradients, checked every step: parameters that became trainable
after the manager was built, and backward passes that capture nothing, are reported.

A training loop may change its trainable set at any step (peft's ``set_adapter`` is tested in
``tests/gradient/layers/test_lora.py``); here the same with plain modules: ``requires_grad``
turned on, a module swapped in, every hooked layer frozen.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) ** 2).sum()


def _x() -> torch.Tensor:
    return torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def test_unchanged_model_reports_nothing() -> None:
    model = _model()
    hm = HookManager(model, callbacks=[CaptureCallback()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hm.collect(deregister_on_exit=True):
            for _ in range(3):
                _loss(model, _x()).backward()
    assert hm.step == 3 and hm.incomplete_steps == 0


def test_parameters_unfrozen_after_construction_are_reported_every_step_they_train() -> None:
    model = _model()
    model[2].requires_grad_(False)
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        _loss(model, _x()).backward()  # as built: no report
        assert hm.incomplete_steps == 0
        model[2].requires_grad_(True)
        with pytest.warns(UserWarning, match="became trainable after the HookManager") as w:
            _loss(model, _x()).backward()
        _loss(model, _x()).backward()  # counted again, warned once
    message = str(w[0].message)
    assert "2.weight, 2.bias" in message and "record leaves their per-sample" in message
    assert hm.incomplete_steps == 2
    # the captured layer's record is still written, and exact
    assert hm.step == 3 and all(r.gradient.layer_names == ["0"] for r in cb.records)


def test_a_module_swapped_in_is_reported_and_a_new_manager_captures_it() -> None:
    model = _model()
    hm = HookManager(model, callbacks=[CaptureCallback()])
    model[2] = nn.Linear(4, 2).double()  # the hooked one is no longer in the model
    with pytest.warns(UserWarning, match=r"became trainable .*: the step's record leaves"):
        with hm.collect(deregister_on_exit=True):
            _loss(model, _x()).backward()
    assert hm.incomplete_steps == 1
    model.zero_grad(set_to_none=True)
    cb = CaptureCallback()  # the fix the warning names
    hm = HookManager(model, callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hm.collect():
            _loss(model, _x()).backward()
    got = captured_by_parameter(hm, cb.record.gradient, model)
    hm.remove()
    model.zero_grad(set_to_none=True)
    ref = per_sample_loop_grads(model, _loss, _x())
    assert set(got) == set(ref)
    for name in ref:
        assert rel_err(got[name], ref[name]) < 1e-12, name


def test_a_backward_that_captures_nothing_is_reported() -> None:
    """Every hooked layer frozen after construction, another layer still training: before,
    the step vanished without a word."""
    model = _model()
    hm = HookManager(model, HookManagerConfig(linear_io=["0"]), callbacks=[CaptureCallback()])
    model[0].requires_grad_(False)
    with pytest.warns(UserWarning, match=r"captured nothing: none of the hooked layers \(0\)"):
        with hm.collect(deregister_on_exit=True):
            _loss(model, _x()).backward()
    assert hm.step == 0 and hm.incomplete_steps == 1


def test_a_parameter_made_trainable_outside_collect_is_found_at_the_next_step() -> None:
    model = _model()
    model[0].bias.requires_grad_(False)
    hm = HookManager(model, HookManagerConfig(linear_io=["2"]), callbacks=[CaptureCallback()])
    model[0].bias.requires_grad_(True)
    with hm.paused():
        _loss(model, _x()).backward()  # not capturing: nothing to report
    assert hm.incomplete_steps == 0
    with pytest.warns(UserWarning, match=r"trainable parameters 0\.bias received"):
        with hm.collect(deregister_on_exit=True):
            _loss(model, _x()).backward()
