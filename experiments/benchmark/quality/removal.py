"""LDS by removal fraction: the small-removal regime.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.removal --setting gpt2 --quick \
        [--fractions 1,5,10,50] [--part truth|scores|table|all]

For each removal fraction ``f`` the harness draws subsets exactly as dattri's ``retrain_lds``
does (``numpy default_rng(seed + i).choice(n, round(n (1 - f)), replace=False)`` kept, so the
50 % subsets are those of the half-data LDS) and retrains with **common random numbers**: run
``j`` of every subset is the reference run's training loop with seed ``j`` (run 0 *is* the
attributed run: same initialisation, batch order, step count and schedule), with the removed
samples dropped from every batch they fall in (``train_func(..., remove=...)``; a batch's
mean loss is then over the samples it keeps; a batch left empty skips its update). A removed
sample therefore changes nothing but its own contribution, which is what a first-order
attribution of the recorded run predicts and what MAGIC's metagradient LDS measures.

Per fraction the result holds, next to every method's LDS (dattri's ``lds`` against the mean
over the ``R`` runs, and against run 0 alone: the attributed trajectory):

* the ground truth's own reliability: Spearman between run 0 and run 1 of the same subsets
  (per test sample, averaged) and its Spearman-Brown ``R``-run value;
* the mean ``|Δ target|`` of a removal (how large the effects are);
* 95 % intervals that cover the finite subsets (delete-one jackknife) and the finite test set
  (bootstrap) together (:func:`lds_with_ci`).

Method scores do not depend on the fraction: each method is run once (its scores are cached
beside the ground truth), then scored at every fraction. ``--part truth`` / ``--part scores``
build one half (two processes can share the 2 cores), ``--part all`` (default) builds what is
missing and writes ``results/removal_<setting>[-quick].{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality.common import RESULTS_DIR, Setting, TupleDataset, environment
from experiments.benchmark.quality.metrics import N_BOOT, spearman_columns, split_run_reliability

FRACTIONS = (0.01, 0.05, 0.10, 0.50)
LDS_SEED = 1000

#: method rows per setting (regex on the harness's method names; the ExactHessian row is added
#: for AdamW runs by :func:`methods`)
ROWS = {
    "gpt2": r"^(Random|Grad-Dot|Grad-Cos|TracIn \(4 ckpts, w=lr\)|EK-FAC \(damping=default\)|"
    r"AdamW-influence \(every step, all coordinates\)|LESS.*|DVEmb.*|"
    r"Grad-Cos mask-2048.*|ProjectedFisher mask-2048.*)$",
    "digits": r"^(Random|Exact IF.*|Grad-Dot|Grad-Cos|TracIn \(4 ckpts, w=lr\)|"
    r"K-FAC \(damping=default\)|EK-FAC \(damping=default\)|Exact unrolled.*|"
    r"DVEmb \(empirical Fisher\)|AdamW-influence)$",
}
EXACT_HESSIAN_ROW = "AdamW-influence, exact Hessian (every step, all coordinates)"
EXACT_PUSH_ROW = "AdamW-influence, exact Hessian + exact push (every step, all coordinates)"
#: ``exact_steps=`` of the AdamW-influence rows that carry the run's first steps exactly
EXACT_STEPS = (2, 4, 16)


def exact_steps_row(k: int) -> str:
    """The removal table's name of the ``ExactHessian`` + ``push="exact", exact_steps=k`` row."""
    return (
        f"AdamW-influence, exact Hessian + exact push, exact_steps={k} "
        "(every step, all coordinates)"
    )


