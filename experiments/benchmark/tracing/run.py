"""Fact-tracing benchmark: which documents taught the model this fact?

Per seed: plant made-up facts in real text (:mod:`.data`), train a tiny GPT-2 on it, score
every document against each fact's held-out query with every row, and report recall@10 and MRR
of the fact's carriers and the causal drop (:mod:`.causal`). docs/benchmarks/tracing.md has the
setting and the full commands::

    python -m experiments.benchmark.tracing.run [--quick] [--seeds S] [--tag T] [--jobs 2]
    python -m experiments.benchmark.tracing.run --combine results/tracing-T.json ...

Writes ``experiments/benchmark/results/tracing[-quick][-TAG].{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments.benchmark.quality.gpt2 import TinyGPT2  # noqa: E402
from experiments.benchmark.tracing import causal  # noqa: E402
from experiments.benchmark.tracing import data as tdata  # noqa: E402
from experiments.benchmark.tracing import metrics as tm  # noqa: E402
from experiments.benchmark.tracing.report import write_report  # noqa: E402
from experiments.benchmark.utils.env import RESULTS_DIR  # noqa: E402
from experiments.benchmark.utils.memory import peak_rss_bytes  # noqa: E402

FULL: dict[str, Any] = {"seeds": [0, 1, 2], "n_docs": 128, "n_facts": 8, "copies": 3, "block": 48,
                        "vocab_words": 1000, "epochs": 40, "batch_size": 32, "lr": 1e-2, "k": 10,
                        "checkpoints": 3}  # fmt: skip
QUICK: dict[str, Any] = {**FULL, "seeds": [0], "n_docs": 64, "n_facts": 4, "epochs": 25}
MODEL: dict[str, Any] = {"n_layer": 2, "n_head": 4, "n_embd": 64}
MASK_DIM = 1024  # coordinates per layer of the TrackStar row's mask capture
DIAG = {"normalized_grad": True, "non_kronecker": "diagonal"}

#: ``fn(data, snapshots, seed) -> (n_docs, n_facts) scores`` or ``(scores, note)``.
Row = Callable[..., Any]


# ---- model, losses, training ----------------------------------------------------------------
def doc_loss_sum(model: Any, batch: dict) -> torch.Tensor:
    """Sum over the batch of each document's mean next-token cross-entropy (training loss)."""
    logits = model(batch["x"])
    return F.cross_entropy(logits.transpose(1, 2), batch["y"], reduction="none").mean(1).sum()


def query_loss_sum(model: Any, batch: dict) -> torch.Tensor:
    """Sum over the batch of ``-log p(attribute | prompt)`` (one labelled position per query)."""
    logits = model(batch["x"])
    return F.cross_entropy(logits.transpose(1, 2), batch["y"], ignore_index=-100, reduction="sum")


def attribute_logp(model: Any, d: tdata.TracingData) -> torch.Tensor:
    """Per fact, the float64 log-probabilities over the vocabulary at the attribute's position
    of its query: ``(n_facts, vocab)``."""
    with torch.no_grad():
        pos = (d.query_y != -100).float().argmax(1)
        return torch.log_softmax(model(d.query_x)[torch.arange(len(pos)), pos].double(), -1)


def recall_accuracy(model: Any, d: tdata.TracingData) -> dict[str, float]:
    """Share of facts whose attribute the model ranks first among its relation's attributes
    (multiple choice) and over the whole vocabulary."""
    lp, attrs = attribute_logp(model, d), d.attribute_ids()
    mc, top1 = [], []
    for i, f in enumerate(d.facts):
        same = [j for j, g in enumerate(d.facts) if g.relation == f.relation]
        mc.append(int(lp[i, attrs[same]].argmax().item() == same.index(i)))
        top1.append(int(lp[i].argmax().item() == attrs[i].item()))
    return {"multiple_choice": float(np.mean(mc)), "top1_vocab": float(np.mean(top1))}


