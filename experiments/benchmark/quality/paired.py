"""Paired LDS differences between rows of the quality benchmark, on the same ground truth.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.paired --setting char-gpt --quick \
        --methods 'AdamW-influence \\(every|^LESS|^DVEmb' --baselines '^Grad-Dot$|^TracIn \\(4'

The rows' own intervals (``run.py``) resample test samples independently per row; two rows
scored on the same test samples are better compared through the per-test difference of their
LDS (dattri's per-test Spearman), with the same percentile bootstrap over test samples. Uses
the cached ground truth (it must exist: run ``run.py`` first) and re-scores the named rows
(their cached scores where the method caches them). Prints one line per (row, baseline,
ground-truth variant).
"""

from __future__ import annotations

import argparse
import re

import numpy as np
import torch

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality.methods import Context, run_method
from experiments.benchmark.quality.metrics import bootstrap_ci
from experiments.benchmark.quality.run import SETTINGS, all_methods, build_setting, protocol


def per_test_lds(scores: torch.Tensor, gt: dict[str, torch.Tensor]) -> np.ndarray:
    """dattri's per-test LDS (Spearman over subsets) of ``scores`` (n_train, n_test)."""
    from dattri.metric import lds

    per_test, _ = lds(scores.to(torch.float64), (gt["gt"], gt["indices"]))
    return per_test.numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", choices=SETTINGS, required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--methods", required=True, help="regex: the rows to compare")
    p.add_argument("--baselines", required=True, help="regex: the rows to compare them with")
    a = p.parse_args(argv)

    setting = build_setting(a.setting)
    spec = protocol(a.setting, a.quick)
    folder = gtm.cache_dir(setting, spec)
    if not (folder / "reference.json").exists():
        raise SystemExit(f"{folder}: no cached ground truth; run quality.run with the same flags.")
    ckpts, _ = gtm.reference_run(setting, folder, seed=spec["loo_seed"])
    truths = {}
    for variant in spec.get("variants", ["default"]):
        sub = folder if variant == "default" else folder / variant
        kwargs = {"crn": [spec["lds_seed"], spec["runs"]]} if variant == "crn" else {}
        truths[variant], _ = gtm.lds_ground_truth(
            setting, sub, spec["num_subsets"], spec["runs"], seed=spec["lds_seed"], **kwargs
        )
    ctx = Context(
        setting, ckpts, quick=a.quick, extra={"cache_dir": folder, "loo_seed": spec["loo_seed"]}
    )
    methods = all_methods(a.quick, False, setting.task_kind, setting.name, setting.trajectory)
    wanted = [m for m in methods if re.search(a.methods, m.name)]
    bases = [m for m in methods if re.search(a.baselines, m.name)]
    per: dict[str, dict[str, np.ndarray]] = {}
    for m in bases + [m for m in wanted if m not in bases]:
        r = run_method(m, ctx)
        if r.status != "ok":
            print(f"{m.name}: {r.status}: {r.note}")
            continue
        per[m.name] = {v: per_test_lds(r.scores, g) for v, g in truths.items()}
    for m in wanted:
        for b in bases:
            if m.name not in per or b.name not in per or m is b:
                continue
            for v in truths:
                d = per[m.name][v] - per[b.name][v]
                lo, hi = bootstrap_ci(d)
                print(
                    f"{m.name} - {b.name} [{v}]: {np.nanmean(d):+.3f} [{lo:+.3f}, {hi:+.3f}] "
                    f"(paired over {int((~np.isnan(d)).sum())} test samples)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
