"""``TrajectoryAttributor``: base of methods unrolling a training run (DVEmb, AdamW-influence).

What a new trajectory method gets from it:

* **Steps in order.** :func:`step_index` turns a train source into random access by step —
  a gradient store (records grouped by step label, micro-batches and rank partitions
  together), a :class:`~dattri_llm.ReplayGradientSource` (recomputed from snapshots), or any
  in-memory source — and checks that no step in between is missing.
* **Dense rows.** Per step, the per-sample shares as one ``(B, P)`` matrix over the captured
  coordinates (layers concatenated in a fixed order), and the queries' gradients the same way.
* **Schedules.** :func:`as_schedule` reads a learning rate (a number, a sequence by step, a
  mapping, a callable) and refuses a missing one instead of defaulting to 1.
* **The score container**: one row per (sample, step it occurred at); ``agnostic_matrix`` sums
  a sample's occurrences.

Subclasses implement :meth:`TrajectoryAttributor.step_loader`: for each step, the linearised
update (a :class:`~dattri_llm.attribution.trajectory.unroll.LinearStep`) and the removals'
pushes; the base runs the sweep. The linearised optimizer steps are in
:mod:`dattri_llm.attribution.trajectory.unroll`.

Conventions: a positive score means removing the sample would raise the query's loss (it
helped); the training loss's reduction must be given (``loss_reduction="sum"`` — the
library's convention — or ``"mean"``): it sets the scale of the curvature and what removing a
sample does to its batch (a mean is then taken over the others, see
:meth:`TrajectoryAttributor.removal_pushes`); numerics follow the inputs (float64 stays
float64; ``compute_dtype`` may raise precision, never lower it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from dattri_llm.attribution.base import BaseAttributor, CallPlan, LiveSides
from dattri_llm.attribution.engine import distributed
from dattri_llm.attribution.engine.sinks import top_k_of
from dattri_llm.attribution.normalization import check_flag, unit_per_sample, unit_rows_dense
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.trajectory.curvature import check_curvature
from dattri_llm.attribution.trajectory.reduction import (
    REDUCTIONS,
    checked_loads,
    recorded_reduction,
    resolve_reduction,
)
from dattri_llm.attribution.trajectory.training import LiveRunArguments, record_training
from dattri_llm.attribution.trajectory.unroll import (
    LinearStep,
    StepPushes,
    adjoint_sweep,
    forward_sweep,
)
from dattri_llm.gradient.gradient import Gradient, GradientBlock
from dattri_llm.gradient.sources import as_source
from dattri_llm.utils.progress import progress

__all__ = ["TrajectoryAttributor", "StepIndex", "step_index", "as_schedule", "dense_rows"]

_METHODS = ("adjoint", "forward")


def as_schedule(value: Any, name: str, by: str = "step") -> Callable[[int], float]:
    """A ``key -> value`` function from a number, sequence, mapping or callable.

    Raises:
        TypeError: for anything else (e.g. ``None``: a missing learning rate is an error).
    """
    if isinstance(value, bool) or value is None:
        raise TypeError(f"{name} must be a number, a sequence, a mapping or a callable.")
    if isinstance(value, (int, float)):
        constant = float(value)
        return lambda key: constant
    if callable(value):
        return lambda key: float(value(key))
    if isinstance(value, Mapping):
        table = {int(k): float(v) for k, v in value.items()}

        def from_mapping(key: int) -> float:
            if key not in table:
                raise KeyError(f"{name} has no value for {by} {key}; it covers {sorted(table)}.")
            return table[key]

        return from_mapping
    if isinstance(value, (Sequence, torch.Tensor)) and not isinstance(value, str):
        values = [float(v) for v in value]

        def from_sequence(key: int) -> float:
            if not 0 <= key < len(values):
                raise KeyError(f"{name} has no value for {by} {key}; it has {len(values)} values.")
            return values[key]

        return from_sequence
    raise TypeError(
        f"{name} must be a number, a sequence, a mapping or a callable, got {type(value).__name__}."
    )


class StepIndex:
    """Random access to a train source's blocks by step."""

    def __init__(self, steps: Sequence[int], load: Callable[[int], list[GradientBlock]]) -> None:
        self.steps = sorted(int(s) for s in steps)
        self._load = load

    def load(self, step: int) -> list[GradientBlock]:
        """Every block of one step (micro-batches and rank partitions)."""
        return self._load(int(step))

    def check_contiguous(self, where: str) -> None:
        """Refuse a trajectory with steps missing in between."""
        if not self.steps:
            raise ValueError(f"{where}: the train gradients hold no steps.")
        missing = sorted(set(range(self.steps[0], self.steps[-1] + 1)) - set(self.steps))
        if missing:
            raise ValueError(
                f"{where}: the train gradients skip steps {missing[:10]}"
                f"{' ...' if len(missing) > 10 else ''}; unrolling a training run needs every "
                "step between the first and the last (capture with offload_interval=1)."
            )


