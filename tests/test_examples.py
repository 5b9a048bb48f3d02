"""Every example script runs offline (they assert their own claims)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.py") if not p.name.startswith("_"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_example_runs(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if path.name.startswith("trl_"):
        pytest.importorskip("trl")  # the `trl` extra
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")
