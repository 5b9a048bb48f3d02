"""The OLMo-core integration stays out of the package's imports and names its extra when missing.

Its checks inside an environment with ai2-olmo-core run from
``experiments/tests/test_olmo_envs.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
