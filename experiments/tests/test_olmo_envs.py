"""OLMo and OLMo-core: their checks run in each package's own virtual environment.

ai2-olmo and ai2-olmo-core cannot share an environment with each other or with this suite's
(they pin other numpy / huggingface_hub / trl versions), so ``.ci/run`` creates
``.venv-olmo`` and ``.venv-olmo-core`` and exports their interpreters as
``DATTRI_LLM_OLMO_PYTHON`` / ``DATTRI_LLM_OLMO_CORE_PYTHON``; these tests run
``experiments/tests/olmo_envs/*_checks.py`` there (the OLMo ``Trainer`` example, the OLMo-core
callback and a quick ``experiments/fidelity`` run included). Outside CI a missing environment
skips them; in CI (``DATTRI_LLM_REQUIRE_OLMO=1``, set by ``.ci/run``) it fails them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENVS = {
    "olmo": ("DATTRI_LLM_OLMO_PYTHON", ROOT / ".venv-olmo"),
    "olmo-core": ("DATTRI_LLM_OLMO_CORE_PYTHON", ROOT / ".venv-olmo-core"),
}


def _python(extra: str) -> str:
    var, venv = ENVS[extra]
    python = os.environ.get(var) or str(venv / "bin" / "python")
    if Path(python).is_file():
        return python
    message = (
        f"no environment with the {extra!r} extra: {var} is unset and {venv} does not exist. "
        f"Create it as .ci/run does: python -m venv {venv.name} && {venv.name}/bin/pip install "
        f'torch==2.13.0 && {venv.name}/bin/pip install -e ".[{extra}]" pytest torch==2.13.0'
    )
    if os.environ.get("DATTRI_LLM_REQUIRE_OLMO") == "1":
        pytest.fail(message)
    pytest.skip(message)


def _run_checks(extra: str, name: str) -> None:
    python = _python(extra)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    checks = f"experiments/tests/olmo_envs/{name}"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", checks]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, tail


@pytest.mark.slow
def test_ai2_olmo_checks_in_their_environment() -> None:
    _run_checks("olmo", "olmo_checks.py")


@pytest.mark.slow
def test_olmo_core_checks_in_their_environment() -> None:
    _run_checks("olmo-core", "olmo_core_checks.py")
