"""kronfluence EK-FAC on the same reference checkpoint, run by
:mod:`experiments.benchmark.quality.kronfluence_worker` in kronfluence's own venv
(``experiments/benchmark/.venv-kronfluence``): one fit serves the whole damping sweep, so the
first row's time is the whole subprocess. Empirical Fisher, ``nn.Linear`` layers, absolute
damping: the conventions of dattri_llm's ``EKFACAttributor``, so the two should agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from experiments.benchmark.quality.common import REPO_ROOT
from experiments.benchmark.quality.methods import Context, Method, Skipped
from experiments.benchmark.quality.methods.ours import dampings

PEER_PY = REPO_ROOT / "experiments" / "benchmark" / ".venv-kronfluence" / "bin" / "python"


def kf_dampings(classifier: bool = True) -> list[float | None]:
    """kronfluence's default (1e-8), its heuristic (``None``: 0.1 x mean eigenvalue), then the
    sweep of dattri_llm's rows."""
    return [1e-8, None] + [d for d in dampings(classifier) if d is not None and d != 1e-8]


def _run(ctx: Context) -> dict[str, torch.Tensor]:
    """The worker's scores (``d=<damping>`` -> ``(n_train, n_test)``), run once per context."""
    if "kronfluence" in ctx.extra:
        return ctx.extra["kronfluence"]
    if not PEER_PY.exists():
        raise Skipped(f"kronfluence venv missing ({PEER_PY}); see /work/shared/ENVIRONMENT.md")
    s = ctx.setting
    with tempfile.TemporaryDirectory(prefix="quality-kf-") as tmp:
        work = Path(tmp)
        data = {"train_x": s.train.x, "train_y": s.train.y, "test_x": s.test.x, "test_y": s.test.y}
        save_file({k: v.contiguous() for k, v in data.items()}, str(work / "data.safetensors"))
        model = {k: v.contiguous() for k, v in ctx.final.items()}
        save_file(model, str(work / "model.safetensors"))
        cfg = {
            "model_spec": s.model_spec,
            "task_kind": s.task_kind,
            "dampings": kf_dampings(s.task_kind == "classification"),
            "batch": 100,
        }
        (work / "cfg.json").write_text(json.dumps(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [str(PEER_PY), "-m", "experiments.benchmark.quality.kronfluence_worker", tmp]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO_ROOT))
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"kronfluence worker failed:\n{res.stderr[-3000:]}")
        info = json.loads(res.stdout.strip().splitlines()[-1])
        ctx.extra["kronfluence"] = load_file(str(work / "scores.safetensors"))
    print(
        f"# kronfluence {info['kronfluence']} (torch {info['torch']}): fit {info['fit_s']:.1f} s, "
        f"subprocess wall {wall:.1f} s",
        flush=True,
    )
    return ctx.extra["kronfluence"]


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    out = []
    for i, d in enumerate(kf_dampings(classifier)):
        label = {None: "heuristic 0.1 x mean eig", 1e-8: "default=1e-08"}.get(d, repr(d))
        note = "empirical Fisher, nn.Linear layers"
        if i == 0:
            note += "; time = whole subprocess (start-up, fit, all scores)"
        out.append(Method(f"EK-FAC (damping={label})", "kronfluence", _scores(d), note))
    return out


def _scores(damping: float | None) -> Any:
    return lambda ctx: _run(ctx)[f"d={damping!r}"]


def version() -> str | None:
    """kronfluence's version in its venv (``None`` when the venv is missing)."""
    if not PEER_PY.exists():
        return None
    cmd = [str(PEER_PY), "-c", "import kronfluence; print(kronfluence.__version__)"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip() or None