def step_index(
    source: Any,
    layers: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
) -> StepIndex:
    """Random access by step to a store, a store directory, a replay source or any source."""
    from dattri_llm.gradient.sources import DiskGradientSource, store_reading
    from dattri_llm.gradient.store import GradientStorageManager

    if isinstance(source, (str, os.PathLike, GradientStorageManager)):
        source = DiskGradientSource(source, layers=layers, device=device)
    reading = store_reading(source)
    if reading is not None:
        store = reading.store
        by_step: dict[int, list[int]] = {}
        for i, rec in enumerate(store.records()):
            if reading.wants(rec.checkpoint):
                by_step.setdefault(rec.step, []).append(i)

        def load_disk(step: int) -> list[GradientBlock]:
            out = []
            for i in by_step[step]:
                r = store.load_record(i, layers=reading.layers, device=reading.device)
                out.append(GradientBlock(r.step, r.gradient, r.hashes, r.checkpoint, r.metadata))
            return out

        return StepIndex(list(by_step), load_disk)
    source = as_source(source, "train")
    if hasattr(source, "load_step") and hasattr(source, "steps"):
        return StepIndex(source.steps(), source.load_step)
    blocks: dict[int, list[GradientBlock]] = {}
    for b in source:
        blocks.setdefault(int(b.step), []).append(b)
    return StepIndex(list(blocks), lambda step: blocks[step])


def dense_rows(
    blocks: Iterable[GradientBlock], layers: Sequence[str], dtype: torch.dtype, device: Any
) -> tuple[torch.Tensor, list[str]]:
    """``(B, P)`` rows over ``layers`` (in that order) and the rows' identities."""
    mats, hashes = [], []
    for b in blocks:
        names = b.gradient.layer_names
        if set(names) != set(layers):
            raise ValueError(
                f"the gradients at step {b.step} hold layers {sorted(names)}, expected "
                f"{sorted(layers)}; capture every step (and the queries) with one hook config."
            )
        mats.append(b.gradient.select_layers(layers).flatten().to(device, dtype))
        hashes += [str(h) for h in b.hashes]
    return torch.cat(mats), hashes


def layer_widths(gradient: Gradient, layers: Sequence[str]) -> dict[str, int]:
    """Captured coordinates per layer."""
    return {n: int(gradient.layers[n].materialize().data.shape[1]) for n in layers}


