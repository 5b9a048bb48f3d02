"""What a view says about a shown training sample besides its score: repeats and leaks.

* **Repeats**: a sample seen several times under one checkpoint label (epochs captured under
  one label, a duplicated item) had its rows combined by the score's ``repeats`` rule; the
  views say how often and at which steps (:func:`occurrence_notes`).
* **Leaks**: a training sample identical to the query (the same content hash, or the same text
  once whitespace is collapsed) explains the query trivially; the views flag it (:func:`leak`).
* **The run's warnings** (:func:`run_warnings`): what the scoring run warned about, kept in the
  score and in the CLI's ``attribution_run.json``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dattri_llm.attribution.score import AttributionScore

__all__ = ["Occurrences", "occurrence_notes", "leak", "run_warnings", "unmatched_texts"]

_STEPS_SHOWN = 6


class Occurrences:
    """Where one training sample occurs: ``{checkpoint: [steps]}`` and its count per label.

    Attributes:
        by_checkpoint: ``{checkpoint: [step of each occurrence]}``.
        count: The most occurrences under one checkpoint label (1: once per label).
    """

    def __init__(self, by_checkpoint: Mapping[int, Sequence[int]]) -> None:
        self.by_checkpoint = {int(c): [int(s) for s in v] for c, v in by_checkpoint.items()}
        self.count = max((len(v) for v in self.by_checkpoint.values()), default=0)

    @property
    def repeated(self) -> bool:
        """Whether the sample occurs more than once under one checkpoint label."""
        return self.count > 1

    def describe(self) -> str:
        """E.g. ``"seen 4x under checkpoint 0 (steps 0, 2, 4, 6)"``."""
        parts = []
        for c, steps in sorted(self.by_checkpoint.items()):
            shown = ", ".join(map(str, steps[:_STEPS_SHOWN]))
            more = f", … {len(steps) - _STEPS_SHOWN} more" if len(steps) > _STEPS_SHOWN else ""
            word = "step" if len(steps) == 1 else "steps"
            parts.append(f"{len(steps)}x under checkpoint {c} ({word} {shown}{more})")
        return "seen " + ", ".join(parts)

    def as_json(self) -> dict[str, Any]:
        """``{"count": n, "steps": {"<checkpoint>": [steps]}}``."""
        return {
            "count": self.count,
            "steps": {str(c): steps for c, steps in sorted(self.by_checkpoint.items())},
        }


def occurrence_notes(score: AttributionScore, hashes: Iterable[str]) -> dict[str, Occurrences]:
    """:class:`Occurrences` of the given training samples, in one pass over the score's rows."""
    wanted = set(hashes)
    if score.top_k_kept is not None:  # few rows; the combined ones list their occurrences
        return {h: Occurrences(score.occurrences(h)) for h in wanted}
    found: dict[str, dict[int, list[int]]] = {}
    for h, s, c in zip(score.train_hashes, score.train_steps, score.train_checkpoints):
        if h in wanted:
            found.setdefault(h, {}).setdefault(c, []).append(s)
    return {h: Occurrences({c: sorted(v) for c, v in occ.items()}) for h, occ in found.items()}


def _normal(text: str) -> str:
    return " ".join(text.split())


def leak(train_hash: str, query_hash: str, train_text: Any = None, query_text: Any = None) -> bool:
    """Whether a training sample is identical to the query (a leak of the query into training).

    Identical when the content hashes are equal, or when both texts are given and equal once
    whitespace is collapsed (``train_text`` / ``query_text``: a string or an object with
    ``.text``).
    """
    if train_hash == query_hash:
        return True
    a = getattr(train_text, "text", train_text)
    b = getattr(query_text, "text", query_text)
    if not (isinstance(a, str) and isinstance(b, str)) or not a.strip():
        return False
    return _normal(a) == _normal(b)


def run_warnings(score: AttributionScore, settings: Mapping[str, Any] | None = None) -> list[str]:
    """The scoring run's warnings: the score's own, then any others ``settings`` recorded."""
    out = list(dict.fromkeys(score.warnings))
    extra = (settings or {}).get("warnings") or []
    if isinstance(extra, str):
        extra = [extra]
    out += [str(w) for w in extra if str(w) not in out]
    return out


def unmatched_texts(texts: Mapping[str, Any], hashes: Sequence[str], what: str, flag: str) -> str:
    """A warning when texts were given but match none of ``hashes`` (``""``: some match)."""
    if not texts or any(h in texts for h in hashes):
        return ""
    ids = list(dict.fromkeys(hashes))
    return (
        f"{flag}: none of its {len(texts)} texts matches the ids of the {len(ids)} {what} "
        f"(e.g. {ids[0][:16]}… has no text): the rows must be keyed by the samples' hashes "
        '({"id": dattri_llm.hash_sample(sample), ...}) or carry their token ids '
        '({"input_ids": [...], ...}) as captured; is it the texts of these scores?'
    )
