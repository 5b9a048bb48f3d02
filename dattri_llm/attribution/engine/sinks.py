"""Where the score loop puts its rows: the full matrix, or a streamed per-query top-k.

* :class:`FullSink` keeps every score row (one per train row: sample and step), in order.
* :class:`TopKSink` keeps, per query, only the ``k`` largest and ``k`` smallest *agnostic*
  scores (a sample's rows summed over the steps and checkpoints it occurs at) while train blocks
  stream by: memory ``O(M·k)`` plus the block being scored, plus one ``M``-vector per sample
  whose rows are not all scored yet (none when every sample has one row: one checkpoint, one
  epoch). It needs to know, before scoring, how many rows each sample has (``counts``): a
  store's index and a dataset's identities give them without reading any gradient.

Both can write their state to a checkpoint (:meth:`state` / :meth:`from_state`: tensors for
safetensors, the rest JSON) and be merged across ranks (``merge``); the result is an
:class:`~dattri_llm.attribution.score.AttributionScore` either way. A top-k result holds one row
per kept sample and ``NaN`` where a (sample, query) score was not among that query's kept ones
(``score.top_k_kept`` is ``k``): ``top_k(k' <= k)`` and ``query`` of kept entries are exact.

Both follow the attributor's ``repeats`` rule: the full matrix records it (its views apply it),
the top-k sink applies it while it sums (under ``"mean"`` a row weighs ``1 / (its sample's rows
under its checkpoint label)``, counted in advance like the rows) and records, for each kept
sample with several rows, where they were (``AttributionScore.occurrences``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dattri_llm.attribution.ranking import check_top_k, clamp_top_k, rank
from dattri_llm.attribution.score import AttributionScore

__all__ = ["FullSink", "TopKSink", "check_top_k", "merge_top_k", "top_k_of", "label_counts_of"]


def label_counts_of(
    hashes: Sequence[str], checkpoints: Sequence[int]
) -> dict[tuple[str, int], int]:
    """``{(train hash, checkpoint): rows}``: how often each sample occurs under each label."""
    counts: dict[tuple[str, int], int] = {}
    for key in zip(hashes, checkpoints):
        counts[key] = counts.get(key, 0) + 1
    return counts


def _common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def _keep_extremes(
    vals: Sequence[torch.Tensor],
    ids: Sequence[torch.Tensor],
    k: int,
    largest: bool,
    has_nan: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the ``k`` largest (or smallest) of the columns of ``vals`` joined, and their ids.

    Ranked by :func:`~dattri_llm.attribution.ranking.rank`: a NaN score comes after the empty
    slots (``∓inf``, id ``-1``), so it is never kept.
    """
    dtype = _common_dtype(vals)
    joined = torch.cat([v.to(dtype) for v in vals], dim=1)
    v, pos = rank(joined, k, largest, has_nan=has_nan)
    return v, torch.cat(list(ids), dim=1).gather(1, pos)


