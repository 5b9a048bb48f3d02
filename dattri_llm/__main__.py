"""``python -m dattri_llm demo``."""

from __future__ import annotations

from dattri_llm.cli import main

raise SystemExit(main())
