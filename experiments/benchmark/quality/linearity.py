"""The first-order ceiling of the small-removal LDS.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.linearity --setting gpt2 \
        [--fraction 1] [--subsets 100] [--eps 0.02] [--check-eps 0.1:10] [--controls 5]

A derivative of the recorded run (AdamW-influence with ``ExactHessian``, MAGIC's metagradient)
predicts a subset's removal by the *first-order* change of the test targets. This harness
measures that first-order change directly, without any attribution method: subset ``i``'s
removed set is kept at weight ``1 − ε`` in a weighted batch mean (``train_func(...,
remove=..., remove_weight=1 − ε)``; run 0, the attributed run), so ``Δ(ε)/ε`` is the
directional derivative of every test target along that subset's removal up to ``O(ε)``, the
exact answer of a perfect first-order method. Against the true removals it gives

* **the first-order ceiling**: LDS of ``Δ(ε)/ε`` against the removal ground truth of run 0
  (``removal.py``'s cache, same subsets): no derivative of the run can score higher on
  average, whatever its cost;
* **each method's fidelity to the derivative**: LDS of the method's cached scores against
  ``Δ(ε)/ε`` (1.0 for an exact derivative);
* **consistency checks**: ``Δ(ε′)/ε′`` at a second ``ε′`` on the first subsets (should agree
  with ``Δ(ε)/ε``), and rounding controls (the set kept at weight 1 through the weighted
  path: the same maths with other float32 rounding, the noise floor of ``Δ(ε)``);
* **the first batch** (``--first-batches K``): the blocks of the run's first ``K`` batches
  (a fresh AdamW's first update is ``≈ sign(g)``, whose derivative is unbounded) removed one
  at a time (``Δ(1)`` and ``Δ(ε)/ε``, run 0), each method's score norms there against the
  median, and every method's LDS with those blocks' scores set to zero or replaced by their
  true single-block effects (what a method exact on them would reach).

Runs are cached per subset in ``linearity-<pct>-<eps>.safetensors`` beside the removal
ground truth (an interrupted run resumes); the result goes to
``results/linearity_<setting>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality import removal
from experiments.benchmark.quality.common import RESULTS_DIR, Setting, environment
from experiments.benchmark.quality.metrics import lds_summed_scores, spearman_columns


def prediction_agreement(pred: np.ndarray, truth: np.ndarray, seed: int = 0) -> dict:
    """LDS-style agreement of per-subset predictions with per-subset truths, both (S, n_test):
    Spearman across subsets per test column, averaged, with :func:`removal.lds_with_ci`'s
    interval (delete-one-subset jackknife + test-sample bootstrap) and the mean Pearson."""
    per_test = spearman_columns(pred, truth)
    value = float(np.nanmean(per_test))
    se = removal.interval_se(pred, truth, per_test, seed)
    pc = pred - pred.mean(0)
    tc = truth - truth.mean(0)
    pearson = (pc * tc).sum(0) / np.sqrt((pc * pc).sum(0) * (tc * tc).sum(0))
    return {
        "mean": value,
        "lo": value - 1.96 * se,
        "hi": value + 1.96 * se,
        "se": se,
        "pearson": float(np.nanmean(pearson)),
    }


def partial_removals(
    setting: Setting,
    folder: Path,
    fraction: float,
    indices: torch.Tensor,
    weight: float,
    count: int,
) -> torch.Tensor:
    """(count, n_test) test targets of run 0 with subset ``i``'s removed set kept at
    ``weight`` (cached per subset, resumable)."""
    name = f"linearity-{round(100 * fraction)}-w{weight:g}"
    cached = gtm._read(folder, name)
    rows = list(cached[0]["targets"]) if cached is not None else []
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    n = len(setting.train)
    t0 = time.perf_counter()
    for i in range(len(rows), count):
        keep = indices[i].numpy()
        removed = torch.as_tensor(np.setdiff1d(np.arange(n), keep), dtype=torch.long)
        model = setting.train_func(loader, seed=0, remove=removed, remove_weight=weight)
        rows.append(setting.target(model, test_loader).to(torch.float64))
        meta = {"fraction": fraction, "weight": weight, "subsets": len(rows), "run": 0}
        gtm._write(folder, name, {"targets": torch.stack(rows)}, meta)
        print(f"#   {name}: subset {i + 1}/{count} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return torch.stack(rows[:count])


def main(argv: list[str] | None = None) -> int:
    from experiments.benchmark.quality.run import build_setting

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", choices=("gpt2",), default="gpt2")
    p.add_argument("--fraction", type=float, default=1.0, help="removal fraction in %%")
    p.add_argument("--subsets", type=int, default=100)
    p.add_argument("--eps", type=float, default=0.02, help="the partial removal's ε")
    p.add_argument(
        "--check-eps", default="0.1:10", help="ε′:K — Δ(ε′)/ε′ on the first K subsets too"
    )
    p.add_argument("--controls", type=int, default=5, help="rounding controls (subsets)")
    p.add_argument(
        "--first-batches", type=int, default=1, help="single-block removals of the first K batches"
    )
    a = p.parse_args(argv)
    command = "OMP_NUM_THREADS={} python -m experiments.benchmark.quality.linearity {}".format(
        os.environ.get("OMP_NUM_THREADS", "<unset>"),
        " ".join(sys.argv[1:] if argv is None else argv),
    )
    print(f"# {command}", flush=True)
    t_start = time.perf_counter()
    spec = removal.protocol(a.setting, quick=False)
    setting = removal.limited(build_setting(a.setting), spec["test_limit"])
    key = {k: v for k, v in spec.items() if k != "num_subsets"}
    folder = gtm.cache_dir(setting, {**key, "kind": "removal"})
    fraction = a.fraction / 100
    want = {"fraction": fraction, "num_subsets": a.subsets, "runs": spec["runs"]}
    done, _ = removal._cached_subsets(
        folder, f"removal-{round(a.fraction)}", {**want, "seed": removal.LDS_SEED}
    )
    if done is None or len(done["per_run"]) < a.subsets:
        raise SystemExit(
            f"linearity: the removal ground truth at {a.fraction:g} % with {a.subsets} subsets is "
            f"not cached in {folder}; build it first with `python -m "
            f"experiments.benchmark.quality.removal --setting {a.setting} --part truth`."
        )
    base0 = gtm._read(folder, "removal-base")[0]["base"][0].to(torch.float64)
    truth0 = done["per_run"][: a.subsets, 0].to(torch.float64)  # -target of run 0
    indices = done["indices"][: a.subsets]
    delta1 = -truth0 - base0  # Δ(1): the removal's change of the target
    t_eps = partial_removals(setting, folder, fraction, indices, 1 - a.eps, a.subsets)
    slope = (t_eps - base0) / a.eps  # Δ(ε)/ε
    out: dict = {"command": command, "setting": setting.name, "fraction": fraction}
    out["subsets"], out["eps"], out["n_test"] = a.subsets, a.eps, len(setting.test)
    # the prediction of -target under removal is -(base + slope): rank by -slope
    out["ceiling"] = prediction_agreement(-slope.numpy(), truth0.numpy())
    out["mean_abs"] = {"delta1": float(delta1.abs().mean()), "slope": float(slope.abs().mean())}
    ratio = (delta1 * slope).sum(0) / (slope * slope).sum(0)
    out["delta1_over_slope_ls"] = float(ratio.mean())
    eps2, k2 = a.check_eps.split(":")
    eps2, k2 = float(eps2), min(int(k2), a.subsets)
    if k2 > 0:
        t2 = partial_removals(setting, folder, fraction, indices, 1 - eps2, k2)
        slope2 = (t2 - base0) / eps2
        out["check"] = {
            "eps": eps2,
            "subsets": k2,
            "vs_slope": prediction_agreement(slope2.numpy(), slope[:k2].numpy()),
            "rel_diff": float((slope2 - slope[:k2]).norm() / slope[:k2].norm()),
        }
    if a.controls > 0:
        tc = partial_removals(setting, folder, fraction, indices, 1.0, a.controls)
        out["control_mean_abs"] = float((tc - base0).abs().mean())
    first = first_batch_blocks(setting, a.first_batches)
    single = {b: single_removal(setting, folder, b) for b in first}
    out["first_batch"] = {
        "blocks": first,
        "delta1_norm": [float((single[b][0] - base0).norm()) for b in first],
        "slope_norm": [float(((single[b][1] - base0) / a.eps).norm()) for b in first],
    }
    rows = []
    score_dir = folder / "removal-scores"
    for path in sorted(score_dir.glob("*.safetensors")):
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.get("status") != "ok":
            continue
        from safetensors.torch import load_file

        scores = load_file(str(path))["scores"].to(torch.float64)
        summed = lds_summed_scores(scores, indices)
        zeroed, true = scores.clone(), scores.clone()
        zeroed[first] = 0.0
        norms = scores.norm(dim=1)
        c = _scale(scores, indices, slope, first)
        for b in first:
            true[b] = (single[b][0] - base0) / c
        rows.append(
            {
                "method": path.stem,
                "vs_slope": prediction_agreement(summed, -slope.numpy()),
                "vs_truth_run0": prediction_agreement(summed, truth0.numpy()),
                "first_batch_norm_over_median": float(norms[first].mean() / norms.median()),
                "first_batch_zeroed": prediction_agreement(
                    lds_summed_scores(zeroed, indices), truth0.numpy()
                ),
                "first_batch_true_effects": prediction_agreement(
                    lds_summed_scores(true, indices), truth0.numpy()
                ),
            }
        )
    out["rows"] = rows
    out["environment"] = environment()
    out["total_seconds"] = time.perf_counter() - t_start
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = f"linearity_{setting.name}-{round(a.fraction)}"
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    print(json.dumps({k: v for k, v in out.items() if k != "environment"}, indent=1, default=str))
    return 0


def first_batch_blocks(setting: Setting, k: int) -> list[int]:
    """The train blocks of the first ``k`` batches of run 0 (the gpt2 loop's epoch-1
    permutation: ``randperm`` of a generator seeded with the run's seed, 0)."""
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(setting.train), generator=gen)
    return sorted(int(i) for i in perm[: k * setting.batch_size])


