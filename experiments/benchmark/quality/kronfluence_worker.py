"""kronfluence EK-FAC on a saved quality-benchmark checkpoint (runs in kronfluence's own venv).

    experiments/benchmark/.venv-kronfluence/bin/python -m \\
        experiments.benchmark.quality.kronfluence_worker WORK_DIR

``WORK_DIR`` holds what :mod:`experiments.benchmark.quality.methods.kronfluence_peer` wrote:
``data.safetensors`` (``train_x``, ``train_y``, ``test_x``, ``test_y``), ``model.safetensors``
(the reference checkpoint) and ``cfg.json`` (``model_spec``, ``task_kind``, ``dampings``,
``batch``). The model is rebuilt from ``model_spec`` (a torch-only module), every ``nn.Linear``
is tracked (kronfluence's default), the Fisher is the empirical one
(``FactorArguments(strategy="ekfac", use_empirical_fisher=True)``), factors are fitted once and
pairwise scores computed for every damping (``ScoreArguments(damping_factor=d)``; ``None`` is
kronfluence's heuristic, 0.1 x the mean eigenvalue). Train loss and measurement are the
per-sample loss summed over the batch (mean token cross-entropy per sample for ``lm``), as
dattri_llm's ``loss_sum``. Writes ``scores.safetensors`` (``d=<damping>`` -> ``(n_train,
n_test)``) and prints one JSON line of timings and versions.

Optional ``model_spec`` keys: ``tracked_exclude`` (regex, full-matched on module names: those
``nn.Linear`` are not tracked, e.g. a ``lm_head`` tied to an embedding that dattri_llm's
K-FAC leaves out) and ``measurement = "neg_log_odds"`` (dattri's GPT-2 log-odds target, as a
loss, on the test side).
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file


def neg_log_odds_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed ``-(logp - log(1 - exp(logp)))``, ``logp = -`` mean token CE (dattri's GPT-2
    target written as a loss)."""
    out = model(x)
    logits = getattr(out, "logits", out)
    ce = F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)
    return (ce + torch.log(-torch.expm1(-ce))).sum()


def build_model(spec: dict) -> torch.nn.Module:
    module = importlib.import_module(spec["module"])
    return getattr(module, spec["factory"])(**spec.get("kwargs", {}))


def per_sample_loss_sum(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str):
    out = model(x)
    logits = getattr(out, "logits", out)
    if kind == "classification":
        return F.cross_entropy(logits, y, reduction="sum")
    if kind == "lm":
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.shape[1]
    raise ValueError(f"task_kind must be 'classification' or 'lm', got {kind!r}.")


def main(work: Path) -> dict:
    from kronfluence import __version__ as kf_version
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    cfg = json.loads((work / "cfg.json").read_text())
    data = load_file(str(work / "data.safetensors"))
    spec = cfg["model_spec"]
    model = build_model(spec)
    model.load_state_dict(load_file(str(work / "model.safetensors")))
    model.eval()
    kind = cfg["task_kind"]

    class QualityTask(Task):
        def compute_train_loss(self, batch, model, sample=False):  # noqa: ANN001, ANN201
            if sample:
                raise RuntimeError("use_empirical_fisher=True: sampled labels are not used")
            return per_sample_loss_sum(model, batch["x"], batch["y"], kind)

        def compute_measurement(self, batch, model):  # noqa: ANN001, ANN201
            if spec.get("measurement") == "neg_log_odds":
                return neg_log_odds_sum(model, batch["x"], batch["y"])
            return per_sample_loss_sum(model, batch["x"], batch["y"], kind)

        def get_influence_tracked_modules(self):  # noqa: ANN201
            if not spec.get("tracked_exclude"):
                return None  # kronfluence's default: every nn.Linear / nn.Conv2d
            skip = re.compile(spec["tracked_exclude"])
            return [
                n
                for n, m in model.named_modules()
                if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and not skip.fullmatch(n)
            ]

    class DS(torch.utils.data.Dataset):
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            self.x, self.y = x, y

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict:
            return {"x": self.x[i], "y": self.y[i]}

    train, test = DS(data["train_x"], data["train_y"]), DS(data["test_x"], data["test_y"])
    task = QualityTask()
    model = prepare_model(model, task)
    analyzer = Analyzer(
        "quality", model, task, cpu=True, disable_tqdm=True, output_dir=str(work / "kf_out")
    )
    bs = int(cfg["batch"])
    t0 = time.perf_counter()
    analyzer.fit_all_factors(
        "ekfac",
        train,
        per_device_batch_size=bs,
        factor_args=FactorArguments(strategy="ekfac", use_empirical_fisher=True),
        overwrite_output_dir=True,
    )
    timings = {"fit_s": time.perf_counter() - t0}
    out = {}
    for i, d in enumerate(cfg["dampings"]):
        t1 = time.perf_counter()
        name = f"s{i}"
        analyzer.compute_pairwise_scores(
            name,
            "ekfac",
            test,
            train,
            per_device_query_batch_size=bs,
            per_device_train_batch_size=bs,
            score_args=ScoreArguments(damping_factor=d),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores(name)["all_modules"]  # (n_test, n_train)
        out[f"d={d!r}"] = scores.T.double().contiguous()
        timings[f"score_s d={d!r}"] = time.perf_counter() - t1
    save_file(out, str(work / "scores.safetensors"))
    return {**timings, "kronfluence": kf_version, "torch": torch.__version__}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} WORK_DIR")
    print(json.dumps(main(Path(sys.argv[1]))))
