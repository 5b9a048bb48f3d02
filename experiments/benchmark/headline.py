"""Headline quality tables: every method x every quality metric, per setting, with intervals,
times and peak memory, read from the result files the quality, removal and tracing benchmarks
wrote (nothing is retrained or re-scored).

    python experiments/benchmark/headline.py            # print the tables
    python experiments/benchmark/headline.py --write    # update results/headline.md
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: make ``experiments`` importable
    sys.path.insert(0, str(ROOT))

from experiments.benchmark.tracing.metrics import mean_ci  # noqa: E402
from experiments.benchmark.utils.env import RESULTS_DIR  # noqa: E402
from experiments.benchmark.utils.table import md_table  # noqa: E402

RESULTS = RESULTS_DIR
DOC = ROOT / "experiments" / "benchmark" / "results" / "headline.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"
FRACTIONS = (1, 5, 10, 50)
GROUND_TRUTH = "ground truth"
PEERS = ("dattri 0.3.0", "kronfluence")

#: Each method's headline name (in table order), then ``| <benchmarks> <row name>`` for each row
#: name that stands for it: ``q`` ``quality/run.py``, ``r`` the removal files, ``t``
#: ``tracing/run.py``; a line starting with ``|`` continues the one above. The first listed name
#: present wins; a peer's row (which shares our names) is ``<source>: <name>``.
NAMES = """
ground truth | t carriers (ground truth)
ground truth padded to the same size (carriers + random) | t carriers + random (same size)
Random | qr Random | t random
TF-IDF (scikit-learn, lexical) | t TF-IDF (scikit-learn)
BM25 (rank-bm25, lexical) | t BM25 (rank-bm25)
Grad-Dot | qrt Grad-Dot
Grad-Cos | qrt Grad-Cos
Grad-Dot, dense-256 projection | q Grad-Dot proj dense-256
Grad-Dot, logra-256 projection | q Grad-Dot proj logra-256
Grad-Dot, mask-256 projection | q Grad-Dot proj mask-256
Grad-Cos, sparse-1024 projection | t Grad-Cos sparse-1024
Grad-Cos, logra-256 projection | t Grad-Cos logra-256
Grad-Dot mask-2048 (the second-moment rows' coordinates) | q Grad-Dot mask-2048
Grad-Cos mask-2048 | r Grad-Cos mask-2048
Grad-Dot mask-2048 + second moment | q Grad-Dot mask-2048 + second moment
Grad-Cos mask-2048 + second moment (TrackStar, R = I)
    | qr Grad-Cos mask-2048 + second moment (TrackStar, R = I)
ProjectedFisher mask-2048, unit-normalized | r ProjectedFisher mask-2048 unit-normalized
ProjectedFisher mask-2048 unit + second moment (TrackStar with its R)
    | r ProjectedFisher mask-2048 unit + second moment (TrackStar with R)
TracIn (checkpoints, w = lr) | qr TracIn (4 ckpts, w=lr)
TracIn-Cos (checkpoints) | t TracIn-Cos (3 ckpts)
TracIn-Cos + second moment (checkpoints; TrackStar, R = I)
    | t TracIn-Cos + second moment (3 ckpts)
ProjectedFisher unit + second moment, mask-1024 (checkpoints; TrackStar with its R)
    | t TrackStar: ProjectedFisher unit + second moment, mask-1024 (3 ckpts)
EK-FAC unit + diagonal + second moment (checkpoints)
    | t EK-FAC unit, diagonal + second moment (3 ckpts)
K-FAC (default damping) | qr K-FAC (damping=default)
EK-FAC (default damping) | qr EK-FAC (damping=default) | t EK-FAC
EK-FAC, unit-normalized | q EK-FAC unit-normalized (normalized_grad=True) (damping=default)
    | t EK-FAC unit
EK-FAC + diagonal embeddings / norms | q EK-FAC + diagonal (damping=default)
EK-FAC unit-normalized + diagonal embeddings / norms | t EK-FAC unit, diagonal non-Kronecker
EK-FAC unit-normalized + diagonal embeddings / norms, summed over checkpoints
    | t EK-FAC unit, diagonal non-Kronecker (3 ckpts)
EK-FAC fit on train + queries (mix=0.5)
    | q EK-FAC fit on train + queries (mix=0.5) (damping=default)
EK-FAC unit-normalized, mix=0.5 | t EK-FAC unit mix=0.5
LESS (checkpoints, frozen form) | qr LESS (4 ckpts, frozen form) | t LESS (3 ckpts, frozen form)
DVEmb (empirical Fisher) | qr DVEmb (empirical Fisher) | qr DVEmb (assumes SGD)
    | t DVEmb (assumes SGD; warns on this AdamW run)
DVEmb (Monte-Carlo Fisher) | q DVEmb (MC Fisher)
AdamW-influence (empirical Fisher) | qr AdamW-influence (every step, all coordinates)
    | qr AdamW-influence | t AdamW-influence (every step)
AdamW-influence, mask-2048 | q AdamW-influence mask-2048
AdamW-influence, mask-256 | q AdamW-influence mask-256
AdamW-influence, mask-256, unit-normalized
    | q AdamW-influence mask-256 unit-normalized (normalized_grad=True)
AdamW-influence, `ExactHessian`
    | qr AdamW-influence, exact Hessian (every step, all coordinates)
    | t AdamW-influence, exact Hessian (every step)
AdamW-influence (empirical Fisher), `push="exact"`
    | r AdamW-influence + exact push (every step, all coordinates)
AdamW-influence, `ExactHessian`, `push="exact"`
    | r AdamW-influence, exact Hessian + exact push (every step, all coordinates)
AdamW-influence (empirical Fisher), `push="exact", exact_steps=2`
    | r AdamW-influence + exact push, exact_steps=2 (every step, all coordinates)
AdamW-influence, `ExactHessian`, `push="exact", exact_steps=2`
    | r AdamW-influence, exact Hessian + exact push, exact_steps=2 (every step, all coordinates)
AdamW-influence, `ExactHessian`, `push="exact", exact_steps=4`
    | r AdamW-influence, exact Hessian + exact push, exact_steps=4 (every step, all coordinates)
AdamW-influence, `ExactHessian`, `push="exact", exact_steps=16`
    | r AdamW-influence, exact Hessian + exact push, exact_steps=16 (every step, all coordinates)
reference: exact IF (explicit Hessian, float64) | qr Exact IF (explicit Hessian)
reference: exact unrolled influence (per-step Hessians, float64)
    | qr Exact unrolled influence (explicit per-step Hessians)
peer: dattri 0.3.0 TRAK, 5 half-data models | q dattri 0.3.0: TRAK-5 (half-data models)
peer: kronfluence EK-FAC (its heuristic damping)
    | q kronfluence: EK-FAC (damping=heuristic 0.1 x mean eig)
"""


def _methods() -> list[tuple[str, dict[str, list[str]]]]:
    """:data:`NAMES` as ``[(headline name, {benchmark: [row names]})]``."""
    out: list[tuple[str, dict[str, list[str]]]] = []
    for line in NAMES.strip().replace("\n    |", " |").splitlines():
        name, *fields = line.split(" | ")
        raw: dict[str, list[str]] = {}
        for f in fields:
            benches, row = f.split(" ", 1)
            for b in benches:
                raw.setdefault({"q": "quality", "r": "removal", "t": "tracing"}[b], []).append(row)
        out.append((name, raw))
    return out


METHODS = _methods()


def pick(bench: str, rows: list[dict]) -> dict[str, dict]:
    """Headline name -> the row of ``bench`` (``quality``, ``removal``, ``tracing``) for it."""
    by_key = {
        (f"{r['source']}: {r['method']}" if r.get("source") in PEERS else r["method"]): r
        for r in rows
    }
    out = {}
    for name, raw in METHODS:
        key = next((k for k in raw.get(bench, ()) if k in by_key), None)
        if key is not None:
            out[name] = by_key[key]
    return out


# ---- cells --------------------------------------------------------------------------------
def _clip(text: str, limit: int = 110) -> str:
    """``text`` cut at a word before ``limit`` characters, as a Markdown cell."""
    text = text.strip().rstrip(".")
    if len(text) > limit:
        text = text[: text.rfind(" ", 0, limit)].rstrip(",;:") + " …"
    return text.replace("|", "\\|").replace("\n", " ")


def fmt_ci(stat: dict | None) -> str | None:
    """``{"mean", "lo", "hi"}`` as ``0.195 [0.168, 0.227]`` (``None`` if absent)."""
    if not stat or stat.get("mean") is None:
        return None
    return f"{stat['mean']:.3f} [{stat['lo']:.3f}, {stat['hi']:.3f}]"


def fmt_pm(values: list[float]) -> str:
    """Mean ± the half-width of its normal 95 % interval, as in the tracing report."""
    m, h = mean_ci(values)
    return f"{m:.3f} ± {h:.3f}"


def refusal(row: dict) -> str | None:
    """``refused: <why>`` / ``skipped: <why>`` / ``failed: <why>`` for a row that did not run."""
    if row.get("error"):
        return f"failed: {_clip(row['error'])}"
    if row.get("refused"):  # fact tracing's rows
        return f"refused: {_clip(row['refused'])}"
    if row.get("status", "ok") == "ok":
        return None
    note = (row.get("note") or "").strip()
    if "refused by the library:" in note:
        why = note.split("refused by the library:", 1)[1].strip()
        why = re.sub(r"^\w+Attributor:\s*", "", why).split(". ")[0].split("; ")[0]
        return f"refused: {_clip(why)}"
    why = re.sub(r"^N/A,?\s*", "", note).split("; ")[0]
    return f"skipped: {_clip(why)}" if why else "skipped"


def warning_of(row: dict) -> str | None:
    """The library's warning recorded in a row's note (``warned: Class: message; ...``)."""
    note = row.get("note") or ""
    if not note.startswith("warned:"):
        return None
    msg = re.sub(r"^\w+Attributor:\s*", "", note[len("warned:") :].strip()).split("; ")[0]
    return _clip(msg, 80)


_RECORDING = re.compile(
    r"recording \(shared by the rows on it\):[^;()]*?(\d+) s, peak RSS \+(\d+) MB"
)


def fmt_cost(seconds: float | None, peak_mb: float | None, note: str = "") -> str:
    """``43 s / 1693 MB`` (scoring), plus the shared recordings the note names, if any."""
    t = "not recorded" if seconds is None else "< 0.1 s" if seconds < 0.1 else f"{seconds:.1f} s"
    t = f"{seconds:.0f} s" if seconds is not None and seconds >= 10 else t
    out = f"{t} / {'not recorded' if peak_mb is None else f'{peak_mb:.0f} MB'}"
    recs = _RECORDING.findall(note or "")
    if recs:
        out += " + recording " + " + ".join(f"{s} s / {mb} MB" for s, mb in recs)
    return out


def metric_cell(row: dict | None, stat: Callable[[dict], str | None]) -> str:
    """One metric of one benchmark row: the value, why it is missing, or ``not run``."""
    if row is None:
        return "not run"
    return refusal(row) or stat(row) or "not scored"


def cost_cell(row: dict | None, rows: list[dict]) -> str:
    """A row's scoring cost; a peer row's share of one subprocess timed on another row."""
    if row is None:
        return "not run"
    if refusal(row):
        return "—"
    src = row.get("source")
    whole = [
        r for r in rows if r.get("source") == src and "whole subprocess" in (r.get("note") or "")
    ]
    if whole and whole[0] is not row:  # a peer timed once for all its rows
        return f"in the {src} subprocess's {whole[0]['seconds']:.0f} s (all its rows)"
    return fmt_cost(row.get("seconds"), row.get("peak_mb"), row.get("note", ""))


# ---- sources ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """A headline table: which result files describe it."""

    title: str
    quality: str | None = None  # quality_<quality>[-quick].json
    removal: str | None = None  # removal_<removal>[-quick].json
    tracing: str | None = None  # <tracing>[-quick].json
    lds_variants: tuple[tuple[str, str], ...] = (("default", "half-data LDS"),)


#: char-GPT's committed results hold two LDS ground truths: independent seeds and CRN.
CHARGPT_LDS = (("independent", "half-data LDS, independent seeds"), ("crn", "half-data LDS, CRN"))
SETTINGS = (
    Setting("GPT-2 fine-tuning (AdamW)", quality="gpt2", removal="gpt2"),
    Setting("digits-LR (SGD)", quality="digits-lr", removal="digits-lr"),
    Setting("digits-MLP (SGD)", quality="digits-mlp", removal="digits-mlp"),
    Setting(
        "char-GPT on Shakespeare (AdamW, trained from scratch)", "char-gpt", None, None, CHARGPT_LDS
    ),
    Setting("fact tracing (AdamW, tiny GPT-2 trained on planted facts)", tracing="tracing"),
)

#: tracing.json holds no command (written before it did): the documented ones.
TRACING_COMMAND = (
    "`python -m experiments.benchmark.tracing.run --seeds S --tag sS` (S = 0, 1, 2) and "
    '`--seeds S --tag mix-sS --rows "EK-FAC unit mix=0.5"`, merged with `--combine`'
)


def _load(stem: str | None, results: Path) -> tuple[dict, dict | None, dict | None] | None:
    """(the file a table reads: full if present, else quick; full; quick), or ``None``."""
    if not stem:
        return None
    full, quick = (
        json.loads(p.read_text()) if p.exists() else None
        for p in (results / f"{stem}.json", results / f"{stem}-quick.json")
    )
    return None if full is None and quick is None else (full or quick, full, quick)


def _commands(result: dict) -> str:
    cmds = result.get("commands") or [result.get("command", "")]
    cmds = [re.sub(r"^OMP_NUM_THREADS=1 ", "", c) for c in cmds if c]
    extra = f" + {len(cmds) - 1} more command(s) (the JSON's `commands`)" if len(cmds) > 1 else ""
    return f"`{cmds[0]}`{extra}" if cmds else "command not recorded"


def _gap(full: dict, quick: dict) -> str:
    """Range of the full protocol's half-data LDS minus the quick one's, over shared rows."""
    lds = {(r.get("source"), r["method"]): (r.get("lds") or {}).get("mean") for r in full["rows"]}
    gaps = [
        lds[k] - m
        for r in quick["rows"]
        if (m := (r.get("lds") or {}).get("mean")) is not None
        and lds.get(k := (r.get("source"), r["method"])) is not None
    ]
    return f"{min(gaps):+.3f} to {max(gaps):+.3f}" if gaps else "no shared row"


def _quality_protocol(q: dict) -> str:
    p = q["protocol"]
    loo, masked = len(p.get("loo_indices") or ()), len(p.get("trajectory_loo_indices") or ())
    parts = [f"{p['num_subsets']} half-data subsets x {p['runs']} runs"]
    parts += [f"LOO of {loo} samples"] * bool(loo)
    parts += [f"{masked} masked samples (trajectory LOO)"] * bool(masked)
    return ", ".join(parts)


def _protocol(stem: str, full: dict | None) -> str:
    kind = "full" if full else "quick"
    return f"`results/{stem}{'' if full else '-quick'}.json`, **{kind} protocol**"


# ---- one setting --------------------------------------------------------------------------
@dataclass
class Part:
    """What one benchmark's result file contributes to a setting's table."""

    rows: dict[str, dict]  # headline name -> the benchmark's row
    columns: list[tuple[str, Callable[[str], str]]] = field(default_factory=list)
    header: list[str] = field(default_factory=list)
    footnotes: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # metrics this setting's file lacks


def quality_part(s: Setting, results: Path) -> Part | None:
    """Half-data LDS (per ground-truth variant), dattri's LOO and the trajectory LOO."""
    found = _load(s.quality and f"quality_{s.quality}", results)
    if found is None:
        return None
    main, q_full, q_quick = found
    rows = pick("quality", main["rows"])
    extra = pick("quality", q_quick["rows"]) if q_full and q_quick else {}
    extra = {n: r for n, r in extra.items() if n not in rows}  # quick-only rows, marked (q)
    part = Part({**rows, **extra})

    def cell(stat: Callable[[dict], str | None], truth: str) -> Callable[[str], str]:
        def fn(name: str) -> str:
            if name == GROUND_TRUTH:
                return truth
            if name in extra:
                return metric_cell(extra[name], stat) + " (q)"
            return metric_cell(rows.get(name), stat)

        return fn

    rel = main.get("reliability_variants") or {"default": main.get("reliability")}
    for variant, label in s.lds_variants if len(rel) > 1 else (("default", "half-data LDS"),):

        def lds(r: dict, v: str = variant) -> str | None:
            return fmt_ci((r.get("lds_variants") or {}).get(v) or r.get("lds"))

        part.columns.append((label, cell(lds, fmt_ci(rel.get(variant)) or "not measured")))
    for key, label, missing in (
        ("loo", "LOO (dattri's)", "dattri's LOO"),
        ("tsloo", "trajectory LOO", "trajectory LOO"),
    ):
        gt = "loo_ground_truth" if key == "loo" else "trajectory_loo_ground_truth"
        if main.get(gt):
            part.columns.append((label, cell(lambda r, k=key: fmt_ci(r.get(k)), "—")))
        else:
            part.missing.append(missing)

    def cost(name: str) -> str:
        if name == GROUND_TRUTH:
            return "—"
        if name in extra:
            return cost_cell(extra[name], q_quick["rows"]) + " (q)"
        return cost_cell(rows.get(name), main["rows"])

    part.columns.append(("time / peak RSS (LDS, LOO scoring)", cost))
    part.header.append(
        f"- *half-data LDS, LOO, trajectory LOO*: {_protocol(f'quality_{s.quality}', q_full)} "
        f"({_quality_protocol(main)}); {_commands(main)}."
    )
    if extra:
        quick_rows = pick("quality", q_quick["rows"])
        refs = "; ".join(
            f"{n} {metric_cell(quick_rows[n], lambda r: fmt_ci(r.get('lds')))}"
            for n in ("Grad-Dot", "EK-FAC (default damping)")
            if n in quick_rows
        )
        part.footnotes.append(
            f"(q): run on the quick protocol only (`results/quality_{s.quality}-quick.json`, "
            f"{_quality_protocol(q_quick)}; {_commands(q_quick)}): compare them with the quick "
            f"values of the same baselines, {refs} (full minus quick half-data LDS on the rows "
            f"run on both: {_gap(q_full, q_quick)})."
        )
    return part


def removal_part(s: Setting, results: Path) -> Part | None:
    """LDS at each removal fraction against run 0 (the attributed run)."""
    found = _load(s.removal and f"removal_{s.removal}", results)
    if found is None:
        return None
    main, r_full, _ = found
    rows = pick("removal", main["rows"])
    part = Part(rows)
    for pct in FRACTIONS:

        def fn(name: str, pct: str = f"{pct} %") -> str:
            if name == GROUND_TRUTH:
                gt = (main.get("truth") or {}).get(pct) or {}
                return fmt_ci(gt.get("reliability")) or "not measured"
            return metric_cell(rows.get(name), lambda r: fmt_ci((r.get("lds_run0") or {}).get(pct)))

        part.columns.append((f"LDS {pct} %", fn))

    def cost(name: str) -> str:
        return "—" if name == GROUND_TRUTH else cost_cell(rows.get(name), main["rows"])

    part.columns.append(("time / peak RSS (removal scoring)", cost))
    p, n = main["protocol"], main["protocol"]["num_subsets"]
    subsets = f"{n} per fraction"
    if isinstance(n, dict):
        pcts = sorted(n, key=float)
        subsets = f"{' / '.join(str(n[k]) for k in pcts)} at {' / '.join(pcts)} %"
    part.header.append(
        f"- *LDS at 1 / 5 / 10 / 50 %*: {_protocol(f'removal_{s.removal}', r_full)} (subsets: "
        f"{subsets}; {p['runs']} common-random-number runs, {p.get('test_limit') or 'all'} test "
        "queries; LDS against run 0, the attributed run); measured with "
        "`experiments/benchmark/quality/removal.py` at commit 0a80d14."
    )
    return part


def tracing_part(s: Setting, results: Path) -> Part | None:
    """recall@10, MRR and causal drop, pooled over seeds x facts, and the scoring cost."""
    found = _load(s.tracing, results)
    if found is None:
        return None
    result, t_full, _ = found
    seeds = result["seeds"]
    present = list(dict.fromkeys(k for sd in seeds for k in sd["rows"]))
    notes = {r: v["note"] for sd in reversed(seeds) for r, v in sd["rows"].items() if "note" in v}
    part = Part(pick("tracing", [{"method": r, "note": notes.get(r)} for r in present]))

    def per_seed(name: str) -> list[dict] | None:
        if name not in part.rows:
            return None
        raw = part.rows[name]["method"]
        return [sd["rows"][raw] for sd in seeds if raw in sd["rows"]]

    def metric(key: str) -> Callable[[str], str]:
        def fn(name: str) -> str:
            parts = per_seed(name)
            if parts is None:
                return "not run"
            why = next((w for w in map(refusal, parts) if w), None)
            values = [v for p in parts for v in p.get(key, [])]
            return why or (fmt_pm(values) if values else "—")

        return fn

    def cost(name: str) -> str:
        parts = per_seed(name)
        if parts is None:
            return "not run"
        secs = [p["score_s"] for p in parts if "score_s" in p]
        peaks = [p["peak_mb"] for p in parts if p.get("peak_mb") is not None]
        if not secs:
            return "—"
        return fmt_cost(sum(secs) / len(secs), max(peaks) if peaks else None)

    part.columns += [
        ("recall@10", metric("recall@10")),
        ("MRR", metric("mrr")),
        ("causal drop (nats)", metric("causal_drop")),
        ("time / peak RSS (tracing scoring)", cost),
    ]
    cfg = result["config"]
    command = _commands(result) if result.get("command") or result.get("commands") else None
    part.header.append(
        f"- *recall@10, MRR, causal drop*: {_protocol(s.tracing, t_full)} ({len(cfg['seeds'])} "
        f"seeds x {cfg['n_facts']} facts, {cfg['n_docs']} documents; mean ± 95 % over seeds x "
        f"facts; time = mean over seeds, peak = max); {command or TRACING_COMMAND}."
    )
    return part


def setting_table(s: Setting, results: Path = RESULTS) -> str:
    """The headline table of one setting, with the sources of its columns, as Markdown."""
    removal, quality, tracing = (f(s, results) for f in (removal_part, quality_part, tracing_part))
    parts = [p for p in (removal, quality, tracing) if p is not None]
    lines = [f"### {s.title}", ""]
    if not parts:
        return "\n".join(lines + ["No result file for this setting.", ""])
    columns = [c for p in parts for c in p.columns]
    warned: dict[str, str] = {}
    for p in parts:
        warned.update({n: w for n, r in p.rows.items() if (w := warning_of(r))})
    lines += [h for p in parts for h in p.header]
    missing = [m for p in parts for m in p.missing]
    if tracing is None:
        if removal is None:
            missing.append("LDS by removal fraction")
        missing.append("fact tracing (its own setting, the last table)")
        truth = "ground truth: split-run reliability (run 0 vs run 1 of the same subsets)"
    else:
        missing.append("LDS and LOO (a retrieval setting: one retraining per method, no subsets)")
        truth = "ground truth: retrained without the planted carriers"
    lines.append(f"- Not measured on this setting: {'; '.join(missing)}.")
    rows = []
    for name, _ in METHODS:
        if name == GROUND_TRUTH or any(name in p.rows for p in parts):
            label = truth if name == GROUND_TRUTH else name
            if name in warned:
                label += f" — warned: {warned[name]}"
            rows.append([label] + [fn(name) for _, fn in columns])
    table = md_table(["method"] + [c for c, _ in columns], rows)
    notes = [f for p in parts for f in p.footnotes]
    return "\n".join(lines + ["", table] + notes + ([""] if notes else []))


def headline(results: Path = RESULTS) -> str:
    """Every setting's table, in :data:`SETTINGS` order."""
    intro = (
        "Generated by `python experiments/benchmark/headline.py --write` from the result files "
        "below (no retraining). Cells: value [95 % interval] (mean ± 95 % on tracing); "
        "`not run`: the benchmark has no such row on this setting; `refused` / `skipped`: the "
        "benchmark ran it and the library (or the machine) declined, with the reason. Time / "
        "peak RSS: the row's scoring wall time and resident-set high-water mark above the "
        "process's before it, on the shared 2-core machine (load 1-16: times move by up to "
        "~3x); `+ recording`: the trajectory methods' shared re-run of training under the "
        "hooks, not in the row's own time."
    )
    body = [intro, ""] + [setting_table(s, results) for s in SETTINGS]
    return "\n".join(body).rstrip() + "\n\n"  # a blank line before the end marker


def write_section(doc: Path, text: str) -> None:
    """Replace what lies between the ``headline`` markers of ``doc`` with ``text``."""
    content = doc.read_text()
    b, e = content.find(BEGIN), content.find(END)
    if content.count(BEGIN) != 1 or content.count(END) != 1 or b > e:
        raise SystemExit(f"{doc}: expected one '{BEGIN}' followed by one '{END}'.")
    doc.write_text(f"{content[:b]}{BEGIN}\n{text}{content[e:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the marked section of {DOC}")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the result JSONs")
    ns = parser.parse_args(argv)
    text = headline(ns.results)
    if ns.write:
        write_section(DOC, text)
        print(f"wrote the headline section of {DOC}")
    else:
        print(text)


if __name__ == "__main__":
    main()
