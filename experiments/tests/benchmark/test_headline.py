"""Headline quality table: method-name normalization and cell formatting on synthetic results."""

from __future__ import annotations

import json

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
SGD = "refused: the run was trained with SGD"


def ci(m: float) -> dict:
    return {"mean": m, "lo": m - 0.1, "hi": m + 0.1}


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
    assert hl.refusal({"status": "skipped", "note": REFUSED}) == SGD
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


def _table(folder, setting, **files) -> tuple[str, dict[str, list[str]]]:
    for name, data in files.items():
        (folder / f"{name.replace('_quick', '-quick')}.json").write_text(json.dumps(data))
    text = hl.setting_table(setting, folder)
    assert hl.setting_table(setting, folder) == text  # deterministic
    lines = [ln.strip("|").split(" | ") for ln in text.splitlines() if ln.startswith("| ")]
    return text, {c[0].strip(): [x.strip() for x in c] for c in lines}


def test_setting_table_on_synthetic_results(tmp_path):
    full = {
        "protocol": {"num_subsets": 50, "runs": 2, "trajectory_loo_indices": [0, 20]},
        "reliability": ci(0.78),
        "trajectory_loo_ground_truth": {"kind": "masked"},
        "commands": ["OMP_NUM_THREADS=1 python -m q --setting s", "python -m q --update"],
        "rows": [
            row("Random", "reference", lds=ci(0.0), tsloo=ci(0.01), seconds=0.5, peak_mb=1.0),
            row("Grad-Dot", lds=ci(0.2), tsloo=ci(0.17), seconds=42.7, peak_mb=1692.7),
            row("AdamW-influence", status="skipped", seconds=0.0, note=REFUSED),
        ],
    }
    quick = dict(full, protocol={"num_subsets": 10, "runs": 2}, commands=["python -m q --quick"])
    quick["rows"] = [
        row("Grad-Dot", lds=ci(0.14)),
        row("Grad-Dot mask-2048 + second moment", lds=ci(0.48), tsloo=ci(0.28), seconds=16.0,
            peak_mb=1110.0, note=RECORDING),
    ]  # fmt: skip
    fracs = [f"{p} %" for p in hl.FRACTIONS]
    removal = {
        "protocol": {"num_subsets": {"1": 8}, "runs": 2, "test_limit": 20},
        "truth": {p: {"reliability": ci(0.65)} for p in fracs},
        "rows": [
            row("Grad-Dot", seconds=25.0, peak_mb=798.0, note="",
                lds_run0={p: ci(int(p[:-2]) / 100) for p in fracs},
                lds={p: ci(-int(p[:-2]) / 100) for p in fracs}),
            row("AdamW-influence", status="skipped", seconds=0.0, note=REFUSED),
        ],
    }  # fmt: skip
    setting = hl.Setting("s", "synthetic", quality="s", removal="s")
    text, rows = _table(
        tmp_path, setting, quality_s=full, quality_s_quick=quick, removal_s_quick=removal
    )
    assert rows["method"][1:] == [
        "LDS 1 %", "LDS 5 %", "LDS 10 %", "LDS 50 %", "time / peak RSS (removal scoring)",
        "half-data LDS", "trajectory LOO", "time / peak RSS (LDS, LOO scoring)",
    ]  # fmt: skip
    grad = rows["Grad-Dot"]
    assert grad[1] == "0.010 [-0.090, 0.110]"  # against run 0, not the mean
    assert grad[4:7] == ["0.500 [0.400, 0.600]", "25 s / 798 MB", "0.200 [0.100, 0.300]"]
    assert grad[8] == "43 s / 1693 MB"  # the full protocol wins over the quick one
    adamw = rows["AdamW-influence (empirical Fisher)"]
    assert adamw[1:] == [SGD] * 4 + ["—", SGD, SGD, "—"]
    sm = rows["Grad-Dot mask-2048 + second moment"]
    assert sm[1:] == ["not run"] * 5 + [
        "0.480 [0.380, 0.580] (q)",
        "0.280 [0.180, 0.380] (q)",
        "16 s / 1110 MB + recording 93 s / 194 MB (q)",
    ]
    truth = rows[next(k for k in rows if k.startswith("ground truth"))]
    assert truth[1] == "0.650 [0.550, 0.750]" and truth[6] == "0.780 [0.680, 0.880]"
    assert "Random" in rows and "Grad-Cos" not in rows  # only rows some benchmark has
    assert "- Not measured on this setting: dattri's LOO; fact tracing" in text
    assert "(q): run on the quick protocol only" in text and "baselines, Grad-Dot 0.140" in text
    assert "run on both: +0.060 to +0.060" in text
    assert "`python -m q --setting s` + 1 more command(s)" in text


def test_tracing_cells_and_missing_memory(tmp_path):
    seed = {
        "rows": {
            "random": {"score_s": 0.001, "recall@10": [0.0, 1.0], "mrr": [0.5, 0.5],
                       "causal_drop": [1.0, 3.0]},
            "EK-FAC": {"score_s": 4.0, "peak_mb": 120.0, "recall@10": [1.0, 1.0],
                       "mrr": [1.0, 1.0], "causal_drop": [2.0, 2.0]},
            "carriers (ground truth)": {"causal_drop": [4.0, 4.0]},
        }
    }  # fmt: skip
    result = {"config": {"seeds": [0], "n_facts": 2, "n_docs": 8}, "seeds": [seed]}
    text, rows = _table(tmp_path, hl.Setting("t", "tracing", tracing="tracing"), tracing=result)
    assert rows["Random"][1:] == [
        "0.500 ± 0.980", "0.500 ± 0.000", "2.000 ± 1.960", "< 0.1 s / not recorded"
    ]  # fmt: skip
    assert rows["EK-FAC (default damping)"][1:] == ["1.000 ± 0.000"] * 2 + [
        "2.000 ± 0.000",
        "4.0 s / 120 MB",
    ]
    truth = rows["ground truth: retrained without the planted carriers"]
    assert truth[1:] == ["—", "—", "4.000 ± 0.000", "—"]
    assert "tracing.run --seeds S --tag sS" in text  # no command in the JSON: the documented one


def test_write_section(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text(f"top\n{hl.BEGIN}\nold\n{hl.END}\nbottom\n")
    hl.write_section(doc, "new\n")
    assert doc.read_text() == f"top\n{hl.BEGIN}\nnew\n{hl.END}\nbottom\n"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="headline:begin"):
        hl.write_section(doc, "new\n")
