"""OLMo and OLMo-core: their checks run in each package's own virtual environment.

ai2-olmo and ai2-olmo-core cannot share an environment with each other or with this suite's
(they pin other numpy / huggingface_hub / trl versions), so ``.ci/run`` creates
``.venv-olmo`` and ``.venv-olmo-core`` and exports their interpreters as
``DATTRI_LLM_OLMO_PYTHON`` / ``DATTRI_LLM_OLMO_CORE_PYTHON``; these tests run
``tests/olmo_envs/*_checks.py`` there (the OLMo ``Trainer`` example, the OLMo-core callback and
a quick ``experiments/fidelity`` run included). Outside CI a missing environment skips them;
in CI (``DATTRI_LLM_REQUIRE_OLMO=1``, set by ``.ci/run``) it fails them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/olmo_envs/{name}"]
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


def test_integration_is_not_imported_by_the_package() -> None:
    code = (
        "import sys, dattri_llm, dattri_llm.integrations; "
        "assert 'dattri_llm.integrations.olmo_core' not in sys.modules; "
        "assert 'olmo_core' not in sys.modules"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_integration_without_olmo_core_names_the_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("olmo_core") is not None:
        pytest.skip("olmo_core is installed here; the error path needs an environment without it")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[olmo-core\]'"):
        import dattri_llm.integrations.olmo_core  # noqa: F401
