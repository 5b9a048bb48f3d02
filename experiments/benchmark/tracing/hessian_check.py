"""Why AdamW-influence with ``ExactHessian`` retrieves fact carriers at chance.

    OMP_NUM_THREADS=1 nice -n 19 python -m experiments.benchmark.tracing.hessian_check \
        --seed 0 --facts 3 6 [--jobs 1]

On one seed of the tracing benchmark (:mod:`.run`, the full configuration):

1. **Scores** of the three AdamW-influence forms over the recorded run (the quality
   benchmark's rows, as the tracing table runs them): the true batch Hessian of every step
   (``ExactHessian``), the default empirical Fisher, and no curvature term (ablation); during
   each adjoint sweep the norms of the queries' adjoints (parameters, first and second
   moments, and ``γ`` the adjoint of the consumed gradient) at every step, and each
   occurrence's score (which epochs a document's score comes from).
2. **Ground truth of the derivative** by partial removal: for each chosen fact, its carriers
   and a few non-carriers (the ``ExactHessian`` row's top non-carriers, the empirical-Fisher
   row's top non-carrier, a random document that carries no fact), the run retrained from the
   same start and batch order with that document kept at weight ``w = 1 − ε`` in a weighted
   batch mean (``run.train(doc_weights=)``): the drop ``D(ε) = log p_full(a) − log p_w(a)`` of
   every fact's attribute under its held-out prompt, for ``ε`` from 1 (the trajectory-specific
   removal: the document dropped from its batches, the mean then over the others) down to
   ``2⁻²⁴`` (``w`` the float32 next below 1: a rounding-level perturbation), every ``w`` exact
   in float32. ``D(ε)/ε`` tends to the derivative ``D'(0)`` while ``ε`` is inside the run's
   linear regime and above its float noise. Weight 1 through the weighted path is the run bit
   for bit (tested); the rounding control instead weights every document 0.9 in every batch
   (the same weighted mean, other rounding at every step).
3. **Joint removals** of each chosen fact's carriers: all at weight 0 (trajectory-specific),
   and the benchmark's causal removal (retrained without them, a fresh batch order).

The library's score approximates ``B/(B−1) · D'(0)`` (its removal push is the batch mean over
the ``B − 1`` others; :meth:`TrajectoryAttributor.removal_pushes`), positive when the
document helped, so ``score · (B−1)/B`` is compared with ``D(ε)/ε`` over every (document,
fact) pair measured (all 8 facts' attributes move in each retraining).

Writes ``results/tracing_hessian_check.json`` and prints the tables. Scores and retrainings
are cached under ``results/cache/tracing-hessian-check/`` (safetensors), so a rerun only
redoes the analysis.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from experiments.benchmark.tracing import (
    causal,  # noqa: E402
    run,  # noqa: E402
)
from experiments.benchmark.tracing import data as tdata  # noqa: E402

CACHE = run.RESULTS / "cache" / "tracing-hessian-check"
VERSION = 1
#: Row -> the quality benchmark's trajectory method (see :func:`_method`).
ROWS = ("exact Hessian", "empirical Fisher", "no curvature")
#: The exact-Hessian row as the tracing table ran it (float32; scored, then only summarised).
FLOAT32 = "exact Hessian, float32 (as in the tracing table)"
#: ``ε`` of the partial removals: ``w = 1 − ε`` is exact in float32 for every one.
EPSILONS = (1.0, 0.1, 0.01, 2.0**-10, 2.0**-14, 2.0**-17, 2.0**-20, 2.0**-24)
#: The rounding control: every document at weight 0.9 in every batch (the same weighted mean,
#: other float rounding at every step; 3, 0.7, 1.1 and 1/3 reproduce the run bit for bit).
ROUNDING = ("weight", 0.9, "all")


# ---- the adjoint sweep, watched --------------------------------------------------------------
@contextlib.contextmanager
def watched_sweeps(record: list[dict], keep: tuple[int, ...] = ()) -> Any:
    """Within: every adjoint sweep of a trajectory attributor appends to ``record`` the norms
    (per step in training order, per query) of the adjoints it carries into each step
    (``theta``, ``m``, ``v``) and of ``γ``, and each occurrence's score with its sample
    identity and step; ``keep``: steps whose parameter adjoint is kept whole (``"kept"``, in
    float64). A sweep the library refuses appends ``{"kept", "refused"}`` and re-raises. The
    sweep's numbers are untouched."""
    from dattri_llm.attribution.trajectory import base

    original = base.adjoint_sweep

    def sweep(steps: Any, load: Callable, queries: torch.Tensor, *rest: Any) -> Any:
        norms: dict[int, dict[str, torch.Tensor]] = {}
        kept: dict[int, torch.Tensor] = {}

        def load_watched(step: int) -> Any:
            op, pushes = load(step)
            inner = op.adjoint

            def adjoint(adj: dict) -> Any:
                prev, gamma = inner(adj)
                norms[step] = {c: adj[c].norm(dim=1) for c in adj}
                norms[step]["gamma"] = gamma.norm(dim=1)
                if step in keep:
                    kept[step] = adj["theta"].detach().double().clone()
                return prev, gamma

            op.adjoint = adjoint
            return op, pushes

        try:
            scores, hashes, rows = original(steps, load_watched, queries, *rest)
        except FloatingPointError as err:
            record.append({"kept": kept, "refused": str(err), "query_norm": queries.norm(dim=1)})
            raise
        order = sorted(norms)
        record.append(
            {
                "steps": order,
                "norms": {
                    c: torch.stack(
                        [norms[s].get(c, torch.zeros_like(norms[s]["theta"])) for s in order]
                    )
                    for c in ("theta", "m", "v", "gamma")
                },
                "query_norm": queries.norm(dim=1),
                "kept": kept,
                "scores": scores,
                "hashes": hashes,
                "rows": rows,
            }
        )
        return scores, hashes, rows

    base.adjoint_sweep = sweep
    try:
        yield
    finally:
        base.adjoint_sweep = original