def protocol(setting: str, quick: bool) -> dict:
    """Subsets / runs per fraction and the test queries scored (``test_limit``)."""
    if setting == "gpt2":
        # quick: 8 subsets at 1 % (the target), 6 elsewhere (a run is ~35 s on the
        # shared 2 cores; the whole new run has to fit in 25 min)
        # full: more subsets on the same 20 queries (the ExactHessian row costs ~40 s per
        # query here, so the query set stays; the quick cache is extended, not rebuilt)
        subsets = {1: 8, 5: 6, 10: 6, 50: 6} if quick else {1: 100, 5: 24, 10: 24, 50: 24}
        return {"num_subsets": subsets, "runs": 2, "test_limit": 20}
    if setting.startswith("digits"):
        return {"num_subsets": 12 if quick else 100, "runs": 2, "test_limit": None}
    raise SystemExit(f"--setting {setting}: the removal LDS is wired for gpt2 and digits-*.")


def limited(setting: Setting, test_limit: int | None) -> Setting:
    """The setting with its first ``test_limit`` test samples only (every method's query set
    and every target); part of the cache key through ``config``."""
    if test_limit is None or test_limit >= len(setting.test):
        return setting
    test = TupleDataset(setting.test.x[:test_limit], setting.test.y[:test_limit])
    return dataclasses.replace(
        setting, test=test, config={**setting.config, "test_limit": test_limit}
    )


def kept_indices(n: int, fraction: float, seed: int, i: int) -> np.ndarray:
    """Subset ``i``'s kept train indices (dattri's ``retrain_lds`` draw)."""
    rng = np.random.default_rng(seed + i)
    return np.sort(rng.choice(n, round(n * (1 - fraction)), replace=False))


def full_runs(
    setting: Setting, folder: Path, runs: int, reference: dict[str, torch.Tensor]
) -> torch.Tensor:
    """(R, n_test) targets of the full-data runs of seeds ``0..R-1`` (cached); the seed-0 run
    must reproduce the reference run bit for bit (run 0 is the attributed run)."""
    cached = gtm._read(folder, "removal-base")
    if cached is not None and cached[1].get("runs") == runs:
        return cached[0]["base"]
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    base = []
    for j in range(runs):
        model = setting.train_func(loader, seed=j)
        if j == 0:
            drift = max(
                float((v.detach() - reference[k]).abs().max())
                for k, v in model.state_dict().items()
                if k in reference
            )
            if drift != 0.0:
                raise RuntimeError(
                    f"removal LDS: the seed-0 full run differs from the reference run by "
                    f"{drift:.3e}; run 0 would not be the attributed run."
                )
        base.append(setting.target(model, test_loader))
    gtm._write(folder, "removal-base", {"base": torch.stack(base)}, {"runs": runs})
    return torch.stack(base)


def removal_ground_truth(
    setting: Setting,
    folder: Path,
    fraction: float,
    num_subsets: int,
    runs: int,
    reference: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict]:
    """``gt`` (S, n_test) = mean over runs of ``-target``; ``indices`` (S, kept); ``per_run``
    (S, R, n_test); ``delta`` (S, R, n_test) = target change against the full run of the same
    seed. Cached as ``removal-<pct>.{safetensors,json}``."""
    name = f"removal-{round(100 * fraction)}"
    spec = {"fraction": fraction, "num_subsets": num_subsets, "runs": runs, "seed": LDS_SEED}
    done, seconds = _cached_subsets(folder, name, spec)
    if done is not None and len(done["per_run"]) >= num_subsets:
        return _first_subsets(done, num_subsets, spec, seconds)
    t0 = time.perf_counter()
    n = len(setting.train)
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    base = full_runs(setting, folder, runs, reference)
    per_run = list(done["per_run"]) if done is not None else []
    kept = list(done["indices"]) if done is not None else []
    for i in range(len(per_run), num_subsets):
        keep = kept_indices(n, fraction, LDS_SEED, i)
        removed = torch.as_tensor(np.setdiff1d(np.arange(n), keep), dtype=torch.long)
        row = torch.zeros(runs, len(setting.test), dtype=torch.float64)
        for j in range(runs):
            model = setting.train_func(loader, seed=j, remove=removed)
            row[j] = -setting.target(model, test_loader)
        per_run.append(row)
        kept.append(torch.as_tensor(keep, dtype=torch.long))
        # written after every subset: an interrupted run keeps what it built, and a larger
        # protocol extends it (subset i's draw depends on i alone)
        _save_subsets(folder, name, spec, per_run, kept, base, seconds + time.perf_counter() - t0)
        print(f"#   {name}: subset {i + 1}/{num_subsets} ({time.perf_counter() - t0:.0f} s)")
    done, seconds = _cached_subsets(folder, name, spec)
    return _first_subsets(done, num_subsets, spec, seconds)


