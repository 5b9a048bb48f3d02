"""Randomized differential test of the capture core, a fixed CI-sized seed set.

Each seed builds a random small model (``tests/fuzz/capture_models.py``) and checks, under
every capture style, the per-parameter per-sample gradients and every routing mode's inner
products against one backward pass per sample: float64 models to 1e-9 relative
(measured: below 1e-14), float32 models to 2e-3. Every trainable parameter must be captured,
no frozen one, and the library must not warn. ``tests/fuzz/capture_fuzz.py`` runs
thousands of seeds.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from tests.fuzz.capture_models import (
    Case,
    Chain,
    CheckpointedReuse,
    Net,
    Volume,
    check_case,
    random_case,
)
from tests.gradient.hooks.test_coverage import ConstantNormInput

SEEDS = range(48)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_model_capture_is_exact(seed: int) -> None:
    case = random_case(seed)
    out = check_case(case)
    assert not out.failures, f"seed {seed} ({', '.join(case.features)}):\n" + "\n".join(
        out.failures[:5]
    )


def test_the_seed_set_covers_every_feature() -> None:
    features = set()
    dtypes = set()
    for seed in SEEDS:
        case = random_case(seed)
        features.update(case.features)
        dtypes.add(case.dtype)
    assert dtypes == {torch.float32, torch.float64}
    wanted = {
        "HF Conv1D",
        "conv1d",
        "conv2d",
        "convT",
        "embedding",
        "embedding (padding_idx)",
        "position embedding (un-batched ids)",
        "norm:ln",
        "norm:ln_nobias",
        "norm:rms",
        "norm:rms_bias",
        "norm:group",
        "norm:instance",
        "in-place activation",
        "residual",
        "residual (in-place add)",
        "branch",
        "module reuse",
        "sub-batch calls",
        "checkpoint",
        "checkpoint (reentrant)",
        "dead layer",
        "tied linears with biases",
        "tied LM head",
        "tied LM head with bias",
        "frozen module",
        "frozen weight (partly trainable)",
        "frozen bias (partly trainable)",
        "moe:mixtral",
        "moe:gpt_oss",
        "in-place relu_ on the model input",
        "checkpointed and plain call",
        "checkpointed and plain call (reentrant)",
        "frozen Linear into a checkpointed and plain call",
        "convT3d(output_size) + replicate conv3d + image LayerNorm",
        "Linear on a sliced position table (refused)",
    }
    assert wanted <= features, sorted(wanted - features)


# ---- three shapes the random models rarely draw, built on purpose --------------------------
@pytest.mark.parametrize(
    "reentrant, inside_first, chained", list(itertools.product([True, False], repeat=3))
)
def test_frozen_linear_into_a_norm_checkpointed_and_called_again(
    reentrant: bool, inside_first: bool, chained: bool
) -> None:
    """7b: ``relu_`` in place on the model input, a frozen ``nn.Linear`` (its input needs no
    gradient), then one ``LayerNorm`` under (reentrant) checkpointing and again outside it:
    float64 per-sample gradients and inner products to 1e-9 against one backward per sample,
    for batches of 3 and 2 and of 1 and 4."""
    torch.manual_seed(7)
    d = 4
    frozen = nn.Linear(d, d).requires_grad_(False)
    ln = nn.LayerNorm(d)
    with torch.no_grad():
        ln.weight.add_(0.3 * torch.randn(d))
        ln.bias.add_(0.3 * torch.randn(d))
    body = Chain(frozen, CheckpointedReuse(ln, reentrant, inside_first, chained))
    model = Net(body, nn.Linear(d, 3), None, None, False, input_relu_=True).double()
    case = Case(0, model, torch.float64, None, d)
    for sizes in ((3, 2), (1, 4)):
        out = check_case(case, batch_sizes=sizes)
        assert not out.failures, out.failures[:3]


def test_conv_transpose3d_output_size_volume_is_exact() -> None:
    """7c: ``ConvTranspose3d(output_size=)`` -> replicate ``Conv3d`` -> ``LayerNorm`` over the
    image dims, in float64 against one backward per sample."""
    torch.manual_seed(3)
    d = 3
    model = Net(Chain(Volume(d, 2, True)), nn.Linear(2, 3), None, None, False).double()
    out = check_case(Case(0, model, torch.float64, None, d))
    assert not out.failures, out.failures[:3]


def test_linear_on_a_sliced_position_table_is_refused() -> None:
    """7a: a Linear fed the un-batched ``(1, T, D)`` slice of a position table and broadcast
    over the batch has no per-sample gradient: every capture style refuses it."""
    torch.manual_seed(5)
    d, vocab = 3, 6
    model = Net(
        Chain(nn.Linear(d, d)),
        nn.Linear(d, vocab),
        nn.Embedding(vocab, d),
        nn.Embedding(8, d),
        False,
        pos_linear=nn.Linear(d, d),
    ).double()
    case = Case(0, model, torch.float64, vocab, d, refusal="un-batched input")
    assert not check_case(case).failures
    case.refusal = None  # and captured without the refusal, the check would fail
    assert check_case(case).failures


class FlatVolume(nn.Module):
    """``(B, T, 12)`` read as a ``(B, 3, 1, 1, 4)`` volume through ``Conv3d`` ->
    ``ConvTranspose3d(output_size=)`` one larger in the first spatial axis -> replicate
    ``Conv3d`` -> ``LayerNorm((3, 4))``, whose input is constant over its axes for any input, so
    the loss is flat in every parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.volume = ConstantNormInput()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.volume(x[:, 0].reshape(x.shape[0], 3, 1, 1, 4)).flatten(1)


def test_a_model_flat_in_its_parameters_is_judged_against_its_output_gradient() -> None:
    """Every true gradient is 0 and the reference is round-off: neither the check (which
    measured round-off relative to round-off) nor the capture (whose coverage check blamed a
    weight used outside its module) may report it."""
    torch.manual_seed(0)
    out = check_case(Case(0, FlatVolume().double(), torch.float64, None, 12))
    assert not out.failures, out.failures[:3]