def _method(row: str) -> Callable:
    from experiments.benchmark.quality.methods import trajectory as qt

    if row == "exact Hessian":  # float64: in float32 the adjoint passes 3.4e38 on this run
        return partial(qt.adamw_influence_exact_hessian, compute_dtype=torch.float64)
    if row == FLOAT32:
        return qt.adamw_influence_exact_hessian
    return qt.adamw_influence("full", curvature=row == "empirical Fisher")


def score_rows(d: tdata.TracingData, states: Any, seed: int, cfg: dict, log: Callable) -> dict:
    """Per row: scores ``(n_docs, n_facts)``, adjoint norms ``(steps, n_facts)`` per component,
    the query norms, and per-epoch score contributions ``(n_docs, epochs, n_facts)``
    (cached)."""
    from dattri_llm import hash_sample
    from experiments.benchmark.quality.methods.ours import _samples

    out: dict[str, Any] = {}
    for row in (*ROWS, FLOAT32):
        path = CACHE / f"scores-s{seed}-{_key(cfg, row)}.safetensors"
        if path.exists():
            out[row] = {**load_file(str(path))}
            log(f"  {row}: scores from the cache")
            continue
        ctx = run.trajectory_context(d, states, seed, cfg)
        record: list[dict] = []
        t0 = time.perf_counter()
        try:
            with watched_sweeps(record):
                scores = _method(row)(ctx)
        except FloatingPointError as err:  # the library refuses an overflowing sweep
            out[row] = {"refused": str(err)}
            log(f"  {row}: refused: {err}")
            continue
        seconds = time.perf_counter() - t0
        ids = {h: i for i, h in enumerate(hash_sample(s) for s in _samples(ctx)[0])}
        per_epoch_steps = len(d.docs) // cfg["batch_size"]
        contrib = torch.zeros(len(d.docs), cfg["epochs"], len(d.facts), dtype=torch.float64)
        cols, start = [], 0
        for rec in record:  # one sweep per query chunk, queries in order
            r = rec["scores"].shape[1]
            for k, (h, st) in enumerate(zip(rec["hashes"], rec["rows"])):
                contrib[ids[h], st // per_epoch_steps, start : start + r] += rec["scores"][k]
            cols.append(rec)
            start += r
        entry = {
            "scores": scores.double(),
            "contrib": contrib,
            "query_norm": torch.cat([r["query_norm"] for r in cols]).double(),
            "seconds": torch.tensor(seconds),
        }
        for c in ("theta", "m", "v", "gamma"):
            entry[f"norm_{c}"] = torch.cat([r["norms"][c] for r in cols], dim=1).double()
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in entry.items()}, str(tmp))
        os.replace(tmp, path)
        out[row] = entry
        log(f"  {row}: scored in {seconds:.0f} s")
    run.release_contexts()
    return out


