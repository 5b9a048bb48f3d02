"""The explorer benchmark's quick mode runs end to end on tiny sizes and writes its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("uvicorn")

BENCH = Path(__file__).resolve().parents[2] / "benchmark"


def test_quick_run_writes_json_and_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the script imports its sibling utils/
    monkeypatch.setattr(sys, "argv", ["serve.py"])
    from experiments.benchmark import serve

    res = serve.main(
        [
            "--quick",
            "--docs",
            "12",
            "--synthetic",
            "40",
            "--queries",
            "2",
            "--requests",
            "1",
            "--big-queries",
            "2",
            "--capture-repeats",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    saved = json.loads((tmp_path / "serve-quick.json").read_text())
    assert saved["capture"]["samples"] == 12
    assert saved["capture"]["cli_over_hand"] > 0
    stores = {"real 12", "synthetic 40", "synthetic 40 + flat index"}
    assert set(res["explorer"]) == stores
    for parts in res["explorer"].values():
        for s in parts.values():
            assert s["n"] == 2 and 0 < s["p50_ms"] <= s["p95_ms"]
    assert set(res["http"]) == stores
    assert {c: s["n"] for c, s in res["http"]["real 12"].items()} == {"1": 1, "4": 4}
    table = (tmp_path / "serve-quick.md").read_text()
    assert "| synthetic 40 + flat index | scoring |" in table
    assert "`dattri-llm capture` / hand-written loop" in table


def test_percentile_nearest_rank():
    from experiments.benchmark import serve

    xs = [float(i) for i in range(1, 21)]  # 1..20
    assert serve.pct(xs, 50) == 10.0
    assert serve.pct(xs, 95) == 19.0
    assert serve.pct([3.0], 95) == 3.0
