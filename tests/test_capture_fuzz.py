"""Randomized differential test of the capture core (issue 16), a fixed CI-sized seed set.

Each seed builds a random small model (``experiments/fuzz/capture_models.py``) and checks, under
every capture style, the per-parameter per-sample gradients and every routing mode's inner
products against one backward pass per sample: float64 models to 1e-9 relative
(measured: below 1e-14), float32 models to 2e-3. Every trainable parameter must be captured,
no frozen one, and the library must not warn. ``experiments/fuzz/capture_fuzz.py`` runs
thousands of seeds.
"""

from __future__ import annotations

import pytest
import torch

from experiments.fuzz.capture_models import check_case, random_case

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
    }
    assert wanted <= features, sorted(wanted - features)
