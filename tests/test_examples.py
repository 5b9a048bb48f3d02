"""Every example script runs offline (they assert their own claims) and leaves no files behind."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
# examples that need an environment of their own run there (experiments/tests/test_olmo_envs.py)
OWN_ENV = {"olmo_trainer.py"}
EXAMPLES = sorted(
    p
    for p in (ROOT / "examples").rglob("*.py")
    if not p.name.startswith("_") and p.name not in OWN_ENV
)


def leftovers(tmp: Path) -> list[str]:
    """What a run left in the temporary directory (torch's own caches aside)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torch"))


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(ROOT)) for p in EXAMPLES])
def test_example_runs(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if path.name.startswith("trl_"):
        pytest.importorskip("trl")  # the `trl` extra
    if path.name == "lora_less.py":
        pytest.importorskip("peft")
    work, tmp = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TMPDIR", str(tmp))  # for the processes an example starts
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(sys, "argv", [str(path)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(path), run_name="__main__")
    # an example does what the docs recommend, so the library has nothing to warn about
    # (third-party deprecation notices of transformers / TRL / torch internals aside)
    warned = [
        f"{w.category.__name__} ({Path(w.filename).name}): {w.message}"
        for w in caught
        if issubclass(w.category, UserWarning) or "dattri_llm" in Path(w.filename).parts
    ]
    assert warned == []
    # an example without --out writes to a temporary directory and removes it
    assert leftovers(tmp) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_example_under_torchrun(tmp_path: Path) -> None:
    """``torchrun --nproc_per_node 2 examples/distributed/ddp_collection.py``, as documented:
    every rank must write into one store (rank 0's temporary directory, removed at the end)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    script = str(ROOT / "examples" / "distributed" / "ddp_collection.py")
    run = subprocess.run(
        [*cmd, script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "partitions ['rank_0', 'rank_1']" in run.stdout
    assert "max relative error" in run.stdout
    assert leftovers(tmp) == []
    # with --out, the stores stay where asked
    out = tmp_path / "out"
    run = subprocess.run(
        [*cmd, script, "--out", str(out)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(p.name for p in (out / "train").iterdir() if p.is_dir()) == ["rank_0", "rank_1"]
