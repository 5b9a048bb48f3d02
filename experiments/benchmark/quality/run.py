"""Attribution-quality benchmark (dattri's LDS / LOO protocol, regenerated offline).

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.run --setting digits-lr [--quick]

Settings: digits-lr, digits-mlp, char-gpt, gpt2 (see docs/benchmarks/quality.md). Ground
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
        spec = {
            "num_subsets": 16 if quick else 50,
            "runs": 2,
            "loo_indices": list(range(20 if quick else 100)),
            "lds_seed": LDS_SEED,
            "loo_seed": LOO_SEED,
        }
        # SGD runs: the trajectory-specific LOO of DVEmb (every 10th sample; 50th with --quick)
        spec["trajectory_loo_indices"] = list(range(0, 1000, 50 if quick else 10))
        return spec
    if setting == "char-gpt":
        return {
            "num_subsets": 8 if quick else 50,
            "runs": 2,
            "loo_indices": [],
            "lds_seed": LDS_SEED,
            "loo_seed": LOO_SEED,
            "variants": list(VARIANTS),
            # trajectory-specific LOO: every 40th train block (200th with --quick) masked out
            # of its batches in a run otherwise identical to the reference run
            "trajectory_loo_indices": list(range(0, 2000, 200 if quick else 40)),
        }
    if setting == "gpt2":
        return {
            "num_subsets": 10 if quick else 50,
            "runs": 2,
            "loo_indices": [],
            "lds_seed": LDS_SEED,
            "loo_seed": LOO_SEED,
            # trajectory-specific LOO: every 20th train block (100th with --quick) masked out
            # of its batch in a run otherwise identical to the reference run
            "trajectory_loo_indices": list(range(0, 1000, 100 if quick else 20)),
        }
    raise SystemExit(f"--setting {setting}: not implemented yet (see docs/benchmarks/quality.md).")


#: LDS ground-truth variants: label -> extra keyword arguments of the train function.
VARIANTS = {"independent": "independent seeds (dattri)", "crn": "common random numbers"}


def build_setting(name: str) -> Setting:
    if name.startswith("digits"):
        from experiments.benchmark.quality.digits import make_setting

        return make_setting(name)
    if name == "char-gpt":
        from experiments.benchmark.quality.chargpt import make_setting as make_char

        return make_char(name)
    if name == "gpt2":
        from experiments.benchmark.quality.gpt2 import make_setting as make_gpt2

        return make_gpt2(name)
    raise SystemExit(f"--setting {name}: not implemented yet (see docs/benchmarks/quality.md).")


#: gpt2 --quick: the rows that fit its budget (random, the TracIn family, the EK-FAC damping
#: sweep, dattri's unprojected Grad-Dot as the same-maths check, kronfluence EK-FAC, the
#: trajectory methods).
GPT2_QUICK_ROWS = re.compile(
    r"^(Random|Grad-Dot|Grad-Cos|TracIn \(4 ckpts, w=lr\)|EK-FAC( \+ diagonal)? \(damping=.*|"
    r"Grad-Dot \(unprojected\)|AdamW-influence.*|LESS.*|DVEmb.*|"
    r"EK-FAC (unit-normalized|fit on).*|Grad-(Dot|Cos) mask-2048.*)$"
)


def all_methods(
    quick: bool,
    peers: bool,
    kind: str = "classification",
    setting: str = "",
    trajectory_kind: str = "",
) -> list[Method]:
    from experiments.benchmark.quality.methods import (
        dattri_peer,
        kronfluence_peer,
        ours,
        reference,
        trajectory,
    )

    classifier = kind == "classification"
    out = list(reference.METHODS) + ours.methods(quick, classifier=classifier)
    out += trajectory.methods(quick, trajectory_kind)
    if peers:
        out += dattri_peer.methods(quick, classifier=classifier)
        out += kronfluence_peer.methods(quick, classifier=classifier)
    if setting == "gpt2" and quick:
        out = [m for m in out if GPT2_QUICK_ROWS.match(m.name)]
    return out


def fmt(m: dict | None) -> str:
    if m is None:
        return "—"
    return f"{m['mean']:.3f} [{m['lo']:.3f}, {m['hi']:.3f}]"


def fmt_mb(mb: float | None) -> str:
    return "—" if mb is None else f"{mb:.0f}"


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
    for d in (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1):
        kf = "default=1e-08" if d == 1e-8 else repr(d)
        pairs.append(
            (("dattri_llm", f"EK-FAC (damping={d})"), ("kronfluence", f"EK-FAC (damping={kf})"))
        )
    for d in (1e-4, 1e-3):
        pairs.append(
            (
                ("dattri_llm", f"EK-FAC (damping={d})"),
                ("dattri 0.3.0", f"IF-EKFAC, 2 bugs patched (damping={d})"),
            )
        )
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
    p.add_argument(
        "--no-peers", action="store_true", help="skip dattri 0.3.0's and kronfluence's rows"
    )
    p.add_argument(
        "--variants",
        default=None,
        help="char-gpt: comma list of LDS ground truths to build/score (independent,crn)",
    )
    p.add_argument(
        "--update",
        action="store_true",
        help="merge the rows run now into the existing result file (same setting and mode): "
        "rows of the same method are replaced, the others kept (e.g. add one method to a "
        "full run without re-scoring every row)",
    )
    a = p.parse_args(argv)

    command = "OMP_NUM_THREADS={} python -m experiments.benchmark.quality.run {}".format(
        os.environ.get("OMP_NUM_THREADS", "<unset>"),
        " ".join(sys.argv[1:] if argv is None else argv),
    )
    env = environment()
    if not a.no_peers:
        from experiments.benchmark.quality.methods.kronfluence_peer import version

        env["kronfluence"] = version()
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
    lds_gts, lds_metas, reliabilities = {}, {}, {}
    chosen = spec.get("variants", ["default"])
    if a.variants:
        chosen = [v for v in a.variants.split(",") if v]
        unknown = sorted(set(chosen) - set(spec.get("variants", [])))
        if unknown:
            raise SystemExit(f"--variants {a.variants}: unknown {unknown}; use {list(VARIANTS)}")
    for variant in chosen:
        sub = folder if variant == "default" else folder / variant
        kwargs = {"crn": [spec["lds_seed"], spec["runs"]]} if variant == "crn" else {}
        lds_gts[variant], lds_metas[variant] = gtm.lds_ground_truth(
            setting, sub, spec["num_subsets"], spec["runs"], seed=spec["lds_seed"], **kwargs
        )
        reliabilities[variant] = split_run_reliability(lds_gts[variant]["per_run"])
        print(f"# LDS ground truth {variant}: {lds_metas[variant]['seconds']:.0f} s", flush=True)
    primary = next(iter(lds_gts))
    lds_gt, lds_meta, reliability = lds_gts[primary], lds_metas[primary], reliabilities[primary]
    loo_gt, loo_meta, tsloo_gt, tsloo_meta = None, None, None, None
    if spec["loo_indices"]:
        loo_gt, loo_meta = gtm.loo_ground_truth(
            setting, folder, spec["loo_indices"], seed=spec["loo_seed"]
        )
    if spec.get("trajectory_loo_indices"):
        tsloo_gt, tsloo_meta = gtm.trajectory_loo_ground_truth(
            setting, folder, spec["trajectory_loo_indices"], spec["loo_seed"], ckpts[-1]
        )
        print(
            f"# trajectory LOO ground truth: {tsloo_meta['seconds']:.0f} s, mean |delta| "
            f"{tsloo_meta['mean_abs_delta']:.2e}",
            flush=True,
        )
    print(f"# ground truth ready ({time.perf_counter() - t_start:.0f} s)", flush=True)

    ctx = Context(
        setting, ckpts, quick=a.quick, extra={"cache_dir": folder, "loo_seed": spec["loo_seed"]}
    )
    results: list[MethodResult] = []
    rows = []
    methods = all_methods(
        a.quick, not a.no_peers, setting.task_kind, setting.name, setting.trajectory
    )
    for method in methods:
        if a.methods and not re.search(a.methods, method.name):
            continue
        r = run_method(method, ctx)
        results.append(r)
        ok = r.status == "ok"
        lds_m = lds_metric(r.scores, lds_gt) if ok else None
        loo_m = loo_metric(r.scores, loo_gt) if ok and loo_gt else None
        tsloo_m = loo_metric(r.scores, tsloo_gt) if ok and tsloo_gt else None
        by_variant = {
            v: (lds_metric(r.scores, g) if r.status == "ok" else None) for v, g in lds_gts.items()
        }
        rows.append(
            {
                "method": r.name,
                "source": r.source,
                "status": r.status,
                "lds": lds_m,
                "loo": loo_m,
                "tsloo": tsloo_m,
                "lds_variants": by_variant,
                "seconds": r.seconds,
                "peak_mb": r.peak_mb,
                "note": r.note,
            }
        )
        cells = " | ".join(f"LDS[{v}] {fmt(m):<24}" for v, m in by_variant.items())
        print(
            f"{r.source:>13} | {r.name:<34} | {r.status:<7} | {cells} | "
            f"LOO {fmt(loo_m):<24} | TSLOO {fmt(tsloo_m):<24} | {r.seconds:6.1f} s | "
            f"{fmt_mb(r.peak_mb)} MB | {r.note}",
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
        "lds_ground_truth_variants": lds_metas,
        "reliability_variants": reliabilities,
        "loo_ground_truth": loo_meta,
        "trajectory_loo_ground_truth": tsloo_meta,
        "reference_run": ref_meta,
        "reliability": reliability,
        "rows": rows,
        "agreement": agreement,
        "environment": env,
        "total_seconds": time.perf_counter() - t_start,
    }
    stem = f"quality_{setting.name}{'-quick' if a.quick else ''}"
    if a.update and (RESULTS_DIR / f"{stem}.json").exists():
        out = merge_results(json.loads((RESULTS_DIR / f"{stem}.json").read_text()), out)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    (RESULTS_DIR / f"{stem}.md").write_text(markdown(out))
    print(f"# wrote {RESULTS_DIR / stem}.{{json,md}} in {out['total_seconds']:.0f} s")
    return 0


def upgrade(out: dict) -> dict:
    """A result file written before the trajectory-LOO column had its own key: there (gpt2) the
    ``loo`` entry of every row *was* the trajectory-specific LOO."""
    spec = out["protocol"]
    if "trajectory_loo_ground_truth" not in out and spec.get("trajectory_loo_indices"):
        out["trajectory_loo_ground_truth"] = out.get("loo_ground_truth")
        out["loo_ground_truth"] = None
        for r in out["rows"]:
            r["tsloo"], r["loo"] = r.get("loo"), None
    return out


def merge_results(old: dict, new: dict) -> dict:
    """``--update``: the new run's rows replace the old rows of the same (source, method); the
    old rows not re-run are kept in their place, new ones appended. Commands are listed."""
    old = upgrade(old)
    fresh = {(r["source"], r["method"]): r for r in new["rows"]}
    rows = [fresh.pop((r["source"], r["method"]), r) for r in old["rows"]]
    rows += [r for r in new["rows"] if (r["source"], r["method"]) in fresh]
    commands = old.get("commands") or [old["command"]]
    merged = {**new, "rows": rows, "commands": [*commands, new["command"]]}
    # the kept rows' peers: versions recorded by the runs that made them stay
    env = {k: v for k, v in old.get("environment", {}).items() if v is not None}
    merged["environment"] = {
        **env,
        **{k: v for k, v in new["environment"].items() if v is not None},
    }
    merged["agreement"] = sorted(set(old.get("agreement", [])) | set(new["agreement"]))
    merged["total_seconds"] = old.get("total_seconds", 0.0) + new["total_seconds"]
    return merged


def markdown(out: dict) -> str:
    """The result as a markdown section (pasted into docs/benchmarks/quality.md)."""
    out = upgrade(out)
    spec = out["protocol"]
    rels = out.get("reliability_variants") or {"default": out["reliability"]}
    variants = list(rels)
    has_loo = bool(spec["loo_indices"])
    trajectory = bool(spec.get("trajectory_loo_indices"))
    env = out["environment"]
    kf = f", kronfluence {env['kronfluence']} (own venv)" if env.get("kronfluence") else ""
    head = f"LDS: {spec['num_subsets']} subsets x {spec['runs']} runs (seed {spec['lds_seed']})"
    if has_loo:
        idx = spec["loo_indices"]
        head += (
            f"; LOO: {len(idx)} removed samples (indices {idx[0]}..{idx[-1]}, "
            f"seed {spec['loo_seed']})"
        )
    if trajectory:
        idx = spec["trajectory_loo_indices"]
        meta = out.get("trajectory_loo_ground_truth") or {}
        head += (
            f"; trajectory-specific LOO: {len(idx)} train samples (indices {idx[0]}, "
            f"{idx[1]}, ..., {idx[-1]}), each masked out of its batch in a run otherwise "
            f"identical to the reference run (seed {spec['loo_seed']}; reference reproduced "
            f"bit-exactly; mean |target change| {meta.get('mean_abs_delta', float('nan')):.1e})"
        )
    lds_cols = (
        ["LDS [95% CI]"]
        if variants == ["default"]
        else [f"LDS {VARIANTS.get(v, v)} [95% CI]" for v in variants]
    )
    cols = (
        lds_cols
        + (["LOO [95% CI]"] if has_loo else [])
        + (["trajectory LOO [95% CI]"] if trajectory else [])
    )
    lines = [
        f"### {out['setting']}{' (quick)' if out['quick'] else ''}",
        "",
        " then ".join(f"`{c}`" for c in out.get("commands", [out["command"]]))
        + f" — {out['total_seconds']:.0f} s, torch threads "
        f"{env['torch_threads']}, torch {env['torch']}, dattri {env['dattri']}{kf}.",
        head + ".",
        "",
        "| method | source | " + " | ".join(cols) + " | time (s) | peak RSS (MB) | note |",
        "|---|---|" + "---|" * len(cols) + "---|---|---|",
    ]
    rel_cells = [fmt(rels[v]) for v in variants] + ["—"] * (has_loo + trajectory)
    avg = ", ".join(f"{rels[v].get('mean_avg', float('nan')):.3f}" for v in variants)
    lines.append(
        "| ground truth split-run reliability (ceiling) | dattri 0.3.0 retrain | "
        + " | ".join(rel_cells)
        + f" | — | — | run 0 vs run 1; {spec['runs']}-run average: {avg} (Spearman-Brown) |"
    )
    for r in out["rows"]:
        if r["status"] == "ok":
            by = r.get("lds_variants") or {"default": r["lds"]}
            cells = [fmt(by.get(v)) for v in variants]
            cells += [fmt(r.get("loo"))] if has_loo else []
            cells += [fmt(r.get("tsloo"))] if trajectory else []
            time_cell, mem_cell = f"{r['seconds']:.1f}", fmt_mb(r.get("peak_mb"))
        else:
            cells, time_cell, mem_cell = [r["status"]] * len(cols), "—", "—"
        lines.append(
            f"| {r['method']} | {r['source']} | " + " | ".join(cells) + f" | {time_cell} "
            f"| {mem_cell} | {r['note']} |"
        )
    if out["agreement"]:
        lines += ["", "Same maths, two implementations:", ""]
        lines += [f"- {line}" for line in out["agreement"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