class Snapshots(list):
    """Model state dicts of one run, evenly spaced, the last the final weights; ``optimizer``:
    the AdamW ``state_dict()`` at each; ``context``: the run for the trajectory rows."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer: list[dict] = []
        self.context: Any = None


def snapshot_steps(n_keep: int, cfg: dict, snapshots: int) -> list[int]:
    """The (1-based) update steps after which :func:`train` keeps ``snapshots`` states."""
    steps = cfg["epochs"] * -(-n_keep // cfg["batch_size"])
    return sorted({round(steps * (s + 1) / snapshots) for s in range(snapshots)})


def train(
    d: tdata.TracingData, keep: list[int], cfg: dict, seed: int, snapshots: int = 1,
    observer: Any = None,
) -> Snapshots:  # fmt: skip
    """AdamW from the seed's initialisation on the documents ``keep``, linear decay to 0.

    Initialisation and batch order depend on ``seed`` alone (common random numbers across
    removals). ``observer`` (a quality-benchmark ``TrainObserver``) records the run for the
    trajectory rows without changing it.
    """
    torch.manual_seed(seed)
    model = TinyGPT2(vocab_size=len(d.vocab), **MODEL)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    x, y = d.docs[keep, :-1], d.docs[keep, 1:]
    bs, epochs = cfg["batch_size"], cfg["epochs"]
    steps = epochs * -(-len(keep) // bs)
    marks = set(snapshot_steps(len(keep), cfg, snapshots))
    states, step = Snapshots(), 0
    kept = torch.as_tensor(keep, dtype=torch.long)
    with observer.run(model, opt) if observer is not None else contextlib.nullcontext():
        for _ in range(epochs):
            for idx in torch.randperm(len(keep), generator=gen).split(bs):
                for group in opt.param_groups:
                    group["lr"] = cfg["lr"] * (1 - step / steps)
                batch = {"x": x[idx], "y": y[idx]}
                if observer is not None:
                    observer.before_backward(step, kept[idx], batch)
                loss = doc_loss_sum(model, batch) / len(idx)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if observer is not None:
                    observer.after_step(step)
                step += 1
                if step in marks:
                    states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                    states.optimizer.append(copy.deepcopy(opt.state_dict()))
    return states


def load(d: tdata.TracingData, state: dict) -> Any:
    model = TinyGPT2(vocab_size=len(d.vocab), **MODEL)
    model.load_state_dict(state)
    return model.eval()


# ---- dattri_llm rows ------------------------------------------------------------------------
def samples(d: tdata.TracingData) -> tuple[list[dict], list[dict]]:
    """dattri_llm samples (``index`` keeps hashes unique)."""
    train = [{"x": d.docs[i, :-1], "y": d.docs[i, 1:], "index": torch.tensor(i)}
             for i in range(len(d.docs))]  # fmt: skip
    test = [{"x": d.query_x[i], "y": d.query_y[i], "index": torch.tensor(i)}
            for i in range(len(d.facts))]  # fmt: skip
    return train, test


def _task(d: tdata.TracingData, states: list[dict], tmp: str, **kw: Any) -> tuple[Any, Any]:
    """``AttributionArguments(**kw)`` and the task over ``states`` (the last: the model)."""
    import dattri_llm

    args = dattri_llm.AttributionArguments(output_dir=tmp, use_cpu=True, show_progress=False,
                                           **kw)  # fmt: skip
    task = dattri_llm.AttributionTask(loss_func=doc_loss_sum, model=load(d, states[-1]),
                                      checkpoints=states, target_func=query_loss_sum)  # fmt: skip
    return args, task


def _attribute(
    d: tdata.TracingData, states: list[dict], cls_name: str, kw: dict, call: dict | None = None
) -> torch.Tensor:
    """``cls_name(**kw)`` over ``states`` (their scores summed), live ``attribute()``."""
    import dattri_llm

    train, test = samples(d)
    with tempfile.TemporaryDirectory() as tmp:
        args, task = _task(d, states, tmp, per_device_train_batch_size=64,
                           per_device_eval_batch_size=64)  # fmt: skip
        attributor = getattr(dattri_llm, cls_name)(args, task=task, **kw)
        return attributor.attribute(train, test, **(call or {})).query(train, test)


def ekfac_mix(d: tdata.TracingData, states: list[dict], *_: Any) -> torch.Tensor:
    """EK-FAC unit fit on a train / query mixture (``mix=0.5``): the live ``attribute()``
    refuses ``mix``, so the gradients at the final weights go to ``attribute_sources``."""
    import dattri_llm
    from dattri_llm.gradient.streaming import GradientStreamer

    train, test = samples(d)
    with tempfile.TemporaryDirectory() as tmp:
        args, task = _task(d, states[-1:], tmp)
        attributor = dattri_llm.EKFACAttributor(args, task=task, normalized_grad=True, mix=0.5)
        task.load_checkpoint(0)
        blocks = [list(GradientStreamer(task.model, ds, loss, batch_size=64))
                  for ds, loss in ((train, task.train_loss), (test, task.test_loss))]  # fmt: skip
        return attributor.attribute_sources(*blocks).query(train, test)


def _projection(style: str, dim: int) -> dict:
    """Capture-time projection; with logra, embeddings and norms are projected densely."""
    from dattri_llm import HookManagerConfig, ProjectionConfig

    proj: Any = ProjectionConfig(style, proj_dim=dim, seed=0)
    if style == "logra":
        dense = ProjectionConfig("dense", proj_dim=dim, seed=0)
        proj = {r"(.*\.)?(wte|wpe|ln_f|h\.\d+\.ln_\d)|gpt\.lm_head": dense, r".*": proj}
    return {"hook_config": HookManagerConfig(projection=proj)}


def second_moments(d: tdata.TracingData, states: Snapshots, config: Any = None) -> list:
    """One ``SecondMoment`` per snapshot (its AdamW ``exp_avg_sq``), laid out by ``config``."""
    from dattri_llm import HookManager, HookManagerConfig, SecondMoment

    out = []
    for state, opt_state in zip(states, states.optimizer):
        model = load(d, state)
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(copy.deepcopy(opt_state))
        hm = HookManager(model, config or HookManagerConfig())
        out.append(SecondMoment.from_optimizer(opt, hm))
        hm.remove()
    return out


def trackstar(d: tdata.TracingData, states: Snapshots, *_: Any) -> torch.Tensor:
    """TrackStar with ``R = I``: per snapshot, TracIn-Cos of the gradients times
    ``1/√(v_c + ε)`` (one attributor per snapshot: a ``SecondMoment`` holds one ``v``), summed."""
    kw = {"normalized_grad": True}
    parts = [_attribute(d, [s], "TracInAttributor", {**kw, "second_moment": sm})
             for s, sm in zip(states, second_moments(d, states))]  # fmt: skip
    return sum(parts)  # type: ignore[return-value]


def trackstar_full(d: tdata.TracingData, states: Snapshots, *_: Any) -> torch.Tensor:
    """TrackStar with its ``R``: ProjectedFisher unit + second moment on a mask capture (a
    seeded subsample: a mixing projection would have to precede the correction)."""
    from dattri_llm import HookManagerConfig, ProjectionConfig

    cfg = HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=MASK_DIM, seed=0))
    kw = {"normalized_grad": True, "second_moment": second_moments(d, states, cfg)}
    return _attribute(d, states, "ProjectedFisherAttributor", kw, {"hook_config": cfg})


def ekfac_moment(d: tdata.TracingData, states: Snapshots, *_: Any) -> torch.Tensor:
    """EK-FAC unit + diagonal with the second-moment correction at every snapshot."""
    kw = {**DIAG, "second_moment": second_moments(d, states)}
    return _attribute(d, states, "EKFACAttributor", kw)


def random_scores(d: tdata.TracingData, states: Any, seed: int) -> torch.Tensor:
    """Uniform random scores, seeded per seed."""
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.rand(len(d.docs), len(d.facts), generator=gen)


def tfidf(d: tdata.TracingData, *_: Any) -> torch.Tensor:
    """scikit-learn TF-IDF cosine between each document's and each query's words."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(analyzer=lambda ws: ws, sublinear_tf=True)
    docs, queries = vec.fit_transform(d.doc_words), vec.transform(d.query_words)
    return torch.from_numpy((docs @ queries.T).toarray())


