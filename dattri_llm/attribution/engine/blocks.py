"""The parts the shared score loop (:mod:`dattri_llm.attribution.base`) is built from.

* :class:`LiveSource` — the live train side: streamed, and remembered within a memory budget;
* :class:`Accumulator` — collects score rows (and token scores) into an ``AttributionScore``,
  checking that every train block was captured like the first and like the test side;
* :class:`WeightsWatch` — one checkpoint label, one set of weights (fingerprints compared);
* block checks — hashes per row, token axes, duplicate test rows.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.gradient.compat import CaptureFacts, check_same_capture, facts_of
from dattri_llm.gradient.gradient import Gradient, GradientBlock, Materialized, Shared
from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY as FINGERPRINT_KEY
from dattri_llm.gradient.layer_gradient import concat_layer
from dattri_llm.gradient.optim.second_moment import check_same_correction

if TYPE_CHECKING:
    from dattri_llm.attribution.engine.prepared import PreparedTest
    from dattri_llm.attribution.engine.protocol import ScoringMethod

__all__ = [
    "LiveSource",
    "Accumulator",
    "WeightsWatch",
    "check_query_weights",
    "stored_label_weights",
    "GRANULARITIES",
    "source_name",
    "first_occurrences",
    "check_granularity",
    "check_hashes",
    "check_token_axis",
    "join_releasing",
]

GRANULARITIES = ("sample", "token")


class LiveSource:
    """The live train side handed to ``fit``: not re-readable, but remembered within a budget.

    The first complete iteration keeps its blocks while their total size stays within
    ``budget`` bytes; later iterations (a second fit pass, the scoring loop) then read memory
    instead of running the model again. Past the budget nothing is kept.
    """

    rereadable = False
    yields_blocks = True

    def __init__(self, make: Callable[[], Iterator[GradientBlock]], budget: int) -> None:
        self._make = make
        self._budget = budget
        self._blocks: list[GradientBlock] | None = None

    def __iter__(self) -> Iterator[GradientBlock]:
        if self._blocks is not None:
            yield from self._blocks
            return
        kept: list[GradientBlock] | None = [] if self._budget > 0 else None
        size = 0
        for block in self._make():
            if kept is not None:
                size += block.gradient.nbytes
                if size <= self._budget:
                    kept.append(block)
                else:
                    kept = None  # over budget: later reads stream again
            yield block
        self._blocks = kept

    def cached(self, checkpoint: int) -> list[GradientBlock] | None:
        """The kept blocks of one checkpoint, or ``None`` when nothing was kept."""
        if self._blocks is None:
            return None
        return [b for b in self._blocks if int(b.checkpoint) == checkpoint]


class WeightsWatch:
    """Warns when the blocks of one pairing key were captured at different weights.

    The methods that run on the score loop read the blocks of one pairing key (the checkpoint
    label, or LESS's step with ``pair_by="step"``) as gradients at one set of weights (Grad-Dot
    / Grad-Cos, each TracIn checkpoint, K-FAC / EK-FAC, LESS). Each record carries a
    fingerprint of the weights it was captured at (:mod:`dattri_llm.gradient.hooks.fingerprint`);
    two different fingerprints under one key (of one rank) mean that a loop trained while it
    captured without relabelling, and the scores would mix gradients at different weights.

    A label the store declares as a training interval (``checkpoints.json``, written by
    :class:`~dattri_llm.integrations.hf_trainer.AttributionCallback`: the records of one epoch
    or of the steps between two saves, standing for the weights at its end) spans several
    weights on purpose and is not warned about.

    Args:
        side: ``"train"`` or ``"test"`` (for the message).
        intervals: Pairing keys declared as training intervals.
    """

    def __init__(self, side: str, intervals: Collection[int] = ()) -> None:
        self.side = side
        self.intervals = {int(k) for k in intervals}
        self._first: dict[tuple[int, str], tuple[str, int]] = {}  # (key, rank) -> first
        self._warned = False

    def see(self, block: GradientBlock, key: int) -> None:
        """Compare a block's fingerprint with the first one of its pairing key; warn once."""
        fingerprint = block.metadata.get(FINGERPRINT_KEY)
        if self._warned or not isinstance(fingerprint, str) or int(key) in self.intervals:
            return
        rank, _, value = fingerprint.partition(":")
        first, step = self._first.setdefault((int(key), rank), (value, int(block.step)))
        if first != value:
            self._warned = True
            warnings.warn(
                f"the {self.side} gradients of checkpoint {block.checkpoint} (pairing key "
                f"{key}) were captured at different weights (steps {step} and {block.step} "
                "differ): this method reads them as gradients at one set of weights, so its "
                "scores mix gradients taken at different weights. Label each set of weights "
                "before capturing it (HookManager.checkpoint = k, e.g. once per saved "
                "checkpoint), or capture at fixed weights (no optimizer step inside collect()).",
                UserWarning,
                stacklevel=4,
            )


