"""Fact-tracing benchmark: which documents taught the model this fact?

Per seed: plant made-up facts in real text (:mod:`.data`), train a tiny GPT-2 from its config
until it recalls them, score every document against every fact's held-out query with each
method, then

* **retrieval**: recall@10 and MRR of the documents that carry the fact;
* **causal check** (:mod:`.causal`): per method and fact, retrain from the same
  initialisation and batch-order seed without exactly that method's top-10 documents for that
  fact, and measure the drop of the fact's attribute log-probability (``log p_full -
  log p_removed``; larger = the method found what taught the fact). Every method row removes
  10 documents per fact; the ``carriers`` row removes the fact's planted documents only (the
  ground truth's own effect), ``carriers + random`` pads them to 10 with random documents
  that carry no fact (the same-size removal a perfect retriever approaches).

Trajectory rows (AdamW-influence, LESS, DVEmb) record the training run once more through its
observer (:func:`trajectory_context`) and use the quality benchmark's rows on it.

Run (OMP_NUM_THREADS=1 is set here; the machine is shared)::

    python -m experiments.benchmark.tracing.run            # full: 3 seeds, one process
    python -m experiments.benchmark.tracing.run --quick    # smoke: 1 seed, 4 facts
    # or one process per seed (--jobs 2: retrain in 2 processes, same results), then merge:
    python -m experiments.benchmark.tracing.run --seeds 0 --tag s0   # (and s1, s2)
    python -m experiments.benchmark.tracing.run --combine \
        experiments/benchmark/results/tracing-s{0,1,2}.json

Writes ``experiments/benchmark/results/tracing[-quick].{json,md}``.
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
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from experiments.benchmark.quality.gpt2 import TinyGPT2  # noqa: E402
from experiments.benchmark.tracing import causal, recipes  # noqa: E402
from experiments.benchmark.tracing import data as tdata  # noqa: E402
from experiments.benchmark.tracing import metrics as tm  # noqa: E402
from experiments.benchmark.tracing.report import write_report  # noqa: E402
from experiments.benchmark.utils.env import BENCH_DIR, RESULTS_DIR  # noqa: E402
from experiments.benchmark.utils.memory import peak_rss_bytes  # noqa: E402

RESULTS = RESULTS_DIR

FULL: dict[str, Any] = {
    "seeds": [0, 1, 2],
    "n_docs": 128,
    "n_facts": 8,
    "copies": 3,
    "block": 48,
    "vocab_words": 1000,
    "epochs": 40,
    "batch_size": 32,
    "lr": 1e-2,
    "k": 10,
    "checkpoints": 3,
}
QUICK: dict[str, Any] = {**FULL, "seeds": [0], "n_docs": 64, "n_facts": 4, "epochs": 25}
MODEL: dict[str, Any] = {"n_layer": 2, "n_head": 4, "n_embd": 64}


# ---- model, losses, training ----------------------------------------------------------------
def doc_losses(model: Any, batch: dict) -> torch.Tensor:
    """``(B,)`` each document's mean next-token cross-entropy."""
    logits = model(batch["x"])
    return F.cross_entropy(logits.transpose(1, 2), batch["y"], reduction="none").mean(1)


def doc_loss_sum(model: Any, batch: dict) -> torch.Tensor:
    """Sum over the batch of each document's mean next-token cross-entropy (training loss)."""
    return doc_losses(model, batch).sum()


def query_loss_sum(model: Any, batch: dict) -> torch.Tensor:
    """Sum over the batch of ``-log p(attribute | prompt)`` (one labelled position per query)."""
    logits = model(batch["x"])
    return F.cross_entropy(logits.transpose(1, 2), batch["y"], ignore_index=-100, reduction="sum")


def attribute_logp(model: Any, d: tdata.TracingData) -> tuple[torch.Tensor, torch.Tensor]:
    """Per fact, the log-probabilities over the vocabulary at the attribute's position of the
    held-out prompt (``(n_facts, vocab)``, float64), and that position."""
    with torch.no_grad():
        logits = model(d.query_x)
        pos = (d.query_y != -100).float().argmax(1)
        lp = torch.log_softmax(logits[torch.arange(len(pos)), pos].double(), -1)
    return lp, pos


