"""Checks that need ai2-olmo-core: run with the ``olmo-core`` extra's own environment's pytest.

Not collected by the main suite (the file name does not match ``test_*.py``);
``experiments/tests/test_olmo_envs.py`` runs it in that environment::

    .venv-olmo-core/bin/python -m pytest -q -p no:cacheprovider \
        experiments/tests/olmo_envs/olmo_core_checks.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from olmo_core.nn.layer_norm import L2Norm, LayerNorm, RMSNorm
from olmo_core.optim import AdamWConfig
from torch import nn

from dattri_llm import (
    CaptureCallback,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
)
from dattri_llm.integrations.olmo_core import GradientCaptureCallback, olmo_core_layer_types
from experiments.fidelity.training import (
    build_model,
    make_data,
    model_config,
    train,
    train_to_store,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("cls", [RMSNorm, LayerNorm])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("full_precision", [True, False])
def test_olmo_core_norms_exact(cls: type, bias: bool, full_precision: bool) -> None:
    torch.manual_seed(0)
    norm = cls(size=8, bias=bias, full_precision=full_precision, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.add_(torch.randn_like(norm.weight))
        if bias:
            norm.bias.add_(torch.randn_like(norm.bias))
    model = nn.Sequential(nn.Linear(4, 8), norm, nn.Linear(8, 3)).double()
    layer_types = olmo_core_layer_types(model)
    assert layer_types == {"1": "nn.RMSNorm" if cls is RMSNorm else "nn.LayerNorm"}
    xs = torch.randn(5, 6, 4, dtype=torch.float64)
    cb = CaptureCallback()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookManager(model, HookManagerConfig(layer_types=layer_types), callbacks=[cb])
        with hm.collect(deregister_on_exit=True):
            model(xs).pow(2).sum().backward()
    assert [str(w.message) for w in caught] == []
    got = cb.pop().gradient.layers["1"].materialize().parameters()
    assert set(got) == ({"weight", "bias"} if bias else {"weight"})
    for pname, p in norm.named_parameters():
        ref = []
        for x in xs:
            model.zero_grad(set_to_none=True)
            model(x[None]).pow(2).sum().backward()
            ref.append(p.grad.clone())
        ref = torch.stack(ref)
        # full_precision normalises in float32 whatever the input dtype: its own round-off
        tol = 1e-6 if full_precision else 1e-12
        assert float((got[pname] - ref).norm() / ref.norm()) < tol, pname


def test_layer_types_leave_out_norms_without_parameters() -> None:
    model = nn.Sequential(
        RMSNorm(size=4), LayerNorm(size=4, elementwise_affine=False), L2Norm(size=4)
    )
    assert olmo_core_layer_types(model) == {"0": "nn.RMSNorm"}


def _run(tmp_path: Path, **kw):
    data = make_data(tmp_path, per_topic=4)
    model = build_model(model_config("untied"))
    run, store = train_to_store(
        tmp_path,
        "t",
        data,
        model,
        batch=8,
        micro_batch=4,
        steps=2,
        optim=AdamWConfig(lr=1e-3),
        **kw,
    )
    return data, run, store


def test_callback_captures_from_the_first_real_step(tmp_path: Path) -> None:
    data, run, store = _run(tmp_path)
    assert run.capture.first_step == 1
    assert sorted({r.step for r in store.records()}) == [0, 1]
    stored = [h for r in store.records() for h in r.hashes]
    assert sorted(stored) == sorted(data.hashes())  # every window once, no dry-run sample
    assert run.warnings == []
    assert not run.hook_manager.capturing
    with pytest.raises(RuntimeError, match="was removed"):  # hooks taken down at the end
        with run.hook_manager.collect():
            pass


def test_coverage_check_names_undeclared_norms(tmp_path: Path) -> None:
    """The fidelity coverage check can fail: OLMo-core's norms left undeclared are missing."""
    from experiments.fidelity.checks import coverage

    data, run, store = _run(tmp_path, declare_norms=False)
    c = coverage(run, data, store)
    assert "lm_head.norm.weight" in c["missing"] and c["captured"] < c["trainable"]
    assert any("lm_head.norm.weight (a RMSNorm)" in w for w in c["warnings"])


def test_collect_around_fit_would_store_the_dry_run(tmp_path: Path) -> None:
    """Why the callback exists: wrapping fit() itself captures OLMo-core's random dry-run batch."""
    data, _, store = _run(tmp_path, wrap_fit=True)
    stored = [h for r in store.records() for h in r.hashes]
    foreign = [h for h in stored if h not in set(data.hashes())]
    assert len({r.step for r in store.records()}) == 3 and len(foreign) > 0


def test_callback_refuses_a_micro_batch_count_mismatch(tmp_path: Path) -> None:
    data = make_data(tmp_path, per_topic=4)
    store = GradientStorageManager(str(tmp_path / "grads"))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=2 so each optimizer step"):
        train(
            tmp_path / "run",
            data,
            build_model(model_config("untied")),
            batch=8,
            micro_batch=4,
            steps=2,
            optim=AdamWConfig(lr=1e-3),
            capture_callbacks=[OffloadCallback(file_manager=store, gradient_accumulation_steps=1)],
        )
    assert len(store) == 0


def test_callback_needs_a_hook_manager(tmp_path: Path) -> None:
    cb = GradientCaptureCallback(hook_manager=None)
    with pytest.raises(TypeError, match="expected a dattri_llm.HookManager"):
        cb.post_attach()


def test_fidelity_quick_run(tmp_path: Path) -> None:
    """The experiment's one command, quick mode: its exactness and coverage checks pass."""
    out = tmp_path / "fidelity.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.fidelity.run", "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["failures"] == []
    for variant, errors in res["exactness"].items():
        assert max(errors.values()) < 1e-5, variant
        assert res["coverage"][variant]["missing"] == []
    rows = set(res["exactness"]["norm-bias"])
    assert {"attention.q_norm.bias", "attention_norm.bias", "lm_head.norm.bias"} <= rows
    assert "embeddings + lm_head.w_out (tied).weight" in res["exactness"]["tied"]
    assert "| olmo2_1M |" in proc.stdout
