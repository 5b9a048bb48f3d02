"""A self-contained HTML report of an :class:`AttributionScore`: who helped each query.

One HTML file, no scripts, no network, no external assets (a Content-Security-Policy forbids
them): a summary (method, stores, settings, an inline SVG histogram of every score), then one
section per query with its text and its top-k proponents and opponents, their scores and their
texts, how often a sample repeated under one checkpoint label and a flag on a training sample
identical to the query (:mod:`~dattri_llm.attribution.views.notes`), and the scoring run's
warnings; long texts are folded (``<details>``), and when the scores hold token-level scores the
train samples' tokens are coloured by :mod:`~dattri_llm.attribution.views.token_view`. Every text is
HTML-escaped: training data is untrusted, and a ``<script>`` in a sample shows as text.

Texts are matched to the scores' sample identities with :func:`load_texts` (JSON Lines).

Example:
    ```python
    train = load_texts("train.jsonl")
    write_report("report.html", score, train, load_texts("test.jsonl"), k=10)
    ```
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.views.notes import Occurrences, leak, occurrence_notes, run_warnings
from dattri_llm.attribution.views.token_view import POSITIVE_RGB, html_tokens, token_window
from dattri_llm.utils.files import atomic_write
from dattri_llm.utils.hashing import hash_sample

__all__ = ["SampleText", "load_texts", "html_report", "write_report", "svg_histogram"]

#: Fields of a texts row that are not shown as labels.
_RESERVED = ("id", "text", "tokens")


@dataclass
class SampleText:
    """What a report shows of one sample.

    Attributes:
        text: The sample's text.
        tokens: The text of each token position (for token heatmaps), if known.
        labels: Other scalar fields of its row (e.g. ``{"topic": "import"}``).
    """

    text: str
    tokens: list[str] | None = None
    labels: dict[str, Any] = field(default_factory=dict)


def _row_identity(row: Mapping[str, Any], where: str) -> str:
    """The sample identity of a texts row: its ``id``, or the content hash of its token ids."""
    if "id" in row:
        if not isinstance(row["id"], str) or not row["id"]:
            raise ValueError(f"{where}: 'id' must be a non-empty string, got {row['id']!r}.")
        return row["id"]
    fields = {
        k: torch.tensor(v, dtype=torch.long)
        for k, v in row.items()
        if isinstance(v, list) and v and all(type(x) is int for x in v)
    }
    if not fields:
        raise ValueError(
            f"{where} has neither an 'id' (the sample's hash, dattri_llm.hash_sample(sample)) "
            "nor integer token fields such as 'input_ids' to hash: give one of them."
        )
    return hash_sample(fields)


def load_texts(path: str | os.PathLike) -> dict[str, SampleText]:
    """Read a JSON Lines file of sample texts, keyed by sample identity.

    Each line is an object with ``"text"`` and either ``"id"`` (the sample's hash, as
    :func:`~dattri_llm.hash_sample` gives it and the stores keep it) or the sample's integer
    token fields (e.g. ``"input_ids": [...]``), hashed like a capture hashes the sample
    (``input_ids`` when present, else every integer field). Optional: ``"tokens"`` (one string
    per token position, for token heatmaps) and any scalar fields (shown as labels).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: naming the line that is not valid JSON or lacks what is needed, or two
            lines that share an identity with different texts (identical repeats, a sample
            that occurs twice in a dataset, are read once).
    """
    path = os.fspath(path)
    out: dict[str, SampleText] = {}
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where} is not valid JSON ({e.msg}).") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}.")
            text = row.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"{where}: 'text' must be a string.")
            tokens = row.get("tokens")
            if tokens is not None and (
                not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens)
            ):
                raise ValueError(f"{where}: 'tokens' must be a list of strings.")
            labels = {
                k: v
                for k, v in row.items()
                if k not in _RESERVED and isinstance(v, (str, int, float, bool))
            }
            identity = _row_identity(row, where)
            sample = SampleText(text, tokens, labels)
            if identity in out and out[identity] != sample:
                # one identity, two texts: whichever was shown would sit beside the other's score
                raise ValueError(
                    f"{where} has the identity {identity!r} of line {first_line[identity]} with "
                    "a different text, tokens or labels; a score belongs to one sample. Remove "
                    "one of the two lines (identical repeats of a sample are fine)."
                )
            first_line.setdefault(identity, lineno)
            out[identity] = sample
    return out


# ---- pieces ------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return f"{x:+.3e}"


def svg_histogram(values: torch.Tensor, bins: int = 40, width: int = 560, height: int = 140) -> str:
    """An inline SVG histogram of ``values`` (non-finite values are counted apart)."""
    v = values.detach().reshape(-1).double().cpu()
    finite = v[torch.isfinite(v)]
    esc = html.escape
    if finite.numel() == 0:
        return '<p class="note">no finite scores to plot.</p>'
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts = torch.histc(finite, bins=bins, min=lo, max=hi).tolist()
    top = max(counts) or 1.0
    pad_l, plot_h = 8, height - 36
    bw = (width - 2 * pad_l) / bins
    bars = []
    for i, c in enumerate(counts):
        h = plot_h * c / top
        x0 = lo + (hi - lo) * i / bins
        x1 = lo + (hi - lo) * (i + 1) / bins
        bars.append(
            f'<rect x="{pad_l + i * bw:.1f}" y="{8 + plot_h - h:.1f}" width="{max(bw - 1, 1):.1f}"'
            f' height="{h:.1f}"><title>{esc(f"[{x0:.3g}, {x1:.3g}): {int(c)}")}</title></rect>'
        )
    zero = ""
    if lo < 0 < hi:
        zx = pad_l + (width - 2 * pad_l) * (0 - lo) / (hi - lo)
        zero = f'<line x1="{zx:.1f}" x2="{zx:.1f}" y1="4" y2="{8 + plot_h}" class="zero"/>'
        if 60 < zx < width - 60:  # the label would overlap an end label otherwise
            zero += f'<text x="{zx:.1f}" y="{height - 4}" text-anchor="middle">0</text>'
    y = height - 4
    bad = v.numel() - finite.numel()
    label = f"{finite.numel()} scores" + (f", {bad} not finite" if bad else "")
    return (
        f'<svg class="hist" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="{esc(label)}"><title>{esc(label)}</title>' + "".join(bars) + zero
        + f'<text x="{pad_l}" y="{y}">{esc(f"{lo:.3g}")}</text>'
        f'<text x="{width - pad_l}" y="{y}" text-anchor="end">{esc(f"{hi:.3g}")}</text>'
        f'<text x="{width - pad_l}" y="12" text-anchor="end">tallest bar: {int(top)}</text>'
        "</svg>"
    )  # fmt: skip


def _folded(text: str, fold_chars: int) -> str:
    esc = html.escape
    if len(text) <= fold_chars:
        return f'<div class="text">{esc(text)}</div>'
    return (
        f'<details class="fold"><summary>{esc(text[:fold_chars])}…</summary>'
        f'<div class="text">{esc(text)}</div></details>'
    )


def _labels(sample: SampleText | None) -> str:
    if sample is None or not sample.labels:
        return ""
    return "".join(
        f'<span class="label">{html.escape(f"{k}: {v}")}</span>' for k, v in sample.labels.items()
    )


def _sample_cell(h: str, sample: SampleText | None, fold_chars: int) -> str:
    if sample is None:
        return f'<span class="missing">no text for sample {html.escape(h[:16])}…</span>'
    return _labels(sample) + _folded(sample.text, fold_chars)


# ---- the page ----------------------------------------------------------------------------------
_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 78em; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin: 0 0 0.4em; }
table { border-collapse: collapse; width: 100%; margin: 0.3em 0 0.8em; }
th, td { text-align: left; vertical-align: top; padding: 0.25em 0.5em;
         border-bottom: 1px solid #e4e4e4; }
th { font-weight: 600; color: #444; font-size: 0.9em; }
td.num { font-family: ui-monospace, monospace; white-space: nowrap; width: 9em; }
td.rank { width: 2.5em; color: #666; } td.id { font-family: ui-monospace, monospace;
          font-size: 0.8em; color: #777; width: 9em; word-break: break-all; }
.summary td:first-child { width: 14em; color: #555; }
section.query { border: 1px solid #ddd; border-radius: 6px; padding: 0.8em 1em; margin: 1.2em 0; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; }
.qtext { background: #f6f6f6; padding: 0.5em; border-radius: 4px; margin-bottom: 0.6em; }
details.fold > summary { cursor: pointer; white-space: pre-wrap; overflow-wrap: anywhere; }
details.fold[open] > summary { color: #888; }
.label { display: inline-block; background: #eef; color: #335; border-radius: 3px;
         font-size: 0.8em; padding: 0 0.4em; margin-right: 0.4em; }
.missing, .note { color: #777; font-size: 0.9em; }
.repeat { display: inline-block; background: #fff3d6; color: #6b4a00; border-radius: 3px;
          font-size: 0.8em; padding: 0 0.4em; margin-right: 0.4em; }
.leak { display: inline-block; background: #b4261e; color: #fff; border-radius: 3px;
        font-size: 0.8em; padding: 0 0.4em; margin-right: 0.4em; font-weight: 600; }
.warnings { border: 1px solid #e0b04a; background: #fffaf0; border-radius: 6px;
            padding: 0.4em 1em; margin: 0.8em 0; }
.pos { color: rgb(0, 120, 56); } .neg { color: rgb(180, 30, 30); }
h3 { font-size: 1em; margin: 0.6em 0 0.1em; }
h2 .qid { font-family: ui-monospace, monospace; font-size: 0.75em; color: #888;
          font-weight: normal; }
nav.index a { display: inline-block; margin: 0 0.5em 0.2em 0; font-size: 0.85em; }
svg.hist rect { fill: rgb__POSITIVE__; } svg.hist text { font-size: 11px; fill: #555; }
svg.hist line.zero { stroke: #222; stroke-dasharray: 3 2; }
.tokens { font-family: ui-monospace, monospace; line-height: 1.8; white-space: pre-wrap;
          border: 1px solid #ddd; padding: 0.4em; border-radius: 4px; font-size: 0.85em; }
.tok { padding: 0.1em 0; border-radius: 2px; }
""".replace("__POSITIVE__", str(POSITIVE_RGB))

