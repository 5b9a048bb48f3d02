"""The HTML report's proponent / opponent lists, read back without a browser.

The page is parsed with the standard library's ``html.parser``; each query section's rows
(rank, score, full id from the ``title``) must equal the top-k written out here from the score
matrix: rows of one training sample summed over the steps it was seen at, sorted by hand.
``test_report_browser.py`` checks the rendering (and needs Chromium); this checks the
content everywhere.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.views.report import SampleText, write_report


class _Lists(HTMLParser):
    """``{query index: {"proponents": [(rank, score text, id)], "opponents": [...]}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.queries: dict[int, dict[str, list[tuple[int, str, str]]]] = {}
        self._query: int | None = None
        self._kind: str | None = None
        self._row: list[str] | None = None
        self._cell: str | None = None
        self._id: str | None = None
        self._in_h3 = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "section" and a.get("class") == "query":
            self._query = int(a["id"].removeprefix("q"))
            self.queries[self._query] = {"proponents": [], "opponents": []}
        elif tag == "h3" and self._query is not None:
            self._in_h3 = True
        elif tag == "tr" and self._kind is not None:
            self._row, self._id = [], None
        elif tag == "td" and self._row is not None:
            cls = a.get("class") or ""
            self._cell = cls.split()[0] if cls else "text"
            if cls == "id":
                self._id = a.get("title")
            self._row.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "h3":
            self._in_h3 = False
        elif tag == "td":
            self._cell = None
        elif tag == "tr" and self._row is not None and self._row:
            rank, num = int(self._row[0]), self._row[1].strip()
            self.queries[self._query][self._kind].append((rank, num, self._id))
            self._row = None
        elif tag == "section":
            self._query, self._kind = None, None

    def handle_data(self, data: str) -> None:
        if self._in_h3 and data.strip() in ("Proponents", "Opponents"):
            self._kind = data.strip().lower()
        elif self._row is not None and self._cell in ("rank", "num"):
            self._row[-1] += data


def _brute_force_top(
    scores: torch.Tensor, train: list[str], q: int, k: int
) -> tuple[list[str], list[str]]:
    totals: dict[str, float] = {}
    for i, h in enumerate(train):
        totals[h] = totals.get(h, 0.0) + float(scores[i, q])
    order = sorted(totals, key=lambda h: totals[h])
    return order[::-1][:k], order[:k]


@pytest.mark.parametrize("k", [1, 4, 20])
def test_report_lists_are_each_querys_top_k(tmp_path: Path, k: int) -> None:
    g = torch.Generator().manual_seed(3)
    n_unique, n_test = 9, 5
    train_unique = [f"train-{i:02d}-" + "ab" * 20 for i in range(n_unique)]
    # samples 0-3 seen at both steps: their scores are summed
    train = train_unique + train_unique[:4]
    steps = [0] * n_unique + [1] * 4
    scores = torch.randn(len(train), n_test, generator=g, dtype=torch.float64)
    test = [f"query-{j}-" + "cd" * 20 for j in range(n_test)]
    score = AttributionScore(scores, train, steps, test)
    texts = {h: SampleText(f"text of {h[:8]}") for h in train_unique}
    page = tmp_path / "report.html"
    write_report(page, score, texts, {h: SampleText(h[:7]) for h in test}, k=k)
    parser = _Lists()
    parser.feed(page.read_text(encoding="utf-8"))
    assert sorted(parser.queries) == list(range(n_test))
    kk = min(k, n_unique)
    for q in range(n_test):
        want_pro, want_opp = _brute_force_top(scores, train, q, kk)
        for kind, want in (("proponents", want_pro), ("opponents", want_opp)):
            rows = parser.queries[q][kind]
            assert [r[0] for r in rows] == list(range(1, kk + 1)), (q, kind)
            assert [r[2] for r in rows] == want, (q, kind)
            totals = [
                float(scores[[i for i, t in enumerate(train) if t == h], q].sum()) for h in want
            ]
            assert [r[1] for r in rows] == [f"{v:+.3e}" for v in totals], (q, kind)


# ---- what is shown beside a score is what was scored --------------------------------------------
def test_texts_sharing_an_identity_are_refused_unless_identical(tmp_path: Path) -> None:
    """Two rows with one id showed the last row's text beside the sample's score, silently."""
    import json

    from dattri_llm.attribution.views.report import load_texts

    path = tmp_path / "texts.jsonl"
    rows = [{"id": "h1", "text": "one"}, {"id": "h2", "text": "two"}, {"id": "h1", "text": "uno"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 3 has the identity 'h1' of line 1 with a diff"):
        load_texts(path)
    # a sample that occurs twice in its dataset, written twice: one text, read once
    rows[2]["text"] = "one"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    assert {h: t.text for h, t in load_texts(path).items()} == {"h1": "one", "h2": "two"}


def _spans(html: str) -> list[tuple[str, float]]:
    """``(token, score)`` of each token span of a report, in order."""
    import re

    out = []
    for score, text in re.findall(r'data-score="([^"]+)"[^>]*>([^<]*)</span>', html):
        out.append((text, float(score)))
    return out


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_heatmap_pairs_each_token_with_its_own_position(side: str) -> None:
    """Three tokens scored in a batch padded to five positions: with left padding the old
    report cut the positions to the first three (two of them padding) and showed the tokens
    beside the wrong scores."""
    from dattri_llm.attribution.views.report import html_report

    own = torch.tensor([[1.0], [-2.0], [3.0]], dtype=torch.float64)
    pad = torch.zeros(2, 1, dtype=torch.float64)
    tok = torch.cat([own, pad] if side == "right" else [pad, own])
    score = AttributionScore(own.sum(0, keepdim=True), ["a"], [0], ["q"], token_scores=[tok])
    texts = {"a": SampleText("x y z", tokens=["x", "y", "z"])}
    html = html_report(score, texts, k=1, token_k=1)
    # the one sample is both the proponent and the opponent list: one heatmap in each
    assert _spans(html) == [("x", 1.0), ("y", -2.0), ("z", 3.0)] * 2
    # a token list that cannot be placed (longer than the positions) is not cut: a note says why
    texts = {"a": SampleText("u v w x y z", tokens=list("uvwxyz"))}
    html = html_report(score, texts, k=1, token_k=1)
    assert not _spans(html) and "token scores not shown: tokens has 6 entries" in html


def test_report_shows_repeats_leaks_and_the_runs_warnings(tmp_path: Path) -> None:
    """Repeats under one label are named with their steps; a leak is flagged; warnings shown."""
    from dattri_llm.attribution.views.report import html_report

    # "rep" four times under checkpoint 0 (epochs); "copy" is the query's text with other
    # spacing (another hash); "q" also occurs in training under its own hash
    train = ["rep", "rep", "rep", "rep", "copy", "q", "other"]
    steps = [0, 1, 2, 3, 0, 0, 0]
    scores = torch.tensor([[0.9], [0.8], [0.95], [0.85], [0.5], [0.4], [-0.2]], dtype=torch.float64)
    score = AttributionScore(scores, train, steps, ["q"], repeats="mean")
    score.warnings = ['the run warned <script>alert("x")</script>']
    texts = {"copy": SampleText("the  cat is\na pet"), "other": SampleText("the cat is a dog")}
    page = html_report(
        score,
        texts,
        {"q": SampleText("the cat is a pet")},
        k=2,  # proponents rep, copy; opponents other, q
        settings={"method": "grad-cos", "warnings": ["a warning of the run file"]},
    )
    assert "seen 4x under checkpoint 0 (steps 0, 1, 2, 3)" in page
    assert page.count("leak: identical to the query") == 2  # "copy" by text, "q" by hash
    section = page[page.index('<section class="query"') :]
    rows = section.split("<tr>")[1:]
    flagged = [r for r in rows if "leak: identical" in r]
    assert all('title="copy"' in r or 'title="q"' in r for r in flagged)
    assert not any("leak" in r for r in rows if 'title="other"' in r)
    assert "Warnings of the scoring run (2)" in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page and "<script" not in page
    assert "a warning of the run file" in page
    assert "combined by their mean (repeats='mean')" in page
    assert "1 training samples occur several times under one checkpoint label (up to 4x)" in page
    # the mean of the repeats, not their sum, is the score shown
    assert f"{scores[:4].mean().item():+.3e}" in page
