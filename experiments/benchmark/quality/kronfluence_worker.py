"""kronfluence EK-FAC on a saved quality-benchmark checkpoint, in kronfluence's own venv:

    experiments/benchmark/.venv-kronfluence/bin/python -m \\
        experiments.benchmark.quality.kronfluence_worker WORK_DIR

``WORK_DIR`` holds what :mod:`~experiments.benchmark.quality.methods.kronfluence_peer` wrote
(``data`` / ``model.safetensors``, ``cfg.json``). Empirical Fisher, every ``nn.Linear`` tracked
but ``model_spec["tracked_exclude"]``, one fit, pairwise scores per damping (``None``: its
heuristic); losses summed over the batch as dattri_llm's ``loss_sum``. Writes
``scores.safetensors`` (``d=<damping>`` -> ``(n_train, n_test)``), prints a JSON line.
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


def main(work: Path) -> dict:
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
    for i, d in enumerate(cfg["dampings"]):
        t1 = time.perf_counter()
        analyzer.compute_pairwise_scores(
            f"s{i}",
            "ekfac",
            test,
            train,
            per_device_query_batch_size=bs,
            per_device_train_batch_size=bs,
            score_args=ScoreArguments(damping_factor=d),
            overwrite_output_dir=True,
        )
        scores = analyzer.load_pairwise_scores(f"s{i}")["all_modules"]  # (n_test, n_train)
        out[f"d={d!r}"] = scores.T.double().contiguous()
        timings[f"score_s d={d!r}"] = time.perf_counter() - t1
    save_file(out, str(work / "scores.safetensors"))
    return {**timings, "kronfluence": kf_version, "torch": torch.__version__}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