def single_removal(setting: Setting, folder: Path, block: int) -> torch.Tensor:
    """(2, n_test): run 0's targets without ``block`` (Δ(1)) and with it at weight 0.98
    (cached as ``linearity-block-<i>``)."""
    name = f"linearity-block-{block}"
    cached = gtm._read(folder, name)
    if cached is not None:
        return cached[0]["targets"]
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    rows = []
    for w in (0.0, 0.98):
        model = setting.train_func(loader, seed=0, remove=torch.tensor([block]), remove_weight=w)
        rows.append(setting.target(model, test_loader).to(torch.float64))
    gtm._write(folder, name, {"targets": torch.stack(rows)}, {"block": block, "weights": [0, 0.98]})
    return torch.stack(rows)


def _scale(
    scores: torch.Tensor, indices: torch.Tensor, slope: torch.Tensor, skip: list[int]
) -> float:
    """The least-squares factor ``c`` with ``c · Σ_removed scores ≈ Δ(ε)/ε`` over the subsets
    that hold none of ``skip`` (a method's scores in target units, so its first-batch scores
    can be replaced by true effects ``Δ(1) / c``)."""
    total = scores.sum(0)
    removed = total[None] - torch.as_tensor(lds_summed_scores(scores, indices))
    clean = torch.tensor([bool(np.isin(skip, k.numpy()).all()) for k in indices])
    r, t = removed[clean], slope[clean]
    return float((r * t).sum() / (r * r).sum())


if __name__ == "__main__":
    raise SystemExit(main())
