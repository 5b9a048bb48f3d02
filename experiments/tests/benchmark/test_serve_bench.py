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

    argv = ["--quick", "--docs", "12", "--sizes", "12,600", "--queries", "2", "--requests", "1"]
    res = serve.main([*argv, "--clients", "1,2", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serve-quick.json").read_text())
    assert [r["samples"] for r in saved["sizes"]] == [12, 600]
    small, large = res["sizes"]
    # index="auto": 12 captured samples are scanned, 600 (> 500) searched through an index
    # that is exact (flat) at this size
    assert (small["samples"], small["search"], small["exact"]) == (12, "store scan", True)
    assert (large["samples"], large["search"], large["exact"]) == (600, "flat index", True)
    for row in (small, large):
        for s in row["explorer"].values():
            assert s["n"] >= 1 and 0 < s["p50_ms"] <= s["p95_ms"]
        assert {c: s["n"] for c, s in row["http"].items()} == {"1": 1, "2": 2}
    table = (tmp_path / "serve-quick.md").read_text()
    assert "| 600 | flat index | yes |" in table


def test_percentile_nearest_rank():
    from experiments.benchmark import serve

    xs = [float(i) for i in range(1, 21)]  # 1..20
    assert serve.pct(xs, 50) == 10.0
    assert serve.pct(xs, 95) == 19.0
    assert serve.pct([3.0], 95) == 3.0
