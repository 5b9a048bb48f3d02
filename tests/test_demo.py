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


def test_demo_first_output_is_clean_and_leaves_nothing(tmp_path, monkeypatch, capsys) -> None:
    """No warning from the library's own code; no progress-bar noise in a pipe; no temp files."""
    import tempfile
    import warnings

    from dattri_llm.demo import main

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    tiny = ["--per-topic", "3", "--queries-per-topic", "1", "--epochs", "1", "--show", "1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = main([*tiny, "--seq-len", "16"])
    ours = [w for w in caught if "dattri_llm" in w.filename]
    assert not ours, [f"{w.filename}:{w.lineno}: {w.message}" for w in ours]
    out, err = capsys.readouterr()
    assert out.startswith("corpus: ")
    assert "temporary, removed at exit" in out
    assert "scoring" not in err and "\r" not in err  # no progress bar when not a terminal
    assert summary["workdir"].startswith(str(tmp))
    assert list(tmp.iterdir()) == []  # the temporary gradients are gone


def test_demo_serve_opens_the_explorer_on_the_tiny_model(tmp_path, monkeypatch, capsys) -> None:
    """``demo --serve`` saves the model, captures the paragraphs and serves them (uvicorn.run is
    replaced by a client that queries the app it was given)."""
    pytest.importorskip("starlette")
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from dattri_llm.cli import main as cli_main

    seen: dict = {}

    def fake_run(app, host, port, **kw):
        client = TestClient(app)
        seen["host"], seen["port"] = host, port
        seen["health"] = client.get("/api/health").json()
        seen["answer"] = client.post(
            "/api/attribute", json={"prompt": "The import statement", "completion": None, "k": 3}
        ).json()

    monkeypatch.setattr(uvicorn, "run", fake_run)
    argv = ["demo", "--serve", "--port", "8123", "--per-topic", "3", "--queries-per-topic", "1",
            "--epochs", "1", "--show", "0", "--workdir", str(tmp_path)]  # fmt: skip
    assert cli_main(argv) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8123
    assert seen["health"]["train_samples"] > 0
    results = seen["answer"]["results"]
    assert [r["rank"] for r in results] == [1, 2, 3]
    assert all(isinstance(r["text"], str) and r["text"] for r in results)
    assert (tmp_path / "explorer_train" / "capture.json").exists()