class FullSink:
    """Every score row, in the order the train rows were scored.

    Args:
        granularity: ``"sample"`` or ``"token"``.
        repeats: The attributor's rule, recorded in the result (its views apply it).
    """

    def __init__(self, granularity: str = "sample", repeats: str = "sum") -> None:
        self.granularity = granularity
        self.repeats = repeats
        self.rows: list[torch.Tensor] = []
        self.hashes: list[str] = []
        self.steps: list[int] = []
        self.checkpoints: list[int] = []
        self.tokens: list[torch.Tensor] | None = [] if granularity == "token" else None
        self._taken = 0  # rows handed to a checkpoint already (see take_new)

    @property
    def num_rows(self) -> int:
        """Rows added so far."""
        return len(self.hashes)

    def label_counts(self) -> dict[tuple[str, int], int]:
        """``{(train hash, checkpoint): rows}`` of the rows added so far."""
        return label_counts_of(self.hashes, self.checkpoints)

    def add(
        self,
        scores: torch.Tensor,
        hashes: Sequence[str],
        steps: Sequence[int],
        checkpoints: Sequence[int],
        tokens: list[torch.Tensor] | None = None,
    ) -> None:
        """Append score rows ``(b, M)`` with each row's identity, step and checkpoint."""
        self.rows.append(scores)
        self.hashes += [str(h) for h in hashes]
        self.steps += [int(s) for s in steps]
        self.checkpoints += [int(c) for c in checkpoints]
        if self.tokens is not None and tokens is not None:
            self.tokens += tokens

    def _matrix(self, num_cols: int) -> torch.Tensor:
        if not self.rows:
            return torch.zeros(0, num_cols)
        dtype = _common_dtype(self.rows)
        scores = torch.cat([r.to(dtype) for r in self.rows])
        if scores.shape[1] < num_cols:  # columns added by a later checkpoint
            scores = torch.nn.functional.pad(scores, (0, num_cols - scores.shape[1]))
        return scores

    def result(self, columns: list[str], output_dir: str | None) -> AttributionScore:
        """The rows as an :class:`AttributionScore` over ``columns``."""
        if not self.rows:
            raise ValueError(
                "the train source yielded no gradients: is the train set (or store) empty?"
            )
        scores = self._matrix(len(columns))
        tokens = None
        if self.tokens is not None:
            tokens = [
                torch.nn.functional.pad(t.to(scores.dtype), (0, len(columns) - t.shape[1]))
                for t in self.tokens
            ]
        return AttributionScore(
            scores,
            self.hashes,
            self.steps,
            columns,
            token_scores=tokens,
            output_dir=output_dir,
            train_checkpoints=self.checkpoints,
            repeats=self.repeats,
        )

    # ---- checkpoints ----
    def take_new(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """The rows added since the last call, as a checkpoint part (``None``: nothing new)."""
        n = self.num_rows
        if n == self._taken:
            return None
        first = self._taken
        self._taken = n
        done = 0
        parts = []
        for r in self.rows:
            lo, hi = done, done + r.shape[0]
            if hi > first:
                parts.append(r[max(0, first - lo) :])
            done = hi
        tensors = {"scores": torch.cat(parts).contiguous()}
        meta: dict[str, Any] = {
            "hashes": self.hashes[first:],
            "steps": self.steps[first:],
            "checkpoints": self.checkpoints[first:],
        }
        if self.tokens is not None:
            toks = self.tokens[first:]
            meta["token_lengths"] = [int(t.shape[0]) for t in toks]
            tensors["tokens"] = (
                torch.cat(toks).contiguous() if toks else torch.zeros(0, tensors["scores"].shape[1])
            )
        return tensors, meta

    def add_part(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Re-add a part written by :meth:`take_new` (resuming)."""
        tokens = None
        if self.tokens is not None:
            tokens = list(torch.split(tensors["tokens"], list(meta["token_lengths"])))
        self.add(tensors["scores"], meta["hashes"], meta["steps"], meta["checkpoints"], tokens)
        self._taken = self.num_rows


class TopKSink:
    """Per query, the ``k`` largest and ``k`` smallest agnostic scores, streamed.

    A NaN score ranks after every other one (:mod:`dattri_llm.attribution.ranking`), so it is
    never kept; the first one met is warned about.

    Args:
        k: How many proponents and opponents to keep per query (``(M, k)`` tensors are
            allocated: the callers clamp ``k`` to the number of train samples first).
        num_cols: ``M``, the queries.
        counts: ``{train hash: rows}`` — how many score rows each sample will get (its steps
            and checkpoints, and duplicated items); a sample's score enters the top-k once its
            rows are all in. A row of a sample not in ``counts`` (or beyond its count) is an
            error: its earlier rows may already have been ranked alone.
        duplicates: As ``AttributionScore.agnostic_matrix``'s: ``"warn"`` / ``"sum"`` combine
            the rows of a sample seen twice at one step (warning with ``"warn"``); ``"error"``
            refuses them. (``"separate"`` has no top-k meaning and is refused.)
        repeats: ``"sum"`` or ``"mean"``: how a sample's rows under one checkpoint label
            combine (labels are summed).
        label_counts: ``{(train hash, checkpoint): rows}``, needed by ``"mean"`` (each row
            weighs ``1 / rows``) and reported by :meth:`label_counts`.
    """

    def __init__(
        self,
        k: int,
        num_cols: int,
        counts: Mapping[str, int],
        duplicates: str = "warn",
        repeats: str = "sum",
        label_counts: Mapping[tuple[str, int], int] | None = None,
    ) -> None:
        if duplicates not in ("warn", "sum", "error"):
            raise ValueError(
                f"top_k streaming takes duplicates='warn', 'sum' or 'error', got {duplicates!r}."
            )
        self.k = int(k)
        self.num_cols = int(num_cols)
        self.counts = counts
        self.duplicates = duplicates
        self.repeats = repeats
        if repeats == "mean" and label_counts is None:
            raise ValueError("TopKSink(repeats='mean') needs label_counts (rows per label).")
        self._label_counts = label_counts
        # under "mean", the rows to reweigh: those of a sample seen several times under a label
        self._weigh = repeats == "mean" and any(n > 1 for n in label_counts.values())
        self.num_train = 0  # samples whose score is complete
        self.top_vals: torch.Tensor | None = None  # (M, k)
        self.top_ids = torch.full((self.num_cols, self.k), -1, dtype=torch.long)
        self.bot_vals: torch.Tensor | None = None
        self.bot_ids = torch.full((self.num_cols, self.k), -1, dtype=torch.long)
        self.ids: list[str] = []  # id -> train hash of the samples that can still be kept
        self.row_step: list[int] = []  # id -> its step (-1: several)
        self.row_ckpt: list[int] = []
        self.row_occ: dict[int, list[tuple[int, int]]] = {}  # id -> (ckpt, step) of its rows
        # hash -> [partial (M,), rows left, step, ckpt, (step, ckpt) seen]
        self.pending: dict[str, list[Any]] = {}
        self._dup_warned = False
        self._nan_warned = False
        self._single = all(n == 1 for n in counts.values())

    # ---- streaming ----
    def add(
        self,
        scores: torch.Tensor,
        hashes: Sequence[str],
        steps: Sequence[int],
        checkpoints: Sequence[int],
        tokens: Any = None,
    ) -> None:
        """Rank score rows ``(b, M)``; a sample's rows are combined before it is ranked."""
        scores = scores.detach().to("cpu")
        if self._weigh:
            n = [self._label_counts.get((str(h), int(c)), 1) for h, c in zip(hashes, checkpoints)]
            w = 1.0 / torch.as_tensor(n, dtype=torch.float64)
            scores = scores * w.to(scores.dtype).unsqueeze(1)
        if self._single and not self.pending and self.counts.keys() >= set(hashes):
            # every sample has one row (one checkpoint, one epoch): rank the rows as they are,
            # with no Python work per row
            first = len(self.ids)
            self.ids += [str(h) for h in hashes]
            self.row_step += [int(s) for s in steps]
            self.row_ckpt += [int(c) for c in checkpoints]
            self.num_train += len(hashes)
            if len(hashes):
                self._merge(scores, torch.arange(first, first + len(hashes)))
            return
        direct: list[int] = []
        done: list[tuple[str, torch.Tensor, int, int]] = []
        for i, h in enumerate(hashes):
            h = str(h)
            n = self.counts.get(h)
            if n is None:
                raise ValueError(
                    f"top_k: train sample {h!r} was not announced before scoring (its rows are "
                    "counted in advance to sum them exactly); this is a bug of the train "
                    "source's row counts."
                )
            if n == 1 and h not in self.pending:
                direct.append(i)
                continue
            key = (int(steps[i]), int(checkpoints[i]))
            entry = self.pending.get(h)
            if entry is None:
                entry = [scores[i].clone(), n - 1, key[0], key[1], [key]]
                self.pending[h] = entry
            else:
                if entry[1] <= 0:
                    raise ValueError(
                        f"top_k: train sample {h!r} has more rows than announced ({n})."
                    )
                self._check_duplicate(h, key, entry[4])
                entry[0] += scores[i]
                entry[1] -= 1
                entry[4].append(key)
                if key[0] != entry[2]:
                    entry[2] = -1
                if key[1] != entry[3]:
                    entry[3] = -1
            if entry[1] == 0:
                del self.pending[h]
                done.append((h, entry[0], entry[2], entry[3], entry[4]))
        rows, ids = [], []
        if direct:
            idx = torch.as_tensor(direct, dtype=torch.long)
            rows.append(scores.index_select(0, idx))
            for i in direct:
                ids.append(self._new_id(str(hashes[i]), int(steps[i]), int(checkpoints[i])))
        if done:
            rows.append(torch.stack([d[1] for d in done]))
            for h, _, s, c, seen in done:
                ids.append(self._new_id(h, s, c, [(ck, st) for st, ck in seen]))
        if rows:
            self._merge(torch.cat(rows), torch.as_tensor(ids, dtype=torch.long))

    def _check_duplicate(self, h: str, key: tuple[int, int], seen: list) -> None:
        if key not in seen:
            return
        combined = "summed" if self.repeats == "sum" else "averaged (repeats='mean')"
        message = (
            f"train sample {h!r} occurs more than once at step {key[0]}: identical samples "
            f"share one id, so their rows are {combined} into one. Deduplicate the train set, "
            "or pass duplicates='sum' to combine them without this message."
        )
        if self.duplicates == "error":
            raise ValueError(message)
        if self.duplicates == "warn" and not self._dup_warned:
            self._dup_warned = True
            warnings.warn(message, UserWarning, stacklevel=4)

    def _new_id(
        self, h: str, step: int, ckpt: int, occ: list[tuple[int, int]] | None = None
    ) -> int:
        self.ids.append(h)
        self.row_step.append(step)
        self.row_ckpt.append(ckpt)
        self.num_train += 1
        if occ is not None and len(occ) > 1:
            self.row_occ[len(self.ids) - 1] = sorted(occ)
        return len(self.ids) - 1

    def label_counts(self) -> dict[tuple[str, int], int] | None:
        """``{(train hash, checkpoint): rows}`` announced before scoring (``None``: unknown)."""
        return None if self._label_counts is None else dict(self._label_counts)

    def _merge(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        m = self.num_cols
        if self.top_vals is None:
            self.top_vals = torch.full((m, self.k), float("-inf"), dtype=rows.dtype)
            self.bot_vals = torch.full((m, self.k), float("inf"), dtype=rows.dtype)
        nan = bool(rows.isnan().any())  # the kept lists never hold one: the rows decide
        if nan and not self._nan_warned:
            self._warn_nan(rows, ids)
        cols = rows.T  # (M, f)
        all_ids = ids.unsqueeze(0).expand(m, -1)
        self.top_vals, self.top_ids = _keep_extremes(
            [self.top_vals, cols], [self.top_ids, all_ids], self.k, True, nan
        )
        self.bot_vals, self.bot_ids = _keep_extremes(
            [self.bot_vals, cols], [self.bot_ids, all_ids], self.k, False, nan
        )
        if len(self.ids) > 8 * (2 * self.k * m + 256):
            self._compact()

    def _warn_nan(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        """Warn once that NaN scores were met (never kept: see ``attribution.ranking``)."""
        nan = rows.isnan()
        self._nan_warned = True
        r, c = (int(x) for x in nan.nonzero()[0])
        warnings.warn(
            f"top_k: train sample {self.ids[int(ids[r])]!r} has a NaN score for query column "
            f"{c} ({int(nan.any(dim=1).sum())} sample(s) with NaN scores in this block): NaN "
            "scores rank after every other score and are not kept. A NaN comes from non-finite "
            "gradients (a diverged step, or a store written with non-finite values); "
            "recapture them, with storage_dtype='bfloat16' or 'float32' if a float16 store "
            "overflowed.",
            UserWarning,
            stacklevel=5,
        )

    def _compact(self) -> None:
        """Forget the samples no query keeps (their ids are renumbered)."""
        used = torch.cat([self.top_ids.flatten(), self.bot_ids.flatten()])
        used = torch.unique(used[used >= 0])
        remap = torch.full((len(self.ids) + 1,), -1, dtype=torch.long)
        remap[used] = torch.arange(used.numel())
        self.top_ids = remap[self.top_ids]  # -1 maps to remap[-1] = -1
        self.bot_ids = remap[self.bot_ids]
        keep = used.tolist()
        self.ids = [self.ids[i] for i in keep]
        self.row_step = [self.row_step[i] for i in keep]
        self.row_ckpt = [self.row_ckpt[i] for i in keep]
        self.row_occ = {j: self.row_occ[i] for j, i in enumerate(keep) if i in self.row_occ}

    # ---- result ----
    def check_complete(self) -> None:
        """Refuse a result while some sample's rows are still missing."""
        if self.pending:
            h, entry = next(iter(self.pending.items()))
            raise ValueError(
                f"top_k: {len(self.pending)} train sample(s) did not get all their rows (e.g. "
                f"{h!r}: {entry[1]} row(s) missing); the train source yielded fewer rows than "
                "its index announced."
            )

    def result(self, columns: list[str], output_dir: str | None) -> AttributionScore:
        """The kept scores: one row per kept sample, ``NaN`` where not kept for a query."""
        self.check_complete()
        if self.num_train == 0:
            raise ValueError(
                "the train source yielded no gradients: is the train set (or store) empty?"
            )
        self._compact()
        assert self.top_vals is not None and self.bot_vals is not None
        n = len(self.ids)
        dtype = self.top_vals.dtype
        mat = torch.full((n, self.num_cols), float("nan"), dtype=dtype)
        cols = torch.arange(self.num_cols).unsqueeze(1).expand(-1, self.k)
        for ids, vals in ((self.top_ids, self.top_vals), (self.bot_ids, self.bot_vals)):
            ok = ids >= 0
            mat[ids[ok], cols[ok]] = vals[ok]
        if mat.shape[1] < len(columns):
            mat = torch.nn.functional.pad(mat, (0, len(columns) - mat.shape[1]), value=float("nan"))
        return AttributionScore(
            mat,
            self.ids,
            self.row_step,
            columns,
            output_dir=output_dir,
            train_checkpoints=self.row_ckpt,
            top_k_kept=self.k,
            num_train=self.num_train,
            repeats=self.repeats,
            occurrences={self.ids[i]: occ for i, occ in self.row_occ.items()},
        )

    # ---- checkpoints ----
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Tensors and JSON metadata of the whole state (a checkpoint rewrites it)."""
        self._compact()
        tensors: dict[str, torch.Tensor] = {
            "top_ids": self.top_ids.contiguous(),
            "bot_ids": self.bot_ids.contiguous(),
        }
        if self.top_vals is not None:
            tensors["top_vals"] = self.top_vals.contiguous()
            tensors["bot_vals"] = self.bot_vals.contiguous()
        pend = list(self.pending.items())
        if pend:
            tensors["pending"] = torch.stack([e[0] for _, e in pend]).contiguous()
        meta = {
            "k": self.k,
            "num_cols": self.num_cols,
            "num_train": self.num_train,
            "ids": self.ids,
            "row_step": self.row_step,
            "row_ckpt": self.row_ckpt,
            "pending": [[h, e[1], e[2], e[3], [list(x) for x in e[4]]] for h, e in pend],
            "dup_warned": self._dup_warned,
            "repeats": self.repeats,
            "row_occ": {str(i): [list(x) for x in occ] for i, occ in self.row_occ.items()},
        }
        return tensors, meta

    def load_state(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a state written by :meth:`state`."""
        if meta["k"] != self.k or meta["num_cols"] != self.num_cols:
            raise ValueError("top_k checkpoint was written for another k or query set.")
        self.num_train = int(meta["num_train"])
        self.top_ids, self.bot_ids = tensors["top_ids"], tensors["bot_ids"]
        self.top_vals = tensors.get("top_vals")
        self.bot_vals = tensors.get("bot_vals")
        self.ids = list(meta["ids"])
        self.row_step = [int(s) for s in meta["row_step"]]
        self.row_ckpt = [int(c) for c in meta["row_ckpt"]]
        self.row_occ = {int(i): [(c, s) for c, s in occ] for i, occ in meta["row_occ"].items()}
        self.pending = {}
        for i, (h, left, step, ckpt, keys) in enumerate(meta["pending"]):
            keys = [tuple(x) for x in keys]
            self.pending[h] = [tensors["pending"][i].clone(), int(left), step, ckpt, keys]
        self._dup_warned = bool(meta["dup_warned"])


def merge_top_k(
    states: Sequence[tuple[Mapping[str, torch.Tensor], Mapping[str, Any]]],
    counts: Mapping[str, int],
    duplicates: str = "warn",
) -> TopKSink:
    """Merge the top-k states of ranks that scored disjoint sets of train samples.

    Each rank's lists are the exact top / bottom ``k`` of its samples (combined by the rule
    the states record), so the global ones are the top / bottom ``k`` of their concatenation.
    """
    meta0 = states[0][1]
    k, m = int(meta0["k"]), int(meta0["num_cols"])
    out = TopKSink(k, m, counts, duplicates)
    out.repeats = str(meta0.get("repeats", "sum"))  # the ranks applied it already
    cand: dict[bool, list[tuple[torch.Tensor, torch.Tensor]]] = {True: [], False: []}
    total = 0
    for tensors, meta in states:
        if meta["pending"]:
            raise ValueError("merge_top_k: a rank's top-k state still has incomplete samples.")
        total += int(meta["num_train"])
        if "top_vals" not in tensors:
            continue  # a rank without train rows
        local_ids = torch.cat([tensors["top_ids"].flatten(), tensors["bot_ids"].flatten()])
        used = sorted({int(i) for i in local_ids.tolist() if i >= 0})
        remap = torch.full((len(meta["ids"]) + 1,), -1, dtype=torch.long)
        occ = meta.get("row_occ", {})
        for i in used:
            remap[i] = out._new_id(
                meta["ids"][i], meta["row_step"][i], meta["row_ckpt"][i], occ.get(str(i))
            )
        cand[True].append((tensors["top_vals"], remap[tensors["top_ids"]]))
        cand[False].append((tensors["bot_vals"], remap[tensors["bot_ids"]]))
    out.num_train = total
    if cand[True]:
        out.top_vals, out.top_ids = _keep_extremes(*zip(*cand[True]), k, largest=True)
        out.bot_vals, out.bot_ids = _keep_extremes(*zip(*cand[False]), k, largest=False)
    return out


def top_k_of(score: AttributionScore, k: int, duplicates: str = "warn") -> AttributionScore:
    """Reduce a full result to the top-k form (sources without an index; trajectory methods)."""
    if score.top_k_kept is not None:
        return score
    ids, matrix = score.agnostic_matrix(duplicates)  # combined by the score's own rule
    where: dict[str, tuple[int, int]] = {}
    occ: dict[str, list[tuple[int, int]]] = {}
    for h, s, c in zip(score.train_hashes, score.train_steps, score.train_checkpoints):
        old = where.get(h)
        where[h] = (s, c) if old is None else (s if old[0] == s else -1, c if old[1] == c else -1)
        occ.setdefault(h, []).append((c, s))
    k = clamp_top_k(k, len(ids))
    sink = TopKSink(k, score.num_test, dict.fromkeys(ids, 1), "sum")
    sink.add(matrix, ids, [where[h][0] for h in ids], [where[h][1] for h in ids])
    sink.repeats = score.repeats  # applied by agnostic_matrix
    sink.row_occ = {i: sorted(occ[h]) for i, h in enumerate(sink.ids) if len(occ[h]) > 1}
    return sink.result(list(score.test_hashes), score.output_dir)