def _key(cfg: dict, *parts: Any) -> str:
    import hashlib

    text = json.dumps(
        [VERSION, {k: v for k, v in cfg.items() if k != "seeds"}, run.MODEL, torch.__version__]
        + [str(p) for p in parts]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- retrainings -----------------------------------------------------------------------------
class _SpecCache:
    """This diagnosis's retrainings on disk, one file per spec (atomic writes)."""

    def __init__(self, cfg: dict, seed: int) -> None:
        self.cfg, self.seed = cfg, seed

    def _path(self, spec: tuple) -> Path:
        return CACHE / f"retrain-s{self.seed}-{_key(self.cfg, spec)}.safetensors"

    def get(self, spec: tuple) -> np.ndarray | None:
        path = self._path(spec)
        return load_file(str(path))["logp"].numpy() if path.exists() else None

    def put(self, spec: tuple, lp: np.ndarray) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = self._path(spec).with_suffix(".tmp")
        save_file({"logp": torch.from_numpy(np.ascontiguousarray(lp))}, str(tmp))
        os.replace(tmp, self._path(spec))


def retrain_specs(
    d: tdata.TracingData, cfg: dict, seed: int, specs: list[tuple], jobs: int, log: Callable
) -> tuple[dict[tuple, np.ndarray], list[float]]:
    """Per spec, every fact's attribute log-probability ``(n_facts,)`` after the retraining:
    ``("weight", w, docs)`` keeps ``docs`` at weight ``w`` in a weighted batch mean,
    ``("remove", docs)`` retrains without them (the benchmark's causal removal). Cached."""
    attrs = d.attribute_ids()
    everything = list(range(len(d.docs)))

    def job(spec: tuple) -> np.ndarray:
        if spec[0] == "weight":
            docs = everything if spec[2] == "all" else spec[2]
            states = run.train(d, everything, cfg, seed, doc_weights=dict.fromkeys(docs, spec[1]))
        else:
            gone = set(spec[1])
            states = run.train(d, [i for i in everything if i not in gone], cfg, seed)
        lp, _ = run.attribute_logp(run.load(d, states[-1]), d)
        return lp[torch.arange(len(attrs)), attrs].numpy()

    return causal.run_cached(specs, job, jobs, log, _SpecCache(cfg, seed))


def chosen_documents(
    d: tdata.TracingData, facts: list[int], scores: dict, seed: int, n_exact: int = 3
) -> dict[int, str]:
    """Document -> why it is measured: each fact's carriers, the ``ExactHessian`` row's top
    ``n_exact`` non-carriers, the empirical-Fisher row's top non-carrier, and one random
    document that carries no fact (seeded)."""
    carrying = {i for f in d.facts for i in f.docs}
    plain = [i for i in range(len(d.docs)) if i not in carrying]
    rng = np.random.default_rng([4000, seed])
    why: dict[int, str] = {}
    for q in facts:
        carriers = set(d.facts[q].docs)
        for z in sorted(carriers):
            why.setdefault(z, f"carrier of fact {q}")
        for row, n in (("exact Hessian", n_exact), ("empirical Fisher", 1)):
            order = torch.argsort(scores[row]["scores"][:, q], descending=True, stable=True)
            picked = [int(i) for i in order if int(i) not in carriers][:n]
            for rank, z in enumerate(picked, 1):
                why.setdefault(z, f"{row} top non-carrier #{rank} of fact {q}")
        z = int(rng.choice([i for i in plain if i not in why]))
        why[z] = f"random non-carrier (fact {q})"
    return why


# ---- analysis --------------------------------------------------------------------------------
def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum() / den) if den > 0 else float("nan")


