"""Attribution-quality benchmark (dattri's LDS / LOO protocol, regenerated offline).

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.run --setting digits-lr [--quick]

Settings: digits-lr, digits-mlp (char-gpt and gpt2: see docs/benchmarks/quality.md). Ground
truth (dattri 0.3.0's retrain + ground-truth functions) is cached under
experiments/benchmark/results/cache/, so re-running only re-scores the methods. Writes
results/quality_<setting>[-quick].{json,md} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality.common import RESULTS_DIR, Setting, environment
from experiments.benchmark.quality.methods import Context, Method, MethodResult, run_method
from experiments.benchmark.quality.metrics import lds_metric, loo_metric, split_run_reliability

SETTINGS = ("digits-lr", "digits-mlp", "char-gpt", "gpt2")
LDS_SEED, LOO_SEED = 1000, 0


def protocol(setting: str, quick: bool) -> dict:
    """Subsets, runs and LOO indices per setting (quick = CI-sized smoke run)."""
    if setting.startswith("digits"):
        return {
            "num_subsets": 16 if quick else 50,
            "runs": 2,
            "loo_indices": list(range(20 if quick else 100)),
            "lds_seed": LDS_SEED,
            "loo_seed": LOO_SEED,
        }
    raise SystemExit(f"--setting {setting}: not implemented yet (see docs/benchmarks/quality.md).")


def build_setting(name: str) -> Setting:
    if name.startswith("digits"):
        from experiments.benchmark.quality.digits import make_setting

        return make_setting(name)
    raise SystemExit(f"--setting {name}: not implemented yet (see docs/benchmarks/quality.md).")


def all_methods(quick: bool, peers: bool) -> list[Method]:
    from experiments.benchmark.quality.methods import dattri_peer, ours, reference

    out = list(reference.METHODS) + ours.methods(quick)
    if peers:
        out += dattri_peer.methods(quick)
    return out


def fmt(m: dict | None) -> str:
    if m is None:
        return "—"
    return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def score_agreement(results: list[MethodResult]) -> list[str]:
    """Max relative difference between rows that compute the same maths."""
    by = {(r.source, r.name): r for r in results if r.status == "ok"}
    pairs = [
        (("dattri_llm", "Grad-Dot"), ("dattri 0.3.0", "Grad-Dot (unprojected)")),
        (("dattri_llm", "Grad-Cos"), ("dattri 0.3.0", "Grad-Cos (unprojected)")),
        (
            ("dattri_llm", "TracIn (4 ckpts, w=lr)"),
            ("dattri 0.3.0", "TracIn (4 ckpts, unprojected)"),
        ),
        (("reference", "Exact IF (explicit Hessian)"), ("dattri 0.3.0", "IF-explicit")),
    ]
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
    p.add_argument("--no-peers", action="store_true", help="skip dattri 0.3.0's attributors")
    a = p.parse_args(argv)

    command = "OMP_NUM_THREADS={} python -m experiments.benchmark.quality.run {}".format(
        os.environ.get("OMP_NUM_THREADS", "<unset>"),
        " ".join(sys.argv[1:] if argv is None else argv),
    )
    env = environment()
    print(
        f"# {command}\n# threads={torch.get_num_threads()} torch={env['torch']} "
        f"dattri={env['dattri']} dattri_llm={env['dattri_llm']}",
        flush=True,
    )
    t_start = time.perf_counter()
    setting = build_setting(a.setting)
    spec = protocol(a.setting, a.quick)
    folder = gtm.cache_dir(setting, spec)
    print(f"# ground-truth cache: {folder}", flush=True)

    ckpts, ref_meta = gtm.reference_run(setting, folder, seed=spec["loo_seed"])
    lds_gt, lds_meta = gtm.lds_ground_truth(
        setting, folder, spec["num_subsets"], spec["runs"], seed=spec["lds_seed"]
    )
    loo_gt, loo_meta = gtm.loo_ground_truth(
        setting, folder, spec["loo_indices"], seed=spec["loo_seed"]
    )
    reliability = split_run_reliability(lds_gt["per_run"])
    print(
        f"# ground truth ready ({time.perf_counter() - t_start:.0f} s; LDS built in "
        f"{lds_meta['seconds']:.0f} s, LOO in {loo_meta['seconds']:.0f} s)",
        flush=True,
    )

    ctx = Context(setting, ckpts, quick=a.quick)
    results: list[MethodResult] = []
    rows = []
    for method in all_methods(a.quick, not a.no_peers):
        if a.methods and not re.search(a.methods, method.name):
            continue
        r = run_method(method, ctx)
        results.append(r)
        lds_m = lds_metric(r.scores, lds_gt) if r.status == "ok" else None
        loo_m = loo_metric(r.scores, loo_gt) if r.status == "ok" else None
        rows.append(
            {
                "method": r.name,
                "source": r.source,
                "status": r.status,
                "lds": lds_m,
                "loo": loo_m,
                "seconds": r.seconds,
                "note": r.note,
            }
        )
        print(
            f"{r.source:>13} | {r.name:<34} | {r.status:<7} | LDS {fmt(lds_m):<24} | "
            f"LOO {fmt(loo_m):<24} | {r.seconds:6.1f} s | {r.note}",
            flush=True,
        )

    agreement = score_agreement(results)
    for line in agreement:
        print("#", line)
    out = {
        "command": command,
        "setting": setting.name,
        "quick": a.quick,
        "config": setting.config,
        "protocol": spec,
        "lds_ground_truth": lds_meta,
        "loo_ground_truth": loo_meta,
        "reference_run": ref_meta,
        "reliability": reliability,
        "rows": rows,
        "agreement": agreement,
        "environment": env,
        "total_seconds": time.perf_counter() - t_start,
    }
    stem = f"quality_{setting.name}{'-quick' if a.quick else ''}"
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    (RESULTS_DIR / f"{stem}.md").write_text(markdown(out))
    print(f"# wrote {RESULTS_DIR / stem}.{{json,md}} in {out['total_seconds']:.0f} s")
    return 0


def markdown(out: dict) -> str:
    """The result as a markdown section (pasted into docs/benchmarks/quality.md)."""
    rel = out["reliability"]
    spec = out["protocol"]
    lines = [
        f"### {out['setting']}{' (quick)' if out['quick'] else ''}",
        "",
        f"`{out['command']}` — {out['total_seconds']:.0f} s, torch threads "
        f"{out['environment']['torch_threads']}, torch {out['environment']['torch']}, "
        f"dattri {out['environment']['dattri']}.",
        f"LDS: {spec['num_subsets']} subsets x {spec['runs']} runs (seed {spec['lds_seed']}); "
        f"LOO: {len(spec['loo_indices'])} removed samples (indices "
        f"{spec['loo_indices'][0]}..{spec['loo_indices'][-1]}, seed {spec['loo_seed']}).",
        "",
        "| method | source | LDS [95% CI] | LOO [95% CI] | time (s) | note |",
        "|---|---|---|---|---|---|",
        f"| ground truth split-run reliability (ceiling) | dattri 0.3.0 retrain | {fmt(rel)} | — "
        f"| — | run 0 vs run 1; {rel.get('runs', '?')}-run average: "
        f"{rel.get('mean_avg', float('nan')):.3f} (Spearman-Brown) |",
    ]
    for r in out["rows"]:
        if r["status"] == "ok":
            lines.append(
                f"| {r['method']} | {r['source']} | {fmt(r['lds'])} | {fmt(r['loo'])} "
                f"| {r['seconds']:.1f} | {r['note']} |"
            )
        else:
            lines.append(
                f"| {r['method']} | {r['source']} | {r['status']} | {r['status']} | — "
                f"| {r['note']} |"
            )
    if out["agreement"]:
        lines += ["", "Same maths, two implementations:", ""]
        lines += [f"- {line}" for line in out["agreement"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
