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


class ConstantNormInput(nn.Module):
    """A volume whose LayerNorm input is constant over the normalised axes, for any input: the
    replicate-padded stride-2 ``Conv3d`` reads only even last-axis positions of the transposed
    convolution's output, which its stride-2 dilation-2 padding-1 kernel never reaches (they hold
    its bias alone). The norm's output is 0, so every true gradient is exactly 0 and autograd's is
    round-off."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(
            3, 2, (1, 1, 2), stride=(2, 2, 1), padding=(2, 0, 0), dilation=(2, 1, 2)
        )
        self.ct = nn.ConvTranspose3d(
            2, 4, 2, stride=(2, 1, 2), padding=(0, 0, 1), dilation=(1, 1, 2)
        )
        self.c2 = nn.Conv3d(
            4, 3, (3, 2, 1), stride=2, padding=2, bias=False, padding_mode="replicate"
        )
        self.ln = nn.LayerNorm((3, 4), bias=False)

    def norm_input(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        size = self.ct(h).shape[2:]
        # an output_size one larger in the first spatial axis (extra output padding)
        return self.c2(self.ct(h, output_size=[size[0] + 1, size[1], size[2]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.norm_input(x))


def _weighted_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    w = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)
    return (out * w).sum() + 0.5 * out.pow(2).sum()


@pytest.mark.parametrize("style", ["factorized", "materialized", "auto"])
def test_a_norm_over_a_constant_input_is_round_off_not_a_missing_share(style: str) -> None:
    import dattri_llm.gradient.hooks.manager as manager

    torch.manual_seed(0)
    model = ConstantNormInput().double()
    x = torch.randn(2, 3, 1, 1, 4, dtype=torch.float64)
    with torch.no_grad():  # the degenerate case
        assert float(model.norm_input(x).var(dim=(-2, -1)).max()) == 0.0
    ref = per_sample_loop_grads(model, _weighted_loss, x)
    manager._WARNED.clear()
    cb = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(capture_style=style), callbacks=[cb])
    with warnings.catch_warnings():
        # the first-step coverage check compared the norm weight's captured gradient (exactly 0)
        # with autograd's round-off and blamed "a weight used outside the hooked module"
        warnings.simplefilter("error")
        with hm.collect(deregister_on_exit=True):
            _weighted_loss(model, x).backward()
    got = captured_by_parameter(hm, cb.record.gradient, model)
    assert sorted(got) == sorted(ref)
    # the true gradients are 0: both sides are round-off of the loss's O(1) output gradient
    for name in ref:
        assert float(ref[name].abs().max()) < 1e-11, name
        assert float(got[name].abs().max()) < 1e-11, name


class FunctionalNormTie(nn.Module):
    """Calls its LayerNorm, then uses the norm's weight again functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.fc(x))
        return h + nn.functional.layer_norm(h, (4,), self.ln.weight)


def test_a_norm_weight_used_outside_its_module_is_still_reported() -> None:
    import dattri_llm.gradient.hooks.manager as manager

    manager._WARNED.clear()
    torch.manual_seed(0)
    model = FunctionalNormTie().double()
    hm = HookManager(model, callbacks=[CaptureCallback()])
    with pytest.warns(UserWarning, match=r"layer 'ln': the captured per-sample gradients"):
        with hm.collect(deregister_on_exit=True):
            _loss(model, _x()).backward()


class FrozenIntoCheckpoint(nn.Module):
    """``relu_`` on the input, a frozen ``Linear``, then one ``LayerNorm`` called under a
    checkpoint and again outside it (``chained``: one call feeds the other, else summed)."""

    def __init__(self, reentrant: bool, inside_first: bool, chained: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 2, bias=False).requires_grad_(False)
        self.ln = nn.LayerNorm(2, bias=False)
        self.head = nn.Linear(2, 6)
        self.reentrant, self.inside_first, self.chained = reentrant, inside_first, chained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.fc(torch.relu_(x))

        def inside(t: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.ln, t, use_reentrant=self.reentrant)

        first, second = (inside, self.ln) if self.inside_first else (self.ln, inside)
        return self.head(second(first(h)) if self.chained else first(h) + second(h))


def _capture_frozen_into_checkpoint(model: nn.Module, x: torch.Tensor, fixed: bool):
    import dattri_llm.gradient.hooks.manager as manager

    manager._WARNED.clear()
    cb = CaptureCallback()
    config = HookManagerConfig(include_frozen=True)
    hm = HookManager(model, config, callbacks=[cb], fixed_weights=fixed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hm.collect():
            _weighted_loss(model, x).backward()
    got = captured_by_parameter(hm, cb.record.gradient, model)
    hm.remove()
    ours = [str(w.message) for w in caught if "dattri_llm" in (w.filename or "")]
    return got, ours


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize(
    "inside_first, chained", [(True, True), (True, False), (False, True), (False, False)]
)
def test_include_frozen_feeding_a_reentrant_checkpoint_is_reported(
    fixed: bool, inside_first: bool, chained: bool
) -> None:
    """With include_frozen the frozen Linear's output is made to require grad, so a reentrant
    checkpoint it feeds (whose inputs otherwise need none, and whose parameters torch then
    leaves without gradient) gets its share: the capture is that of the model with the Linear
    trainable, not of the backward without the manager (silently 1e-5 to 100% off before)."""
    torch.manual_seed(7)
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    model = FrozenIntoCheckpoint(True, inside_first, chained).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "None of the inputs have requires_grad=True"
        plain = per_sample_loop_grads(model, _weighted_loss, x)
        model.fc.requires_grad_(True)
        trainable = per_sample_loop_grads(model, _weighted_loss, x)
        model.fc.requires_grad_(False)
    got, ours = _capture_frozen_into_checkpoint(model, x, fixed)
    for name in trainable:
        assert rel_err(got[name], trainable[name]) < 1e-12, name
    # the outer call feeds the checkpoint (a trainable LayerNorm on its path): nothing changes
    differs = not (chained and not inside_first)
    assert (rel_err(got["ln.weight"], plain["ln.weight"]) > 1e-7) == differs
    if differs:
        assert len(ours) == 1 and "reentrant checkpoint" in ours[0], ours
        assert "['fc']" in ours[0] and "include_frozen" in ours[0]
    else:
        assert not ours, ours
    # the fix the warning names: a non-reentrant checkpoint is exact and silent
    model.reentrant = False
    got, ours = _capture_frozen_into_checkpoint(model, x, fixed)
    assert not ours, ours
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = per_sample_loop_grads(model, _weighted_loss, x)
    for name in plain:
        assert rel_err(got[name], plain[name]) < 1e-12, name


def test_include_frozen_into_a_reentrant_checkpoint_of_frozen_layers_is_silent() -> None:
    """All frozen but the head: include_frozen captures every layer as if trainable, which the
    reentrant checkpoint then agrees with; nothing trainable changes, nothing to report."""
    torch.manual_seed(7)
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    model = FrozenIntoCheckpoint(True, True, True).double()
    model.ln.requires_grad_(False)
    got, ours = _capture_frozen_into_checkpoint(model, x, fixed=False)
    assert not ours, ours
    model.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainable = per_sample_loop_grads(model, _weighted_loss, x)
    for name in trainable:
        assert rel_err(got[name], trainable[name]) < 1e-12, name
