"""Headline quality table: method-name normalization and cell formatting on synthetic results."""

from __future__ import annotations

import pytest

from experiments.benchmark import headline as hl

REFUSED = (
    "N/A, refused by the library: AdamWInfluenceAttributor: the run was trained with SGD; "
    "AdamW-influence models torch.optim.Adam / AdamW. For SGD use DVEmbAttributor."
)
RECORDING = (
    "adjoint sweep; recording (shared by the rows on it): re-run of the reference run under the "
    "hooks, bit-exact, 375 steps, 93 s, peak RSS +194 MB, 2182 MB on disk"
)


def row(method: str, source: str = "dattri_llm", **kw) -> dict:
    return {"method": method, "source": source, "status": "ok", **kw}


def _name(bench: str, method: str, source: str = "dattri_llm") -> str | None:
    return next(iter(hl.pick(bench, [row(method, source)])), None)


def test_names_across_benchmarks():
    assert _name("quality", "EK-FAC (damping=default)") == "EK-FAC (default damping)"
    assert _name("removal", "EK-FAC (damping=default)") == "EK-FAC (default damping)"
    assert _name("tracing", "EK-FAC") == "EK-FAC (default damping)"
    assert _name("tracing", "random") == "Random" == _name("quality", "Random")
    assert _name("quality", "DVEmb (assumes SGD)") == "DVEmb (empirical Fisher)"  # one method
    # a continued line of the name map
    assert _name("tracing", "AdamW-influence (every step)") == "AdamW-influence (empirical Fisher)"
    # a peer shares our row names: only its source tells them apart
    heuristic = "EK-FAC (damping=heuristic 0.1 x mean eig)"
    assert _name("quality", heuristic, "kronfluence").startswith("peer: kronfluence")
    assert _name("quality", heuristic) is None
    assert _name("quality", "Grad-Dot", "dattri 0.3.0") is None
    # not headline rows, and a name of one benchmark is not looked up in another
    assert _name("quality", "EK-FAC (damping=1e-07)") is None
    assert _name("quality", "EK-FAC") is None
    # the first listed name wins
    rows = [row("DVEmb (assumes SGD)", x=2), row("DVEmb (empirical Fisher)", x=1)]
    assert hl.pick("quality", rows)["DVEmb (empirical Fisher)"]["x"] == 1


def test_cells():
    assert hl.fmt_ci({"mean": 0.1954, "lo": 0.16788, "hi": 0.2272}) == "0.195 [0.168, 0.227]"
    assert hl.fmt_ci(None) is None
    assert hl.fmt_pm([1.0, 3.0]) == "2.000 ± 1.960"  # sd √2, n 2
    assert hl.refusal({"status": "skipped", "note": REFUSED}) == (
        "refused: the run was trained with SGD"
    )
    assert hl.refusal({"status": "skipped", "note": "17226 parameters: too large; x"}) == (
        "skipped: 17226 parameters: too large"
    )
    assert hl.refusal({"status": "ok", "note": REFUSED}) is None
    assert hl.refusal({"error": "RuntimeError: a|b"}) == "failed: RuntimeError: a\\|b"
    assert hl.metric_cell(None, lambda r: "x") == "not run"
    assert hl.metric_cell({"status": "ok"}, lambda r: None) == "not scored"
    warned = {"note": "warned: DVEmbAttributor: trained with AdamW, assumes SGD; recording ..."}
    assert hl.warning_of(warned) == "trained with AdamW, assumes SGD"
    assert hl.warning_of({"note": RECORDING}) is None
    assert hl.fmt_cost(42.7, 1692.7) == "43 s / 1693 MB"
    assert hl.fmt_cost(3.61, None) == "3.6 s / not recorded"
    assert hl.fmt_cost(None, None) == "not recorded / not recorded"
    assert hl.fmt_cost(0.02, 1.0) == "< 0.1 s / 1 MB"
    assert hl.fmt_cost(481.0, 486.0, RECORDING) == "481 s / 486 MB + recording 93 s / 194 MB"
    peer = [
        {"source": "kronfluence", "seconds": 42.2, "note": "time = whole subprocess (...)"},
        {"source": "kronfluence", "seconds": 1e-5, "note": ""},
    ]
    assert hl.cost_cell(peer[1], peer) == "in the kronfluence subprocess's 42 s (all its rows)"
    assert hl.cost_cell(peer[0], peer) == "42 s / not recorded"


def test_the_committed_tables_regenerate_from_the_committed_results():
    """Every setting's table (quick-only rows, refusals, warnings, peers, removal and tracing
    columns) as ``headline.md`` holds it, from the committed result files."""
    text = hl.DOC.read_text()
    section = text.split(f"{hl.BEGIN}\n", 1)[1].split(hl.END, 1)[0]
    assert hl.headline(hl.ROOT / "experiments" / "benchmark" / "results") == section
    assert "| AdamW-influence (empirical Fisher) | refused: the run was trained with SGD |" in text


def test_write_section(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text(f"top\n{hl.BEGIN}\nold\n{hl.END}\nbottom\n")
    hl.write_section(doc, "new\n")
    assert doc.read_text() == f"top\n{hl.BEGIN}\nnew\n{hl.END}\nbottom\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="headline:begin"):
        hl.write_section(doc, "new\n")
