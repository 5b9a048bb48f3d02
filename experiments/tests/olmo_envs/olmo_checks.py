"""Checks that need ai2-olmo: run with the ``olmo`` extra's own environment's pytest.

Not collected by the main suite (the file name does not match ``test_*.py``);
``experiments/tests/test_olmo_envs.py`` runs it in that environment::

    .venv-olmo/bin/python -m pytest -q -p no:cacheprovider \
        experiments/tests/olmo_envs/olmo_checks.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ.setdefault("WANDB_MODE", "disabled")

from olmo.config import ModelConfig  # noqa: E402
from olmo.model import LayerNorm as OLMoLayerNorm  # noqa: E402
from olmo.model import OLMo, RMSLayerNorm  # noqa: E402

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig, Shared  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "trainers" / "olmo_trainer.py"


def _example():
    spec = importlib.util.spec_from_file_location("_olmo_trainer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _per_sample(model: nn.Module, loss_fn, xs: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, list[torch.Tensor]] = {}
    for x in xs:
        model.zero_grad(set_to_none=True)
        loss_fn(model, x[None]).backward()
        for n, p in model.named_parameters():
            out.setdefault(n, []).append(p.grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def _captured(model: nn.Module, loss_fn, xs: torch.Tensor, config: HookManagerConfig):
    cb = CaptureCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookManager(model, config=config, callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            loss_fn(model, xs).backward()
    model.zero_grad(set_to_none=True)
    grad = cb.pop().gradient
    dense = {
        f"{layer}.{k}": v
        for layer in grad.layer_names
        for k, v in grad.layers[layer].materialize().parameters().items()
    }
    return grad, dense, [str(w.message) for w in caught]


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).norm() / y.norm())


@pytest.mark.parametrize("cls", [RMSLayerNorm, OLMoLayerNorm])
@pytest.mark.parametrize("bias", [False, True])
def test_olmo_norms_exact_with_and_without_bias(cls: type, bias: bool) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=8, bias_for_layer_norm=bias, layer_norm_eps=1e-5)
    norm = cls(cfg)
    with torch.no_grad():
        norm.weight.add_(torch.randn_like(norm.weight))
        if bias:
            norm.bias.add_(torch.randn_like(norm.bias))
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 3)).double()
    xs = torch.randn(5, 6, 4, dtype=torch.float64)

    def loss_fn(m, x):
        return m(x).pow(2).sum()

    config = HookManagerConfig(layer_types=_example().olmo_layer_types(model))
    assert config.layer_types == {"1": "nn.RMSNorm" if cls is RMSLayerNorm else "nn.LayerNorm"}
    _, dense, warned = _captured(model, loss_fn, xs, config)
    ref = _per_sample(model, loss_fn, xs)
    assert set(dense) == set(ref)  # the bias too, when there is one
    assert ("1.bias" in dense) == bias
    assert warned == []
    # RMSLayerNorm normalises in float32 whatever the input dtype: its own round-off
    tol = 1e-6 if cls is RMSLayerNorm else 1e-12
    for name in ref:
        assert _rel(dense[name], ref[name]) < tol, name


def _tiny_olmo(weight_tying: bool) -> OLMo:
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=16,
        n_heads=2,
        n_layers=1,
        mlp_ratio=2,
        max_sequence_length=8,
        vocab_size=32,
        embedding_size=32,
        eos_token_id=0,
        pad_token_id=0,
        rope=True,
        attention_layer_norm=True,
        layer_norm_type="rms",
        include_bias=False,
        bias_for_layer_norm=True,
        weight_tying=weight_tying,
        attention_dropout=0.0,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        init_device="cpu",
    )
    return OLMo(cfg).double()


def _lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def test_functional_tie_is_caught_by_the_coverage_check_and_refused() -> None:
    ex = _example()
    model = _tiny_olmo(weight_tying=True)
    ids = torch.randint(1, 32, (3, 8))
    config = HookManagerConfig(layer_types=ex.olmo_layer_types(model))
    _, dense, warned = _captured(model, _lm_loss, ids, config)
    assert any("layer 'transformer.wte'" in w and "F.linear(h, wte.weight)" in w for w in warned), (
        warned
    )
    ref = _per_sample(model, _lm_loss, ids)
    assert _rel(dense["transformer.wte.weight"], ref["transformer.wte.weight"]) > 0.1
    with pytest.raises(ValueError, match="tie_head_as_module"):
        ex.refuse_functional_tie(model)


def test_tie_head_as_module_is_the_same_model_and_captured_exactly() -> None:
    ex = _example()
    model = _tiny_olmo(weight_tying=True)
    ids = torch.randint(1, 32, (3, 8))
    before = model(input_ids=ids).logits.detach()
    n_params = len(list(model.parameters()))
    ex.tie_head_as_module(model)
    assert model.transformer.ff_out.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == n_params  # no new parameter
    assert torch.equal(model(input_ids=ids).logits, before)
    ex.refuse_functional_tie(model)  # no longer a functional tie
    config = HookManagerConfig(layer_types=ex.olmo_layer_types(model))
    grad, dense, warned = _captured(model, _lm_loss, ids, config)
    assert warned == []
    assert isinstance(grad.layers["transformer.wte"], Shared)
    ref = _per_sample(model, _lm_loss, ids)
    assert set(dense) == set(ref)
    for name in ref:
        assert _rel(dense[name], ref[name]) < 1e-6, name


@pytest.mark.parametrize("tying", [False, True])
def test_olmo_trainer_example(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, tying: bool
) -> None:
    """The example's ``main``, as a user runs it (it starts and ends its gloo group)."""
    if tying:
        result = _example().main(["--out", str(tmp_path), "--weight-tying"])
    else:  # without --out: a temporary directory, removed at the end
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        result = _example().main([])
        # torch's compile cache, and wandb's temporary directories (removed at interpreter exit)
        left = [p.name for p in tmp_path.iterdir()]
        assert [n for n in left if not n.startswith("torch") and "wandb-" not in n] == []
    out = capsys.readouterr().out
    assert "exact: every trainable parameter captured" in out, out
    assert result["missing"] == [] and max(result["errors"].values()) < 1e-4
    kinds = set(result["errors"])
    assert kinds == {"Linear", "RMSLayerNorm", "Embedding (tied head)" if tying else "Embedding"}
    assert "TracIn scores: (32, 8)" in out
    assert not torch.distributed.is_initialized()