def bm25(d: Any, *_: Any) -> torch.Tensor:
    """rank-bm25's Okapi BM25 (k1 = 1.5, b = 0.75) of each query's words against each
    document's words (``pip install rank-bm25``)."""
    from rank_bm25 import BM25Okapi

    index = BM25Okapi(d.doc_words, k1=1.5, b=0.75)
    return torch.stack([torch.from_numpy(index.get_scores(q)) for q in d.query_words], 1)


# ---- trajectory rows (the quality benchmark's, over this run) -------------------------------
def trajectory_context(d: tdata.TracingData, states: Snapshots, seed: int, cfg: dict) -> Any:
    """This run as a quality-benchmark ``Context`` (one per run: the rows share its recording
    of the same loop through ``observer=``, refused unless its final weights are ``states[-1]``)."""
    if states.context is not None:
        return states.context
    from experiments.benchmark.quality.common import Setting, TupleDataset
    from experiments.benchmark.quality.methods import Context

    def train_func(loader: Any, seed: int | None = None, observer: Any = None, **_: Any) -> Any:
        everything = list(range(len(d.docs)))
        return load(d, train(d, everything, cfg, int(seed or 0), observer=observer)[-1])

    def unused(*_: Any) -> Any:
        raise NotImplementedError("not used by the trajectory rows")

    setting = Setting(
        name=f"tracing-s{seed}", train=TupleDataset(d.docs[:, :-1], d.docs[:, 1:]),
        test=TupleDataset(d.query_x, d.query_y), train_func=train_func, target=unused,
        make_model=lambda: TinyGPT2(vocab_size=len(d.vocab), **MODEL), loss_sum=doc_loss_sum,
        make_loss_single=unused, batch_size=cfg["batch_size"], lr=cfg["lr"], task_kind="lm",
        checkpoint_epochs=snapshot_steps(len(d.docs), cfg, len(states)), trajectory="adamw",
        target_sum=query_loss_sum,
        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=cfg["lr"], weight_decay=0),
    )  # fmt: skip
    states.context = Context(setting, [*states, states[-1]], extra={"loo_seed": seed})
    return states.context


