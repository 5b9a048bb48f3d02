"""``BaseAttributor``: the attributor interface, and the one road every call takes.

The entry points (:meth:`~BaseAttributor.attribute`, :meth:`~BaseAttributor.attribute_from_cache`,
:meth:`~BaseAttributor.attribute_sources`) are written once, here: each resolves its two sides
(a dataset streamed live with the task's model, a store, or any gradient source), opens the
call's plan (per-call options merged over the constructor's, undone when the call returns) and
hands both sides to one driver. Train blocks are scored against the test gradients of the same
checkpoint, ``score_block_size`` train rows by ``score_block_size`` test columns at a time, and
collected into an :class:`AttributionScore`. The loop itself is the score engine
(:mod:`dattri_llm.attribution.engine`); a method overrides the extension points below, never an
entry point.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.engine import distributed
from dattri_llm.attribution.engine.blocks import (
    Accumulator,
    LiveSource,
    WeightsWatch,
    check_granularity,
    check_hashes,
    check_query_weights,
    first_occurrences,
    join_releasing,
    source_name,
    stored_label_weights,
)
from dattri_llm.attribution.engine.distributed import row_keys
from dattri_llm.attribution.engine.prepared import PreparedTest, densify_test
from dattri_llm.attribution.engine.resume import ScoreCheckpoint, checkpoint_for
from dattri_llm.attribution.engine.scoring import ScoreLoop, final_result, progress_bar
from dattri_llm.attribution.engine.sinks import FullSink, TopKSink, label_counts_of
from dattri_llm.attribution.engine.units import row_counts, units_of
from dattri_llm.attribution.engine.vector_scan import run_vector_scan, vector_units
from dattri_llm.attribution.normalization import refuse_double_correction
from dattri_llm.attribution.ranking import check_top_k, clamp_top_k
from dattri_llm.attribution.score import AttributionScore, check_repeats
from dattri_llm.attribution.task import AttributionTask
from dattri_llm.gradient import ops
from dattri_llm.gradient.compat import (
    CaptureFacts,
    check_compatible,
    check_same_capture,
    facts_of,
)
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.hooks import HookManagerConfig
from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY as FINGERPRINT_KEY
from dattri_llm.gradient.optim.second_moment import check_same_correction
from dattri_llm.gradient.sources import GradientBlock, GradientSource, as_source
from dattri_llm.utils.distributed import get_rank, get_world_size

__all__ = ["BaseAttributor", "CallPlan", "LiveSides", "StoredSides"]

_MODES = ("auto", "factorized", "materialized")
_NO_TOKEN_SPLIT = (
    "attribution_granularity='token' is not split across ranks (per-token scores are not "
    "gathered); run token attribution in one process."
)


@dataclass(frozen=True)
class LiveSides:
    """The two sides of a live call: datasets streamed through the task's model."""

    train_set: Any
    test_set: Any
    hook_config: HookManagerConfig | None
    collate_fn: Callable[[list[Any]], Any] | None


@dataclass(frozen=True)
class StoredSides:
    """The two sides of a stored call: gradient sources (stores or any other source)."""

    train: Any
    test: Any


@dataclass(frozen=True)
class CallPlan:
    """What one call asks for, once its options are checked.

    Attributes:
        where: The entry point (as errors name it).
        granularity: ``"sample"`` or ``"token"``.
        top_k: Keep each test sample's ``top_k`` largest and smallest scores (``None``: all).
        fit_options: The call's options that are not the method's :attr:`call_options`,
            passed to :meth:`BaseAttributor.fit`.
    """

    where: str
    granularity: str
    top_k: int | None
    fit_options: dict[str, Any]


