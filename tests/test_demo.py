"""The README's demo runs offline end to end and finds topic structure above chance."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.mark.slow
def test_demo_runs_and_beats_chance(tmp_path, capsys) -> None:
    from dattri_llm.cli import main as cli_main
    from dattri_llm.demo import main

    summary = main(
        [
            "--per-topic",
            "14",
            "--queries-per-topic",
            "2",
            "--epochs",
            "3",
            "--workdir",
            str(tmp_path),
            "--show",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "top proponents share the query's topic" in out
    assert 0.0 <= summary["topic_share"] <= 1.0
    assert summary["topic_share"] > summary["chance"]
    assert (tmp_path / "train_grads").exists()
    assert cli_main(["--help"]) == 0
    assert cli_main(["bogus"]) == 2