#: No scripts, no fetches: only the inline style sheet.
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


def _badges(occ: Occurrences | None, leaked: bool) -> str:
    """The repeat and leak badges of one shown training sample."""
    out = ""
    if leaked:
        out += '<span class="leak">leak: identical to the query</span>'
    if occ is not None and occ.repeated:
        out += f'<span class="repeat">{html.escape(occ.describe())}</span>'
    return out


def _rows(
    kind: str,
    hashes: Sequence[str],
    values: Sequence[float],
    texts: Mapping[str, SampleText],
    fold_chars: int,
    heatmap: Any,
    notes: Mapping[str, Occurrences],
    query: tuple[str, SampleText | None],
) -> str:
    esc = html.escape
    cls = "pos" if kind == "proponents" else "neg"
    body = []
    for r, (h, s) in enumerate(zip(hashes, values), 1):
        sample = texts.get(h)
        badges = _badges(notes.get(h), leak(h, query[0], sample, query[1]))
        cell = badges + _sample_cell(h, sample, fold_chars) + heatmap(h, sample, r)
        body.append(
            f'<tr><td class="rank">{r}</td><td class="num {cls}">{_fmt(s)}</td>'
            f"<td>{cell}</td>"
            f'<td class="id" title="{esc(h)}">{esc(h[:12])}</td></tr>'
        )
    return (
        f'<div><h3 class="{cls}">{"Proponents" if cls == "pos" else "Opponents"}</h3>'
        "<table><thead><tr><th>#</th><th>score</th><th>training sample</th><th>id</th></tr>"
        f"</thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def html_report(
    score: AttributionScore,
    train_texts: Mapping[str, SampleText] | None = None,
    test_texts: Mapping[str, SampleText] | None = None,
    k: int = 10,
    title: str = "Training data attribution",
    settings: Mapping[str, Any] | None = None,
    queries: Sequence[int] | None = None,
    fold_chars: int = 200,
    token_k: int = 3,
) -> str:
    """The report as one HTML string (see the module docstring).

    Args:
        score: The scores (``AttributionScore.load(dir)``).
        train_texts: ``{train hash: SampleText}`` (:func:`load_texts`); missing ones are shown
            by id.
        test_texts: The same for the queries.
        k: Proponents and opponents per query.
        title: Page title (escaped).
        settings: Shown in the summary table (e.g. method, stores, damping); its
            ``"warnings"`` join the score's own in the warnings box.
        queries: Test column indices to show (default: all).
        fold_chars: Texts longer than this are folded.
        token_k: With token scores, heatmaps for the first ``token_k`` proponents and
            opponents of each query (0: none).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    train_texts, test_texts = train_texts or {}, test_texts or {}
    cols = list(range(score.num_test)) if queries is None else [int(q) for q in queries]
    for q in cols:
        if not 0 <= q < score.num_test:
            raise IndexError(f"query {q} out of range: the scores have {score.num_test} queries.")
    ids, matrix = score.agnostic_matrix()
    top = score.top_k(k)
    esc = html.escape
    shown = {h for q in cols for h in top.proponent_hashes[q] + top.opponent_hashes[q]}
    notes = occurrence_notes(score, shown)

    def heatmap_for(j: int) -> Any:
        def make(h: str, sample: SampleText | None, rank: int) -> str:
            if not score.has_token_scores or rank > token_k:
                return ""
            if sample is None or not sample.tokens:
                return '<p class="note">token scores: add "tokens" to this sample\'s row</p>'
            try:
                per = score.token_scores(h)
                window = token_window(sample.tokens, per[1])  # placed by padding, never cut
            except ValueError as e:
                return f'<p class="note">token scores not shown: {esc(str(e))}</p>'
            per = per[1][window, j]
            scale = max(float(per.abs().max()) if per.numel() else 0.0, 0.0)
            return (
                f'<details class="fold"><summary>token view (full colour at |score| = '
                f"{scale:.2e})</summary>{html_tokens(sample.tokens, per, scale)}</details>"
            )

        return make

    sections, index = [], []
    for q in cols:
        h = score.test_hashes[q]
        sample = test_texts.get(h)
        qtext = (
            _labels(sample) + _folded(sample.text, fold_chars * 2)
            if sample is not None
            else f'<span class="missing">no text for query {esc(h[:16])}…</span>'
        )
        heat = heatmap_for(q)
        pro = _rows(
            "proponents",
            top.proponent_hashes[q],
            top.proponent_scores[q].tolist(),
            train_texts,
            fold_chars,
            heat,
            notes,
            (h, sample),
        )
        opp = _rows(
            "opponents",
            top.opponent_hashes[q],
            top.opponent_scores[q].tolist(),
            train_texts,
            fold_chars,
            heat,
            notes,
            (h, sample),
        )
        snippet = sample.text[:40] if sample is not None else h[:12]
        index.append(f'<a href="#q{q}" title="{esc(snippet)}">{q}</a>')
        sections.append(
            f'<section class="query" id="q{q}"><h2>Query {q} '
            f'<span class="qid">{esc(h[:12])}</span></h2>'
            f'<div class="qtext">{qtext}</div><div class="cols">{pro}{opp}</div></section>'
        )

    finite = matrix[torch.isfinite(matrix)]
    counts = score.occurrence_counts()
    repeated = sum(n > 1 for n in counts.values())
    how = "mean" if score.repeats == "mean" else "sum"
    summary = {
        **{key: v for key, v in (settings or {}).items() if key != "warnings"},
        "training samples": len(ids),
        "repeats": (
            f"{repeated} training samples occur several times under one checkpoint label "
            f"(up to {max(counts.values())}x); their rows are combined by their {how}"
            if repeated
            else "none (each training sample once per checkpoint label)"
        ),
        "queries": f"{score.num_test} ({len(cols)} shown)",
        "steps": ", ".join(map(str, score.steps)) if len(score.steps) <= 12 else len(score.steps),
        "token scores": "yes" if score.has_token_scores else "no",
        "score range": (
            f"{_fmt(float(finite.min()))} … {_fmt(float(finite.max()))}" if finite.numel() else "-"
        ),
        "shown per query": f"top {min(k, len(ids))} proponents and opponents",
    }
    rows = "".join(
        f"<tr><td>{esc(str(key))}</td><td>{esc(_setting(v))}</td></tr>"
        for key, v in summary.items()
    )
    warned = run_warnings(score, settings)
    warning_box = (
        f'<div class="warnings"><h3>Warnings of the scoring run ({len(warned)})</h3><ul>'
        + "".join(f'<li class="text">{esc(w)}</li>' for w in warned)
        + "</ul></div>\n"
        if warned
        else ""
    )
    legend = (
        '<p class="note">A <span class="pos">positive</span> score means the training sample '
        "helped the query: training on it lowered the query's loss (removing it would raise "
        'it); a <span class="neg">negative</span> score means it hurt. A sample\'s scores '
        f"under one checkpoint label are combined by their {how} (repeats={score.repeats!r}), "
        "and checkpoint labels are summed. Click a folded text to unfold it.</p>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f'<h1>{esc(title)}</h1>\n<table class="summary"><tbody>{rows}</tbody></table>\n'
        + warning_box
        + f"<h3>Score distribution</h3>\n{svg_histogram(matrix)}\n{legend}\n"
        f'<nav class="index"><strong>Queries:</strong> {"".join(index)}</nav>\n'
        + "\n".join(sections)
        + "\n</body>\n</html>\n"
    )


def _setting(v: Any) -> str:
    if isinstance(v, float) and math.isfinite(v):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(map(str, v))
    return str(v)


def write_report(
    path: str | os.PathLike, score: AttributionScore, *args: Any, **kwargs: Any
) -> str:
    """Write :func:`html_report` to ``path`` (UTF-8, atomically; parent folders created).

    Returns:
        The path written.
    """
    page = html_report(score, *args, **kwargs)
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    atomic_write(path, page)
    return path