def _cached_subsets(folder: Path, name: str, spec: dict) -> tuple[dict | None, float]:
    """The subsets a cached file of the same fraction / runs / seed holds (any count), and the
    seconds spent building them; ``(None, 0)`` when there is none."""
    cached = gtm._read(folder, name)
    if cached is None:
        return None, 0.0
    tensors, meta = cached
    same = {k: v for k, v in meta.get("spec", {}).items() if k != "num_subsets"}
    if same != {k: v for k, v in spec.items() if k != "num_subsets"}:
        return None, 0.0
    return tensors, float(meta.get("seconds", 0.0))


def _save_subsets(
    folder: Path, name: str, spec: dict, per_run: list, kept: list, base: torch.Tensor, s: float
) -> None:
    pr = torch.stack(per_run)
    meta = {
        "spec": {**spec, "num_subsets": len(per_run)},
        "removal": "common random numbers: run j = the reference loop with seed j, removed "
        "samples dropped from their batches (schedule, step count, batch order kept)",
        "subsets": f"numpy default_rng({LDS_SEED} + i).choice(n, round(n (1 - f))) kept",
        "mean_abs_delta": float((-pr - base[None]).abs().mean()),
        "seconds": s,
    }
    tensors = {
        "gt": pr.mean(1),
        "indices": torch.stack(kept),
        "per_run": pr,
        "delta": -pr - base[None],
    }
    gtm._write(folder, name, tensors, meta)


def _first_subsets(
    tensors: dict, count: int, spec: dict, seconds: float
) -> tuple[dict[str, torch.Tensor], dict]:
    """The first ``count`` subsets of a cached ground truth, with its metadata for ``spec``."""
    out = {k: v[:count] for k, v in tensors.items()}
    meta = {
        "spec": spec,
        "removal": "common random numbers: run j = the reference loop with seed j, removed "
        "samples dropped from their batches (schedule, step count, batch order kept)",
        "subsets": f"numpy default_rng({LDS_SEED} + i).choice(n, round(n (1 - f))) kept",
        "mean_abs_delta": float(out["delta"].abs().mean()),
        "seconds": seconds * count / len(tensors["per_run"]),
    }
    return out, meta


def lds_with_ci(scores: torch.Tensor, gt: torch.Tensor, kept: torch.Tensor, seed: int = 0) -> dict:
    """dattri's LDS (point) and a 95 % interval ``point ± 1.96 se`` with ``se² = (subsets'
    delete-one jackknife variance) + (test samples' bootstrap variance)``: it covers both the
    finite set of retrained subsets and the finite test set. (A bootstrap that resamples
    subsets with replacement is biased downwards for a rank correlation: the repeated rows
    tie.)"""
    from dattri.metric import lds

    per_test, _ = lds(scores.to(torch.float64), (gt, kept))
    value = float(np.nanmean(per_test.numpy()))
    summed = torch.stack([scores.to(torch.float64)[k].sum(0) for k in kept]).numpy()
    se = interval_se(summed, gt.numpy(), per_test.numpy(), seed)
    return {"mean": value, "lo": value - 1.96 * se, "hi": value + 1.96 * se, "se": se}