def check_query_weights(
    train: Mapping[int, set[str] | None],
    tests: Mapping[int, str | None],
    train_name: str,
    test_name: str,
) -> None:
    """Refuse test gradients captured at weights that match none of their train labels'.

    A test side at pairing key ``k`` is scored against the train label ``k`` (or, when the test
    side has a single key, against every train label); gradients at other weights than the
    ones those labels stand for are not comparable, and the scores would mean nothing.

    Args:
        train: ``{train label: fingerprints it stands for, or None when unknown}``
            (:func:`~dattri_llm.gradient.store.checkpoints.label_weights`).
        tests: ``{test pairing key: fingerprint of its first record, or None}``.
        train_name: How the message names the train side.
        test_name: How the message names the test side.

    Raises:
        ValueError: naming the test key, its fingerprint, the train labels with theirs, and
            the fix.
    """
    for key, fingerprint in tests.items():
        paired = list(train) if len(tests) == 1 else [key] if key in train else []
        known = [train[c] for c in paired]
        if fingerprint is None or not paired or any(k is None for k in known):
            continue  # nothing to compare, or a label whose weights are not known
        rank = fingerprint.partition(":")[0]
        if not any(f.partition(":")[0] == rank for k in known for f in k):
            continue  # fingerprints of another rank's shard (FSDP) are not comparable
        if any(fingerprint in k for k in known):
            continue
        listed = "; ".join(f"label {c}: {', '.join(sorted(train[c]))}" for c in paired)
        raise ValueError(
            f"the {test_name} (checkpoint label {key}) was captured at weights with fingerprint "
            f"{fingerprint}, which match none of the weights of the train checkpoint label(s) it "
            f"is scored against in the {train_name} ({listed}). Gradients taken at other "
            "weights are not comparable, so the scores would mean nothing. Capture the queries "
            "at the weights of the checkpoint you attribute at: right after trainer.train() "
            "for the last label, or after loading checkpoint k's weights for label k; "
            "dattri_llm.integrations.hf_trainer.capture_queries(model, queries, dir, "
            "train_store=...) labels them with the matching checkpoint. If scoring across "
            "weights is what you mean, pass AttributionArguments(check_weights=False)."
        )


def stored_label_weights(
    source: Any, test_source: Any = None
) -> tuple[dict[int, set[str] | None], set[int]]:
    """``(label_weights, declared interval labels)`` of a store-backed train source.

    The label weights are empty (nothing to compare) for a source without a store, and when the
    test side is not a store that captured the same layers: a fingerprint covers the captured
    layers' parameters, so two captures of different layers have different fingerprints at the
    same weights.
    """
    from dattri_llm.gradient.store.checkpoints import declared_labels, label_weights

    store = getattr(source, "store", None)
    if store is None or not callable(getattr(store, "index_entries", None)):
        return {}, set()
    declared = set(declared_labels(store.save_dir))
    test_store = getattr(test_source, "store", None)
    if test_store is None or set(getattr(test_store, "layer_names", ())) != set(store.layer_names):
        return {}, declared
    return label_weights(store, getattr(source, "checkpoints", None)), declared


class Accumulator:
    """Checks every train block's capture and hands its score rows to a sink.

    The sink (:mod:`dattri_llm.attribution.engine.sinks`) keeps the full matrix (default) or a
    streamed top-k.
    """

    def __init__(self, granularity: str, source: str = "train source", sink: Any = None) -> None:
        from dattri_llm.attribution.engine.sinks import FullSink

        self.granularity = granularity
        self.source = source
        self.sink = sink if sink is not None else FullSink(granularity)
        self.facts: CaptureFacts | None = None  # of the first train block
        self.weights = WeightsWatch("train")
        #: Checks of the whole call run once, after the first train block's own checks (so a
        #: block's more specific refusal, such as a capture-time correction, is raised first).
        self.deferred: list[Callable[[], None]] = []
        self._checked: set[int] = set()  # test sides the train facts were checked against

    def check_facts(
        self, attributor: ScoringMethod, block: GradientBlock, test: PreparedTest
    ) -> None:
        """Check a train block against the first one and, once, the first against the test."""
        self.weights.see(block, attributor.pairing_key(block))
        if self.facts is None:
            self.facts = facts_of(block.gradient, block.metadata, self.source)
        else:
            check_same_capture(
                self.facts, block.gradient, self.source, f"the block at step {block.step}"
            )
        if id(test) not in self._checked:
            attributor.check_compatible(self.facts, test.facts)
            self._checked.add(id(test))
        check_same_correction(  # every block: a store may hold several corrections
            block.metadata,
            test.facts.metadata,
            f"the train gradients at step {block.step} ({self.source})",
            f"the test gradients ({test.facts.source or 'test'})",
        )
        while self.deferred:
            self.deferred.pop(0)()

    def add(
        self, scores: torch.Tensor, block: GradientBlock, tokens: list[torch.Tensor] | None
    ) -> None:
        """Append one train block's score rows (and per-token scores)."""
        n = scores.shape[0]
        self.add_rows(
            scores, block.hashes, [int(block.step)] * n, [int(block.checkpoint)] * n, tokens
        )

    def add_rows(
        self,
        scores: torch.Tensor,
        hashes: list[str],
        steps: list[int],
        checkpoints: list[int],
        tokens: list[torch.Tensor] | None,
    ) -> None:
        """Append score rows with each row's identity, step and checkpoint."""
        self.sink.add(scores, hashes, steps, checkpoints, tokens)

    def result(self, columns: list[str], output_dir: str | None) -> AttributionScore:
        """The collected rows as an :class:`AttributionScore` over ``columns``."""
        return self.sink.result(columns, output_dir)