class BaseAttributor:
    """Base of the gradient-based attributors: data handling, pairing and the score loop.

    Entry points: :meth:`attribute` (live: a model, a train set and a test set; nothing is
    written), :meth:`attribute_from_cache` (two gradient stores; no model) and
    :meth:`attribute_sources` (any two :class:`GradientSource`). They are written once, here,
    and every method takes the same road through them: a call's keyword options named in
    :attr:`call_options` set the constructor's option of that name for the call alone (checked
    by :meth:`check_option`; nothing survives the call), the others go to :meth:`fit`; then
    :meth:`score_live` (live) or :meth:`score` (stored) runs the engine. A method implements its
    mathematics in the extension points below; the trajectory methods replace :meth:`score`
    with their sweep.

    Pairing: a train block captured at checkpoint ``c`` is scored against the test gradients
    captured at checkpoint ``c``; a test side with a single checkpoint pairs with every train
    block. Live runs stream the test set once per checkpoint, keep its gradients, then stream
    the train set at that checkpoint (rows get ``step = checkpoint index``).

    Extension points (override in subclasses; each default is the plain gradient dot product):

    * ``fit(train_source, **kwargs)`` — optional pre-pass over the train gradients before any
      scoring (e.g. K-FAC covariances, keyed by ``block.checkpoint``). ``kwargs`` are the extra
      keyword arguments of the ``attribute*`` call; the default accepts none. In the live path
      the source streams every checkpoint (it loads them) and is not re-readable.
    * ``check_call(granularity, live)`` — refuse a call the method cannot score (e.g. token
      granularity on materialized, corrected gradients) before anything is read.
    * ``check_option(name, value, where)`` — validate a per-call option of
      :attr:`call_options`.
    * ``prepare_test(gradient, checkpoint) -> Gradient`` — applied once to the concatenated test
      gradients of a checkpoint before scoring (e.g. an inverse-Fisher preconditioner, a
      normalisation). Default: identity.
    * ``prepare_train(gradient, checkpoint) -> Gradient`` — applied to every chunk of at most
      ``score_block_size`` train rows (row-wise maps only: normalisation, weights). Default:
      identity.
    * ``block_weight(block) -> float`` — a weight multiplying every score of a train block
      (e.g. LESS's learning rate of the block's step). Default: 1.
    * ``pairing_key(block) -> int`` — which test gradients a train block is scored against:
      train and test blocks with equal keys pair. Default: ``block.checkpoint``.
    * ``check_block(block, side)`` — validate each train / test block (``side`` is
      ``"train"`` or ``"test"``) before use, e.g. that a train store was preconditioned.
    * ``streamer_options(checkpoint, side) -> dict`` — extra ``GradientStreamer`` arguments
      of the live path (e.g. the optimizer of a preconditioned train side).
    * ``check_compatible(train_facts, test_facts)`` — refuse train and test gradients that
      cannot be scored against each other (:class:`~dattri_llm.gradient.compat.CaptureFacts`:
      layers, layer types / ``module_kwargs``, projection; the dtype and record metadata, e.g.
      a preconditioned train capture, are recorded for an override to judge). Default:
      :func:`~dattri_llm.gradient.compat.check_compatible` ignoring :attr:`compat_ignore`.
    * ``score_block(train_grad, test_grad, granularity) -> Tensor`` — scores of a train chunk
      against a test chunk: ``(B_train, B_test)`` for ``"sample"``, ``(B_train, T, B_test)``
      for ``"token"`` (rows summed over ``T`` are the instance scores, so the per-token split
      is only meaningful when the score is linear in the train gradient). Default:
      ``ops.cross_dot`` / ``ops.cross_dot_per_token`` routed with ``self.mode``.
    * ``default_repeats() -> str`` — how a sample's rows under one checkpoint label combine
      when ``repeats=`` is not given (``"mean"`` for a cosine, ``"sum"`` otherwise);
      ``warn_repeats(labels)`` — the warning when a sample occurs several times under a label.

    Args:
        args: Run options (batch sizes, device, ``score_block_size``, ``output_dir``, ...).
        task: An :class:`AttributionTask` (or a dattri task, adapted); needed by
            :meth:`attribute`, not by :meth:`attribute_from_cache`.
        mode: Routing of the inner products: ``"auto"`` (cost model), ``"factorized"`` or
            ``"materialized"``; every mode is exact.
        repeats: How the rows of one train sample under one checkpoint label combine (a loop
            captured over several epochs under one label, or a duplicated item): ``"sum"``
            (each occurrence adds its score) or ``"mean"`` (their mean). ``None``: the
            method's :meth:`default_repeats` — ``"mean"`` for a cosine (``normalized_grad``),
            so a cosine stays in ``[-1, 1]``, ``"sum"`` for the dot-product and influence
            scores. Checkpoint labels are always summed. The result records the rule
            (:attr:`AttributionScore.repeats`) and how often each sample occurs
            (:meth:`AttributionScore.occurrence_counts`).
    """

    #: What the train / test compatibility check does not compare (see
    #: :func:`~dattri_llm.gradient.compat.compare_facts`).
    compat_ignore: tuple[str, ...] = ()
    #: Whether :meth:`fit` is collective under ``torch.distributed`` (every rank must then
    #: hold train records of every checkpoint).
    collective_fit: bool = False
    #: Score ``top_k`` over a vector store with the block reader (``engine/vector_scan.py``):
    #: for attributors whose ``prepare_train`` / ``score_block`` act row by row.
    vector_scan: bool = False
    #: Constructor options a call may set for itself (``attribute*(..., name=value)``): the
    #: value holds for that call alone (``None`` keeps the constructor's), checked by
    #: :meth:`check_option`. Every other keyword option of a call goes to :meth:`fit`.
    call_options: ClassVar[tuple[str, ...]] = ()
    #: Whether ``attribute_from_cache(checkpoints=...)`` filters the test store as well as
    #: the train store.
    filter_test_checkpoints: ClassVar[bool] = True
    #: Scratch of the call in progress (e.g. a warning given once per call); emptied when the
    #: call returns.
    call_state: dict[str, Any]

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        mode: str = "auto",
        repeats: str | None = None,
    ) -> None:
        if args is not None and not isinstance(args, AttributionArguments):
            raise TypeError(f"args must be an AttributionArguments, got {type(args).__name__}.")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}.")
        self.args = args if args is not None else AttributionArguments()
        self.task = AttributionTask.coerce(task)
        self.mode = mode
        self.repeats = (
            None if repeats is None else check_repeats(repeats, f"{type(self).__name__}(repeats=)")
        )
        self.call_state = {}

    @property
    def device(self) -> torch.device:
        """Where scores are computed (see :attr:`AttributionArguments.device`)."""
        return self.args.device

    # ---- extension points ------------------------------------------------------------------
    def default_repeats(self) -> str:
        """The ``repeats`` rule when none is given: ``"mean"`` for a cosine, else ``"sum"``.

        A cosine (``normalized_grad=True``: Grad-Cos, TracIn-Cos per checkpoint, TrackStar)
        averages a sample's occurrences under one label, so it stays a cosine; a dot product
        or an influence adds them (each occurrence is a step the sample trained at). LESS
        and the trajectory methods sum (their scores are sums over the steps).
        """
        return "mean" if getattr(self, "normalized_grad", False) else "sum"

    def repeats_rule(self) -> str:
        """The ``repeats`` rule of the call in progress (the constructor's, or the default)."""
        return self.repeats if self.repeats is not None else self.default_repeats()

    def fit(self, train_source: GradientSource, **kwargs: Any) -> None:
        """Pre-pass over the train gradients before scoring (default: nothing to fit)."""
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} takes no extra arguments, got {sorted(kwargs)}."
            )

    def check_compatible(self, train: CaptureFacts, test: CaptureFacts) -> None:
        """Refuse train and test gradients captured incompatibly (before anything is scored).

        Raises:
            IncompatibleGradientsError: naming the two sources and every difference.
        """
        check_compatible(train, test, ignore=self.compat_ignore)
        refuse_double_correction(self, train)

    def prepare_test(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Map the test gradients of one checkpoint before scoring (default: identity)."""
        return gradient

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Map a chunk of train gradients before scoring (default: identity)."""
        return gradient

    def block_weight(self, block: GradientBlock) -> float:
        """A weight multiplying every score of a train block (default: 1)."""
        return 1.0

    def pairing_key(self, block: GradientBlock) -> int:
        """Train and test blocks with equal keys are scored together (default: checkpoint)."""
        return int(block.checkpoint)

    def check_block(self, block: GradientBlock, side: str) -> None:
        """Validate a train or test block before use (default: nothing to check)."""

    def streamer_options(self, checkpoint: int, side: str) -> dict[str, Any]:
        """Extra ``GradientStreamer`` arguments of the live path (default: none)."""
        return {}

    def score_block(
        self, train_grad: Gradient, test_grad: Gradient, granularity: str
    ) -> torch.Tensor:
        """Scores of a train chunk against a test chunk (default: routed inner products)."""
        if granularity == "token":
            return ops.cross_dot_per_token(train_grad, test_grad, mode=self.mode)
        return ops.cross_dot(train_grad, test_grad, mode=self.mode)

    # ---- the call's plan -------------------------------------------------------------------
    def check_option(self, name: str, value: Any, where: str) -> Any:
        """Validate a per-call option (one of :attr:`call_options`); return the value to use.

        Default: the value as given. A method with call options checks them here, with the
        same rules as its constructor.
        """
        return value

    def check_call(self, granularity: str, live: bool) -> None:
        """Refuse a call the method cannot score, before anything is read (default: none).

        Args:
            granularity: The call's ``attribution_granularity``.
            live: Whether the call streams from the task's model (:meth:`attribute`).
        """

    @contextlib.contextmanager
    def _plan(self, options: dict[str, Any], where: str) -> Iterator[dict[str, Any]]:
        """Within: the call's own values of :attr:`call_options`; yields the other options.

        A call's option overrides the constructor's value for that call alone (``None`` keeps
        the constructor's); on return every option is back to the constructor's value and
        :attr:`call_state` is emptied, so no call reads what an earlier one left.
        ``call_state["options"]`` names the options the call set.
        """
        name = type(self).__name__
        own = {k: v for k, v in options.items() if k in self.call_options and v is not None}
        checked = {k: self.check_option(k, v, f"{name}.{where}({k}=)") for k, v in own.items()}
        outer, self.call_state = self.call_state, {"options": frozenset(checked)}
        try:
            with self._overriding(checked):
                yield {k: v for k, v in options.items() if k not in self.call_options}
        finally:
            self.call_state = outer

    @contextlib.contextmanager
    def _overriding(self, values: dict[str, Any]) -> Iterator[None]:
        """Within: these attributes set to these values; restored on the way out."""
        kept = {k: getattr(self, k) for k in values}
        try:
            for key, value in values.items():
                setattr(self, key, value)
            yield
        finally:
            for key, value in kept.items():
                setattr(self, key, value)

    def _drive(
        self,
        where: str,
        sides: LiveSides | StoredSides,
        granularity: str,
        top_k: int | None,
        options: dict[str, Any],
    ) -> AttributionScore:
        """The one road: validate the call, open its plan, score the two sides.

        The warnings the call gives are recorded in the result (``score.warnings``, saved
        with it) and given as usual.
        """
        check_granularity(granularity)
        k = check_top_k(top_k)
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught, self._plan(options, where) as rest:
                live = isinstance(sides, LiveSides)
                self.check_call(granularity, live)
                plan = CallPlan(where, granularity, k, rest)
                if live:
                    score = self.score_live(sides, plan)
                else:
                    score = self.score(sides.train, sides.test, plan)
        finally:
            for w in caught:  # given again outside the recorder, to the caller's filters
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        score.warnings = [*score.warnings, *(str(w.message) for w in caught)]
        return score

    # ---- entry points ----------------------------------------------------------------------
    def attribute(
        self,
        train_set: Any,
        test_set: Any,
        hook_config: HookManagerConfig | None = None,
        attribution_granularity: str = "sample",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        top_k: int | None = None,
        **options: Any,
    ) -> AttributionScore:
        """Attribute live: stream gradients from the task's model; nothing is written.

        Args:
            train_set: Sequence or ``Dataset`` of train samples (dicts or tuples of tensors).
            test_set: Same for the test samples.
            hook_config: Which layers to capture (default: every supported trainable layer).
            attribution_granularity: ``"sample"`` or ``"token"`` (one score per train token
                position as well; needs factorized capture).
            collate_fn: Overrides ``args.dataloader_collate``.
            top_k: Keep only each test sample's ``top_k`` largest and smallest scores while
                streaming (see :meth:`attribute_sources`).
            **options: The method's per-call options (:attr:`call_options`, e.g.
                ``normalized_grad=`` or ``damping=``: for this call only); the others are
                passed to :meth:`fit`.

        Under ``torch.distributed`` each rank scores a contiguous slice of ``train_set``
        (see :mod:`dattri_llm.attribution.engine.distributed`).
        """
        if self.task is None:
            raise ValueError(
                f"{type(self).__name__}.attribute needs a task: pass "
                "task=AttributionTask(loss_func=..., model=...) to the constructor, "
                "or use attribute_from_cache with gradient stores."
            )
        for name, ds in (("train_set", train_set), ("test_set", test_set)):
            if not hasattr(ds, "__getitem__") and not hasattr(ds, "__iter__"):
                raise TypeError(
                    f"{name} must be a sequence or a torch Dataset of samples, got "
                    f"{type(ds).__name__}."
                )
        sides = LiveSides(train_set, test_set, hook_config, self._collate(collate_fn))
        return self._drive("attribute", sides, attribution_granularity, top_k, options)

    def attribute_from_cache(
        self,
        train_dir: str | os.PathLike | Any,
        test_dir: str | os.PathLike | Any,
        attribution_granularity: str = "sample",
        layers: Sequence[str] | None = None,
        checkpoints: Sequence[int] | None = None,
        top_k: int | None = None,
        **options: Any,
    ) -> AttributionScore:
        """Attribute from two gradient stores (no model, no backward).

        Args:
            train_dir: Store of the train gradients (its directory or a
                ``GradientStorageManager``; a trajectory method also takes a
                :class:`~dattri_llm.ReplayGradientSource`).
            test_dir: Store of the test gradients, captured on the same layers.
            attribution_granularity: ``"sample"`` or ``"token"``.
            layers: Score only these layers, exact stored names (default: all captured); a
                name a store does not hold is refused, listing the stored ones. Selects from
                stores only: with a gradient source, build the source with the selection.
            checkpoints: Read only records with these checkpoint labels from both stores
                (e.g. ``[last]`` for Grad-Dot on stores captured at several checkpoints);
                default: all.
            top_k: Keep only each test sample's ``top_k`` largest and smallest scores (see
                :meth:`attribute_sources`).
            **options: As for :meth:`attribute`.
        """
        for name, where in (("train_dir", train_dir), ("test_dir", test_dir)):
            if where is None or isinstance(where, (str, os.PathLike)):
                if where is None or not os.path.isdir(where):
                    raise FileNotFoundError(
                        f"{name} {os.fspath(where) if where is not None else None!r} is not a "
                        "directory: pass the save_dir of a GradientStorageManager the gradients "
                        "were offloaded to."
                    )
        test_checkpoints = checkpoints if self.filter_test_checkpoints else None
        sides = StoredSides(
            self._stored_side(train_dir, layers, checkpoints),
            self._stored_side(test_dir, layers, test_checkpoints),
        )
        return self._drive("attribute_from_cache", sides, attribution_granularity, top_k, options)

    def attribute_sources(
        self,
        train_source: GradientSource | Iterable[GradientBlock],
        test_source: GradientSource | Iterable[GradientBlock],
        attribution_granularity: str = "sample",
        top_k: int | None = None,
        **options: Any,
    ) -> AttributionScore:
        """Attribute from any two gradient sources.

        A source yields ``(step, Gradient, hashes)`` blocks, optionally with ``checkpoint``
        (default 0) and ``metadata`` after them, or :class:`GradientBlock` (see
        :func:`~dattri_llm.gradient.sources.as_source`). ``fit`` reads ``train_source`` first
        when a method needs it, so pass a re-readable source to such attributors.

        Args:
            train_source: The train gradients.
            test_source: The test gradients.
            attribution_granularity: ``"sample"`` or ``"token"``.
            top_k: Keep only each test sample's ``top_k`` largest and smallest scores (see
                :meth:`score`). A positive int; beyond the number of train samples it is
                clamped to that number (every sample, ranked). A ``NaN`` score ranks after
                every other score (:mod:`dattri_llm.attribution.ranking`).
            **options: As for :meth:`attribute`.
        """
        sides = StoredSides(train_source, test_source)
        return self._drive("attribute_sources", sides, attribution_granularity, top_k, options)

    def _stored_side(self, where: Any, layers: Sequence[str] | None, checkpoints: Any) -> Any:
        """A store (directory or manager) opened as a source; any other source as it is."""
        from dattri_llm.gradient.sources import DiskGradientSource
        from dattri_llm.gradient.store import GradientStorageManager

        if not isinstance(where, (str, os.PathLike, GradientStorageManager)):
            # a gradient source (e.g. a ReplayGradientSource) yields what it was built to:
            # a selection passed here would be dropped without a word, so it is refused
            chosen = {"layers": layers, "checkpoints": checkpoints}
            passed = [k for k, v in chosen.items() if v is not None]
            if passed:
                raise ValueError(
                    f"{type(self).__name__}.attribute_from_cache({'=, '.join(passed)}=) selects "
                    f"from a store, but this side is a {type(where).__name__}, which yields "
                    "what it was built to yield. Pass the store's directory or "
                    "GradientStorageManager instead, or build the source with the selection "
                    "(DiskGradientSource(store, layers=..., checkpoints=...); a "
                    "ReplayGradientSource captures the layers of its hook config)."
                )
            return where
        return DiskGradientSource(where, layers=layers, device=self.device, checkpoints=checkpoints)

    # ---- the drivers -----------------------------------------------------------------------
    def score_live(self, sides: LiveSides, plan: CallPlan) -> AttributionScore:
        """Score a live call: per checkpoint, the test set's gradients, then the train set's.

        Args:
            sides: The datasets, hook config and collate of the call.
            plan: The call's granularity, ``top_k`` and options for :meth:`fit`.
        """
        granularity, k = plan.granularity, plan.top_k
        from dattri_llm.gradient.streaming import GradientStreamer

        args, task = self.args, self.task
        train_set, test_set = sides.train_set, sides.test_set
        hook_config, collate_fn = sides.hook_config, sides.collate_fn

        def stream(ds: Any, loss: Callable, bs: int, c: int, desc: str) -> GradientStreamer:
            side = "test" if desc.startswith("test") else "train"
            return GradientStreamer(
                task.model,
                ds,
                loss,
                hook_config=hook_config,
                batch_size=bs,
                checkpoint=c,
                collate_fn=collate_fn,
                num_workers=args.dataloader_num_workers,
                drop_last=args.dataloader_drop_last,
                show_progress=args.show_progress,
                desc=desc,
                **self.streamer_options(c, side),
            )

        def train_source() -> Iterator[GradientBlock]:
            for c in range(task.num_checkpoints):
                task.load_checkpoint(c)
                yield from stream(
                    train_set,
                    task.train_loss,
                    args.per_device_train_batch_size,
                    c,
                    f"train ckpt {c}",
                )

        keys = None
        if k is not None:
            # before the sink allocates its (M, k) lists: the whole train set bounds the
            # samples (the same bound on every rank, so that their lists merge)
            k = clamp_top_k(k, len(train_set))
        split = distributed.active(args)
        if split:
            distributed.join(args, f"{type(self).__name__}.attribute")
            if granularity == "token":
                raise ValueError(_NO_TOKEN_SPLIT)
            n = len(train_set)
            mine = distributed.live_slice(n, get_rank(), get_world_size())
            if not args.dataloader_drop_last:  # else rows may be dropped: rank order
                keys = [[c, i] for c in range(task.num_checkpoints) for i in mine]
            train_set = torch.utils.data.Subset(train_set, list(mine))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            live = LiveSource(train_source, int(args.live_cache_gb * 2**30))
            self.fit_call(live, None, sides, plan.fit_options)
            counts = labels = None
            if k is not None:
                from dattri_llm.gradient.streaming import sample_id

                counts, labels = {}, {}
                for i in range(len(train_set)):
                    h = sample_id(train_set[i], hook_config)
                    counts[h] = counts.get(h, 0) + task.num_checkpoints
                    for c in range(task.num_checkpoints):
                        labels[(h, c)] = labels.get((h, c), 0) + 1
            columns: dict[str, int] = {}
            acc: Accumulator | None = None
            for c in range(task.num_checkpoints):
                task.load_checkpoint(c)
                test_blocks = list(
                    stream(
                        test_set,
                        task.test_loss,
                        args.per_device_eval_batch_size,
                        c,
                        f"test ckpt {c}",
                    )
                )
                test = self._test_side(
                    test_blocks, c, columns, grow=(c == 0), source="the live test set"
                )
                del test_blocks  # the test side holds what scoring needs
                if acc is None:
                    acc = Accumulator(
                        granularity,
                        "the live train set",
                        self._sink(k, granularity, counts, len(columns), labels),
                    )
                train = live.cached(c)  # blocks fit already streamed, if they were kept
                if train is None:
                    train = stream(
                        train_set,
                        task.train_loss,
                        args.per_device_train_batch_size,
                        c,
                        f"train ckpt {c}",
                    )
                ScoreLoop(self, {c: test}, len(columns), acc).run_blocks(train)
                del test
        assert acc is not None
        return self._result(acc.sink, list(columns), k, keys, split)

    def fit_call(
        self, train: Any, test: Any, sides: LiveSides | None, fit_options: dict[str, Any]
    ) -> None:
        """Run :meth:`fit` for one call, before any score (default: ``fit(train, **options)``).

        Args:
            train: The train side as the fit reads it (a source, the store's units of this
                rank, or the live stream).
            test: The test blocks of a stored call (``None`` on the live path).
            sides: The live call's datasets (``None`` for stored sides).
            fit_options: The call's options that are not :attr:`call_options`.
        """
        self.fit(train, **fit_options)

    def score(self, train_source: Any, test_source: Any, plan: CallPlan) -> AttributionScore:
        """Score two gradient sources: the engine behind the stored entry points.

        Train blocks are joined into chunks sized from ``args.score_memory_gb`` (see
        :mod:`dattri_llm.attribution.engine.scoring`). Over a store:

        * ``top_k=k`` streams: per test sample only the ``k`` largest and ``k`` smallest
          agnostic scores are kept (memory ``O(M·k)`` plus one chunk; a sample's rows at
          several steps or checkpoints are summed first, the store's index counting them in
          advance). The result is an :class:`AttributionScore` with ``top_k_kept=k`` whose
          ``top_k(k' <= k)`` equals sorting the full matrix. Over other sources (no index) the
          full matrix is computed and then reduced.
        * ``args.resumable`` checkpoints the partial result after every chunk under
          ``args.output_dir`` and resumes an interrupted identical call
          (:mod:`dattri_llm.attribution.engine.resume`).
        * under ``torch.distributed`` the records are split across ranks and the results
          merged (:mod:`dattri_llm.attribution.engine.distributed`).

        Args:
            train_source: The train gradients (any source :func:`as_source` reads).
            test_source: The test gradients.
            plan: The call's granularity, ``top_k`` and options for :meth:`fit`.
        """
        granularity, k = plan.granularity, plan.top_k
        train_source, test_source = as_source(train_source, "train"), as_source(test_source, "test")
        names = (source_name(train_source, "train"), source_name(test_source, "test"))
        if all(hasattr(s, "capture_facts") for s in (train_source, test_source)):
            # stores: refuse an incompatible pair before any pass over the train gradients
            self.check_compatible(train_source.capture_facts(), test_source.capture_facts())
        units = units_of(train_source)
        split = distributed.active(self.args)
        if split:
            distributed.join(self.args, f"{type(self).__name__}.{plan.where}")
            if granularity == "token":
                raise ValueError(_NO_TOKEN_SPLIT)
            if units is None:
                raise ValueError(
                    "distributed scoring splits the records of a gradient store across ranks; "
                    f"the train source {names[0]} has no store index. Offload the train "
                    "gradients to a store (OffloadCallback) and use attribute_from_cache, or "
                    "give each rank its own train source and merge the scores yourself."
                )
            full = units
            units, _ = distributed.split_units(full, get_rank(), get_world_size())
            distributed.check_shares(full, units, self.collective_fit)
        test_blocks = list(test_source)  # read once: a fit on train and queries reads it too
        self.fit_call(units if split else train_source, test_blocks, None, plan.fit_options)
        by_ckpt: dict[int, list[GradientBlock]] = {}
        for block in test_blocks:
            by_ckpt.setdefault(self.pairing_key(block), []).append(block)
        if not by_ckpt:
            raise ValueError("the test source yielded no gradients.")
        train_weights, intervals = stored_label_weights(train_source, test_source)
        fingerprints = {c: blocks[0].metadata.get(FINGERPRINT_KEY) for c, blocks in by_ckpt.items()}
        columns: dict[str, int] = {}
        tests = {
            c: self._test_side(blocks, c, columns, grow=True, source=names[1])
            for c, blocks in sorted(by_ckpt.items())
        }
        del by_ckpt, test_blocks
        counts = labels = None
        if units is not None:
            counts = row_counts(units.units)
            labels = label_counts_of(
                [h for u in units.units for h in u.hashes],
                [u.checkpoint for u in units.units for _ in u.hashes],
            )
        if k is not None and counts is not None:
            # before the sink allocates its (M, k) lists: beyond the train samples means every
            # one (the samples of every rank, so that the ranks' lists merge)
            k = clamp_top_k(k, len(row_counts(full.units)) if split else len(counts))
        sink = self._sink(k, granularity, counts, len(columns), labels)
        acc = Accumulator(granularity, names[0], sink)
        acc.weights = WeightsWatch("train", intervals)
        if self.args.check_weights and type(self).pairing_key is BaseAttributor.pairing_key:
            acc.deferred.append(
                lambda: check_query_weights(train_weights, fingerprints, names[0], names[1])
            )
        loop = ScoreLoop(self, tests, len(columns), acc)
        show = self.args.show_progress
        checkpoint = None
        if units is None:
            total = getattr(train_source, "num_samples", None)
            bar = progress_bar(show, total, "scoring")
            loop.run_blocks(train_source, bar)
        else:
            if self.args.resumable:
                checkpoint = self._checkpoint(units, tests, granularity, k, columns)
            start = checkpoint.resume(sink) if checkpoint is not None else 0
            done = sum(u.num_rows for u in units.units[:start])
            bar = progress_bar(show, units.num_samples, "scoring", initial=done)
            vectors = self._vector_layers(units, k, granularity)
            if vectors is not None and checkpoint is None:
                run_vector_scan(self, units, vectors, tests, len(columns), acc, bar)
            else:
                loop.run_units(units, checkpoint, bar, start)
        if bar is not None:
            bar.close()
        out = self._result(sink, list(columns), k, row_keys(units) if split else None, split)
        if checkpoint is not None:
            checkpoint.finish()
        return out

    def _vector_layers(self, units: Any, k: int | None, granularity: str) -> Any:
        """The layers of the vector fast path (``engine/vector_scan.py``), or ``None``.

        It runs for ``top_k`` over a store whose selected layers are fixed-size vectors, for an
        attributor that opts in (``vector_scan = True``) and keeps the base class's per-block
        rules (pairing by checkpoint, block weight 1, no block check); not with ``resumable``.
        """
        cls = type(self)
        if (
            k is None
            or granularity != "sample"
            or not cls.vector_scan
            or self.args.resumable
            or cls.pairing_key is not BaseAttributor.pairing_key
            or cls.block_weight is not BaseAttributor.block_weight
            or cls.check_block is not BaseAttributor.check_block
        ):
            return None
        return vector_units(units)

    def _collate(self, collate_fn: Callable[[list[Any]], Any] | None) -> Any:
        """``collate_fn``, or the padding collate ``args.dataloader_collate="pad"`` asks for."""
        if collate_fn is None and self.args.dataloader_collate == "pad":
            from dattri_llm.gradient.streaming import pad_collate

            return pad_collate(self.args.dataloader_pad_value)
        return collate_fn

    # ---- sinks, checkpoints, merge ------------------------------------------------------------
    def _sink(
        self, k: int | None, granularity: str, counts: Any, num_cols: int, labels: Any = None
    ) -> Any:
        if k is None or counts is None:
            return FullSink(granularity, self.repeats_rule())
        if granularity == "token":
            raise ValueError(
                "top_k keeps whole-sample scores; attribution_granularity='token' needs the "
                "full per-token scores (drop top_k, or use granularity 'sample')."
            )
        return TopKSink(k, num_cols, counts, repeats=self.repeats_rule(), label_counts=labels)

    def _result(
        self, sink: Any, columns: list[str], k: int | None, keys: Any, split: bool
    ) -> AttributionScore:
        """The sink's result; merged over ranks when scoring is split; top-k reduced.

        Warns when a train sample occurs several times under one checkpoint label, naming
        the ``repeats`` rule that combined its rows.
        """
        self.warn_repeats(sink.label_counts())
        return final_result(sink, columns, k, keys, self.args.output_dir, split)

    def warn_repeats(self, labels: dict[tuple[str, int], int] | None) -> None:
        """Warn once when a train sample occurs several times under one checkpoint label.

        Args:
            labels: ``{(train hash, checkpoint): rows}`` of the call (``None``: unknown).
        """
        many = {key: n for key, n in (labels or {}).items() if n > 1}
        if not many:
            return
        (h, c), n = max(many.items(), key=lambda kv: kv[1])
        samples = len({h for h, _ in many})
        rule = self.repeats_rule()
        how = "the mean of their scores" if rule == "mean" else "the sum of their scores"
        name = type(self).__name__
        warnings.warn(
            f"{samples} train sample(s) occur several times under one checkpoint label (e.g. "
            f"{h!r}: {n} times under checkpoint {c}): several epochs captured under one label, "
            f"or duplicated items. {name} combines a sample's rows under one label by "
            f"repeats={rule!r} ({how}). To score each epoch at its own weights, label it "
            "(HookManager.checkpoint = epoch) and the labels are summed as TracIn "
            f"checkpoints; to choose the rule, pass {name}(repeats='sum' or 'mean'). "
            "AttributionScore.occurrences(hash) lists where a sample occurs.",
            UserWarning,
            stacklevel=6,  # the caller of attribute*
        )

    def _checkpoint(
        self, units: Any, tests: dict, granularity: str, k: int | None, columns: dict
    ) -> ScoreCheckpoint:
        """The checkpoint of this call (its key: what the result depends on)."""
        chunks = [t.chunks for _, t in sorted(tests.items())]
        return checkpoint_for(self, units, chunks, granularity, k, list(columns))

    # ---- the loop --------------------------------------------------------------------------
    def _test_side(
        self,
        blocks: list[GradientBlock],
        checkpoint: int,
        columns: dict[str, int],
        grow: bool,
        source: str = "test source",
    ) -> PreparedTest:
        if not blocks:
            raise ValueError(
                f"no test gradients at checkpoint {checkpoint}: is the test set empty?"
            )
        hashes: list[str] = []
        seen: dict[str, tuple[int, int]] = {}  # hash -> (block, step) of its first capture
        weights = WeightsWatch("test")
        for i, b in enumerate(blocks):
            check_hashes(b, "test")
            self.check_block(b, "test")
            weights.see(b, checkpoint)
            for h in b.hashes:
                # twice at one step: identical content at the same weights, identical gradient
                # (one column keeps it, see first_occurrences); at two steps: possibly other
                # weights
                if h in seen and seen[h][1] != int(b.step):
                    raise ValueError(
                        f"test sample {h!r} has several gradients (two captures) for pairing key "
                        f"{checkpoint} (steps {seen[h][1]} and {b.step}); they would be mixed "
                        "into one query silently. Capture each query once per checkpoint, or "
                        "label the captures (HookManager.checkpoint) so each pairs with its "
                        "train checkpoint."
                    )
                seen.setdefault(h, (i, int(b.step)))
            hashes += list(b.hashes)
        names = blocks[0].gradient.layer_names
        facts = facts_of(blocks[0].gradient, blocks[0].metadata, source)
        for b in blocks[1:]:
            if set(b.gradient.layer_names) != set(names):
                raise ValueError(
                    f"test blocks disagree on their layers at checkpoint {checkpoint}: "
                    f"{sorted(names)} vs {sorted(b.gradient.layer_names)} (step {b.step})."
                )
            check_same_capture(facts, b.gradient, source, f"the block at step {b.step}")
            check_same_correction(
                blocks[0].metadata,
                b.metadata,
                f"the test gradients of {source} (first block)",
                f"those of step {b.step}",
            )
        del b  # the loops' last block: the join frees the blocks' layers as it goes
        grad = join_releasing(blocks, names)
        keep = first_occurrences(hashes, checkpoint, source)
        if len(keep) < len(hashes):
            grad, hashes = grad.slice(keep), [hashes[i] for i in keep]
        grad = self.prepare_test(grad.to(self.device), checkpoint)
        if type(self).score_block is BaseAttributor.score_block:
            grad = self._densify_test(grad)
        for h in hashes:
            if h not in columns:
                if not grow:
                    raise ValueError(
                        f"test sample {h!r} at checkpoint {checkpoint} was not "
                        "seen at checkpoint 0; the test set must not change."
                    )
                columns[h] = len(columns)
        cols = torch.as_tensor([columns[h] for h in hashes], dtype=torch.long)
        bs = self.args.score_block_size
        chunks = [
            (grad.slice(slice(i, i + bs)), cols[i : i + bs]) for i in range(0, len(hashes), bs)
        ]
        return PreparedTest(chunks, names, grad.dtype, facts)

    def _densify_test(self, grad: Gradient) -> Gradient:
        """The test side, its layers worth materializing once materialized.

        See :func:`~dattri_llm.attribution.engine.prepared.densify_test`.
        """
        return densify_test(grad, self.mode, self.args)
