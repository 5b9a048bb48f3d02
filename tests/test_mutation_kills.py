"""Tests written to kill surviving mutants of ``experiments/mutation/run_mutmut.sh`` (issue 26,
item 14): each checks a core module's result against an independent formula written out here."""

from __future__ import annotations
