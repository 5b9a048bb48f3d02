"""Attribution-quality benchmark: dattri's LDS / LOO protocol, regenerated offline.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.run --setting digits-lr [--quick]

Settings: digits-lr, digits-mlp, char-gpt, gpt2. The ground truth (dattri 0.3.0's retraining) is
cached under results/cache/; writes results/quality_<setting>[-quick].json, which
``experiments/benchmark/headline.py`` tabulates, and prints one line per row.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality.common import RESULTS_DIR, Setting
from experiments.benchmark.quality.methods import Context, Method, MethodResult, run_method
from experiments.benchmark.quality.metrics import lds_metric, loo_metric, split_run_reliability
from experiments.benchmark.utils.env import header

SETTINGS = ("digits-lr", "digits-mlp", "char-gpt", "gpt2")
LDS_SEED, LOO_SEED = 1000, 0
#: gpt2 --quick: the rows that fit its budget.
GPT2_QUICK_ROWS = re.compile(
    r"^(Random|Grad-(Dot|Cos)|TracIn \(4 ckpts, w=lr\)|EK-FAC( \+ diagonal)? \(damping=.*|"
    r"Grad-Dot \(unprojected\)|AdamW-influence.*|LESS.*|DVEmb.*)$"
)


def protocol(setting: str, quick: bool) -> dict:
    """Subsets, runs and LOO indices per setting; the trajectory LOO masks every ``step``-th
    train sample (dattri's LOO on the digits settings only: one sample's effect is below the
    language models' retraining noise)."""
    sizes = {"char-gpt": (2000, 40, 200, 8), "gpt2": (1000, 20, 100, 10)}
    n_train, step, quick_step, subsets = sizes.get(setting, (1000, 10, 50, 16))
    return {
        "num_subsets": subsets if quick else 50,
        "runs": 2,
        "loo_indices": list(range(20 if quick else 100)) if setting.startswith("digits") else [],
        "lds_seed": LDS_SEED,
        "loo_seed": LOO_SEED,
        "trajectory_loo_indices": list(range(0, n_train, quick_step if quick else step)),
    }


def build_setting(name: str) -> Setting:
    module = {"char-gpt": "chargpt", "gpt2": "gpt2"}.get(name, "digits")
    return importlib.import_module(f"experiments.benchmark.quality.{module}").make_setting(name)


def all_methods(quick: bool, peers: bool, setting: Setting) -> list[Method]:
    from experiments.benchmark.quality.methods import (
        dattri_peer,
        kronfluence_peer,
        ours,
        reference,
        trajectory,
    )

    classifier = setting.task_kind == "classification"
    out = list(reference.METHODS) + ours.methods(quick, classifier=classifier)
    out += trajectory.methods(quick, setting.trajectory)
    for peer in (dattri_peer, kronfluence_peer) if peers else ():
        out += peer.methods(quick, classifier=classifier)
    if setting.name == "gpt2" and quick:
        out = [m for m in out if GPT2_QUICK_ROWS.match(m.name)]
    return out


def fmt(m: dict | None) -> str:
    return "—" if m is None else f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def score_agreement(results: list[MethodResult]) -> list[str]:
    """Max relative difference between rows that compute the same maths."""
    by = {(r.source, r.name): r for r in results if r.status == "ok"}
    ours, dattri, kf = "dattri_llm", "dattri 0.3.0", "kronfluence"
    pairs = [
        ((ours, "Grad-Dot"), (dattri, "Grad-Dot (unprojected)")),
        ((ours, "TracIn (4 ckpts, w=lr)"), (dattri, "TracIn (4 ckpts, unprojected)")),
        (("reference", "Exact IF (explicit Hessian)"), (dattri, "IF-explicit")),
    ]
    for d in (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
        label = "default=1e-08" if d == 1e-8 else repr(d)
        pairs.append(((ours, f"EK-FAC (damping={d})"), (kf, f"EK-FAC (damping={label})")))
    for d in (1e-4, 1e-3):
        patched = (dattri, f"IF-EKFAC, 2 bugs patched (damping={d})")
        pairs.append(((ours, f"EK-FAC (damping={d})"), patched))
    lines = []
    for a, b in pairs:
        if a in by and b in by:
            x, y = by[a].scores, by[b].scores
            rel = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
            lines.append(f"{a[0]} {a[1]} vs {b[0]} {b[1]}: max |diff| / max |score| = {rel:.2e}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", choices=SETTINGS, required=True)
    p.add_argument("--quick", action="store_true", help="few subsets / LOO samples (~2-3 min)")
    p.add_argument("--methods", default=None, help="regex on method names to run")
    p.add_argument("--no-peers", action="store_true", help="skip dattri's and kronfluence's rows")
    a = p.parse_args(argv)
    args = " ".join(sys.argv[1:] if argv is None else argv)
    omp = os.environ.get("OMP_NUM_THREADS", "<unset>")
    command = f"OMP_NUM_THREADS={omp} python -m experiments.benchmark.quality.run {args}"
    env = header(f"Attribution quality: {a.setting}")  # versions, threads, machine
    print(env, flush=True)
    t_start = time.perf_counter()
    setting = build_setting(a.setting)
    spec = protocol(a.setting, a.quick)
    folder = gtm.cache_dir(setting, spec)
    seed = spec["loo_seed"]
    ckpts, ref_meta = gtm.reference_run(setting, folder, seed=seed)
    subsets, runs = spec["num_subsets"], spec["runs"]
    lds_gt, lds_meta = gtm.lds_ground_truth(setting, folder, subsets, runs, seed=spec["lds_seed"])
    reliability = split_run_reliability(lds_gt["per_run"])
    loo_gt = loo_meta = tsloo_gt = tsloo_meta = None
    if spec["loo_indices"]:
        loo_gt, loo_meta = gtm.loo_ground_truth(setting, folder, spec["loo_indices"], seed=seed)
    if spec["trajectory_loo_indices"]:
        tsloo_gt, tsloo_meta = gtm.trajectory_loo_ground_truth(
            setting, folder, spec["trajectory_loo_indices"], seed, ckpts[-1]
        )
    print(f"# ground truth ready in {folder} ({time.perf_counter() - t_start:.0f} s)", flush=True)

    ctx = Context(setting, ckpts, quick=a.quick, extra={"cache_dir": folder, "loo_seed": seed})
    results: list[MethodResult] = []
    rows = []
    for method in all_methods(a.quick, not a.no_peers, setting):
        if a.methods and not re.search(a.methods, method.name):
            continue
        r = run_method(method, ctx)
        results.append(r)
        ok = r.status == "ok"
        row = {"method": r.name, "source": r.source, "status": r.status}
        row["lds"] = lds_metric(r.scores, lds_gt) if ok else None
        row["loo"] = loo_metric(r.scores, loo_gt) if ok and loo_gt else None
        row["tsloo"] = loo_metric(r.scores, tsloo_gt) if ok and tsloo_gt else None
        row |= {"seconds": r.seconds, "peak_mb": r.peak_mb, "note": r.note}
        rows.append(row)
        cells = " | ".join(f"{k} {fmt(row[k])}" for k in ("lds", "loo", "tsloo"))
        print(f"{r.source} | {r.name} | {r.status} | {cells} | {r.seconds:.1f} s | {r.note}")

    agreement = score_agreement(results)
    print("\n".join(f"# {line}" for line in agreement))
    out = {"command": command, "setting": setting.name, "quick": a.quick, "config": setting.config}
    out |= {"protocol": spec, "lds_ground_truth": lds_meta, "loo_ground_truth": loo_meta}
    out |= {"trajectory_loo_ground_truth": tsloo_meta, "reference_run": ref_meta}
    out |= {"reliability": reliability, "rows": rows, "agreement": agreement, "environment": env}
    out["total_seconds"] = time.perf_counter() - t_start
    path = RESULTS_DIR / f"quality_{setting.name}{'-quick' if a.quick else ''}.json"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"# wrote {path} in {out['total_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
