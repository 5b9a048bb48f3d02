"""kronfluence EK-FAC on the same reference checkpoint, run by this module in kronfluence's own
venv (``experiments/benchmark/.venv-kronfluence``): one fit serves the whole damping sweep, so
the first row's time is the whole subprocess. Empirical Fisher, every ``nn.Linear`` but
``model_spec["tracked_exclude"]``, absolute damping, losses summed over the batch: the
conventions of dattri_llm's ``EKFACAttributor``, so the two should agree.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from experiments.benchmark.quality.common import REPO_ROOT
from experiments.benchmark.quality.methods import Context, Method, Skipped
from experiments.benchmark.quality.methods.ours import DAMPINGS, DAMPINGS_LM

PEER_PY = REPO_ROOT / "experiments" / "benchmark" / ".venv-kronfluence" / "bin" / "python"


def kf_dampings(classifier: bool = True) -> list[float | None]:
    """kronfluence's default (1e-8), its heuristic (``None``: 0.1 x mean eigenvalue), then the
    sweep of dattri_llm's rows."""
    sweep = DAMPINGS if classifier else DAMPINGS_LM
    return [1e-8, None] + [d for d in sweep if d is not None and d != 1e-8]


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
        save_file(
            {k: v.contiguous() for k, v in ctx.final.items()}, str(work / "model.safetensors")
        )
        cfg = {"model_spec": s.model_spec, "task_kind": s.task_kind, "batch": 100}
        cfg["dampings"] = kf_dampings(s.task_kind == "classification")
        (work / "cfg.json").write_text(json.dumps(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cmd = [str(PEER_PY), "-m", "experiments.benchmark.quality.methods.kronfluence_peer", tmp]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO_ROOT))
        wall = time.perf_counter() - t0
        if res.returncode != 0:
            raise RuntimeError(f"kronfluence worker failed:\n{res.stderr[-3000:]}")
        info = json.loads(res.stdout.strip().splitlines()[-1])
        ctx.extra["kronfluence"] = load_file(str(work / "scores.safetensors"))
    ctx.extra["last_note"] = (
        f"kronfluence {info['kronfluence']} (torch {info['torch']}): fit {info['fit_s']:.1f} s, "
        f"subprocess wall {wall:.1f} s"
    )
    return ctx.extra["kronfluence"]


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    out = []
    for i, d in enumerate(kf_dampings(classifier)):
        label = {None: "heuristic 0.1 x mean eig", 1e-8: "default=1e-08"}.get(d, repr(d))
        note = "empirical Fisher, nn.Linear layers"
        note += "; time = whole subprocess (start-up, fit, all scores)" * (i == 0)
        fn = lambda ctx, d=d: _run(ctx)[f"d={d!r}"]  # noqa: E731
        out.append(Method(f"EK-FAC (damping={label})", "kronfluence", fn, note))
    return out


def worker(work: Path) -> dict:
    """The subprocess: fit on ``work``'s data and model, write ``scores.safetensors``."""
    from kronfluence import __version__ as kf_version
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    cfg = json.loads((work / "cfg.json").read_text())
    data = load_file(str(work / "data.safetensors"))
    spec, kind = cfg["model_spec"], cfg["task_kind"]
    model = getattr(importlib.import_module(spec["module"]), spec["factory"])(**spec["kwargs"])
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    model.eval()

    def loss_sum(model: torch.nn.Module, batch: dict, log_odds: bool = False) -> torch.Tensor:
        logits, y = model(batch["x"]), batch["y"]
        if kind == "classification":
            return F.cross_entropy(logits, y, reduction="sum")
        if not log_odds:  # the per-sample mean token CE, summed
            return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.shape[1]
        # dattri's GPT-2 target as a loss: -(logp - log(1 - exp(logp))), logp = -ce
        ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
        return (ce + torch.log(-torch.expm1(-ce))).sum()

    class QualityTask(Task):
        def compute_train_loss(self, batch, model, sample=False):  # noqa: ANN001, ANN201
            assert not sample, "use_empirical_fisher=True: sampled labels are not used"
            return loss_sum(model, batch)

        def compute_measurement(self, batch, model):  # noqa: ANN001, ANN201
            return loss_sum(model, batch, spec.get("measurement") == "neg_log_odds")

        def get_influence_tracked_modules(self):  # noqa: ANN201
            if not spec.get("tracked_exclude"):
                return None  # kronfluence's default: every nn.Linear / nn.Conv2d
            skip = re.compile(spec["tracked_exclude"])
            linear = (torch.nn.Linear, torch.nn.Conv2d)
            mods = model.named_modules()
            return [n for n, m in mods if isinstance(m, linear) and not skip.fullmatch(n)]

    class Samples(torch.utils.data.Dataset):
        def __init__(self, split: str) -> None:
            self.x, self.y = data[f"{split}_x"], data[f"{split}_y"]

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "y": self.y[i]}

    train, test = Samples("train"), Samples("test")
    task = QualityTask()
    model = prepare_model(model, task)
    out_dir = str(work / "kf_out")
    analyzer = Analyzer("quality", model, task, cpu=True, disable_tqdm=True, output_dir=out_dir)
    bs = int(cfg["batch"])
    t0 = time.perf_counter()
    factor_args = FactorArguments(strategy="ekfac", use_empirical_fisher=True)
    analyzer.fit_all_factors(
        "ekfac", train, per_device_batch_size=bs, factor_args=factor_args, overwrite_output_dir=True
    )
    timings, out = {"fit_s": time.perf_counter() - t0}, {}
    batches = {"per_device_query_batch_size": bs, "per_device_train_batch_size": bs}
    for i, d in enumerate(cfg["dampings"]):
        t1, args = time.perf_counter(), ScoreArguments(damping_factor=d)
        analyzer.compute_pairwise_scores(
            f"s{i}", "ekfac", test, train, score_args=args, overwrite_output_dir=True, **batches
        )
        scores = analyzer.load_pairwise_scores(f"s{i}")["all_modules"]  # (n_test, n_train)
        out[f"d={d!r}"] = scores.T.double().contiguous()
        timings[f"score_s d={d!r}"] = time.perf_counter() - t1
    save_file(out, str(work / "scores.safetensors"))
    return {**timings, "kronfluence": kf_version, "torch": torch.__version__}


if __name__ == "__main__":
    print(json.dumps(worker(Path(sys.argv[1]))))
