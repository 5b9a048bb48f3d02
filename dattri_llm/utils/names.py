"""Options that name layers: a name that names nothing is refused, with the candidates.

A misspelt or mis-prefixed layer name (``"model.fc"`` for a layer called ``"fc"``, as a wrapper
such as DDP or ``torch.compile`` names it) would otherwise select nothing and change a result
silently. Every option that takes layer names resolves them against the names that exist, when
those are known, and refuses the ones that match nothing with :func:`unknown_names` — one
wording, the closest candidates first.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = ["close_candidates", "unknown_names", "check_names"]


def close_candidates(name: str, names: Sequence[str], limit: int = 10) -> list[str]:
    """The ``names`` most likely meant by ``name``: dotted-suffix relatives, then close spellings.

    ``"model.fc"`` finds ``"fc"`` (and ``"fc"`` finds ``"model.fc"``): a name one wrapper
    prefix away. With no close candidate, the first ``limit`` names.
    """
    names = list(names)
    related = [n for n in names if name and (n.endswith("." + name) or name.endswith("." + n))]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.4)
    out = related + [n for n in close if n not in related]
    return out[:limit] if out else names[:limit]


def unknown_names(option: str, unknown: Sequence[str], names: Sequence[str], what: str) -> str:
    """The refusal of ``unknown`` names passed to ``option`` (a sentence, no exception).

    Args:
        option: The option as the user spelt it, e.g. ``"OffloadCallback(keep_token_factors=)"``.
        unknown: The names or patterns that match nothing.
        names: Every name that exists (``what`` names them, e.g. ``"the hooked layers"``).
        what: What ``names`` are.
    """
    hint = close_candidates(unknown[0], names)
    shown = ", ".join(repr(n) for n in names[:20]) + (" ..." if len(names) > 20 else "")
    return (
        f"{option}: {list(unknown)} match none of {what}, so they would select nothing. "
        f"Closest to {unknown[0]!r}: {hint}. {what[0].upper() + what[1:]}: [{shown}]."
    )


def check_names(
    option: str, requested: Iterable[str], names: Sequence[str], what: str
) -> list[str]:
    """``requested`` as given, refusing any that is not one of ``names``.

    Raises:
        ValueError: naming ``option``, the unknown names and the candidates.
    """
    requested = list(requested)
    known = set(names)
    unknown = [n for n in requested if n not in known]
    if unknown:
        raise ValueError(unknown_names(option, unknown, list(names), what))
    return requested