def source_name(source: Any, side: str) -> str:
    """How errors name a source: its store directory, or "train / test source"."""
    store = getattr(source, "store", None)
    if store is not None and hasattr(store, "save_dir"):
        return f"{side} store {store.save_dir}"
    return f"{side} source"


def first_occurrences(hashes: list[str], checkpoint: int, source: str) -> list[int]:
    """Rows of the first occurrence of each test id (a duplicate would double its column)."""
    first: dict[str, int] = {}
    for i, h in enumerate(hashes):
        first.setdefault(h, i)
    if len(first) < len(hashes):
        dup = next(h for i, h in enumerate(hashes) if first[h] != i)
        warnings.warn(
            f"test sample {dup!r} occurs {hashes.count(dup)} times in the {source} at checkpoint "
            f"{checkpoint} ({len(hashes) - len(first)} duplicate row(s) in all): identical "
            "samples share one id and one score column, which holds one occurrence's score. "
            "Deduplicate the test set to silence this.",
            UserWarning,
            stacklevel=4,
        )
    return sorted(first.values())


def check_granularity(g: str) -> None:
    """Refuse an unknown ``attribution_granularity``."""
    if g not in GRANULARITIES:
        raise ValueError(f"attribution_granularity must be one of {GRANULARITIES}, got {g!r}.")


def check_hashes(block: GradientBlock, side: str) -> None:
    """Refuse a block without exactly one sample identity per gradient row."""
    n = block.gradient.batch_size
    if len(block.hashes) != n:
        raise ValueError(
            f"{side} block at step {block.step} (checkpoint {block.checkpoint}) has "
            f"{len(block.hashes)} sample hashes for {n} gradient rows: every row needs exactly one "
            "hash (check the capture's set_sample_ids / hash_keys)."
        )


def check_token_axis(grad: Gradient) -> None:
    """Refuse token granularity on layers captured without their token axis."""
    bad = []
    for name, lg in grad.layers.items():
        sites = lg.sites if isinstance(lg, Shared) else [lg]
        if any(isinstance(s, Materialized) for s in sites):
            bad.append(name)
    if bad:
        raise ValueError(
            f"attribution_granularity='token' needs the train gradients' token axis, but layers "
            f"{bad} are materialized (no token axis). A store written with the defaults keeps "
            "each layer in its smaller form; write the train store with "
            "OffloadCallback(keep_token_factors=True) to keep the token axis. Capture "
            "factorized: HookManagerConfig(capture_style='factorized') and no 'dense' / 'mask' "
            "projection."
        )


def join_releasing(blocks: list[GradientBlock], names: list[str]) -> Gradient:
    """The blocks' gradients joined along the batch, layer by layer; empties ``blocks``.

    Each block's copy of a layer is dropped as soon as that layer is joined, so the join peaks
    at the joined gradients plus one layer of the blocks, not twice the blocks (the test side:
    4x512 GPT-2, 256 train x 32 queries, peak RSS of ``attribute()`` 1090 -> 899 MB with the
    in-place sum of ``Shared.materialize``; a train chunk: see ``ScoreLoop.chunk_rows``). The
    blocks' own ``Gradient`` objects are not modified; their tensors are freed when nothing
    else holds the blocks, which is why the list is emptied in place.
    """
    parts = [dict(b.gradient.select_layers(names).layers) for b in blocks]
    blocks.clear()
    if len(parts) == 1:
        return Gradient(parts[0])
    return Gradient({n: concat_layer([p.pop(n) for p in parts]) for n in names})