def trajectory_row(name: str, cfg: dict) -> Row:
    """The quality benchmark's trajectory method ``name`` on this seed's recorded run."""

    def fn(d: tdata.TracingData, states: Snapshots, seed: int) -> tuple[torch.Tensor, str]:
        from experiments.benchmark.quality.methods import trajectory as qt

        ctx = trajectory_context(d, states, seed, cfg)
        method = qt.adamw_influence("full") if name == "adamw_influence" else getattr(qt, name)
        ctx.extra.pop("last_note", None)
        scores = method(ctx)
        return scores, ctx.extra.pop("last_note", "")

    return fn


TRAJECTORY_ROWS = {
    "AdamW-influence (every step)": "adamw_influence",
    "LESS (3 ckpts, frozen form)": "less",
    "DVEmb (assumes SGD; warns on this AdamW run)": "dvemb_on_adam",
}
#: Run only when named in ``--rows`` (too slow for the default run).
OPT_IN_ROWS = {"AdamW-influence, exact Hessian (every step)": "adamw_influence_exact_hessian"}


def _att(cls_name: str, every: bool = False, proj: tuple | None = None, **kw: Any) -> Row:
    """Row of ``cls_name(**kw)`` at the final weights, or summed over every snapshot."""
    return lambda d, s, seed: _attribute(
        d, s if every else s[-1:], cls_name, kw, _projection(*proj) if proj else None
    )


