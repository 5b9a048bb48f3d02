"""kronfluence EK-FAC on the same reference checkpoint, run in kronfluence's own venv.

The model (final reference checkpoint) and the data are written to a temporary folder as
safetensors and :mod:`experiments.benchmark.quality.kronfluence_worker` is launched with
``experiments/benchmark/.venv-kronfluence/bin/python`` (kronfluence needs its own torch
install; see ``/work/shared/ENVIRONMENT.md``). One fit serves the whole damping sweep; the
first row's time is the fit plus its scores, later rows their scores only. Empirical Fisher,
every ``nn.Linear`` tracked, absolute damping: the same conventions as dattri_llm's
``EKFACAttributor`` (whose rows skip embeddings and norms too), so the two should agree.
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
SOURCE = "kronfluence"


#: kronfluence's own default (1e-8), its heuristic (``None``: 0.1 x mean eigenvalue), then the
#: sweep used for dattri_llm's rows.
def kf_dampings(classifier: bool = True) -> list[float | None]:
    return [1e-8, None] + [d for d in dampings(classifier) if d is not None and d != 1e-8]


KF_DAMPINGS = kf_dampings()


def _label(d: float | None) -> str:
    if d is None:
        return "heuristic 0.1 x mean eig"
    if d == 1e-8:
        return "default=1e-08"
    return repr(d)


def _run(ctx: Context) -> dict[str, Any]:
    if "kronfluence" in ctx.extra:
        return ctx.extra["kronfluence"]
    if not PEER_PY.exists():
        raise Skipped(f"kronfluence venv missing ({PEER_PY}); see /work/shared/ENVIRONMENT.md")
    s = ctx.setting
    if not s.model_spec:
        raise Skipped(f"{s.name}: no model_spec to rebuild the model in the kronfluence venv")
    with tempfile.TemporaryDirectory(prefix="quality-kf-") as tmp:
        work = Path(tmp)
        save_file(
            {
                "train_x": s.train.x.contiguous(),
                "train_y": s.train.y.contiguous(),
                "test_x": s.test.x.contiguous(),
                "test_y": s.test.y.contiguous(),
            },
            str(work / "data.safetensors"),
        )
        save_file(
            {k: v.contiguous() for k, v in ctx.final.items()}, str(work / "model.safetensors")
        )
        cfg = {
            "model_spec": s.model_spec,
            "task_kind": s.task_kind,
            "dampings": kf_dampings(s.task_kind == "classification"),
            "batch": 100,
        }
        (work / "cfg.json").write_text(json.dumps(cfg))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        cmd = [str(PEER_PY), "-m", "experiments.benchmark.quality.kronfluence_worker", tmp]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO_ROOT))
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"kronfluence worker failed:\n{res.stderr[-3000:]}")
        info = json.loads(res.stdout.strip().splitlines()[-1])
        scores = load_file(str(work / "scores.safetensors"))
    info["wall_s"] = wall
    ctx.extra["kronfluence"] = {"info": info, "scores": scores, "first": True}
    print(
        f"# kronfluence {info['kronfluence']} (torch {info['torch']}): fit {info['fit_s']:.1f} s, "
        f"subprocess wall {wall:.1f} s",
        flush=True,
    )
    return ctx.extra["kronfluence"]


def ekfac(damping: float | None) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        run = _run(ctx)
        return run["scores"][f"d={damping!r}"]

    return fn


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    del quick
    return [
        Method(
            f"EK-FAC (damping={_label(d)})",
            SOURCE,
            ekfac(d),
            "empirical Fisher, nn.Linear layers"
            + ("; time = whole subprocess (start-up, fit, all scores)" if i == 0 else ""),
        )
        for i, d in enumerate(kf_dampings(classifier))
    ]


def version() -> str | None:
    """kronfluence's version in its venv (``None`` when the venv is missing)."""
    if not PEER_PY.exists():
        return None
    res = subprocess.run(
        [str(PEER_PY), "-c", "import kronfluence; print(kronfluence.__version__)"],
        capture_output=True,
        text=True,
    )
    return res.stdout.strip() or None