class TrajectoryAttributor(BaseAttributor):
    """Base of the attributors that unroll the training trajectory.

    Subclasses implement :meth:`run`; see the module docstring for what the base provides.

    Args:
        args: Run options.
        task: For the live path.
        loss_reduction: How the training loss of the captured run combined each batch:
            ``"sum"`` (``loss = Σ ℓ_z``) or ``"mean"`` (``loss = Σ ℓ_z / B``, e.g.
            ``model(**batch).loss``). It sets ``κ`` in the batch curvature ``κ Σ s sᵀ`` and how
            a removal re-normalises the batch (the captured ``s`` are the samples' shares
            either way), so it changes every score. ``None``: what the capture recorded
            (``OffloadCallback(loss_reduction=...)``; an argument contradicting it is an
            error); recorded nowhere, the live ``attribute`` (trained with the task's sum) uses
            ``"sum"``, and a store (``attribute_from_cache``, ``attribute_sources``, ``embed``)
            is refused with a ValueError naming both ways to declare it.
        compute_dtype: Raise the precision of the propagation (e.g. ``torch.float64`` for a
            float32 run); never lowers it.
        method: ``"adjoint"`` (the queries' adjoints carried backward: memory ∝ queries) or
            ``"forward"`` (every removal carried forward: memory ∝ samples); the same numbers.
        normalized_grad: TrackStar's cosine: each train sample's displacement (summed over its
            occurrences) and each query divided by its norm, so a sample's rows sum
            (``agnostic_matrix``) to the cosine. Needs ``method="forward"``.
        live_run: The run the live :meth:`attribute` trains and records (optimizer, learning
            rate, schedule, epochs; default :class:`LiveRunArguments`).
        curvature: Each step's batch-loss curvature: one of :attr:`curvatures` or an
            :class:`~dattri_llm.attribution.trajectory.curvature.ExactHessian`.
        repeats: ``"sum"`` (or ``None``) only: a sample's rows (one per step it trained at)
            are the parts of one number, the effect of removing it from the whole run, so
            ``"mean"`` is refused.
    """

    name = "trajectory"

    def __init__(
        self,
        args: Any = None,
        task: Any = None,
        loss_reduction: str | None = None,
        compute_dtype: torch.dtype | None = None,
        method: str = "adjoint",
        normalized_grad: bool = False,
        live_run: LiveRunArguments | None = None,
        curvature: Any = "empirical_fisher",
        repeats: str | None = None,
    ) -> None:
        super().__init__(args, task, repeats=repeats)
        if self.repeats == "mean":
            raise ValueError(
                f"{type(self).__name__}(repeats='mean'): a sample's rows are the parts of one "
                "removal's effect over the run (one per step it trained at), which add up; "
                "averaging them has no meaning. Pass repeats='sum' or leave it out."
            )
        check_curvature(curvature, self.curvatures)
        self.curvature = curvature
        if live_run is not None and not isinstance(live_run, LiveRunArguments):
            raise TypeError(
                f"{type(self).__name__}(live_run=) must be a LiveRunArguments, got "
                f"{type(live_run).__name__}."
            )
        self.live_run = live_run if live_run is not None else LiveRunArguments()
        where = f"{type(self).__name__}(normalized_grad=)"
        self.normalized_grad = check_flag(normalized_grad, where)
        if self.normalized_grad and method != "forward":
            raise ValueError(
                f"{where}: True divides each train sample's displacement by its norm, which "
                'only the forward sweep forms: pass method="forward".'
            )
        if method not in _METHODS:
            raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
        self.method = method
        if loss_reduction is not None and loss_reduction not in REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be one of {REDUCTIONS} (how the training loss combined "
                f"the batch), got {loss_reduction!r}."
            )
        if compute_dtype is not None and not (
            isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point
        ):
            raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}.")
        self.loss_reduction = loss_reduction
        self.compute_dtype = compute_dtype

    def default_repeats(self) -> str:
        """``"sum"``: a sample's rows are the parts of one removal's effect (even a cosine's)."""
        return "sum"

    def require_reduction(self, where: str) -> str:
        """``loss_reduction``, refusing ``None`` (a captured run's reduction is not guessed).

        Raises:
            ValueError: ``loss_reduction`` was not declared, with how to declare it.
        """
        if self.loss_reduction is None:
            name = type(self).__name__
            raise ValueError(
                f"{name}.{where}: loss_reduction is not declared: it says how the training loss "
                f"of the captured run combined each batch, and it changes every score. Declare: "
                f'{name}(..., loss_reduction="mean") if the loop trained on the batch mean '
                f"(loss = sum of the per-sample losses / B, e.g. model(**batch).loss), or "
                f'loss_reduction="sum" if it trained on their sum.'
            )
        return self.loss_reduction

    @contextlib.contextmanager
    def declared_reduction(
        self, where: str, live: bool = False, index: StepIndex | None = None
    ) -> Iterator[StepIndex | None]:
        """Within: ``loss_reduction`` resolved, for this call only (no state survives it).

        From the argument, else from what the capture recorded in ``index``'s first step
        (``OffloadCallback(loss_reduction=...)``); declared nowhere, a ValueError naming both
        ways to declare it, except on the live path, which trains with the task's per-sample
        sum and uses ``"sum"`` (:mod:`~dattri_llm.attribution.trajectory.reduction`). Yields
        ``index`` with every step's records checked against the resolved reduction (``None``
        without one).
        """
        name = type(self).__name__
        recorded = None if index is None else recorded_reduction(index.load(index.steps[0]), name)
        declared = self.loss_reduction
        self.loss_reduction = resolve_reduction(name, where, declared, recorded, live)
        try:
            yield (
                None
                if index is None
                else StepIndex(index.steps, checked_loads(index.load, name, self.loss_reduction))
            )
        finally:
            self.loss_reduction = declared

    # ---- what subclasses implement ---------------------------------------------------------
    def step_loader(
        self, index: StepIndex, layers: list[str], dtype: torch.dtype
    ) -> Callable[[int], tuple[LinearStep, StepPushes]]:
        """``step -> (LinearStep, StepPushes)``: the step's linearised update and removals.

        Validate the method's options here (the call's plan has set them on the attributor);
        the base runs the sweep (:meth:`run`).
        """
        raise NotImplementedError

    def run(
        self,
        index: StepIndex,
        layers: list[str],
        queries: torch.Tensor,
        query_hashes: list[str],
        dtype: torch.dtype = torch.float64,
        row_filter: Callable[[Any], Any] | None = None,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """Scores ``(N_occ, R)`` with each row's sample identity and step.

        ``method="adjoint"`` carries the queries' adjoints backward (memory ∝ queries);
        ``"forward"`` carries every removal forward and takes inner products at the end.
        ``row_filter`` (forward only) keeps a subset of each step's removals (a rank's share).
        """
        load = self.step_loader(index, layers, dtype)
        if self.method == "forward":
            emb, hashes, rows = forward_sweep(index.steps, load, self._bar("unroll"), row_filter)
            if self.normalized_grad:
                emb, queries = unit_per_sample(emb, hashes), unit_rows_dense(queries)
            return emb @ queries.T, hashes, rows
        return adjoint_sweep(index.steps, load, queries, self._bar("unroll"))

    def _bar(self, desc: str) -> Callable[[Iterable[int]], Iterable[int]]:
        return lambda steps: self.progress(steps, desc)

    #: The optimizer ``LiveRunArguments(optimizer="auto")`` means for the live path.
    default_optimizer = "adamw_torch"
    #: The named curvatures the method models (an ``ExactHessian`` is always accepted).
    curvatures: tuple[str, ...] = ("empirical_fisher", "none")
    #: The queries are the run's final gradients, whatever their checkpoint label.
    filter_test_checkpoints = False
    #: The recorded optimizer dynamics a method reads (``None``: the method reads none, or
    #: the call passes them).
    dynamics: Any = None

    # ---- the call's plan ---------------------------------------------------------------------
    def check_call(self, granularity: str, live: bool) -> None:
        """An unrolled trajectory scores whole samples only."""
        if granularity != "sample":
            raise ValueError(
                f"{type(self).__name__} scores whole samples; attribution_granularity='token' "
                "is not defined for an unrolled trajectory."
            )

    # ---- the drivers -------------------------------------------------------------------------
    def score_live(self, sides: LiveSides, plan: CallPlan) -> AttributionScore:
        """Live: train a copy of the task's model while recording, then score the queries.

        The run is set by ``live_run`` (``learning_rate``, ``optimizer``, ``num_train_epochs``,
        ...; see :mod:`dattri_llm.attribution.trajectory.training`); the
        task's model is not modified, and the queries' gradients are taken at the trained weights.
        With ``trajectory=`` (a :class:`~dattri_llm.TrajectorySnapshots` directory holding
        parameters, batches and dynamics of a run already done) the run is replayed instead, and
        the queries are taken at the task's model as it is (its final weights). The recorded
        run's dynamics are used unless the call passes its own ``dynamics=``.
        """
        from dattri_llm.gradient.streaming import GradientStreamer
        from dattri_llm.gradient.trajectory import (
            OptimizerDynamics,
            ReplayGradientSource,
            TrajectorySnapshots,
        )

        args, task = self.args, self.task
        hook_config, collate_fn = sides.hook_config, sides.collate_fn
        fit_options = dict(plan.fit_options)
        trajectory = fit_options.pop("trajectory", None)
        dynamics = None
        if trajectory is None:
            run = record_training(
                task.model,
                sides.train_set,
                task.train_loss,
                args,
                self.live_run,
                self.default_optimizer,
                hook_config,
                collate_fn,
            )
            model, train, dynamics = run.model, run.gradients, run.dynamics
        else:
            snaps = TrajectorySnapshots(trajectory)
            model = task.model
            train = ReplayGradientSource(model, snaps, task.train_loss, hook_config)
            if snaps.has("layout", -1):
                dynamics = OptimizerDynamics(snaps)
        test = GradientStreamer(
            model,
            sides.test_set,
            task.test_loss,
            hook_config=hook_config,
            batch_size=args.per_device_eval_batch_size,
            collate_fn=collate_fn,
            show_progress=args.show_progress,
            desc="queries",
        )
        recorded = {}
        if dynamics is not None and "dynamics" not in self.call_state.get("options", ()):
            recorded = {"dynamics": dynamics}  # the run just recorded, unless the call chose
        with self._overriding(recorded), self.declared_reduction("attribute", live=True):
            return self.score(train, test, replace(plan, fit_options=fit_options))

    def score(self, train_source: Any, test_source: Any, plan: CallPlan) -> AttributionScore:
        """Unroll a train source (store, replay, records) for the queries of a test source.

        ``top_k=k`` reduces the result to each query's ``k`` proponents and opponents (the
        same form as the streamed top-k of the other attributors, ``score.top_k_kept == k``).
        It is a reduction of the full result, not a stream: the sweep's own state — the
        queries' adjoints, or every occurrence's embedding — is what bounds its memory.

        Args:
            train_source: The run's per-step per-sample gradients.
            test_source: The queries' gradients at the end of the run.
            plan: The call's ``top_k``; its ``fit_options`` must be empty (a trajectory
                method's options are its :attr:`call_options`).
        """
        if plan.fit_options:
            raise TypeError(
                f"{type(self).__name__}.{plan.where} got unexpected options "
                f"{sorted(plan.fit_options)}; its per-call options are {list(self.call_options)}."
            )
        k = plan.top_k
        index = step_index(train_source, device=self.device)
        index.check_contiguous(type(self).__name__)
        first = index.load(index.steps[0])
        if not first:
            raise ValueError(f"{type(self).__name__}: step {index.steps[0]} holds no gradients.")
        layers = first[0].gradient.layer_names
        test_blocks = list(as_source(test_source, "test"))
        if not test_blocks:
            raise ValueError("the test source yielded no gradients.")
        dtype = first[0].gradient.dtype
        for b in test_blocks:
            dtype = torch.promote_types(dtype, b.gradient.dtype)
        if self.compute_dtype is not None:
            dtype = torch.promote_types(dtype, self.compute_dtype)
        self._check_queries(test_blocks, first[0].gradient, layers)
        queries, query_hashes = dense_rows(test_blocks, layers, dtype, self.device)
        with self.declared_reduction("attribute_sources", index=index) as index:
            if distributed.active(self.args):
                distributed.join(self.args, f"{type(self).__name__}.attribute_sources")
                scores, hashes, steps = self._run_split(index, layers, queries, query_hashes, dtype)
            else:
                scores, hashes, steps = self.run(index, layers, queries, query_hashes, dtype=dtype)
        score = AttributionScore(
            scores.detach().cpu(), hashes, steps, query_hashes, output_dir=self.args.output_dir
        )
        return score if k is None else top_k_of(score, k)

    def _run_split(
        self,
        index: StepIndex,
        layers: list[str],
        queries: torch.Tensor,
        query_hashes: list[str],
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, list[str], list[int]]:
        """The sweep split across ranks; every rank returns the full result.

        The sweep is sequential over steps, so the ranks split what is independent within it:
        the *queries* for the adjoint sweep (each query's adjoint is carried alone; memory and
        work per rank ∝ its queries), the *removed samples* for the forward sweep (each
        occurrence's perturbation is carried alone; a sample's occurrences stay on one rank).
        Every rank reads every step's gradients and dynamics. No communication until the end,
        where the score columns (adjoint) or rows (forward) are all-gathered and put back in
        single-process order.
        """
        from dattri_llm.utils.distributed import get_rank, get_world_size

        rank, world = get_rank(), get_world_size()
        if self.method == "adjoint":
            mine = distributed.live_slice(len(query_hashes), rank, world)
            scores, hashes, steps = self.run(
                index,
                layers,
                queries[mine.start : mine.stop],
                query_hashes[mine.start : mine.stop],
                dtype=dtype,
            )
            cols = distributed.all_gather_tensors(scores.detach().cpu())
            return torch.cat(cols, dim=1), hashes, steps
        keys: list[list[int]] = []

        def keep(pushes: Any) -> Any:
            rows = [i for i, h in enumerate(pushes.hashes) if distributed.owner(h, world) == rank]
            keys.extend([int(pushes.step), i] for i in rows)
            idx = torch.as_tensor(rows, dtype=torch.long, device=pushes.shares.device)
            return type(pushes)(
                pushes.step, pushes.shares.index_select(0, idx), [pushes.hashes[i] for i in rows]
            )

        scores, hashes, steps = self.run(
            index, layers, queries, query_hashes, dtype=dtype, row_filter=keep
        )
        parts = distributed.all_gather_tensors(scores.detach().cpu())
        metas = distributed.all_gather_json({"keys": keys, "hashes": hashes, "steps": steps})
        flat = [tuple(k) for m in metas for k in m["keys"]]
        order = sorted(range(len(flat)), key=lambda i: flat[i])
        full = torch.cat(parts).index_select(0, torch.as_tensor(order, dtype=torch.long))
        all_h = [h for m in metas for h in m["hashes"]]
        all_s = [st for m in metas for st in m["steps"]]
        return full, [all_h[i] for i in order], [all_s[i] for i in order]

    def _check_queries(
        self, blocks: list[GradientBlock], train: Gradient, layers: list[str]
    ) -> None:
        seen: dict[str, int] = {}
        checkpoints = {int(b.checkpoint) for b in blocks}
        if len(checkpoints) > 1:
            raise ValueError(
                f"{type(self).__name__}: the queries were captured at checkpoints "
                f"{sorted(checkpoints)}; an unrolled trajectory is scored against the queries' "
                "gradients at the end of the run only (filter with checkpoints=[...])."
            )
        for b in blocks:
            for h in b.hashes:
                if h in seen:
                    raise ValueError(
                        f"query {h!r} has several gradients (steps {seen[h]} and {b.step}); "
                        "capture each query once, at the end of the run."
                    )
                seen[h] = int(b.step)
        want = layer_widths(train, layers)
        got = (
            layer_widths(blocks[0].gradient, layers)
            if set(blocks[0].gradient.layer_names) == set(layers)
            else None
        )
        if got != want:
            raise ValueError(
                f"{type(self).__name__}: the queries' layers {blocks[0].gradient.layer_names} "
                f"(widths {got}) differ from the train gradients' {want}; capture both with "
                "the same hook config and projection."
            )

    def progress(self, steps: Iterable[int], desc: str) -> Iterable[int]:
        """A progress bar over steps as ``args.show_progress`` says (see ``utils.progress``)."""
        return progress(list(steps), self.args.show_progress, desc=desc)

    def kappa(self, batch_size: int) -> float:
        """``κ`` of the batch curvature: the batch size for a mean loss, 1 for a sum."""
        return float(batch_size) if self.require_reduction("kappa") == "mean" else 1.0

    def removal_pushes(self, shares: torch.Tensor, step: int) -> torch.Tensor:
        """The change of a step's batch gradient when each sample is removed from its batch.

        Sum loss: ``−s_z``, returned as ``s_z`` (the sign is the push's). Mean loss: the mean is
        then over the ``B − 1`` others, ``(Σ_{z'≠z} s_{z'}) B/(B−1) − G = (G − B s_z)/(B−1)``
        with ``G = Σ s``, returned as ``(B s_z − G)/(B − 1)``.
        """
        if self.require_reduction("removal_pushes") == "sum":
            return shares
        b = shares.shape[0]
        if b < 2:
            raise ValueError(
                f"{type(self).__name__}: step {step} has one sample; removing it from a "
                "mean-reduced batch leaves no batch (loss_reduction='mean')."
            )
        return (b * shares - shares.sum(0)) / (b - 1)
