"""Why AdamW-influence reaches the TSLOO it reaches: smaller removals, the exact derivative.

    OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.trajectory_check [--quick]
        [--setting gpt2|char-gpt] [--fractions 0.5,0.1] [--controls] [--rows REGEX]
        [--derivative K [--float64-removal]] [--exact-curvature Q]

The trajectory-specific LOO removes a block from its batch (gpt2: 8 blocks, fine-tuning;
char-gpt: 16, from scratch; the mean then over the others) at each of its occurrences.
Down-weighting it instead to ``w = 1 − ε`` in a weighted batch mean
(``train_func(mask_index=z, mask_weight=1 − ε)``, otherwise the reference run, in float32 like
the ground truth) gives the removal's effect at fraction ``ε``; ``Δ(ε)/ε`` tends to the
first-order effect as ``ε → 0``. With ``--derivative K`` the **exact derivative** ``dΔ/dε`` at
0 is computed for the first ``K`` samples by forward-mode autodiff through a functional copy of
the run (float64; the same start, batch order, schedule and torch AdamW maths — char-gpt's two
parameter groups and weight decay included — ``torch.func.jvp`` over the loop,
forward-over-reverse through each step's gradient): the first-order influence with the *true*
Hessian of every step; ``--float64-removal`` adds the removal itself in that float64 run.
``--controls`` checks the ground truth's own reliability: the reference and one masked run
re-trained (bit-identity), and a rounding-only perturbation (the block kept at weight 1 through
the weighted loss: the same maths, other float rounding; not scaled).

Each is compared as the benchmark does (``loo_corr``: Pearson across the removed samples per
test block, averaged) with the ground truth (``ε = 1``) and with the AdamW-influence rows
(first order, each step's curvature approximated by the empirical Fisher of its captured
per-sample gradients; in float64; and without the curvature term). Reading:

* ``Δ(ε)/ε`` vs ``Δ(1)``: how nonlinear removing 1 of B samples is under Adam — a first-order
  method estimates ``lim Δ(ε)/ε``, not ``Δ(1)``;
* AdamW-influence vs ``Δ(0.1)/0.1`` (and the derivative): the first-order method against the
  first-order truth: what its curvature approximation costs.

Writes ``results/quality_<setting>_trajectory_check[-quick].json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.func import functional_call, grad, jvp

from experiments.benchmark.quality import ground_truth as gtm
from experiments.benchmark.quality.common import RESULTS_DIR
from experiments.benchmark.quality.gpt2 import HP, MODEL, TinyGPT2, neg_log_odds, per_sample_ce


def adamw_loop(
    params0: dict[str, torch.Tensor],
    batches: list[torch.Tensor],
    lr_at: Any,
    betas: tuple[float, float],
    decay: dict[str, float],
    batch_loss: Any,
    target: Any,
) -> Any:
    """``run(weight_of) -> (targets (n_test,), final params)``: torch's AdamW (``eps`` 1e-8,
    decoupled weight decay ``decay[name]``) written out functionally over ``batches`` at
    ``lr_at(t)`` (1-based steps), each step's loss ``batch_loss(p, idx, w)`` with the
    per-occurrence weights ``w = weight_of(t, idx)``; ``target(p)`` at the end. A second moment
    that is exactly 0 (an embedding row no batch has used yet) is kept out of the square root's
    derivative, which is infinite there (its tangent is 0 too)."""
    beta1, beta2 = betas
    eps = 1e-8  # torch.optim.AdamW's default, as in both runs

    def run(weight_of: Any) -> tuple[torch.Tensor, dict]:
        p = dict(params0)
        m = {k: torch.zeros_like(v) for k, v in p.items()}
        v = {k: torch.zeros_like(t) for k, t in p.items()}
        for t, idx in enumerate(batches, start=1):
            lr = lr_at(t)
            g = grad(batch_loss)(p, idx, weight_of(t, idx))
            bc1, bc2 = 1 - beta1**t, 1 - beta2**t
            for k in p:
                if decay.get(k, 0.0):
                    p[k] = p[k] * (1 - lr * decay[k])
                m[k] = beta1 * m[k] + (1 - beta1) * g[k]
                v[k] = beta2 * v[k] + (1 - beta2) * g[k] * g[k]
                used = v[k] > 0
                root = torch.where(used, v[k], torch.ones_like(v[k])).sqrt() * used
                p[k] = p[k] - (lr / bc1) * m[k] / (root / math.sqrt(bc2) + eps)
        return target(p), p

    return run


def functional_run(
    setting: Any, pretrained: dict, dtype: torch.dtype, seed: int = 0, limit: int | None = None
) -> Any:
    """gpt2's reference fine-tuning as :func:`adamw_loop` (``limit``: only the first steps,
    for a smoke test)."""
    model = TinyGPT2(**MODEL).to(dtype)
    model.load_state_dict(pretrained, strict=False)
    model.train()
    params0 = {k: v.detach().to(dtype).clone() for k, v in model.named_parameters()}
    train, test = setting.train, setting.test
    n, bs = len(train), HP["batch_size"]
    steps = HP["epochs"] * math.ceil(n / bs)
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(HP["epochs"]):
        perm = torch.randperm(n, generator=gen)
        batches += [perm[s : s + bs] for s in range(0, n, bs)]

    call, batch_loss = _ce_losses(model, train)

    return adamw_loop(
        params0,
        batches[:limit],
        lambda t: HP["lr"] * (1 - (t - 1) / steps),
        HP["betas"],
        {},
        batch_loss,
        lambda p: neg_log_odds(per_sample_ce(call(p), test.x, test.y)),
    )


def _ce_losses(model: Any, train: Any) -> tuple[Any, Any]:
    """``call(p)``: the model under parameters ``p``; ``batch_loss(p, idx, w)``: the weighted
    mean token cross-entropy of the train samples ``idx`` (the loops' batch loss)."""

    def call(p: dict) -> Any:
        return lambda x: functional_call(model, p, (x,))

    def batch_loss(p: dict, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (w * per_sample_ce(call(p), train.x[idx], train.y[idx])).sum() / w.sum()

    return call, batch_loss


def chargpt_functional_run(
    setting: Any, dtype: torch.dtype, seed: int = 0, limit: int | None = None
) -> Any:
    """char-GPT's reference run (from scratch: the same init, batch stream, warm-up + cosine
    schedule and two AdamW groups, weight decay on the matrices) as :func:`adamw_loop`."""
    from experiments.benchmark.quality import chargpt
    from experiments.benchmark.quality.common import seed_all

    hp = chargpt.HP
    seed_all(seed)  # as train_func: the init draws from the global generator
    model = setting.make_model().to(dtype)
    model.train()
    params0 = {k: v.detach().clone() for k, v in model.named_parameters()}
    decay = {k: float(hp["weight_decay"]) for k, v in params0.items() if v.dim() >= 2}
    train, test = setting.train, setting.test
    batches = chargpt.batch_stream(torch.arange(len(train)), len(train), seed, False)

    call, batch_loss = _ce_losses(model, train)

    return adamw_loop(
        params0,
        batches[:limit],
        chargpt.lr_at,
        hp["betas"],
        decay,
        batch_loss,
        lambda p: per_sample_ce(call(p), test.x, test.y),
    )


def weights_removing(z: int, eps: Any, dtype: torch.dtype) -> Any:
    """``w_z = 1 − eps`` wherever sample ``z`` is in the batch, 1 elsewhere."""

    def weight_of(t: int, idx: torch.Tensor) -> torch.Tensor:
        hit = (idx == z).to(dtype)
        return 1 - hit * eps

    return weight_of


def loo_corr(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over test columns of the Pearson correlation across removed samples (rows)."""
    a = a - a.mean(0, keepdims=True)
    b = b - b.mean(0, keepdims=True)
    den = np.sqrt((a * a).sum(0) * (b * b).sum(0))
    ok = den > 0
    return float(((a * b).sum(0)[ok] / den[ok]).mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--setting", choices=("gpt2", "char-gpt"), default="gpt2")
    p.add_argument("--quick", action="store_true", help="the --quick ground truth (10 samples)")
    p.add_argument("--fractions", default="0.5,0.1", help="partial-removal fractions")
    p.add_argument(
        "--controls",
        action="store_true",
        help="the ground truth's reliability: repeated runs (bit-identity) and a rounding-only "
        "perturbation (the removed block kept at weight 1 through the weighted loss)",
    )
    p.add_argument(
        "--rows",
        default=None,
        help="regex of the AdamW-influence rows to compare (default: every full-coordinate row "
        "on gpt2; on char-gpt the quick protocol's row only, each other row is one more sweep)",
    )
    p.add_argument("--derivative", type=int, default=0, help="exact derivative, first K samples")
    p.add_argument(
        "--float64-removal",
        action="store_true",
        help="with --derivative K: the removal (fraction 1) of those K samples in the float64 "
        "functional run too (the ground truth's float32 rounding vs float64)",
    )
    p.add_argument(
        "--exact-curvature",
        type=int,
        default=0,
        help="AdamW-influence with exact Hessian-vector products, first Q test blocks",
    )
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    from torch.utils.data import DataLoader

    from experiments.benchmark.quality.methods import Context
    from experiments.benchmark.quality.methods.trajectory import cached_scores, methods
    from experiments.benchmark.quality.run import build_setting, protocol

    t_start = time.perf_counter()
    setting = build_setting(a.setting)
    spec = protocol(a.setting, a.quick)
    folder = gtm.cache_dir(setting, spec)
    seed = spec["loo_seed"]
    ckpts, _ = gtm.reference_run(setting, folder, seed=seed)
    gt, _ = gtm.trajectory_loo_ground_truth(
        setting, folder, spec["trajectory_loo_indices"], seed, ckpts[-1]
    )
    indices = gt["indices"].tolist()
    rows: dict[str, np.ndarray] = {"ground truth: removal (fraction 1)": gt["delta"].numpy()}
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    test_loader = DataLoader(setting.test, batch_size=len(setting.test))
    base = gt["base"]
    timing: dict[str, float] = {}
    fractions = [float(x) for x in a.fractions.split(",") if x]
    for f in ([0.0] if a.controls else []) + fractions:
        # cached beside the ground truth (the runs are deterministic); fraction 0: the
        # removed block at weight 1 through the weighted loss (a rounding-only change, unscaled)
        name = (
            "control: weight 1 through the weighted loss (rounding only; not scaled)"
            if f == 0
            else f"partial removal, fraction {f:g} (/fraction)"
        )
        path = folder / "trajectory" / f"partial-removal-{f:g}.safetensors"
        if path.exists() and load_file(str(path))["indices"].tolist() == indices:
            cached = load_file(str(path))
            rows[name] = cached["delta"].numpy()
            timing[f"fraction {f:g}"] = float(cached["seconds"])
            continue
        t0 = time.perf_counter()
        out = []
        for z in indices:
            model = setting.train_func(loader, seed=seed, mask_index=z, mask_weight=1 - f)
            out.append((setting.target(model, test_loader) - base) / (f or 1.0))
        timing[f"fraction {f:g}"] = time.perf_counter() - t0
        delta = torch.stack(out)
        rows[name] = delta.numpy()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(
            {
                "delta": delta.contiguous(),
                "indices": torch.as_tensor(indices),
                "seconds": torch.tensor(timing[f"fraction {f:g}"]),
            },
            str(path),
        )
        print(f"# fraction {f:g}: {timing[f'fraction {f:g}']:.0f} s", flush=True)
    repeats = repeat_checks(setting, loader, test_loader, seed, ckpts[-1], gt) if a.controls else {}

    ctx = Context(setting, ckpts, extra={"cache_dir": folder, "loo_seed": seed})
    wanted = a.rows or (r"^AdamW-influence \(every step" if a.setting == "char-gpt" else "")
    for m in methods(False, "adamw"):  # the rows over every coordinate (not the masks / LESS)
        if not re.search(wanted, m.name):
            continue
        if m.name.startswith("AdamW-influence") and "mask" not in m.name:
            rows[m.name] = cached_scores(ctx, m)[indices].numpy()

    derivative_rows, drift, target_drift = {}, None, None
    if a.derivative:
        dtype = torch.float64
        if a.setting == "gpt2":
            run = functional_run(setting, _pretrained(setting), dtype, seed=seed)
        else:
            run = chargpt_functional_run(setting, dtype, seed=seed)
        t0 = time.perf_counter()
        ref, final = run(lambda t, idx: torch.ones(len(idx), dtype=dtype))
        drift = max(
            float((final[k].float() - ckpts[-1][k]).abs().max() / ckpts[-1][k].abs().max())
            for k in final
        )
        diff = (ref - base).abs()  # float64 loop vs the float32 reference: targets
        target_drift = {"mean_abs": float(diff.mean()), "max_abs": float(diff.max())}
        print(f"# functional loop: {time.perf_counter() - t0:.0f} s, final weights vs the "
              f"reference: max relative difference {drift:.2e}; targets: mean |difference| "
              f"{target_drift['mean_abs']:.2e}", flush=True)  # fmt: skip
        tangents = []
        for z in indices[: a.derivative]:
            path = folder / "trajectory" / f"derivative-{z}.safetensors"  # cached
            if path.exists():
                tangents.append(load_file(str(path))["derivative"].numpy())
                continue
            zero = torch.zeros((), dtype=dtype)
            _, tan = jvp(
                lambda e, z=z: run(weights_removing(z, e, dtype))[0],
                (zero,),
                (torch.ones_like(zero),),
            )
            save_file({"derivative": tan.detach().contiguous()}, str(path))
            tangents.append(tan.detach().numpy())
            print(f"# derivative of sample {z}: {time.perf_counter() - t0:.0f} s", flush=True)
        timing["derivative"] = time.perf_counter() - t0
        derivative_rows = {"exact derivative (forward mode, float64)": np.stack(tangents)}
        if a.float64_removal:
            t0, removed = time.perf_counter(), []
            for z in indices[: a.derivative]:
                path = folder / "trajectory" / f"float64-removal-{z}.safetensors"  # cached
                if not path.exists():
                    delta = run(weights_removing(z, 1.0, dtype))[0] - ref
                    save_file({"delta": delta.detach().contiguous()}, str(path))
                removed.append(load_file(str(path))["delta"].numpy())
            timing["float64 removal"] = time.perf_counter() - t0
            derivative_rows["removal (fraction 1) in the float64 functional run"] = np.stack(
                removed
            )

    exact_rows, exact_table = {}, {}
    if a.exact_curvature:  # on the first Q test blocks only
        q = a.exact_curvature
        path = folder / "trajectory" / f"exact-hessian-{q}.safetensors"  # library ExactHessian
        t0 = time.perf_counter()
        if path.exists():
            exact = load_file(str(path))["scores"]
        else:
            exact = exact_curvature_scores(ctx, q)
            save_file({"scores": exact.to(torch.float64).contiguous()}, str(path))
        timing["exact curvature"] = time.perf_counter() - t0
        exact_rows = {k: v[:, :q] for k, v in rows.items()}
        exact_rows["AdamW-influence, exact Hessian-vector products"] = exact[indices].numpy()
        exact_table = {x: {y: loo_corr(exact_rows[x], exact_rows[y]) for y in exact_rows}
                       for x in exact_rows}  # fmt: skip
        print(f"# exact curvature ({q} queries): {timing['exact curvature']:.0f} s", flush=True)

    names = list(rows)
    table = {x: {y: loo_corr(rows[x], rows[y]) for y in names} for x in names}
    first = a.derivative or 0
    sub, versus = {}, {}
    if derivative_rows:  # the same comparisons restricted to the derivative's samples
        small = {k: v[:first] for k, v in rows.items()} | derivative_rows
        if exact_rows:  # (on the exact-curvature rows' test blocks)
            q = a.exact_curvature
            key = "AdamW-influence, exact Hessian-vector products"
            small[key] = np.zeros_like(small[next(iter(small))])
            small[key][:, :q] = exact_rows[key][:first]
        sub = {x: {y: loo_corr(small[x], small[y]) for y in small} for x in small}
        exact = next(iter(derivative_rows.values()))
        for x, v in small.items():  # over every (sample, test) pair: Pearson, relative error
            ref = exact
            if x == "AdamW-influence, exact Hessian-vector products":  # its own test blocks
                v, ref = v[:, : a.exact_curvature], exact[:, : a.exact_curvature]
            versus[x] = {
                "pearson": float(np.corrcoef(v.ravel(), ref.ravel())[0, 1]),
                "relative_error": float(np.linalg.norm(v - ref) / np.linalg.norm(ref)),
            }
    out = {
        "command": "OMP_NUM_THREADS=1 python -m experiments.benchmark.quality.trajectory_check "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "indices": indices,
        "loo_corr": table,
        "loo_corr_derivative_samples": sub,
        "versus_derivative_all_pairs": versus,
        "exact_curvature_queries": a.exact_curvature,
        "loo_corr_exact_curvature_queries": exact_table,
        "derivative_samples": indices[:first],
        "functional_loop_max_rel_weight_diff_vs_reference": drift,
        "functional_loop_target_diff_vs_reference": target_drift,
        "mean_abs": {k: float(np.abs(v).mean()) for k, v in (rows | derivative_rows).items()},
        "repeats": repeats,
        "seconds": timing,
        "total_seconds": time.perf_counter() - t_start,
    }
    stem = f"quality_{a.setting}_trajectory_check{'-quick' if a.quick else ''}"
    (RESULTS_DIR / f"{stem}.json").write_text(json.dumps(out, indent=1))
    for title, tab in (
        ("all samples", table),
        ("derivative samples", sub),
        (f"first {a.exact_curvature} test blocks", exact_table),
    ):
        if not tab:
            continue
        keys = list(tab)
        print(f"\n{title}: loo_corr (row vs column)\n")
        print("| | " + " | ".join(f"({i})" for i in range(len(keys))) + " |")
        print("|---|" + "---|" * len(keys))
        for i, x in enumerate(keys):
            cells = " | ".join(f"{tab[x][y]:.3f}" for y in keys)
            scale = out["mean_abs"].get(x)
            tag = "" if scale is None else f" (mean abs {scale:.1e})"
            print(f"| ({i}) {x}{tag} | {cells} |")
    for x, v in versus.items():
        print(f"# vs the exact derivative, all pairs: {x}: Pearson {v['pearson']:.3f}, "
              f"relative error {v['relative_error']:.2f}")  # fmt: skip
    for k, v in repeats.items():
        print(f"# {k}: {v}")
    print(f"# wrote {RESULTS_DIR / stem}.json in {out['total_seconds']:.0f} s")
    return 0


def repeat_checks(
    setting: Any, loader: Any, test_loader: Any, seed: int, final: dict, gt: dict
) -> dict[str, Any]:
    """Is the ground truth reproducible? The reference run re-trained (its weights against the
    cached final checkpoint) and the first masked run re-trained (its targets against the
    cached ground truth); both differences are 0 on a deterministic machine."""
    t0 = time.perf_counter()
    model = setting.train_func(loader, seed=seed)
    state = model.state_dict()
    weights = max(float((state[k] - v).abs().max()) for k, v in final.items() if k in state)
    target = float((setting.target(model, test_loader) - gt["base"]).abs().max())
    z = int(gt["indices"][0])
    masked = setting.train_func(loader, seed=seed, mask_index=z)
    again = float((setting.target(masked, test_loader) - gt["gt"][0]).abs().max())
    return {
        "reference re-trained: max |weight difference|": weights,
        "reference re-trained: max |target difference|": target,
        f"masked run of sample {z} re-trained: max |target difference|": again,
        "seconds": time.perf_counter() - t0,
    }


def exact_curvature_scores(ctx: Any, n_queries: int) -> torch.Tensor:
    """AdamW-influence with each step's true batch Hessian (the library's ``ExactHessian``)
    for the first ``n_queries`` test blocks: the benchmark's own row
    (``methods.trajectory.adamw_influence_exact_hessian``) restricted to them. Returns
    ``(n_train, n_queries)``."""
    from experiments.benchmark.quality.methods.trajectory import adamw_influence_exact_hessian

    return adamw_influence_exact_hessian(ctx, limit=n_queries)


def _pretrained(setting: Any) -> dict:
    from experiments.benchmark.quality.gpt2 import make_data, pretrain

    pre_ids, _, _, _ = make_data()
    return pretrain(setting.make_model, pre_ids)


if __name__ == "__main__":
    raise SystemExit(main())
