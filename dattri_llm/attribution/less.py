"""``LESSAttributor``: cosine between a query's gradient and a sample's Adam update direction.

LESS (Xia et al., 2024) scores a training sample ``z`` for a query ``q`` by

    score(z, q) = Σ_t w_t · cos(Γ_t(z), ∇ℓ(q; θ_t))

with ``Γ_t(z)`` the optimizer's update direction for ``z`` alone from the state at ``t`` (see
:mod:`dattri_llm.gradient.optim.precondition`: the *train side is preconditioned at capture*,
``HookManager(model, optimizer=opt)``), the query's raw gradient, and ``w_t`` the learning rate.
Norms are over all captured layers together.

Two forms:

* **Trajectory form** (from a cache): the train store holds Γ of every captured step (recorded
  during training with ``HookManager(optimizer=...)``, which also records each step's learning
  rate); the weights default to those learning rates. ``learning_rates=`` overrides them; a
  store without them and no ``learning_rates=`` is an error, never a silent 1.
* **Frozen form** (the paper's): checkpoints ``k`` with their optimizer states;
  ``LESSAttributor(args, task=AttributionTask(..., checkpoints=[...]), optimizers=[...])``
  computes Γ at each checkpoint with its optimizer and the queries' gradients at the same
  weights; the weights default to each optimizer's learning rate (``checkpoint_weights=``
  overrides).

Pairing: a train block is scored against the query gradients of the same checkpoint label
(``pair_by="checkpoint"``) or the same step (``pair_by="step"``, for queries captured at every
step); a single query set pairs with every train block. A query with several gradients under
one key is refused, never collapsed.

Sign: as for every attributor, a positive score means the training sample helped the query.
Numerics follow the inputs (float64 in, float64 out); nothing is carried between calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.tracin import TracInAttributor
from dattri_llm.attribution.trajectory.base import as_schedule
from dattri_llm.gradient.compat import CaptureFacts
from dattri_llm.gradient.gradient import Gradient, GradientBlock
from dattri_llm.gradient.optim.second_moment import capture_correction

__all__ = ["LESSAttributor"]

LearningRates = float | Sequence[float] | Mapping[int, float] | Callable[[int], float]
_PAIRINGS = ("checkpoint", "step")


class LESSAttributor(TracInAttributor):
    """LESS data selection scores (positive = the training sample helped the query).

    Regime: ranking training data for a target (LESS's selection), with Adam's per-coordinate
    normalisation at a few checkpoints, not the effect of a removal from one run. Measured on
    the GPT-2 fine-tuning setting (docs/benchmarks/quality.md): half-data LDS 0.425,
    between Grad-Dot / TracIn (0.20 / 0.19) and EK-FAC (0.67); LDS at 1 / 5 / 10 / 50 % removals
    0.18 / 0.35 / 0.39 / 0.12 against the recorded run (intervals ±0.2-0.4), below
    AdamW-influence's 0.39-0.49: for small removals from a recorded run use AdamW-influence.

    Args:
        args: Run options.
        task: For the live (frozen) form: the model, the loss and the checkpoints.
        optimizers: Frozen form: one optimizer per checkpoint of ``task`` (or callables
            returning them), holding that checkpoint's state for the task's model parameters.
        checkpoint_weights: Frozen form: ``w_k`` per checkpoint (sequence or mapping);
            default: each optimizer's learning rate.
        precondition_scale: See ``HookManager(precondition_scale=...)`` (live form):
            ``"batch_size"`` maps a mean loss's ``∇ℓ`` instead of its share ``∇ℓ/B``.
        mode: Routing of the inner products.
        learning_rates: Trajectory form: the weights ``w_t`` by step (a number, a sequence
            indexed by step, a ``{step: lr}`` mapping or a callable); default: the learning
            rates recorded at capture. A call may pass its own (for that call only).
        pair_by: ``"checkpoint"`` (a train block pairs with the queries of its checkpoint
            label) or ``"step"`` (queries captured at every step). A call may pass its own.
        repeats: How a train sample's rows under one checkpoint label combine: ``None`` or
            ``"sum"`` (LESS's sum over the steps a sample trained at, weighted by their
            learning rates), or ``"mean"`` (their mean; not with ``pair_by="step"``).

    Example:
        ```python
        hm = HookManager(model, callbacks=[OffloadCallback(file_manager=train_store)],
                         optimizer=opt)        # train side: Adam directions + learning rates
        ...                                    # train; capture raw query gradients
        score = LESSAttributor(args).attribute_from_cache("train_grads", "query_grads")
        ```
    """

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        optimizers: Sequence[Any] | None = None,
        checkpoint_weights: Sequence[float] | Mapping[int, float] | None = None,
        precondition_scale: float | str = 1.0,
        mode: str = "auto",
        learning_rates: LearningRates | None = None,
        pair_by: str = "checkpoint",
        repeats: str | None = None,
    ) -> None:
        super().__init__(args, task, normalized_grad=True, mode=mode, repeats=repeats)
        self.checkpoint_weights = None  # TracIn's weighting is replaced by block_weight
        self._frozen_weights = (
            None
            if checkpoint_weights is None
            else as_schedule(checkpoint_weights, "checkpoint_weights", "checkpoint")
        )
        if optimizers is not None:
            optimizers = list(optimizers)
            n = self.task.num_checkpoints if self.task is not None else None
            if n is not None and len(optimizers) != n:
                raise ValueError(
                    f"LESSAttributor: {len(optimizers)} optimizers for {n} checkpoint(s) of the "
                    "task; give one optimizer (its state at that checkpoint) per checkpoint."
                )
        self.optimizers = optimizers
        self.precondition_scale = precondition_scale
        self.learning_rates = self.check_option(
            "learning_rates", learning_rates, "LESSAttributor(learning_rates=)"
        )
        self.pair_by = self.check_option("pair_by", pair_by, "LESSAttributor(pair_by=)")

    # ---- the call's plan ----------------------------------------------------------------------
    call_options = ("learning_rates", "pair_by")

    def check_option(self, name: str, value: Any, where: str) -> Any:
        """``learning_rates`` (as a schedule by step) or ``pair_by`` of a call."""
        if name == "pair_by":
            if value not in _PAIRINGS:
                raise ValueError(f"pair_by must be one of {_PAIRINGS}, got {value!r}.")
            return value
        if value is not None and self._frozen_weights is not None:
            raise ValueError(
                "LESSAttributor: pass learning_rates= (by step) or checkpoint_weights= (by "
                "checkpoint), not both."
            )
        return None if value is None else as_schedule(value, "learning_rates")

    def default_repeats(self) -> str:
        """``"sum"``: LESS sums a sample's weighted cosines over the steps it trained at.

        In the trajectory form those steps share a checkpoint label; weighted by their
        learning rates, their sum is the method.
        """
        return "sum"

    def warn_repeats(self, labels: dict[tuple[str, int], int] | None) -> None:
        """No warning: a sample at several steps under one label is LESS's trajectory form."""

    def check_call(self, granularity: str, live: bool) -> None:
        """The live (frozen) form needs one optimizer state per checkpoint."""
        super().check_call(granularity, live)
        if self.pair_by == "step" and self.repeats == "mean":
            raise ValueError(
                "LESSAttributor(repeats='mean') averages a sample's rows under one checkpoint "
                "label, but pair_by='step' scores each step at its own weights and sums the "
                "steps: pass repeats='sum' (or leave it out) with pair_by='step'."
            )
        if not live:
            return
        if self.optimizers is None:
            raise ValueError(
                "LESSAttributor.attribute needs optimizers=[...] (one per checkpoint of the task, "
                "holding its state): Γ is the optimizer's update direction. Or score a "
                "preconditioned capture with attribute_from_cache."
            )
        _check_distinct_states(self.optimizers)

    def pairing_key(self, block: GradientBlock) -> int:
        """The block's checkpoint label, or its step with ``pair_by="step"``."""
        return int(block.step if self.pair_by == "step" else block.checkpoint)

    def check_block(self, block: GradientBlock, side: str) -> None:
        """Train blocks must be preconditioned, test blocks raw."""
        pre = "preconditioned" in block.metadata
        if side == "train" and capture_correction(block.metadata) is not None:
            raise ValueError(
                f"LESSAttributor: train gradients at step {block.step} were corrected by "
                'TrackStar\'s 1/sqrt(v + eps) at capture (precondition="second_moment"), not '
                "mapped to Adam's update direction. Capture the train side with "
                "HookManager(model, optimizer=opt) (precondition=True), or score this store "
                "with TracInAttributor(normalized_grad=True) against queries corrected alike."
            )
        if side == "train" and not pre:
            raise ValueError(
                f"LESSAttributor: train gradients at step {block.step} are raw, not "
                "preconditioned. Capture the train side with HookManager(model, optimizer=opt) "
                "(or score raw gradients with TracInAttributor(normalized_grad=True))."
            )
        if side == "test" and pre:
            raise ValueError(
                f"LESSAttributor: query gradients at step {block.step} are preconditioned; LESS "
                "compares Adam directions with raw query gradients. Capture the queries without "
                "optimizer= (or inside HookManager.raw_gradients())."
            )

    def check_compatible(self, train: CaptureFacts, test: CaptureFacts) -> None:
        """LESS's own refusal of a second-moment corrected train side first, then the base's."""
        _refuse_corrected(train.metadata, f"({train.source or 'train'})")
        super().check_compatible(train, test)

    def block_weight(self, block: GradientBlock) -> float:
        """``w_t``: the call's ``learning_rates``, ``checkpoint_weights`` or the recorded rate."""
        if self.learning_rates is not None:
            return self.learning_rates(int(block.step))
        if self._frozen_weights is not None:
            return self._frozen_weights(int(block.checkpoint))
        lr = block.metadata.get("learning_rate")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            if lr == 0 and not self.call_state.get("warned_zero"):
                self.call_state["warned_zero"] = True
                warnings.warn(
                    f"LESSAttributor: the learning rate recorded at step {block.step} "
                    f"(checkpoint {block.checkpoint}) is 0, so it weighs nothing (e.g. the last "
                    "checkpoint of a schedule decaying to 0). The paper weighs each checkpoint "
                    "by its epoch's mean learning rate: pass checkpoint_weights= or "
                    "learning_rates= to choose.",
                    UserWarning,
                    stacklevel=2,
                )
            return float(lr)
        if "learning_rates" in block.metadata:
            raise ValueError(
                f"LESSAttributor: step {block.step} was trained with several learning rates "
                f"{block.metadata['learning_rates']} (parameter groups); one weight per step is "
                "needed: pass learning_rates=."
            )
        raise ValueError(
            f"LESSAttributor: train step {block.step} has no recorded learning rate; pass "
            "learning_rates= (the weight of each step) or capture with HookManager(optimizer=...)."
        )

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Normalise each Γ (the weight is applied per block)."""
        return self._normalize(gradient)

    def streamer_options(self, checkpoint: int, side: str) -> dict[str, Any]:
        """The live train side is preconditioned with the checkpoint's optimizer."""
        if side != "train" or self.optimizers is None:
            return {}
        return {
            "optimizer": self.optimizers[checkpoint],
            "precondition_scale": self.precondition_scale,
        }


def _refuse_corrected(metadata: Mapping[str, Any], where: str) -> None:
    """Refuse train gradients corrected by TrackStar's second moment (not LESS's direction)."""
    if capture_correction(metadata) is not None:
        raise ValueError(
            f"LESSAttributor: the train gradients {where} were corrected by TrackStar's "
            '1/sqrt(v + eps) at capture (precondition="second_moment"), not mapped to Adam\'s '
            "update direction. Capture the train side with HookManager(model, optimizer=opt) "
            "(precondition=True), or score this store with TracInAttributor(normalized_grad="
            "True) against queries corrected alike."
        )


def _check_distinct_states(optimizers: Sequence[Any]) -> None:
    """Refuse checkpoint optimizers that share state: copies of one state, not each their own.

    ``opt.state_dict()`` returns references to the live state: kept at several checkpoints
    without ``copy.deepcopy`` they all end up holding the final state, and the frozen form would
    silently score every checkpoint with it.
    """
    from dattri_llm.gradient.optim.kinds import resolve_optimizer

    seen: dict[int, int] = {}
    counts: dict[tuple, int] = {}
    for k, opt in enumerate(optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            continue  # a factory: resolved when its checkpoint is scored
        resolve_optimizer(opt, "LESSAttributor(optimizers=...)")
        steps = []
        for state in opt.state.values():
            for name, t in state.items():
                if not isinstance(t, torch.Tensor):
                    continue
                if name == "step":
                    steps.append(float(t))
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen and seen[ptr] != k:
                    raise ValueError(
                        f"LESSAttributor: the optimizers of checkpoints {seen[ptr]} and {k} share "
                        "state tensors, so they hold one state, not one each. Keep each "
                        "checkpoint's copy.deepcopy(opt.state_dict()) and load it into its own "
                        "optimizer."
                    )
                seen[ptr] = k
        key = tuple(steps)
        if steps and key in counts:
            raise ValueError(
                f"LESSAttributor: the optimizers of checkpoints {counts[key]} and {k} have the "
                "same update counts: the same state twice (was opt.state_dict() kept without "
                "copy.deepcopy?). Give each checkpoint the optimizer state saved at it."
            )
        counts[key] = k