def methods(quick: bool, cfg: dict | None = None, opt_in: bool = False) -> dict[str, Row]:
    """Row name -> row (the quick run has the first six and the trajectory rows)."""
    cfg = cfg or (QUICK if quick else FULL)
    rows: dict[str, Row] = {
        "random": random_scores,
        "TF-IDF (scikit-learn)": tfidf,
        "BM25 (rank-bm25)": bm25,
        "Grad-Dot": _att("TracInAttributor"),
        "Grad-Cos": _att("TracInAttributor", normalized_grad=True),
        "EK-FAC unit": _att("EKFACAttributor", normalized_grad=True),
    }
    if not quick:
        rows |= {
            "EK-FAC": _att("EKFACAttributor"),
            "EK-FAC unit, diagonal non-Kronecker": _att("EKFACAttributor", **DIAG),
            "EK-FAC unit mix=0.5": ekfac_mix,
            "TracIn-Cos (3 ckpts)": _att("TracInAttributor", True, normalized_grad=True),
            "EK-FAC unit, diagonal non-Kronecker (3 ckpts)": _att("EKFACAttributor", True, **DIAG),
            "TracIn-Cos + second moment (3 ckpts)": trackstar,
            "TrackStar: ProjectedFisher unit + second moment, mask-1024 (3 ckpts)": trackstar_full,
            "EK-FAC unit, diagonal + second moment (3 ckpts)": ekfac_moment,
            "Grad-Cos sparse-1024": _att(
                "TracInAttributor", proj=("sparse", 1024), normalized_grad=True
            ),
            "Grad-Cos logra-256": _att(
                "TracInAttributor", proj=("logra", 256), normalized_grad=True
            ),
        }
    extra = {**TRAJECTORY_ROWS, **(OPT_IN_ROWS if opt_in else {})}
    return rows | {row: trajectory_row(name, cfg) for row, name in extra.items()}