def interval_se(summed: np.ndarray, truth: np.ndarray, per_test: np.ndarray, seed: int) -> float:
    """The standard error of an LDS: the delete-one-subset jackknife variance of the mean
    per-test Spearman of ``summed`` against ``truth`` (both ``(S, n_test)``) plus the bootstrap
    variance of the mean of ``per_test`` over test samples."""
    s = truth.shape[0]
    jack = np.array(
        [
            np.nanmean(spearman_columns(np.delete(summed, i, 0), np.delete(truth, i, 0)))
            for i in range(s)
        ]
    )
    var_subsets = (s - 1) / s * float(((jack - jack.mean()) ** 2).sum())
    v = per_test[~np.isnan(per_test)]
    rng = np.random.default_rng(seed)
    var_tests = float(v[rng.integers(0, len(v), (N_BOOT, len(v)))].mean(1).var())
    return float(np.sqrt(var_subsets + var_tests))


def methods(setting: Setting, quick: bool) -> list:
    """The rows of the removal table for ``setting`` (see :data:`ROWS`)."""
    from experiments.benchmark.quality.methods import Method
    from experiments.benchmark.quality.methods import trajectory as traj
    from experiments.benchmark.quality.run import all_methods

    key = "gpt2" if setting.name == "gpt2" else "digits"
    rows = [
        m
        for m in all_methods(quick, False, setting.task_kind, "", setting.trajectory)
        if re.match(ROWS[key], m.name)
    ]
    if setting.trajectory == "adamw" and setting.task_kind == "lm":
        rows.append(
            Method(
                EXACT_HESSIAN_ROW,
                "dattri_llm",
                traj.adamw_influence_exact_hessian,
                "curvature=ExactHessian(...): each step's batch-loss Hessian by HVPs",
            )
        )
        rows.append(
            Method(
                "AdamW-influence + exact push (every step, all coordinates)",
                "dattri_llm",
                traj.adamw_influence("full", push="exact"),
                "empirical Fisher, push='exact': each removal's own Adam step recomputed "
                "without the sample, the later steps linear",
            )
        )
        rows.append(
            Method(
                "AdamW-influence + exact push, exact_steps=2 (every step, all coordinates)",
                "dattri_llm",
                traj.adamw_influence("full", push="exact", exact_steps=2),
                "empirical Fisher, push='exact', exact_steps=2",
            )
        )
        rows.append(
            Method(
                EXACT_PUSH_ROW,
                "dattri_llm",
                functools.partial(traj.adamw_influence_exact_hessian, push="exact"),
                "curvature=ExactHessian(...), push='exact': each removal's own Adam step "
                "recomputed without the sample, the later steps linear",
            )
        )
        rows += [
            Method(
                exact_steps_row(k),
                "dattri_llm",
                functools.partial(traj.adamw_influence_exact_hessian, push="exact", exact_steps=k),
                f"curvature=ExactHessian(...), push='exact', exact_steps={k}: the run's first {k} "
                "updates carry every perturbation through torch's exact Adam update (gradient "
                "change linear)",
            )
            for k in EXACT_STEPS
        ]
    return rows


def scores_for(method, ctx, folder: Path, compute: bool) -> dict | None:
    """Cached ``{"scores", "seconds", "peak_mb", "status", "note"}`` of one method (run now when
    ``compute``)."""
    from experiments.benchmark.quality.methods import run_method

    slug = "".join(c if c.isalnum() else "_" for c in method.name).strip("_")
    path = folder / "removal-scores" / f"{slug}.safetensors"
    meta_path = path.with_suffix(".json")
    if path.exists() and meta_path.exists():
        return {**json.loads(meta_path.read_text()), "scores": load_file(str(path))["scores"]}
    if not compute:
        return None
    r = run_method(method, ctx)
    meta = {"status": r.status, "seconds": r.seconds, "peak_mb": r.peak_mb, "note": r.note}
    meta["source"] = r.source
    path.parent.mkdir(parents=True, exist_ok=True)
    if r.status == "ok":
        save_file({"scores": r.scores.detach().to(torch.float64).contiguous()}, str(path))
    else:
        save_file({"scores": torch.zeros(0)}, str(path))
    meta_path.write_text(json.dumps(meta, default=str))
    print(f"#   {r.source} {method.name}: {r.status} {r.seconds:.0f} s {r.note[:100]}", flush=True)
    return {**meta, "scores": r.scores if r.status == "ok" else torch.zeros(0)}


