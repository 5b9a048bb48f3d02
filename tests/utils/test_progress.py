"""Progress bars follow tqdm's convention: by default only on a terminal."""

from __future__ import annotations

import io
import pathlib
import sys

import pytest
import torch

from dattri_llm import AttributionArguments, TracInAttributor
from dattri_llm.gradient.sources import InMemoryGradientSource
from dattri_llm.gradient.streaming import GradientStreamer
from tests.helpers.tracin import dataset, make_mlp, mlp_loss


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _score(tmp_path, **kw):
    model = make_mlp()
    tr = list(GradientStreamer(model, dataset(6), mlp_loss, batch_size=3))
    te = list(GradientStreamer(model, dataset(2, seed=2), mlp_loss, batch_size=2))
    a = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw)
    return TracInAttributor(a).attribute_sources(
        InMemoryGradientSource(tr), InMemoryGradientSource(te)
    )


def test_no_bars_when_stderr_is_not_a_terminal(tmp_path, monkeypatch):
    for stream, kw, bars in (
        (io.StringIO(), {}, False),  # a log file, CI, a redirected notebook: no bars
        (Terminal(), {}, True),  # a terminal: bars
        (io.StringIO(), {"show_progress": True}, True),  # forced on
        (Terminal(), {"show_progress": False}, False),  # forced off
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        score = _score(tmp_path, **kw)
        monkeypatch.undo()
        assert torch.isfinite(score.scores).all()
        assert ("scoring" in stream.getvalue()) is bars, (type(stream).__name__, kw)
    assert AttributionArguments().show_progress is None
    with pytest.raises(TypeError, match="show_progress must be None"):
        AttributionArguments(show_progress="yes")


def test_the_helper_and_the_live_streamer_follow_the_stream(monkeypatch):
    from dattri_llm.utils.progress import progress, progress_bar

    log = io.StringIO()
    assert progress_bar(None, total=3, file=log).disable
    assert not progress_bar(True, total=3, file=io.StringIO()).disable
    assert progress_bar(False, total=3) is None
    items = [1, 2]
    assert progress(items, False) is items
    assert list(progress(items, None, file=log)) == items and log.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    blocks = list(GradientStreamer(make_mlp(), dataset(4), mlp_loss, show_progress=None))
    assert len(blocks) == 1 and sys.stderr.getvalue() == ""


def test_every_bar_is_made_by_the_one_helper():
    root = pathlib.Path(__file__).resolve().parents[2] / "dattri_llm"
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "import tqdm" in p.read_text() or "from tqdm" in p.read_text()
    )
    assert users == ["utils/progress.py"]