# ---- one seed -----------------------------------------------------------------------------
def _timed(fn: Row, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


def run_seed(
    cfg: dict, seed: int, rows: dict[str, Row], log: Any, jobs: int = 1, controls: bool = True
) -> dict[str, Any]:
    """Train, score every row, then the causal check: per row and fact one retraining without
    that row's top-``k`` for the fact (and the two control rows unless ``controls=False``)."""
    from experiments.benchmark.quality.methods import Skipped

    sizes = ("n_docs", "n_facts", "copies", "block", "vocab_words")
    d = tdata.build(*(cfg[k] for k in sizes), seed)
    states, train_s = _timed(train, d, list(range(len(d.docs))), cfg, seed, cfg["checkpoints"])
    full = load(d, states[-1])
    attrs = d.attribute_ids()
    base = attribute_logp(full, d)[torch.arange(len(attrs)), attrs]
    acc = recall_accuracy(full, d)
    log(f"seed {seed}: trained in {train_s:.1f}s, recall {acc}")
    out: dict[str, Any] = {"seed": seed, "train_s": train_s, "recall": acc, "rows": {}}
    removals: dict[str, list[list[int]]] = {}
    for name, fn in rows.items():
        try:
            peak, (res, score_s) = peak_rss_bytes(partial(_timed, fn, d, states, seed))
        except Exception as err:  # recorded in the table, the other rows still run
            refused = isinstance(err, Skipped)  # the library refuses the method for this run
            why = {"refused": str(err)} if refused else {"error": f"{type(err).__name__}: {err}"}
            out["rows"][name] = {k: v[:300] for k, v in why.items()}
            log(f"  {name:24s} {why}")
            continue
        scores, note = res if isinstance(res, tuple) else (res, "")
        row = {"note": note} if note else {}
        row |= {"score_s": score_s, "peak_mb": peak / 1e6}  # peak RSS above the level before
        row["recall@10"] = tm.recall_at_k(scores, d.relevant(), cfg["k"]).tolist()
        row["mrr"] = tm.reciprocal_rank(scores, d.relevant()).tolist()
        removals[name], out["rows"][name] = tm.top_k(scores, cfg["k"]), row
        log(f"  {name:24s} recall@10 {np.mean(row['recall@10']):.3f} ({score_s:.1f} s)")
    if states.context is not None and "tmp_root" in states.context.extra:
        states.context.extra.pop("tmp_root").cleanup()  # the trajectory rows' recording
    if controls:
        for name, rem in causal.control_removals(d, cfg["k"], seed).items():
            removals[name], out["rows"][name] = rem, {}

    def retrain(keep: list[int]) -> np.ndarray:
        return attribute_logp(load(d, train(d, keep, cfg, seed)[-1]), d).numpy()

    t0 = time.perf_counter()
    keys = [tuple(sorted(r)) for rem in removals.values() for r in rem]
    lps, secs = causal.retrain_all(keys, len(d.docs), retrain, jobs, log)
    each = float(np.mean(secs)) if secs else 0.0
    out["retrain"] = {"removals": len(keys), "retrainings": len(lps), "jobs": jobs,
                      "wall_s": time.perf_counter() - t0, "each_s": each}  # fmt: skip
    for name, drop in causal.drops(removals, lps, base, attrs).items():
        out["rows"][name] |= {
            "causal_drop": drop,
            "removed_per_fact": [len(r) for r in removals[name]],
        }
        log(f"  {name:24s} drop {np.mean(drop):.3f}")
    return out


# ---- command line -------------------------------------------------------------------------
def combine(paths: list[str], name: str) -> dict[str, Any]:
    """Merge per-seed result files; a later file's rows of the same seed are added."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    by_seed: dict[int, dict] = {}
    for s in (s for part in parts for s in part["seeds"]):
        by_seed.setdefault(s["seed"], {**s, "rows": {}})["rows"].update(s["rows"])
    result = {k: v for k, v in parts[0].items() if k != "command"}
    result |= {
        "seeds": list(by_seed.values()),
        "config": {**parts[0]["config"], "seeds": list(by_seed)},
        "wall_s": max(part["wall_s"] for part in parts),
        "commands": [p.get("command", "command not recorded") for p in parts]
        + [shlex.join(["python", "-m", "experiments.benchmark.tracing.run", "--combine", *paths])],
        "parallel_processes": len(parts),
    }
    _write(result, name)
    return result


def _write(result: dict[str, Any], name: str) -> None:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{name}.json").write_text(json.dumps(result, indent=1))
    md = write_report(result)
    (RESULTS_DIR / f"{name}.md").write_text(md)
    print(md)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, small sizes")
    parser.add_argument("--seeds", type=int, nargs="*", help="override the seeds")
    parser.add_argument("--tag", default="", help="suffix of the result files (tracing-TAG)")
    parser.add_argument("--rows", nargs="*", help="run only these rows (names as in the table)")
    parser.add_argument("--combine", nargs="*", help="merge these per-seed JSON results")
    parser.add_argument("--jobs", type=int, default=1, help="retraining processes (same results)")
    ns = parser.parse_args(argv)
    name = "tracing-quick" if ns.quick else "tracing"
    if ns.combine:
        combine(ns.combine, name)
        return
    torch.set_num_threads(1)
    cfg = {**(QUICK if ns.quick else FULL), **({"seeds": ns.seeds} if ns.seeds else {})}
    rows, controls = methods(ns.quick, cfg, opt_in=bool(ns.rows)), True
    if ns.rows:
        if unknown := set(ns.rows) - {*rows, causal.CARRIERS, causal.FILLED}:
            raise SystemExit(f"--rows: unknown {sorted(unknown)}; known: {sorted(rows)}")
        rows = {k: v for k, v in rows.items() if k in ns.rows}
        controls = bool({causal.CARRIERS, causal.FILLED} & set(ns.rows))
    t0 = time.perf_counter()
    seeds = [run_seed(cfg, s, rows, lambda m: print(m, flush=True), ns.jobs, controls)
             for s in cfg["seeds"]]  # fmt: skip
    command = ["python", "-m", "experiments.benchmark.tracing.run", *(argv or sys.argv[1:])]
    result = {"command": shlex.join(command), "config": cfg, "model": MODEL,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
              "wall_s": time.perf_counter() - t0, "seeds": seeds}  # fmt: skip
    _write(result, f"{name}-{ns.tag}" if ns.tag else name)


if __name__ == "__main__":
    main()