def recall_accuracy(model: Any, d: tdata.TracingData) -> dict[str, float]:
    """Share of facts whose attribute the model ranks first: among the attributes of the same
    relation (multiple choice) and over the whole vocabulary."""
    lp, _ = attribute_logp(model, d)
    attrs = d.attribute_ids()
    mc, top1 = [], []
    for i, f in enumerate(d.facts):
        same = [j for j, g in enumerate(d.facts) if g.relation == f.relation]
        mc.append(int(lp[i, attrs[same]].argmax().item() == same.index(i)))
        top1.append(int(lp[i].argmax().item() == attrs[i].item()))
    return {"multiple_choice": float(np.mean(mc)), "top1_vocab": float(np.mean(top1))}


class Snapshots(list):
    """Model state dicts of one training run, evenly spaced, the last the final weights, and
    ``optimizer``: the AdamW ``state_dict()`` saved at each of them (same order)."""

    def __init__(self) -> None:
        super().__init__()
        self.optimizer: list[dict] = []


def snapshot_steps(n_keep: int, cfg: dict, snapshots: int) -> list[int]:
    """The (1-based) update steps after which :func:`train` keeps ``snapshots`` states."""
    bs = cfg["batch_size"]
    steps = cfg["epochs"] * ((n_keep + bs - 1) // bs)
    return sorted({round(steps * (s + 1) / snapshots) for s in range(snapshots)})


def train(
    d: tdata.TracingData,
    keep: list[int],
    cfg: dict,
    seed: int,
    snapshots: int = 1,
    observer: Any = None,
) -> Snapshots:
    """AdamW from the seed's initialisation on the documents ``keep``; linear decay to 0.

    The initialisation and the batch-order generator are seeded by ``seed`` alone (common
    random numbers across removals). Returns ``snapshots`` states, evenly spaced, the last
    being the final weights, with the optimizer's state at each (``Snapshots.optimizer``).
    ``observer`` (a quality-benchmark ``TrainObserver``) watches the loop: the trajectory rows
    record the run through it; it does not change the run (checked bit for bit).
    """
    torch.manual_seed(seed)
    model = TinyGPT2(vocab_size=len(d.vocab), **MODEL)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    x, y = d.docs[keep, :-1], d.docs[keep, 1:]
    bs, epochs = cfg["batch_size"], cfg["epochs"]
    steps = epochs * ((len(keep) + bs - 1) // bs)
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


# ---- methods ------------------------------------------------------------------------------
def samples(d: tdata.TracingData) -> tuple[list[dict], list[dict]]:
    """dattri_llm samples (dicts; ``index`` keeps hashes unique)."""
    train = [
        {"x": d.docs[i, :-1], "y": d.docs[i, 1:], "index": torch.tensor(i)}
        for i in range(len(d.docs))
    ]
    test = [
        {"x": d.query_x[i], "y": d.query_y[i], "index": torch.tensor(i)}
        for i in range(len(d.facts))
    ]
    return train, test


def _attribute(
    d: tdata.TracingData, states: list[dict], cls_name: str, kw: dict, call: dict | None = None
) -> torch.Tensor:
    import dattri_llm

    train, test = samples(d)
    with tempfile.TemporaryDirectory() as tmp:
        args = dattri_llm.AttributionArguments(
            output_dir=tmp,
            use_cpu=True,
            per_device_train_batch_size=64,
            per_device_eval_batch_size=64,
            show_progress=False,
        )
        task = dattri_llm.AttributionTask(
            loss_func=doc_loss_sum,
            model=load(d, states[-1]),
            checkpoints=states,
            target_func=query_loss_sum,
        )
        attributor = getattr(dattri_llm, cls_name)(args, task=task, **kw)
        return attributor.attribute(train, test, **(call or {})).query(train, test)


def _streamed(d: tdata.TracingData, state: dict, cls_name: str, kw: dict) -> torch.Tensor:
    """``cls_name(**kw)`` over train and query gradients streamed once at ``state``'s weights,
    through ``attribute_sources``."""
    import dattri_llm
    from dattri_llm.gradient.streaming import GradientStreamer

    train, test = samples(d)
    with tempfile.TemporaryDirectory() as tmp:
        args = dattri_llm.AttributionArguments(output_dir=tmp, use_cpu=True, show_progress=False)
        task = dattri_llm.AttributionTask(
            loss_func=doc_loss_sum, model=load(d, state), checkpoints=[state],
            target_func=query_loss_sum,
        )  # fmt: skip
        attributor = getattr(dattri_llm, cls_name)(args, task=task, **kw)
        task.load_checkpoint(0)
        blocks = [
            list(GradientStreamer(task.model, ds, loss, batch_size=64))
            for ds, loss in ((train, task.train_loss), (test, task.test_loss))
        ]
        return attributor.attribute_sources(*blocks).query(train, test)


def _ekfac_mix(d: tdata.TracingData, states: list[dict], mix: float) -> torch.Tensor:
    """EK-FAC (unit) fit on a train / query mixture: ``mix`` needs the test side at fit time,
    which the live ``attribute()`` refuses; the same gradients go through
    ``attribute_sources`` (streamed once at the final weights)."""
    return _streamed(d, states[-1], "EKFACAttributor", {"normalized_grad": True, "mix": mix})


def _projection(style: str, dim: int) -> Any:
    """Capture-time projection; with logra, embeddings and norms are projected densely."""
    from dattri_llm import HookManagerConfig, ProjectionConfig

    proj: Any = ProjectionConfig(style, proj_dim=dim, seed=0)
    if style == "logra":
        dense = ProjectionConfig("dense", proj_dim=dim, seed=0)
        proj = {r"(.*\.)?(wte|wpe|ln_f|h\.\d+\.ln_\d)|gpt\.lm_head": dense, r".*": proj}
    return {"hook_config": HookManagerConfig(projection=proj)}


def tfidf(d: tdata.TracingData) -> torch.Tensor:
    """scikit-learn TF-IDF cosine between each document's and each query's words."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    vec = TfidfVectorizer(analyzer=lambda ws: ws, sublinear_tf=True)
    docs = vec.fit_transform(d.doc_words)
    queries = vec.transform(d.query_words)
    return torch.from_numpy((docs @ queries.T).toarray())


def bm25(d: tdata.TracingData) -> torch.Tensor:
    """Okapi BM25 (``rank_bm25.BM25Okapi``: k1 = 1.5, b = 0.75, the package's ATIRE idf
    ``log((N − n + 0.5) / (n + 0.5))`` floored at ``0.25 ×`` the mean idf for terms in more than
    half the documents) of each query's words against each document's words, the same word
    tokens as the TF-IDF row. Needs ``pip install rank-bm25``."""
    try:
        from rank_bm25 import BM25Okapi
    except ImportError as err:
        raise ImportError(
            "the BM25 row needs the rank-bm25 package: pip install rank-bm25"
        ) from err

    index = BM25Okapi(d.doc_words, k1=1.5, b=0.75)
    cols = [torch.from_numpy(index.get_scores(q)) for q in d.query_words]
    return torch.stack(cols, 1)


def trackstar(d: tdata.TracingData, states: Snapshots) -> torch.Tensor:
    """TrackStar without its ``R`` (identity): per checkpoint, train and query gradients times
    ``1/√(v_c + ε)`` (that checkpoint's AdamW second moment), unit-normalized, dotted; summed
    over the checkpoints. One ``TracInAttributor(second_moment=, normalized_grad=True)`` per
    checkpoint (a ``SecondMoment`` holds one ``v``)."""
    total = None
    for state, sm in zip(states, recipes.second_moments(d, states, load)):
        part = _attribute(
            d, [state], "TracInAttributor", {"normalized_grad": True, "second_moment": sm}
        )
        total = part if total is None else total + part
    return total


# ---- trajectory rows (the quality benchmark's, over this run) -------------------------------
#: Per seed: the quality-benchmark ``Context`` of the run (its recording is shared by the rows).
_CONTEXTS: dict[int, tuple[Any, Any]] = {}


def trajectory_context(d: tdata.TracingData, states: Snapshots, seed: int, cfg: dict) -> Any:
    """This seed's run as a quality-benchmark ``Context``, so that the trajectory rows of
    :mod:`experiments.benchmark.quality.methods.trajectory` record it (the same loop through
    ``observer=``, refused unless its final weights equal ``states[-1]`` bit for bit) and
    score it. LESS reads the AdamW state at the snapshot steps; the checkpoint weights are
    equal (the quality default, ``lr`` each)."""
    if seed in _CONTEXTS and _CONTEXTS[seed][0] is states:
        return _CONTEXTS[seed][1]
    from experiments.benchmark.quality.common import Setting, TupleDataset
    from experiments.benchmark.quality.methods import Context

    everything = list(range(len(d.docs)))

    def train_func(loader: Any, seed: int | None = None, observer: Any = None, **_: Any) -> Any:
        return load(d, train(d, everything, cfg, int(seed or 0), observer=observer)[-1])

    def unused(*_: Any) -> Any:
        raise NotImplementedError("not used by the trajectory rows")

    setting = Setting(
        name=f"tracing-s{seed}",
        train=TupleDataset(d.docs[:, :-1], d.docs[:, 1:]),
        test=TupleDataset(d.query_x, d.query_y),
        make_model=lambda: TinyGPT2(vocab_size=len(d.vocab), **MODEL),
        train_func=train_func,
        target=unused,
        loss_sum=doc_loss_sum,
        make_loss_single=unused,
        batch_size=cfg["batch_size"],
        checkpoint_epochs=snapshot_steps(len(d.docs), cfg, len(states)),
        lr=cfg["lr"],
        task_kind="lm",
        target_sum=query_loss_sum,
        trajectory="adamw",
        make_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=cfg["lr"], weight_decay=0),
    )
    ctx = Context(setting, [*states, states[-1]])
    ctx.extra["loo_seed"] = seed
    release_contexts()
    _CONTEXTS[seed] = (states, ctx)
    return ctx


def release_contexts() -> None:
    """Delete the recordings of the cached contexts."""
    for _, ctx in _CONTEXTS.values():
        tmp = ctx.extra.pop("tmp_root", None)
        if tmp is not None:
            tmp.cleanup()
    _CONTEXTS.clear()


def trajectory_row(name: str, cfg: dict) -> Any:
    """Row ``fn(d, states, seed) -> (scores, note)`` of the quality benchmark's trajectory
    method ``name`` (``adamw_influence``, ``adamw_influence_exact_hessian``, ``less``,
    ``dvemb_on_adam``) on this seed's recorded run."""

    def fn(d: tdata.TracingData, states: Snapshots, seed: int) -> tuple[torch.Tensor, str]:
        from experiments.benchmark.quality.methods import trajectory as qt

        ctx = trajectory_context(d, states, seed, cfg)
        method = qt.adamw_influence("full") if name == "adamw_influence" else getattr(qt, name)
        ctx.extra.pop("last_note", None)
        scores = method(ctx)
        return scores, ctx.extra.pop("last_note", "")

    return fn


#: The trajectory rows (names as in the tables) and the quality-benchmark method of each.
TRAJECTORY_ROWS = {
    "AdamW-influence (every step)": "adamw_influence",
    "LESS (3 ckpts, frozen form)": "less",
    "DVEmb (assumes SGD; warns on this AdamW run)": "dvemb_on_adam",
}
#: Rows run only when named in ``--rows`` (too slow for the default run; see the docs).
OPT_IN_ROWS = {"AdamW-influence, exact Hessian (every step)": "adamw_influence_exact_hessian"}


def methods(quick: bool, cfg: dict | None = None, opt_in: bool = False) -> dict[str, Any]:
    """Row name -> ``fn(data, states, seed) -> (n_docs, n_facts) scores`` (or ``(scores,
    note)``); ``opt_in`` adds :data:`OPT_IN_ROWS`."""
    rows: dict[str, Any] = {
        "random": lambda d, s, seed: torch.rand(
            len(d.docs), len(d.facts), generator=torch.Generator().manual_seed(1000 + seed)
        ),
        "TF-IDF (scikit-learn)": lambda d, s, seed: tfidf(d),
        "BM25 (rank-bm25)": lambda d, s, seed: bm25(d),
        "Grad-Dot": lambda d, s, seed: _attribute(d, s[-1:], "TracInAttributor", {}),
        "Grad-Cos": lambda d, s, seed: _attribute(
            d, s[-1:], "TracInAttributor", {"normalized_grad": True}
        ),
        "EK-FAC unit": lambda d, s, seed: _attribute(
            d, s[-1:], "EKFACAttributor", {"normalized_grad": True}
        ),
    }
    cfg = cfg or (QUICK if quick else FULL)
    trajectory = {row: trajectory_row(name, cfg) for row, name in TRAJECTORY_ROWS.items()}
    if quick:
        return {**rows, **trajectory}
    rows.update(
        {
            "EK-FAC": lambda d, s, seed: _attribute(d, s[-1:], "EKFACAttributor", {}),
            "EK-FAC unit, diagonal non-Kronecker": lambda d, s, seed: _attribute(
                d,
                s[-1:],
                "EKFACAttributor",
                {"normalized_grad": True, "non_kronecker": "diagonal"},
            ),
            "EK-FAC unit mix=0.5": lambda d, s, seed: _ekfac_mix(d, s, 0.5),
            "TracIn-Cos (3 ckpts)": lambda d, s, seed: _attribute(
                d, s, "TracInAttributor", {"normalized_grad": True}
            ),
            "EK-FAC unit, diagonal non-Kronecker (3 ckpts)": lambda d, s, seed: _attribute(
                d, s, "EKFACAttributor", {"normalized_grad": True, "non_kronecker": "diagonal"}
            ),
            "TracIn-Cos + second moment (3 ckpts)": lambda d, s, seed: trackstar(d, s),
            "TrackStar: ProjectedFisher unit + second moment, mask-1024 (3 ckpts)": (
                lambda d, s, seed: recipes.trackstar_full(d, s, _attribute, load)
            ),
            "EK-FAC unit, diagonal + second moment (3 ckpts)": (
                lambda d, s, seed: recipes.ekfac_moment(d, s, _attribute, load)
            ),
            "Grad-Cos sparse-1024": lambda d, s, seed: _attribute(
                d,
                s[-1:],
                "TracInAttributor",
                {"normalized_grad": True},
                _projection("sparse", 1024),
            ),
            "Grad-Cos logra-256": lambda d, s, seed: _attribute(
                d, s[-1:], "TracInAttributor", {"normalized_grad": True}, _projection("logra", 256)
            ),
        }
    )
    rows.update(trajectory)
    if opt_in:
        rows.update({row: trajectory_row(name, cfg) for row, name in OPT_IN_ROWS.items()})
    return rows


# ---- one seed -----------------------------------------------------------------------------
def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and its wall time in seconds."""
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


RETRAIN_CACHE = Path(BENCH_DIR) / "results" / "cache" / "tracing-retrain"


def run_seed(
    cfg: dict,
    seed: int,
    rows: dict[str, Any],
    log: Any,
    jobs: int = 1,
    controls: bool = True,
    cache_root: Path | None = None,
) -> dict[str, Any]:
    """Train, score every row, then the causal check (:mod:`.causal`): per row and fact one
    retraining without exactly that row's top-``k`` for the fact (plus the two control rows
    unless ``controls=False``). Retrainings are cached under ``cache_root`` (the command line
    uses :data:`RETRAIN_CACHE`: an interrupted seed resumes)."""
    from experiments.benchmark.quality.methods import Skipped

    d = tdata.build(
        cfg["n_docs"], cfg["n_facts"], cfg["copies"], cfg["block"], cfg["vocab_words"], seed
    )
    everything = list(range(len(d.docs)))
    t0 = time.perf_counter()
    states = train(d, everything, cfg, seed, snapshots=cfg["checkpoints"])
    train_s = time.perf_counter() - t0
    full = load(d, states[-1])
    base_lp, _ = attribute_logp(full, d)
    attrs = d.attribute_ids()
    base = base_lp[torch.arange(len(attrs)), attrs]
    acc = recall_accuracy(full, d)
    log(f"seed {seed}: trained in {train_s:.1f}s, recall {acc}")
    relevant = d.relevant()
    out: dict[str, Any] = {"seed": seed, "train_s": train_s, "recall": acc, "rows": {}}
    removals: dict[str, list[list[int]]] = {}
    for name, fn in rows.items():
        row: dict[str, Any] = {}
        try:
            peak, (res, row["score_s"]) = peak_rss_bytes(partial(_timed, fn, d, states, seed))
        except Skipped as err:  # the library refuses the method for this run
            out["rows"][name] = {"refused": str(err)[:300]}
            log(f"  {name:24s} refused: {err}")
            continue
        except Exception as err:  # recorded in the table, the other rows still run
            out["rows"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
            log(f"  {name:24s} FAILED {out['rows'][name]['error']}")
            continue
        scores, note = res if isinstance(res, tuple) else (res, "")
        if note:
            row["note"] = note
        row["peak_mb"] = peak / 1e6  # resident-set high-water mark above the level before
        row["recall@10"] = tm.recall_at_k(scores, relevant, cfg["k"]).tolist()
        row["mrr"] = tm.reciprocal_rank(scores, relevant).tolist()
        removals[name] = tm.top_k(scores, cfg["k"])
        out["rows"][name] = row
        log(f"  {name:24s} recall@10 {np.mean(row['recall@10']):.3f} ({row['score_s']:.1f} s)")
    release_contexts()
    if controls:
        for name, rem in causal.control_removals(d, cfg["k"], seed).items():
            removals[name], out["rows"][name] = rem, {}

    def retrain(keep: list[int]) -> np.ndarray:
        return attribute_logp(load(d, train(d, keep, cfg, seed)[-1]), d)[0].numpy()

    keys = [tuple(sorted(r)) for rem in removals.values() for r in rem]
    context = {"cfg": {k: v for k, v in cfg.items() if k != "seeds"}, "model": MODEL, "seed": seed}
    context["torch"] = torch.__version__
    cache = None if cache_root is None else causal.RetrainCache(cache_root, context)
    t0 = time.perf_counter()
    lps, secs = causal.retrain_all(keys, len(d.docs), retrain, jobs, log, cache)
    out["retrain"] = {
        "removals": len(keys),
        "retrainings": len(lps),
        "new": len(secs),
        "wall_s": time.perf_counter() - t0,
        "each_s": float(np.mean(secs)) if secs else 0.0,
        "jobs": jobs,
    }
    for name, drop in causal.drops(removals, lps, base, attrs).items():
        out["rows"][name]["causal_drop"] = drop
        out["rows"][name]["removed_per_fact"] = [len(r) for r in removals[name]]
        log(f"  {name:24s} drop {np.mean(drop):.3f}")
    return out


def combine(paths: list[str], name: str) -> dict[str, Any]:
    """Merge per-seed result files (run in parallel processes) into one result."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    result = dict(parts[0])
    by_seed: dict[int, dict] = {}
    for part in parts:  # a later file's rows of the same seed are added (e.g. --rows reruns)
        for s in part["seeds"]:
            if s["seed"] in by_seed:
                by_seed[s["seed"]]["rows"].update(s["rows"])
            else:
                by_seed[s["seed"]] = s
    result["seeds"] = list(by_seed.values())
    result["config"] = {**parts[0]["config"], "seeds": [s["seed"] for s in result["seeds"]]}
    result["wall_s"] = max(part["wall_s"] for part in parts)
    result["commands"] = [p.get("command", "command not recorded") for p in parts] + [
        shlex.join(["python", "-m", "experiments.benchmark.tracing.run", "--combine", *paths])
    ]
    result.pop("command", None)
    result["parallel_processes"] = len(parts)
    _write(result, name)
    return result


def _write(result: dict[str, Any], name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    md = write_report(result)
    (RESULTS / f"{name}.md").write_text(md)
    print(md)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, small sizes")
    parser.add_argument("--seeds", type=int, nargs="*", help="override the seeds")
    parser.add_argument("--tag", default="", help="suffix of the result files (tracing-TAG)")
    parser.add_argument("--rows", nargs="*", help="run only these rows (names as in the table)")
    parser.add_argument("--combine", nargs="*", help="merge these per-seed JSON results")
    parser.add_argument(
        "--jobs", type=int, default=1, help="retrain in this many processes (same results)"
    )
    ns = parser.parse_args(argv)
    name = "tracing-quick" if ns.quick else "tracing"
    if ns.combine:
        combine(ns.combine, name)
        return
    torch.set_num_threads(1)
    cfg = dict(QUICK if ns.quick else FULL)
    if ns.seeds:
        cfg["seeds"] = ns.seeds
    rows = methods(ns.quick, cfg, opt_in=bool(ns.rows))
    controls = True
    if ns.rows:
        unknown = sorted(set(ns.rows) - set(rows) - {causal.CARRIERS, causal.FILLED})
        if unknown:
            raise SystemExit(
                f"--rows: unknown {unknown}; known: "
                f"{sorted([*rows, causal.CARRIERS, causal.FILLED])}"
            )
        rows = {k: v for k, v in rows.items() if k in ns.rows}
        controls = bool({causal.CARRIERS, causal.FILLED} & set(ns.rows))
    t0 = time.perf_counter()
    out_name = f"{name}-{ns.tag}" if ns.tag else name
    seeds: list[dict] = []

    def result_of(parts: list[dict]) -> dict[str, Any]:
        return {
            "command": shlex.join(
                ["python", "-m", "experiments.benchmark.tracing.run", *(argv or sys.argv[1:])]
            ),
            "config": cfg,
            "model": MODEL,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch": torch.__version__,
            "wall_s": time.perf_counter() - t0,
            "seeds": parts,
        }

    def log(message: str) -> None:
        print(message, flush=True)

    for s in cfg["seeds"]:
        seeds.append(run_seed(cfg, s, rows, log, ns.jobs, controls, RETRAIN_CACHE))
    _write(result_of(seeds), out_name)


if __name__ == "__main__":
    main()