def fmt(m: dict | None) -> str:
    if not m:
        return "—"
    return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def markdown(out: dict) -> str:
    """The result as markdown: one LDS table (vs the R-run mean) and one vs run 0."""
    fr = [f"{round(100 * f)} %" for f in out["fractions"]]
    spec = out["protocol"]
    # the subsets each fraction's ground truth holds (an unfinished extension has fewer)
    built = {k: v["spec"]["num_subsets"] for k, v in out["truth"].items()}
    lines = [
        f"### {out['setting']}{' (quick)' if out['quick'] else ''}: LDS by removal fraction",
        "",
        f"`{out['command']}` — {out['total_seconds']:.0f} s, torch threads "
        f"{out['environment']['torch_threads']}. Subsets per fraction: {built}, "
        f"{spec['runs']} CRN runs each; {out['n_test']} test queries."
        + (f" Not run (time): {', '.join(out['not_run'])}." if out.get("not_run") else ""),
        "",
    ]
    for key, title in (("lds", "vs the mean of the runs"), ("lds_run0", "vs run 0 only")):
        lines += [
            f"LDS {title} [95% CI: subsets jackknife + test-sample bootstrap]:",
            "",
            "| method | " + " | ".join(fr) + " | time (s) | note |",
            "|---|" + "---|" * len(fr) + "---|---|",
        ]
        if key == "lds":
            rel = [fmt(out["truth"][f]["reliability"]) for f in fr]
            lines.append(
                "| ground truth: run 0 vs run 1 (split-run reliability) | "
                + " | ".join(rel)
                + " | — | Spearman, per test sample, averaged |"
            )
            sb = [f"{out['truth'][f]['reliability'].get('mean_avg', float('nan')):.3f}" for f in fr]
            lines.append(
                "| ground truth: R-run mean (Spearman-Brown) | "
                + " | ".join(sb)
                + " | — | ceiling of an LDS vs the mean |"
            )
            mad = [f"{out['truth'][f]['mean_abs_delta']:.2e}" for f in fr]
            lines.append("| mean abs target change of a removal | " + " | ".join(mad) + " | — | |")
        for r in out["rows"]:
            if r["status"] == "ok":
                cells = [fmt(r[key].get(f)) for f in fr]
                t = f"{r['seconds']:.0f}"
            else:
                cells, t = [r["status"]] * len(fr), "—"
            note = r["note"].replace("|", "/")[:160]
            lines.append(f"| {r['method']} | " + " | ".join(cells) + f" | {t} | {note} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from experiments.benchmark.quality.methods import Context
    from experiments.benchmark.quality.run import build_setting

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", choices=("gpt2", "digits-lr", "digits-mlp"), required=True)
    p.add_argument("--quick", action="store_true", help="fewer subsets / test queries")
    p.add_argument("--fractions", default="1,5,10,50", help="removal fractions in %% (comma list)")
    p.add_argument(
        "--part",
        choices=("all", "truth", "scores", "table"),
        default="all",
        help="truth / scores: build one half only; table: the table from what is cached "
        "(fractions without a cached ground truth are listed as not run)",
    )
    p.add_argument("--methods", default=None, help="regex on method names (default: all rows)")
    a = p.parse_args(argv)
    try:
        fractions = [float(x) / 100 for x in a.fractions.split(",") if x.strip()]
    except ValueError as err:
        raise SystemExit(
            f"--fractions {a.fractions!r}: expected percentages, e.g. 1,5,10,50."
        ) from err
    if not fractions or any(not 0 < f < 1 for f in fractions):
        raise SystemExit(f"--fractions {a.fractions!r}: each must be in (0, 100).")
    command = "OMP_NUM_THREADS={} python -m experiments.benchmark.quality.removal {}".format(
        os.environ.get("OMP_NUM_THREADS", "<unset>"),
        " ".join(sys.argv[1:] if argv is None else argv),
    )
    print(f"# {command}", flush=True)
    t_start = time.perf_counter()
    spec = protocol(a.setting, a.quick)
    setting = limited(build_setting(a.setting), spec["test_limit"])
    # the key leaves the subset counts out: each fraction's file holds however many subsets
    # were built, and a larger protocol extends it (quick and full share one cache)
    key = {k: v for k, v in spec.items() if k != "num_subsets"}
    folder = gtm.cache_dir(setting, {**key, "kind": "removal"})
    print(f"# cache: {folder}", flush=True)
    ckpts, _ = gtm.reference_run(setting, folder, seed=0)
    truths = {}
    missing = []
    for f in fractions if a.part != "scores" else []:
        subsets = spec["num_subsets"]
        if isinstance(subsets, dict):
            subsets = subsets[round(100 * f)]
        if a.part == "table":
            want = {"fraction": f, "num_subsets": subsets, "runs": spec["runs"], "seed": LDS_SEED}
            done, secs = _cached_subsets(folder, f"removal-{round(100 * f)}", want)
            if done is None:
                missing.append(f)
                continue
            have = min(subsets, len(done["per_run"]))  # an unfinished extension: what it has
            gt, meta = _first_subsets(done, have, {**want, "num_subsets": have}, secs)
        else:
            gt, meta = removal_ground_truth(setting, folder, f, subsets, spec["runs"], ckpts[-1])
        truths[f] = (gt, meta)
        print(f"# ground truth {f:.0%}: {meta['seconds']:.0f} s", flush=True)
    ctx = Context(setting, ckpts, quick=a.quick, extra={"cache_dir": folder, "loo_seed": 0})
    rows = []
    for method in methods(setting, a.quick):
        if a.methods and not re.search(a.methods, method.name):
            continue
        got = scores_for(method, ctx, folder, compute=a.part in ("all", "scores"))
        if got is None or a.part in ("truth", "scores"):
            continue
        row = {k: got.get(k) for k in ("status", "seconds", "peak_mb", "note", "source")}
        row.update(method=method.name, lds={}, lds_run0={})
        if got["status"] == "ok":
            for f, (gt, _) in truths.items():
                label = f"{round(100 * f)} %"
                row["lds"][label] = lds_with_ci(got["scores"], gt["gt"], gt["indices"])
                row["lds_run0"][label] = lds_with_ci(
                    got["scores"], gt["per_run"][:, 0], gt["indices"]
                )
        rows.append(row)
        print(f"{method.name:<62} " + " | ".join(fmt(m) for m in row["lds"].values()), flush=True)
    if a.part in ("truth", "scores"):
        return 0
    truth_out = {}
    for f, (gt, meta) in truths.items():
        rel = split_run_reliability(gt["per_run"])
        truth_out[f"{round(100 * f)} %"] = {**meta, "reliability": rel}
    out = {
        "command": command,
        "setting": setting.name,
        "quick": a.quick,
        "fractions": [f for f in fractions if f not in missing],
        "not_run": [f"{round(100 * f)} %" for f in missing],
        "protocol": spec,
        "n_test": len(setting.test),
        "config": setting.config,
        "truth": truth_out,
        "rows": rows,
        "environment": environment(),
        "total_seconds": time.perf_counter() - t_start,
    }
    stem = f"removal_{setting.name}{'-quick' if a.quick else ''}"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    (RESULTS_DIR / f"{stem}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
