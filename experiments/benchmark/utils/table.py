"""Markdown tables and number formatting."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["md_table", "fmt_bytes", "fmt_s", "fmt_x"]


def md_table(headers: Sequence[str] | str, rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; ``headers`` a list or one string of ``|``-separated names."""
    if isinstance(headers, str):
        headers = headers.split("|")
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def fmt_bytes(n: float | None) -> str:
    """Bytes as MB (10^6) with sensible precision."""
    if n is None:
        return "n/a"
    mb = n / 1e6
    return f"{mb:.0f} MB" if mb >= 100 else f"{mb:.1f} MB" if mb >= 1 else f"{mb:.3f} MB"


def fmt_s(t: float | None) -> str:
    """Seconds with 3 significant digits."""
    if t is None:
        return "n/a"
    if t >= 100:
        return f"{t:.0f} s"
    return f"{t:.3g} s" if t >= 0.01 else f"{t * 1e3:.3g} ms"


def fmt_x(r: float | None) -> str:
    """A ratio."""
    return "n/a" if r is None else f"{r:.2f}x"


def emit(text: str, out: str | None) -> None:
    """Print a benchmark's report and, with ``--out``, append it to that file."""
    print(text)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(text + "\n")
