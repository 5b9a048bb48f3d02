"""``AttributionScore``: scores keyed by sample identity, with per-step and per-token views.

Rows are ``(train hash, step)`` pairs (one per train sample and step it was seen at; a live
run's step is the checkpoint index), columns are the unique test hashes in order of first
appearance. On disk a score is a directory with ``scores.safetensors`` (tensors) and
``scores.json`` (hashes, steps, format version); nothing is pickled.

Duplicates. Identical samples have the same id (``dattri_llm.utils.hashing``), so a sample
that occurs twice at one step (a duplicated train item) gives two rows with one id. The
per-sample views (:meth:`AttributionScore.agnostic_matrix`, ``step_matrix``, ``query``,
``top_k``) then follow ``duplicates=``: ``"warn"`` (default: sum the occurrences — the
influence of every copy together — and warn naming them), ``"sum"`` (the same, silently),
``"separate"`` (one row per occurrence) or ``"error"``. A sample seen at *different* steps
(epochs, checkpoints) is not a duplicate.

Repeats. A sample can occur several times under one checkpoint label: at several steps (a loop
captured over several epochs without relabelling) or twice at one step (a duplicate).
:meth:`AttributionScore.occurrences` says where, :meth:`AttributionScore.occurrence_counts`
how often. ``repeats`` says how the rows of one sample under one checkpoint label combine in
the per-sample views: ``"sum"`` (each occurrence adds its score: the dot-product and influence
methods, whose scores add over steps) or ``"mean"`` (the mean of the occurrences' scores: a
cosine stays a cosine, in ``[-1, 1]``). Rows of different checkpoint labels are always summed
(TracIn's sum over checkpoints). An attributor records the rule it used
(``BaseAttributor(repeats=...)``); a full score can be viewed under the other one
(``agnostic_matrix(repeats=...)``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from dattri_llm.utils.files import atomic_write
from dattri_llm.utils.hashing import hash_sample

__all__ = ["AttributionScore", "TopK", "SCORE_FORMAT_VERSION", "REPEATS", "check_repeats"]

#: Version of the on-disk layout written by :meth:`AttributionScore.save`.
SCORE_FORMAT_VERSION = 1
_TENSORS = "scores.safetensors"
_META = "scores.json"
_DUPLICATES = ("warn", "sum", "separate", "error")
#: How the rows of one sample under one checkpoint label combine (see the module docstring).
REPEATS = ("sum", "mean")


def check_repeats(value: Any, where: str) -> str:
    """Validate a ``repeats=`` value (``"sum"`` or ``"mean"``)."""
    if value not in REPEATS:
        raise ValueError(
            f"{where} must be one of {REPEATS} (how the rows of one sample under one checkpoint "
            f"label combine), got {value!r}."
        )
    return str(value)


class TopK(NamedTuple):
    """Top proponents and opponents of each test sample (over the agnostic matrix).

    Attributes:
        test_hashes: The test samples (columns), ``M`` of them.
        proponent_hashes: ``M`` lists of the ``k`` train hashes with the largest scores.
        proponent_scores: ``(M, k)`` their scores, descending.
        opponent_hashes: ``M`` lists of the ``k`` train hashes with the smallest scores.
        opponent_scores: ``(M, k)`` their scores, ascending.
    """

    test_hashes: list[str]
    proponent_hashes: list[list[str]]
    proponent_scores: torch.Tensor
    opponent_hashes: list[list[str]]
    opponent_scores: torch.Tensor


def _as_hash(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, (tuple, list)):
        x = {str(i): v for i, v in enumerate(x)}
    if isinstance(x, (Mapping, torch.Tensor)):
        return hash_sample(x)
    raise TypeError(
        f"expected a sample hash (str) or a sample (dict/tuple of tensors), got {type(x).__name__}."
    )


def _warn_nan(train: Sequence[str], test: Sequence[str], cols: torch.Tensor) -> bool:
    """Warn when a full matrix (``cols``: ``(M, N)``) holds NaN scores, naming the first.

    Returns:
        Whether it does.
    """
    nan = cols.isnan()
    if not bool(nan.any()):
        return False
    j, i = (int(x) for x in nan.nonzero()[0])
    warnings.warn(
        f"{int(nan.sum())} score(s) are NaN (e.g. train sample {train[i]!r}, test sample "
        f"{test[j]!r}): they rank after every other score. A NaN comes from non-finite "
        "gradients (a diverged step, or a store written with non-finite values); recapture "
        "them, with storage_dtype='bfloat16' or 'float32' if a float16 store overflowed.",
        UserWarning,
        stacklevel=3,
    )
    return True


class AttributionScore:
    """The result of an attribution run.

    Args:
        scores: ``(R, M)`` one row per ``(train hash, step)``, one column per test hash.
        train_hashes: ``R`` train sample identities.
        train_steps: ``R`` steps (checkpoint index for a live run, record step from a cache).
        test_hashes: ``M`` unique test sample identities.
        token_scores: Optional per-row ``(T_r, M)`` scores of each train token position (token
            granularity); rows sum to ``scores``.
        output_dir: Default directory of :meth:`save`.
        train_checkpoints: ``R`` checkpoint labels of the rows (default all 0); a sample at
            the same step of two checkpoints is not a duplicate.
        top_k_kept: Set by ``attribute*(..., top_k=k)``: the scores hold, per test sample, only
            its ``k`` largest and ``k`` smallest agnostic scores (one row per kept train
            sample, summed over its steps; step ``-1`` when it occurred at several), and
            ``NaN`` for every score not kept. :meth:`top_k` then takes ``k' <= k``.
        num_train: With ``top_k_kept``: how many train samples were ranked.
        repeats: How the rows of one sample under one checkpoint label combine in the views:
            ``"sum"`` (default) or ``"mean"`` (see the module docstring).
        occurrences: ``{train hash: [(checkpoint, step), ...]}`` for the samples whose rows
            were combined before they reached the score (a top-k result); every other
            sample's occurrences are its rows.
        warnings: The messages of the warnings the scoring run gave (saved with the score).
    """

    def __init__(
        self,
        scores: torch.Tensor,
        train_hashes: Sequence[str],
        train_steps: Sequence[int],
        test_hashes: Sequence[str],
        token_scores: Sequence[torch.Tensor] | None = None,
        output_dir: str | None = None,
        train_checkpoints: Sequence[int] | None = None,
        top_k_kept: int | None = None,
        num_train: int | None = None,
        repeats: str = "sum",
        occurrences: Mapping[str, Sequence[Sequence[int]]] | None = None,
        warnings: Sequence[str] | None = None,
    ) -> None:
        self.scores = scores
        self.repeats = check_repeats(repeats, "AttributionScore(repeats=)")
        self.warnings = [str(w) for w in warnings or ()]
        self._occ = {
            str(h): [(int(c), int(s)) for c, s in occ] for h, occ in (occurrences or {}).items()
        }
        self.top_k_kept = top_k_kept
        self.num_train = num_train
        self.train_hashes = [str(h) for h in train_hashes]
        self.train_steps = [int(s) for s in train_steps]
        self.train_checkpoints = (
            [int(c) for c in train_checkpoints]
            if train_checkpoints is not None
            else [0] * len(self.train_steps)
        )
        self.test_hashes = [str(h) for h in test_hashes]
        self.output_dir = output_dir
        r, m = (int(scores.shape[0]), int(scores.shape[1])) if scores.dim() == 2 else (-1, -1)
        if (
            r != len(self.train_hashes)
            or r != len(self.train_steps)
            or r != len(self.train_checkpoints)
            or m != len(self.test_hashes)
        ):
            raise ValueError(
                f"AttributionScore: scores of shape {tuple(scores.shape)} need "
                f"{len(self.train_hashes)} train hashes / {len(self.train_steps)} steps as rows "
                f"and {len(self.test_hashes)} test hashes as columns."
            )
        if len(set(self.test_hashes)) != m:
            raise ValueError("AttributionScore: test hashes (columns) must be unique.")
        if token_scores is not None:
            token_scores = list(token_scores)
            if len(token_scores) != r:
                raise ValueError(f"token_scores has {len(token_scores)} rows, expected {r}.")
        self._token_scores = token_scores
        self._test_index = {h: j for j, h in enumerate(self.test_hashes)}

    # ---- shapes ----------------------------------------------------------------------------
    @property
    def num_test(self) -> int:
        """Number of test samples (columns)."""
        return len(self.test_hashes)

    @property
    def steps(self) -> list[int]:
        """The distinct steps, sorted."""
        return sorted(set(self.train_steps))

    @property
    def has_token_scores(self) -> bool:
        """Whether per-token scores are held (token granularity)."""
        return self._token_scores is not None

    def __repr__(self) -> str:
        return (
            f"AttributionScore(rows={len(self.train_hashes)}, "
            f"train={len(set(self.train_hashes))}, test={self.num_test}, steps={self.steps}, "
            f"token_scores={self.has_token_scores}"
            + (f", top_k_kept={self.top_k_kept} of {self.num_train})" if self.top_k_kept else ")")
        )

    # ---- views -----------------------------------------------------------------------------
    def duplicates(self) -> dict[tuple[str, int, int], int]:
        """Samples that occur more than once at one step of one checkpoint (identical items).

        Returns:
            ``{(train hash, step, checkpoint): occurrences}``, empty when there are none.
        """
        counts: dict[tuple[str, int, int], int] = {}
        for key in zip(self.train_hashes, self.train_steps, self.train_checkpoints):
            counts[key] = counts.get(key, 0) + 1
        return {k: c for k, c in counts.items() if c > 1}

    def occurrences(self, train_hash: Any) -> dict[int, list[int]]:
        """Where one train sample occurs: ``{checkpoint: [step of each occurrence]}``.

        A step is listed once per occurrence (twice for a duplicate at one step), sorted. A
        top-k result's row with step ``-1`` stands for the occurrences it combined, which it
        lists.

        Raises:
            KeyError: the sample is not in the scores.
        """
        h = _as_hash(train_hash)
        pairs = self._occ.get(h)
        if pairs is None:
            pairs = [
                (c, s)
                for rh, s, c in zip(self.train_hashes, self.train_steps, self.train_checkpoints)
                if rh == h
            ]
        if not pairs:
            raise KeyError(f"train hash {h!r} is not in the scores.")
        out: dict[int, list[int]] = {}
        for c, s in sorted(pairs):
            out.setdefault(c, []).append(s)
        return out

    def occurrence_counts(self) -> dict[str, int]:
        """How many times each train sample occurs under one checkpoint label.

        Returns:
            ``{train hash: count}`` in order of first appearance, the count being the largest
            over the sample's checkpoint labels (1: once per label, the usual case; 4: e.g.
            four epochs captured under one label).
        """
        per_label: dict[tuple[str, int], int] = {}
        for h, c in zip(self.train_hashes, self.train_checkpoints):
            per_label[(h, c)] = per_label.get((h, c), 0) + 1
        for h, occ in self._occ.items():
            for key in {(h, c) for c, _ in occ}:
                per_label[key] = sum(1 for c, _ in occ if c == key[1])
        out: dict[str, int] = {}
        for (h, _), n in per_label.items():
            out[h] = max(out.get(h, 0), n)
        return out

    def _row_keys(self, duplicates: str) -> tuple[list[tuple[str, int]], dict]:
        """Each row's output key ``(hash, occurrence)`` and the duplicates at one step."""
        seen: dict[tuple[str, int, int], int] = {}
        keys: list[tuple[str, int]] = []
        for at in zip(self.train_hashes, self.train_steps, self.train_checkpoints):
            k = seen.get(at, 0)
            seen[at] = k + 1
            keys.append((at[0], k if duplicates == "separate" else 0))
        return keys, seen

    def _sum_rows(
        self, rows: Sequence[int], duplicates: str, repeats: str | None = None
    ) -> tuple[list[str], torch.Tensor]:
        if duplicates not in _DUPLICATES:
            raise ValueError(f"duplicates must be one of {_DUPLICATES}, got {duplicates!r}.")
        rule = self.repeats if repeats is None else check_repeats(repeats, "repeats")
        if rule != self.repeats and self.top_k_kept is not None:
            raise ValueError(
                f"these top-k scores combined each sample's repeats by {self.repeats!r} before "
                f"ranking; repeats={rule!r} needs the full scores (attribute without top_k) or "
                f"an attributor built with repeats={rule!r}."
            )
        all_keys, seen = self._row_keys(duplicates)
        rows = list(rows)
        chosen = {
            (self.train_hashes[i], self.train_steps[i], self.train_checkpoints[i]) for i in rows
        }
        dups = {at: c for at, c in seen.items() if c > 1 and at in chosen}
        if dups and duplicates in ("warn", "error"):
            (h, step, _), c = next(iter(dups.items()))
            more = f" (and {len(dups) - 1} more)" if len(dups) > 1 else ""
            combined = "summed" if rule == "sum" else "averaged (repeats='mean')"
            message = (
                f"train sample {h!r} occurs {c} times at step {step}{more}: identical samples "
                f"share one id, so their rows are {combined} into one (N rows in, fewer "
                "samples out). Deduplicate the train set, or pass duplicates='separate' for one "
                "row per occurrence, or duplicates='sum' to combine them without this message "
                "(AttributionScore.duplicates() lists them)."
            )
            if duplicates == "error":
                raise ValueError(message)
            warnings.warn(message, UserWarning, stacklevel=3)
        ids: list[str] = []
        where: dict[tuple[str, int], int] = {}
        target = []
        for i in rows:
            key = all_keys[i]
            if key not in where:
                where[key] = len(ids)
                ids.append(key[0])
            target.append(where[key])
        out = self.scores.new_zeros(len(ids), self.num_test)
        if rows:
            idx = torch.as_tensor(target, dtype=torch.long)
            picked = self.scores[torch.as_tensor(rows, dtype=torch.long)]
            if rule == "mean":  # each row weighs 1 / (its sample's rows under its label)
                group: dict[tuple[tuple[str, int], int], int] = {}
                for key, c in zip(all_keys, self.train_checkpoints):
                    group[(key, c)] = group.get((key, c), 0) + 1
                n = [group[(all_keys[i], self.train_checkpoints[i])] for i in rows]
                if max(n) > 1:
                    w = 1.0 / torch.as_tensor(n, dtype=torch.float64)
                    picked = picked * w.to(picked.dtype).unsqueeze(1)
            out.index_add_(0, idx, picked)
        return ids, out

    def agnostic_matrix(
        self, duplicates: str = "warn", repeats: str | None = None
    ) -> tuple[list[str], torch.Tensor]:
        """Scores per unique train sample, combined over its steps and checkpoints.

        A sample's rows under one checkpoint label combine by ``repeats``; checkpoint labels
        are summed.

        Args:
            duplicates: What to do with a sample that occurs several times at one step (see
                the module docstring): ``"warn"``, ``"sum"``, ``"separate"`` or ``"error"``.
            repeats: ``"sum"`` or ``"mean"`` over a sample's rows under one checkpoint label;
                default the score's own :attr:`repeats` (the rule its attributor used).

        Returns:
            ``(train_ids, matrix)``: unique train hashes in order of first appearance (with
            ``"separate"``, a duplicated hash once per occurrence) and the
            ``(num_train, num_test)`` matrix.
        """
        return self._sum_rows(range(len(self.train_hashes)), duplicates, repeats)

    def step_matrix(
        self, step: int, duplicates: str = "warn", repeats: str | None = None
    ) -> tuple[list[str], torch.Tensor]:
        """``(train_ids, (num_train_at_step, num_test))`` of one step.

        ``duplicates`` and ``repeats`` as in :meth:`agnostic_matrix`; under ``"mean"`` a row
        weighs ``1 / (its sample's rows under its checkpoint label)``, so the step matrices
        add up to the agnostic matrix.
        """
        rows = [i for i, s in enumerate(self.train_steps) if s == step]
        if not rows:
            raise KeyError(f"step {step} not in the scores; available steps: {self.steps}.")
        return self._sum_rows(rows, duplicates, repeats)

    def step_matrices(
        self, duplicates: str = "warn", repeats: str | None = None
    ) -> dict[int, tuple[list[str], torch.Tensor]]:
        """``{step: step_matrix(step)}`` for every step."""
        return {s: self.step_matrix(s, duplicates, repeats) for s in self.steps}

    def query(
        self,
        train: Sequence[Any],
        test: Sequence[Any] | None = None,
        duplicates: str = "warn",
        repeats: str | None = None,
    ) -> torch.Tensor:
        """Agnostic scores realigned to the given samples (by identity, not position).

        Args:
            train: Train sample hashes, or the samples themselves (hashed with
                :func:`~dattri_llm.utils.hashing.hash_sample`).
            test: Test hashes or samples; default every column in order.
            duplicates: As in :meth:`agnostic_matrix`, but ``"separate"`` is refused (a
                sample's id would name several rows).
            repeats: As in :meth:`agnostic_matrix`.

        Returns:
            ``(len(train), len(test))``; with ``top_k_kept``, ``NaN`` where a score was not
            among the kept ones.

        Raises:
            KeyError: naming the first hash that is not in the scores.
        """
        if duplicates == "separate":
            raise ValueError(
                "query(..., duplicates='separate') is ambiguous: a duplicated sample's id names "
                "several rows. Use agnostic_matrix(duplicates='separate')."
            )
        ids, matrix = self.agnostic_matrix(duplicates, repeats)
        where = {h: i for i, h in enumerate(ids)}
        tr = [_as_hash(x) for x in train]
        te = self.test_hashes if test is None else [_as_hash(x) for x in test]
        for h in tr:
            if h not in where:
                kept = (
                    f" kept by top_k={self.top_k_kept} for any test sample"
                    if self.top_k_kept is not None
                    else ""
                )
                raise KeyError(
                    f"train hash {h!r} is not in the scores{kept} ({len(ids)} train samples)."
                )
        for h in te:
            if h not in self._test_index:
                raise KeyError(
                    f"test hash {h!r} is not in the scores ({self.num_test} test samples)."
                )
        ri = torch.as_tensor([where[h] for h in tr], dtype=torch.long)
        ci = torch.as_tensor([self._test_index[h] for h in te], dtype=torch.long)
        return matrix[ri][:, ci]

    def top_k(self, k: int, duplicates: str = "warn", repeats: str | None = None) -> TopK:
        """Top proponents and opponents of every test sample.

        The ``k`` train samples with the most positive (proponents) and the most negative
        (opponents) scores, over :meth:`agnostic_matrix` (``duplicates`` and ``repeats`` as
        there). A ``k`` beyond the number of train samples is clamped to it (every sample,
        ranked). A ``NaN`` score ranks after every other score on both lists (it is no
        influence, large or small: :mod:`dattri_llm.attribution.ranking`), with a warning
        naming it; so a list holds a ``NaN`` only where a test sample has fewer than ``k``
        other scores.

        Raises:
            ValueError: ``k`` is not a positive int, or exceeds the ``top_k`` these scores
                were computed with (while that was fewer than the train samples).
        """
        from dattri_llm.attribution.ranking import check_top_k, clamp_top_k, rank

        k = check_top_k(k, "k")
        if k is None:
            raise ValueError("k must be a positive int, got None.")
        ids, matrix = self.agnostic_matrix(duplicates, repeats)
        k = clamp_top_k(k, self.num_train if self.num_train is not None else len(ids))
        cols = matrix.T  # (M, N)
        nan = None
        if self.top_k_kept is not None:  # NaN: not kept (never ranked)
            if k > self.top_k_kept:
                raise ValueError(
                    f"these scores kept the top {self.top_k_kept} per test sample "
                    f"(attribute(..., top_k={self.top_k_kept})); top_k({k}) needs a run with "
                    f"top_k >= {k}."
                )
        else:
            nan = _warn_nan(ids, self.test_hashes, cols)
        p_val, p_idx = rank(cols, k, True, has_nan=nan)
        o_val, o_idx = rank(cols, k, False, has_nan=nan)
        return TopK(
            list(self.test_hashes),
            [[ids[i] for i in r] for r in p_idx.tolist()],
            p_val,
            [[ids[i] for i in r] for r in o_idx.tolist()],
            o_val,
        )

    def token_scores(
        self, train_hash: Any, step: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of each token position of one train sample.

        Args:
            train_hash: The train sample's hash (or the sample itself).
            step: One step; default the sum over every step the sample was seen at.

        Returns:
            ``(positions (T,), scores (T, num_test))``; summed over positions they give the
            sample's instance scores. Occurrences of different lengths are summed position by
            position only where the longer ones' extra positions score exactly zero (a padded
            tail).

        Raises:
            ValueError: no token scores, or occurrences whose positions do not line up (the
                message says how to pick one with ``step=``).
        """
        if self._token_scores is None:
            raise ValueError(
                "these scores hold no token scores: run the attributor with "
                "attribution_granularity='token'."
            )
        h = _as_hash(train_hash)
        rows = [
            i
            for i, (rh, s) in enumerate(zip(self.train_hashes, self.train_steps))
            if rh == h and (step is None or s == step)
        ]
        if not rows:
            where = "" if step is None else f" at step {step}"
            raise KeyError(f"train hash {h!r} is not in the scores{where}.")
        lengths = [self._token_scores[i].shape[0] for i in rows]
        length, shortest = max(lengths), min(lengths)
        for i, n in zip(rows, lengths):
            # occurrences padded to different lengths line up position by position only when
            # the extra positions are a padded tail (exactly zero): with left padding the
            # same position index holds different tokens, and a sum would mix them
            if n > shortest and bool(self._token_scores[i][shortest:].ne(0).any()):
                seen = sorted({(self.train_steps[r], m) for r, m in zip(rows, lengths)})
                raise ValueError(
                    f"token_scores: train sample {h!r} occurs with different numbers of token "
                    f"positions ((step, positions): {seen}) and the longer ones score positions "
                    f"past the shortest's {shortest}, so position i is not the same token in "
                    "each (left padding?). Pass step= for one occurrence, or capture with "
                    "right padding."
                )
        out = self.scores.new_zeros(length, self.num_test)
        for i in rows:
            t = self._token_scores[i]
            out[: t.shape[0]] += t
        return torch.arange(length), out

    # ---- persistence -----------------------------------------------------------------------
    def save(self, path: str | os.PathLike | None = None) -> str:
        """Write the scores to a directory (default: ``output_dir``); returns its path."""
        from safetensors.torch import save_file

        target = path if path is not None else self.output_dir
        if target is None:
            raise ValueError(
                "AttributionScore.save needs a path: pass one or set output_dir "
                "(AttributionArguments.output_dir)."
            )
        target = os.fspath(target)
        os.makedirs(target, exist_ok=True)
        tensors = {"scores": self.scores.detach().cpu().contiguous()}
        meta: dict[str, Any] = {
            "format": "dattri_llm.AttributionScore",
            "version": SCORE_FORMAT_VERSION,
            "train_hashes": self.train_hashes,
            "train_steps": self.train_steps,
            "train_checkpoints": self.train_checkpoints,
            "test_hashes": self.test_hashes,
            "token_scores": self._token_scores is not None,
            "repeats": self.repeats,
            "warnings": self.warnings,
        }
        if self._occ:
            meta["occurrences"] = {h: [list(x) for x in occ] for h, occ in self._occ.items()}
        if self.top_k_kept is not None:
            meta["top_k_kept"] = self.top_k_kept
            meta["num_train"] = self.num_train
        if self._token_scores is not None:
            lengths = [int(t.shape[0]) for t in self._token_scores]
            tensors["token_scores"] = (
                torch.cat(self._token_scores).detach().cpu().contiguous()
                if lengths
                else self.scores.new_zeros(0, self.num_test)
            )
            meta["token_lengths"] = lengths
        tmp = os.path.join(target, _TENSORS + ".tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(target, _TENSORS))
        atomic_write(os.path.join(target, _META), json.dumps(meta))
        return target

    @classmethod
    def load(cls, path: str | os.PathLike) -> AttributionScore:
        """Read scores written by :meth:`save`."""
        from safetensors.torch import load_file

        path = os.fspath(path)
        meta_path, tensor_path = os.path.join(path, _META), os.path.join(path, _TENSORS)
        for p in (meta_path, tensor_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(
                    f"{p!r} not found: {path!r} is not a directory written "
                    "by AttributionScore.save."
                )
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{meta_path!r} is not valid JSON ({e}).") from None
        if meta.get("format") != "dattri_llm.AttributionScore":
            raise ValueError(f"{meta_path!r} does not describe an AttributionScore.")
        if meta.get("version") != SCORE_FORMAT_VERSION:
            raise ValueError(
                f"{meta_path!r} has format version {meta.get('version')!r}; this "
                f"dattri_llm reads version {SCORE_FORMAT_VERSION}."
            )
        tensors = load_file(tensor_path)
        tokens = None
        if meta.get("token_scores"):
            lengths = meta["token_lengths"]
            tokens = list(torch.split(tensors["token_scores"], lengths)) if lengths else []
        return cls(
            tensors["scores"],
            meta["train_hashes"],
            meta["train_steps"],
            meta["test_hashes"],
            token_scores=tokens,
            output_dir=path,
            train_checkpoints=meta.get("train_checkpoints"),
            top_k_kept=meta.get("top_k_kept"),
            num_train=meta.get("num_train"),
            repeats=meta.get("repeats", "sum"),  # written before the option: summed
            occurrences=meta.get("occurrences"),
            warnings=meta.get("warnings"),
        )