def _compare(est: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """Pearson, relative error ``‖est − truth‖/‖truth‖`` and norm ratio over the pairs."""
    nt = float(np.linalg.norm(truth))
    return {
        "pearson": _pearson(est, truth),
        "rel_error": float(np.linalg.norm(est - truth)) / nt if nt > 0 else float("nan"),
        "norm_ratio": float(np.linalg.norm(est)) / nt if nt > 0 else float("nan"),
        "sign_agreement": float(np.mean(np.sign(est) == np.sign(truth))),
    }


def analyse(
    d: tdata.TracingData,
    cfg: dict,
    facts: list[int],
    why: dict[int, str],
    scores: dict,
    lps: dict[tuple, np.ndarray],
    base: np.ndarray,
) -> dict[str, Any]:
    """The derivative's ground truth against every row (see the module docstring)."""
    bs = cfg["batch_size"]
    scale = (bs - 1) / bs  # library score · (B−1)/B ≈ D'(0)
    docs = sorted(why)
    drop = {e: np.stack([base - lps[("weight", 1 - e, (z,))] for z in docs]) for e in EPSILONS}
    ratio = {e: drop[e] / e for e in EPSILONS}  # (docs, facts)
    rows = {r: scores[r]["scores"].numpy()[docs] * scale for r in ROWS}
    noise = np.abs(base - lps[ROUNDING])
    scaling = []
    for i, e in enumerate(EPSILONS):
        entry: dict[str, Any] = {
            "epsilon": e,
            "median |D(eps)| (nats)": float(np.median(np.abs(drop[e]))),
            "median |D(eps)/eps|": float(np.median(np.abs(ratio[e]))),
            **{f"vs {r}": _compare(rows[r].ravel(), ratio[e].ravel()) for r in ROWS},
        }
        if i + 1 < len(EPSILONS):
            nxt = EPSILONS[i + 1]
            entry[f"pearson with D({nxt:g})/{nxt:g}"] = _pearson(
                ratio[e].ravel(), ratio[nxt].ravel()
            )
        scaling.append(entry)
    per_doc = []
    for i, z in enumerate(docs):
        entry = {"doc": z, "why": why[z]}
        for q in facts:
            entry[f"fact {q}"] = {
                **{f"D({e:g})/{e:g}": float(ratio[e][i, q]) for e in EPSILONS},
                **{r: float(rows[r][i, q]) for r in ROWS},
                **{f"rank {r}": tm_rank(scores[r]["scores"][:, q], z) for r in ROWS},
            }
        per_doc.append(entry)
    joint = {}
    for q in facts:
        carriers = tuple(sorted(d.facts[q].docs))
        rows_q = [docs.index(z) for z in carriers]
        joint[f"fact {q}"] = {
            "carriers": list(carriers),
            "all carriers at weight 0 (trajectory-specific)": float(
                base[q] - lps[("weight", 0.0, carriers)][q]
            ),
            "all carriers removed (benchmark, fresh batch order)": float(
                base[q] - lps[("remove", carriers)][q]
            ),
            **{
                f"sum of single-carrier D({e:g})/{e:g}": float(ratio[e][rows_q, q].sum())
                for e in EPSILONS
            },
            **{f"sum of single-carrier {r}": float(rows[r][rows_q, q].sum()) for r in ROWS},
        }
    return {
        "rounding control (every document at weight 0.9; same maths) |D| per fact": noise.tolist(),
        "scaling": scaling,
        "documents": per_doc,
        "joint": joint,
        "dynamics": dynamics_summary(d, cfg, facts, scores),
        "rankings": ranking_summary(d, scores, cfg["k"]),
        "float32": float32_summary(d, scores, cfg["k"]),
    }


def ranking_summary(d: tdata.TracingData, scores: dict, k: int = 10) -> dict[str, Any]:
    """Per row, over every fact: recall@k, the mean Pearson between two facts' score columns
    (near 1: one ranking whatever the query), the distinct documents in the union of the
    facts' top-k lists, and the share of the total |contribution| from the first epoch."""
    from experiments.benchmark.tracing import metrics as tm

    out = {}
    n = len(d.facts)
    for r in ROWS:
        s = scores[r]["scores"]
        corr = np.corrcoef(s.T.numpy())
        contrib = scores[r]["contrib"].abs()
        out[r] = {
            f"recall@{k}": tm.recall_at_k(s, d.relevant(), k).tolist(),
            "mean Pearson between facts' columns": float(corr[~np.eye(n, dtype=bool)].mean()),
            f"distinct documents in the {n} top-{k} lists": len(
                {i for col in tm.top_k(s, k) for i in col}
            ),
            "share of |contribution| from the first epoch": float(
                contrib[:, 0].sum() / contrib.sum()
            ),
        }
    return out


def float32_summary(d: tdata.TracingData, scores: dict, k: int = 10) -> dict[str, Any]:
    """The exact-Hessian row as the tracing table ran it (float32) against float64: per fact,
    its non-finite scores, recall@k, and the Pearson with float64 over its finite scores (or
    the library's refusal, since the sweeps refuse non-finite values)."""
    from experiments.benchmark.tracing import metrics as tm

    s32 = scores[FLOAT32]
    if "refused" in s32:
        return {"refused": s32["refused"]}
    a, b = s32["scores"], scores["exact Hessian"]["scores"]
    finite = torch.isfinite(a)
    return {
        "non-finite scores per fact": (~finite).sum(0).tolist(),
        f"recall@{k}": tm.recall_at_k(a, d.relevant(), k).tolist(),
        "Pearson with float64 over the finite scores, per fact": [
            _pearson(a[finite[:, q], q].numpy(), b[finite[:, q], q].numpy())
            for q in range(a.shape[1])
        ],
        "largest finite |score|": float(a[finite].abs().max()),
        "largest |score| in float64": float(b.abs().max()),
    }


def tm_rank(column: torch.Tensor, z: int) -> int:
    """1-based rank of document ``z`` in ``column`` (descending, ties by index)."""
    order = torch.argsort(column, descending=True, stable=True)
    return int((order == z).nonzero()[0, 0]) + 1


def dynamics_summary(d: tdata.TracingData, cfg: dict, facts: list[int], scores: dict) -> dict:
    """Per row: the adjoint's norm relative to the query's at a few steps (mean over the
    chosen facts), and per chosen fact the share of |score| from each quarter of training for
    the carriers and for the row's top-10 non-carriers."""
    out: dict[str, Any] = {}
    epochs = cfg["epochs"]
    quarters = [range(k * epochs // 4, (k + 1) * epochs // 4) for k in range(4)]
    for r in ROWS:
        s = scores[r]
        steps = s["norm_theta"].shape[0]
        marks = sorted({0, steps // 8, steps // 4, steps // 2, 3 * steps // 4, steps - 1})
        qn = s["query_norm"][facts]
        entry: dict[str, Any] = {
            "adjoint theta / query norm, at step": {
                str(t): float((s["norm_theta"][t, facts] / qn).mean()) for t in marks
            },
            "adjoint m / query norm, at step": {
                str(t): float((s["norm_m"][t, facts] / qn).mean()) for t in marks
            },
            "adjoint v / query norm, at step": {
                str(t): float((s["norm_v"][t, facts] / qn).mean()) for t in marks
            },
            "max over steps of adjoint theta / query norm": float(
                (s["norm_theta"][:, facts] / qn).max()
            ),
        }
        for q in facts:
            carriers = sorted(d.facts[q].docs)
            col = s["scores"][:, q]
            top = [
                int(i)
                for i in torch.argsort(col, descending=True, stable=True)
                if int(i) not in carriers
            ][:10]
            shares = {}
            for label, group in (("carriers", carriers), ("top-10 non-carriers", top)):
                c = s["contrib"][group, :, q]  # (docs, epochs)
                tot = float(c.abs().sum())
                shares[label] = {
                    "mean |score|": float(col[group].abs().mean()),
                    "share of |contribution| by quarter of training": [
                        round(float(c[:, list(qq)].abs().sum()) / tot, 3) for qq in quarters
                    ],
                }
            entry[f"fact {q}"] = shares
        out[r] = entry
    return out


# ---- entry point -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--facts", type=int, nargs="+", default=[3, 6])
    parser.add_argument("--jobs", type=int, default=1, help="retraining processes")
    parser.add_argument("--quick", action="store_true", help="smoke: the quick configuration")
    parser.add_argument("--scores-only", action="store_true", help="score (and cache), then stop")
    ns = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = dict(run.QUICK if ns.quick else run.FULL)
    if ns.quick:
        ns.facts = [q for q in ns.facts if q < cfg["n_facts"]] or [0]
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], ns.seed
    )
    states = run.train(d, list(range(len(d.docs))), cfg, ns.seed, snapshots=cfg["checkpoints"])
    attrs = d.attribute_ids()
    lp, _ = run.attribute_logp(run.load(d, states[-1]), d)
    base = lp[torch.arange(len(attrs)), attrs].numpy()
    log(f"seed {ns.seed}: trained; scoring {ROWS}")
    scores = score_rows(d, states, ns.seed, cfg, log)
    if ns.scores_only:
        return
    why = chosen_documents(d, ns.facts, scores, ns.seed)
    log(f"documents: {why}")
    specs = [ROUNDING] + [("weight", 1 - e, (z,)) for z in sorted(why) for e in EPSILONS]
    for q in ns.facts:
        carriers = tuple(sorted(d.facts[q].docs))
        specs += [("weight", 0.0, carriers), ("remove", carriers)]
    t1 = time.perf_counter()
    lps, secs = retrain_specs(d, cfg, ns.seed, specs, ns.jobs, log)
    result = {
        "command": shlex.join(
            ["python", "-m", "experiments.benchmark.tracing.hessian_check", *(argv or sys.argv[1:])]
        ),
        "seed": ns.seed,
        "facts": ns.facts,
        "config": cfg,
        "torch": torch.__version__,
        "score_seconds": {r: float(scores[r]["seconds"]) for r in ROWS},
        "retrain": {
            "runs": len(lps),
            "new": len(secs),
            "each_s": float(np.mean(secs)) if secs else 0.0,
            "wall_s": time.perf_counter() - t1,
        },
        "load_average": os.getloadavg(),
        "base_logp": base.tolist(),
        **analyse(d, cfg, ns.facts, why, scores, lps, base),
        "wall_s": time.perf_counter() - t0,
    }
    path = run.RESULTS / f"tracing_hessian_check{'-quick' if ns.quick else ''}.json"
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("scaling", "joint")}, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
