"""The suite's per-test seed (and one torch thread) for the experiments' tests too."""

from __future__ import annotations

from tests.conftest import _seed  # noqa: F401  (autouse fixture)
