"""Hugging Face ``Trainer``, TRL ``SFTTrainer`` / ``GRPOTrainer``: one-meaning per-sample gradients.

Attach one callback and train as usual; capture the queries with one call::

    from dattri_llm.integrations.hf_trainer import AttributionCallback

    capture = AttributionCallback("./train_grads")       # per_sample_loss="sum" (default)
    trainer.add_callback(capture)
    trainer.train()
    capture.capture_queries(model, queries, "./test_grads")

What a stock ``Trainer`` backpropagates is not a per-sample loss: a causal-LM loss is a mean
over every label token of the micro-batch, or of all the micro-batches of a gradient
accumulation step (``num_items_in_batch``), further divided by the number of micro-batches
when the model takes no ``num_items_in_batch``. A hook captures each sample's share of *that*,
``∇(Σ_t ℓ_it) / N_batch`` with ``N_batch`` changing from batch to batch under padding and label
masking, so samples would be weighted by the batches they fell in. The callback records each
batch's label-token counts, observes the exact factor the trainer put between the model's
loss and ``backward()`` (a hook on the loss tensor), and rescales every captured row so that it
is the gradient of the declared per-sample loss:

* ``per_sample_loss="sum"`` — ``Σ_t ℓ_it`` over the sample's label tokens (``labels != -100``,
  after the causal shift): every token counts once, wherever it was batched;
* ``per_sample_loss="mean"`` — ``(1/T_i) Σ_t ℓ_it`` over its own ``T_i`` label tokens;
* ``per_sample_loss="share"`` — the row as the trainer backpropagated it: the sample's share of
  the gradient the optimizer applied (the rows of one update sum to it). What the trajectory
  methods read (below); it weighs samples by their batches, so prefer ``"sum"`` otherwise.

Both sides use it: :func:`capture_queries` backpropagates the same per-sample loss for the
queries, in eval mode (no dropout), with the train store's layers, and labels them with the
train checkpoint whose weights the model holds.

Checkpoint labels. The gradients of a training run are taken at weights that change at every
step; the callback labels the records of each epoch (``checkpoint_every="epoch"``, default) or
of the steps between two saves (``"save"``) with their own ``HookManager.checkpoint`` label,
and declares in the store's ``checkpoints.json`` which weights each label stands for: those at
the end of its interval (the saved checkpoint, or the final weights). A multi-epoch run is then
never summed under one label; Grad-Dot / Grad-Cos read one label
(``attribute_from_cache(..., checkpoints=[k])``), TracIn sums them. The score loop refuses a
query store captured at weights that match none of the labels it is scored against.

Steps. The stored step is the trainer's optimizer step (``state.global_step`` when the update
began); the micro-batches of one accumulation step share it
(``TrainingArguments.gradient_accumulation_steps`` is declared to the store).

TRL's ``GRPOTrainer``. A sample is a rollout: a prompt and one sampled completion ``c_i`` of
``T_i`` tokens, with its advantage ``A_i`` (as the trainer computed it, group-normalised
rewards). Its loss is the advantage-weighted negative log-likelihood of the completion:
``"sum"``: ``-A_i Σ_t log π(c_it | prompt_i, c_i<t)``; ``"mean"``: the same over ``T_i``
(GRPO's own per-sequence term). On-policy (``num_iterations=1``, completions of the current
weights) every importance ratio is 1, so the gradient TRL backpropagates for a rollout is that
loss's, divided by a normaliser of its ``loss_type`` that the callback undoes exactly
(``"grpo"``, ``"bnpo"``, ``"dr_grpo"``; ``"dapo"``, TRL's default, with one micro-batch per
generation batch on one process). Refused, with the option that makes it exact: a KL term
(``beta=0.0``), ``num_iterations > 1`` or ``steps_per_generation >
gradient_accumulation_steps`` (an older policy's completions), the other loss types, an
entropy bonus or mask, vLLM's importance-sampling correction, and ``temperature != 1`` (the
queries' log-probabilities are untempered). A query's loss is its labels' negative
log-likelihood (``capture_queries``). Note that ``GRPOConfig`` autocasts to bfloat16 by default
(``bf16=True``): the captured gradients are those of that computation.

What is refused: a loss the model does not compute itself (``compute_loss_func``, label
smoothing) or that is not a mean of the label tokens' cross-entropy (checked against the logits
at the first step), per-token weights that differ within a sample (TRL's ``"dft"`` loss), and
TRL's other reinforcement-learning and preference trainers.

The trajectory methods. AdamW-influence and DVEmb model each update as the sum of the stored
rows of its step; a trainer's token-weighted mean is no sum of per-sample sums or means, but it
is the sum of the shares it backpropagated. ``AttributionCallback(per_sample_loss="share",
optimizer_state=True)`` stores those shares (declaring ``loss_reduction="sum"`` to the store),
records the optimizer's moments around every update (an
:class:`~dattri_llm.OptimizerStateCallback`, in memory or under ``snapshots=``), and hands
them to the methods with :meth:`AttributionCallback.dynamics`. Gradient clipping makes an
update no sum of the rows: it is refused (``TrainingArguments(max_grad_norm=0.0)``).

TRL computes the SFT loss with a fused LM head that uses ``lm_head.weight`` without calling the
``lm_head`` module, so hooks cannot see the head: exclude it
(``HookManagerConfig(exclude=[r"lm_head"])``) and untie the embedding, as
``examples/trainers/trl_sft.py`` does. The per-sample scale is then read from the gradient of
TRL's per-token log-probabilities.

Needs ``transformers`` (the ``transformers`` extra); ``import dattri_llm`` never imports it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

try:
    from transformers import TrainerCallback
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "dattri_llm.integrations.hf_trainer needs transformers: pip install -e "
        f"'.[transformers]'. Import failed with: {err}"
    ) from err

from dattri_llm.gradient.callbacks.offload import OffloadCallback
from dattri_llm.gradient.callbacks.optimizer_state import OptimizerStateCallback
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.hooks import HookManager, HookManagerConfig
from dattri_llm.gradient.hooks.fingerprint import weights_fingerprint
from dattri_llm.gradient.store import GradientStorageManager
from dattri_llm.gradient.store.checkpoints import (
    declare_capture,
    declare_checkpoint,
    label_weights,
    read_checkpoints_file,
)
from dattri_llm.gradient.streaming import is_distributed_wrapper, pad_collate
from dattri_llm.utils.distributed import get_rank
from dattri_llm.utils.hashing import hash_sample

__all__ = ["AttributionCallback", "capture_queries", "PER_SAMPLE_LOSSES"]

#: The per-sample loss conventions: a sum, or a mean over the sample's own label tokens, or
#: the sample's share of the gradient the optimizer applied (the trajectory methods' input).
PER_SAMPLE_LOSSES = ("sum", "mean", "share")
#: What a query's loss can be (a query has no batch, so no share of one).
QUERY_LOSSES = ("sum", "mean")
_EVERY = ("epoch", "save")


def _check_loss(
    per_sample_loss: str, where: str, allowed: Sequence[str] = PER_SAMPLE_LOSSES
) -> str:
    if per_sample_loss not in allowed:
        share = (
            ", or 'share' (its share of the gradient the optimizer applied)"
            if "share" in allowed
            else ""
        )
        raise ValueError(
            f"{where}(per_sample_loss={per_sample_loss!r}): expected 'sum' (the sample's "
            f"label-token losses summed) or 'mean' (averaged over its own label tokens){share}."
        )
    return per_sample_loss


def _label_counts(labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Label tokens per sample (``labels != -100``, after the causal shift when ``shift``)."""
    lab = labels[:, 1:] if shift else labels
    return (lab != -100).reshape(lab.shape[0], -1).sum(1)


def _sum_nll(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """Per-sample sum of the label tokens' cross-entropy, ``(B,)``."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    b = logits.shape[0]
    tokens = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=-100,
        reduction="none",
    )
    return tokens.reshape(b, -1).sum(1)


class _PerSampleScale:
    """Turns each captured row into the gradient of the declared per-sample loss.

    It observes what the trainer backpropagates; :meth:`transform` is a
    :meth:`HookManager.add_transform` transform.

    Two ways a trainer's loss reaches ``backward()``, both observed exactly:

    * the model's own ``labels=`` loss (``Trainer``): ``u · Σ_i S_i / N`` with ``N`` the
      ``num_items_in_batch`` the model was given (else the micro-batch's label tokens) and ``u``
      the factor applied after the model (``1 / gradient_accumulation_steps``, ...), read from
      the gradient reaching the loss tensor;
    * TRL's fused head: ``Σ -log_probs · c_i``, with ``c_i`` read from the gradient reaching the
      per-token log-probabilities (equal on every label token of a sample, or refused).
    """

    def __init__(self, per_sample_loss: str) -> None:
        self.per_sample_loss = per_sample_loss
        self.manager: HookManager | None = None
        # GRPO: how TRL normalises the advantage-weighted log-likelihood of each completion
        self.grpo: _GRPONormaliser | None = None
        self.shift: bool | None = None  # decided (and checked) at the first captured forward
        self._counts: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None

    # ---- the forward: labels, the normaliser, the hook that reads the factor --------------
    def on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self.manager is None or not self.manager.capturing or not torch.is_grad_enabled():
            return
        self._scale, self._counts = None, None
        labels = kwargs.get("labels")
        loss = getattr(output, "loss", None) if not isinstance(output, tuple) else None
        log_probs = getattr(output, "log_probs", None)
        if isinstance(log_probs, torch.Tensor) and log_probs.requires_grad:
            mask = getattr(output, "label_mask", None)
            if mask is None and labels is not None:
                mask = labels != -100
            if mask is None:
                raise RuntimeError(_NO_LOSS)
            self._counts = mask.reshape(mask.shape[0], -1).sum(1)
            mask = mask.detach().reshape(mask.shape[0], -1)
            log_probs.register_hook(lambda grad: self._from_token_grads(grad, mask))
            return
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad or labels is None:
            raise RuntimeError(_NO_LOSS)
        items = kwargs.get("num_items_in_batch")
        if self.shift is None:
            self.shift = self._check_model_loss(output, labels, loss, items)
        counts = _label_counts(labels, self.shift)
        n = float(items.sum() if isinstance(items, torch.Tensor) else items or counts.sum())
        self._counts = counts
        loss.register_hook(lambda grad: self._from_loss_grad(grad, n))

    @torch.no_grad()
    def _check_model_loss(
        self, output: Any, labels: torch.Tensor, loss: torch.Tensor, items: Any
    ) -> bool:
        """Whether the model's loss is Σ of its label tokens' cross-entropy / N, shifted or not."""
        logits = getattr(output, "logits", None)
        if not isinstance(logits, torch.Tensor) or logits.shape[:2] != labels.shape[:2]:
            return True  # no full logits to check against (logits_to_keep): a causal LM's loss
        value = float(loss.detach())
        for shift in (True, False):
            total = float(_sum_nll(logits.detach().float(), labels, shift).sum())
            counts = _label_counts(labels, shift)
            n = float(items.sum() if isinstance(items, torch.Tensor) else items or counts.sum())
            if math.isclose(total / max(n, 1.0), value, rel_tol=1e-4, abs_tol=1e-6):
                return shift
        raise ValueError(
            f"the model's loss ({value:.6g}) is not the mean of its label tokens' cross-entropy "
            "(over num_items_in_batch or the batch's label tokens, with or without the causal "
            "shift), so the per-sample share of each captured gradient is unknown. "
            "AttributionCallback supports the model's own labels= cross-entropy loss; capture a "
            "custom loss with a HookManager and a summed loss instead."
        )

    def _from_loss_grad(self, grad: torch.Tensor, n: float) -> None:
        u = float(grad.detach().sum())
        if u == 0.0:
            raise RuntimeError(
                "the trainer backpropagated the model's loss times 0; no per-sample gradient "
                "can be recovered from it."
            )
        # captured row i = (u / n) ∇S_i; S_i's gradient is that times n / u
        self._scale = self._finish(torch.full_like(self._counts, n / u, dtype=torch.float64))

    def _from_token_grads(self, grad: torch.Tensor, mask: torch.Tensor) -> None:
        grad = grad.detach().reshape(grad.shape[0], -1).to(torch.float64)
        if self.grpo is not None:
            self._scale = self._finish(self.grpo.scales(grad, mask, self._counts))
            return
        coef = torch.zeros(grad.shape[0], dtype=torch.float64, device=grad.device)
        for i in range(grad.shape[0]):
            g = -grad[i][mask[i]]  # the weight of each label token's -log p in the loss
            if g.numel() == 0:
                continue
            if not torch.allclose(g, g[0].expand_as(g), rtol=1e-6, atol=0.0) or g[0] <= 0:
                raise ValueError(
                    "the trainer's loss weighs the label tokens of one sample differently (or "
                    "not as a negative log-likelihood): a per-sample sum or mean of their "
                    "losses cannot be recovered. AttributionCallback supports SFT's 'nll' "
                    "loss; capture other losses with a HookManager."
                )
            coef[i] = g[0]
        inv = torch.where(coef > 0, 1.0 / coef.clamp_min(1e-300), torch.zeros_like(coef))
        self._scale = self._finish(inv)

    def _finish(self, to_sum: torch.Tensor) -> torch.Tensor:
        """Row scales to the sum convention, then to the mean one if declared."""
        if self.per_sample_loss == "share":
            # as backpropagated: the rows of one update sum to the gradient the optimizer reads
            return torch.ones_like(to_sum)
        if self.per_sample_loss == "mean":
            counts = self._counts.to(to_sum)
            to_sum = torch.where(counts > 0, to_sum / counts.clamp_min(1), torch.zeros_like(to_sum))
        return to_sum

    # ---- the transform -------------------------------------------------------------------------
    def transform(self, spec: Any, item: Any) -> Any:
        """Scale each row of one layer's captured gradient (exact: a row scale is linear)."""
        scale = self._scale
        if scale is None:
            raise RuntimeError(
                f"layer {spec.name!r} received a gradient that did not come through the model's "
                "loss in this step (a second loss, or a backward outside the trainer's step): "
                "its per-sample share is unknown. Only the trainer's loss may be "
                "backpropagated while the AttributionCallback captures."
            )
        if item.batch_size != scale.shape[0]:
            raise RuntimeError(
                f"layer {spec.name!r} captured {item.batch_size} rows for a batch of "
                f"{scale.shape[0]} samples; the per-sample rescaling needs one row per sample."
            )
        return Gradient({spec.name: item}).scale(scale).layers[spec.name]


_NO_LOSS = (
    "AttributionCallback: the model computed no loss from labels= in a differentiated forward "
    "(the trainer computes its loss outside the model: compute_loss_func, label smoothing, or a "
    "custom compute_loss), so the per-sample share of each captured gradient is unknown. Let "
    "the model compute its loss (labels in the batch, no compute_loss_func / "
    "label_smoothing_factor), or capture with a HookManager and a summed loss."
)


#: TRL GRPO ``loss_type`` values whose per-completion normaliser the callback can observe.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")


class _GRPONormaliser:
    """The factor TRL's GRPO loss puts on each completion's advantage-weighted log-likelihood.

    On-policy (``num_iterations=1``, ``beta=0``, ...: :func:`_check_grpo`), every importance
    ratio is 1 and the gradient reaching completion ``i``'s per-token log-probabilities is
    ``-A_i / Z_i`` on each of its ``T_i`` tokens, with ``A_i`` its advantage and ``Z_i`` the
    loss type's normaliser (``G`` the micro-batches of this optimizer step, ``B`` the rows of
    the micro-batch, ``N`` its completion tokens): ``"grpo"``: ``T_i B G``; ``"bnpo"`` and
    ``"dapo"`` (one micro-batch per generation batch, one process): ``N G``; ``"dr_grpo"``:
    ``B max_completion_length G``. The captured row is ``-A_i / Z_i Σ_t ∇log π(c_it)``, so
    ``Z_i`` times it is the gradient of ``-A_i Σ_t log π(c_it)`` whatever ``A_i`` is (zero
    included): no advantage needs to be observed, only the normaliser.
    """

    def __init__(self, loss_type: str, max_completion_length: int) -> None:
        self.loss_type = loss_type
        self.max_completion_length = int(max_completion_length)
        self.accumulation = 1  # micro-batches of the current optimizer step (set per step)

    def scales(self, grad: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``Z_i`` per row, after checking each completion's tokens share one weight."""
        for i in range(grad.shape[0]):
            g = grad[i][mask[i]]
            # one weight per completion, of either sign (the advantage's) or zero
            tol = 1e-6 * float(g.abs().max()) if g.numel() else 0.0
            if g.numel() and float((g - g[0]).abs().max()) > tol:
                raise ValueError(
                    "AttributionCallback: the GRPO loss weighs the completion tokens of one "
                    "rollout differently (importance ratios of an older policy, a KL term, "
                    "clipping, a tool or entropy mask), so no per-completion loss describes its "
                    "gradient. Train on-policy: GRPOConfig(num_iterations=1, beta=0.0, "
                    "steps_per_generation <= gradient_accumulation_steps)."
                )
        counts = counts.to(device=grad.device, dtype=torch.float64)
        rows, g_steps = float(grad.shape[0]), float(self.accumulation)
        if self.loss_type == "grpo":
            z = counts.clamp_min(1.0) * rows * g_steps
        elif self.loss_type in ("bnpo", "dapo"):
            z = torch.full_like(counts, float(counts.sum().clamp_min(1.0)) * g_steps)
        else:  # dr_grpo
            z = torch.full_like(counts, rows * self.max_completion_length * g_steps)
        return z


def _check_grpo(args: Any) -> _GRPONormaliser:
    """Refuse the GRPO configurations whose per-completion loss cannot be recovered exactly."""
    fixes = []
    loss_type = getattr(args, "loss_type", "grpo")
    if loss_type not in GRPO_LOSS_TYPES:
        fixes.append(f"loss_type={loss_type!r} (use loss_type='grpo')")
    if loss_type == "dapo" and (
        int(getattr(args, "steps_per_generation", 1) or 1) != 1 or int(args.world_size) != 1
    ):
        # dapo divides by the completion tokens of the whole generation batch on all ranks,
        # a count no single micro-batch sees
        fixes.append(
            "loss_type='dapo' with several micro-batches per generation batch or several "
            "processes (use loss_type='grpo' or 'bnpo')"
        )
    if float(getattr(args, "beta", 0.0)) != 0.0:
        fixes.append(f"beta={args.beta} (a KL term; use beta=0.0)")
    if int(getattr(args, "num_iterations", 1)) != 1:
        fixes.append(f"num_iterations={args.num_iterations} (use num_iterations=1)")
    spg = getattr(args, "steps_per_generation", None)
    if spg is not None and int(spg) > int(args.gradient_accumulation_steps):
        fixes.append(
            f"steps_per_generation={spg} > gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} (completions of an older policy; use "
            "steps_per_generation <= gradient_accumulation_steps)"
        )
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        fixes.append("top_entropy_quantile < 1 (use top_entropy_quantile=1.0)")
    if float(getattr(args, "entropy_coef", 0.0)) != 0.0 or getattr(
        args, "use_adaptive_entropy", False
    ):
        # the entropy bonus reaches the weights outside the log-probabilities the callback reads
        fixes.append("an entropy bonus (use entropy_coef=0.0, use_adaptive_entropy=False)")
    if getattr(args, "use_vllm", False) and getattr(
        args, "vllm_importance_sampling_correction", False
    ):
        fixes.append(
            "vLLM importance-sampling correction (vllm_importance_sampling_correction=False)"
        )
    if float(getattr(args, "temperature", 1.0)) != 1.0:
        # the loss's log-probabilities would be of the tempered policy, the queries' are not
        fixes.append(f"temperature={args.temperature} (use temperature=1.0)")
    if fixes:
        raise ValueError(
            "AttributionCallback: this GRPOConfig makes the per-completion loss unrecoverable "
            "from what the trainer backpropagates: " + "; ".join(fixes) + "."
        )
    return _GRPONormaliser(loss_type, int(args.max_completion_length))


def _trainer_kind(args: Any) -> str:
    """``"lm"`` (Trainer, SFTTrainer) or ``"grpo"``; TRL's other RL trainers are refused."""
    cls = type(args)
    names = {c.__name__ for c in cls.__mro__}
    if not cls.__module__.startswith("trl") or "SFTConfig" in names:
        return "lm"
    if "GRPOConfig" in names:
        return "grpo"
    raise ValueError(
        f"AttributionCallback: {cls.__name__} trains with a loss that is not a per-sample "
        "log-likelihood or a GRPO policy gradient (preferences, a value model), so no "
        "per_sample_loss convention describes its gradients. Capture them as they are with a "
        "HookManager and an OffloadCallback."
    )


class AttributionCallback(TrainerCallback):
    """Capture per-sample training gradients from a ``Trainer`` / ``SFTTrainer`` run.

    ``trainer.add_callback(AttributionCallback(store_dir))``: at ``on_train_begin`` it builds a
    :class:`~dattri_llm.HookManager` with an :class:`~dattri_llm.OffloadCallback` on the
    trainer's model and captures until ``on_train_end``. See the module docstring for the
    conventions (per-sample loss, checkpoint labels, steps).

    Args:
        store_dir: The train gradient store's directory.
        per_sample_loss: ``"sum"`` (default) or ``"mean"`` over the sample's label tokens, or
            ``"share"``: each row as the trainer backpropagated it, the sample's share of the
            gradient the optimizer applied (the rows of one update sum to it; the store
            declares ``loss_reduction="sum"``). Required by ``optimizer_state``.
        checkpoint_every: ``"epoch"`` (default): one checkpoint label per epoch; ``"save"``:
            one per interval between two saves (``save_strategy``), the last one ending with
            training.
        config: Which layers to hook (default: every supported trainable layer); the same
            config is used by :meth:`capture_queries`.
        mode: The store's mode (``"create"``, ``"append"``, ``"overwrite"``).
        keep_token_factors: As ``OffloadCallback(keep_token_factors=)``.
        storage_dtype: As ``OffloadCallback(storage_dtype=)``.
        optimizer_state: Also record the trainer's optimizer moments around every update
            (an :class:`~dattri_llm.OptimizerStateCallback`), for AdamW-influence and DVEmb:
            ``AdamWInfluenceAttributor(args).attribute_from_cache(store, queries,
            dynamics=callback.dynamics())``. Needs ``per_sample_loss="share"`` and no gradient
            clipping (``TrainingArguments(max_grad_norm=0.0)``): a clipped update is no sum of
            the stored rows.
        snapshots: With ``optimizer_state``: write the recorded moments to this directory (a
            :class:`~dattri_llm.TrajectorySnapshots`) as each step completes, instead of
            keeping them in memory.

    Attributes:
        manager: The hook manager (built at ``on_train_begin``).
        store: The train :class:`~dattri_llm.GradientStorageManager`.
        checkpoints: ``{label: {"weights_fingerprint", "global_step", "epoch", "reason"}}`` of
            the labels closed so far (also in the store's ``checkpoints.json``).
    """

    def __init__(
        self,
        store_dir: str | os.PathLike,
        *,
        per_sample_loss: str = "sum",
        checkpoint_every: str = "epoch",
        config: HookManagerConfig | None = None,
        mode: str = "create",
        keep_token_factors: bool | Sequence[str] = False,
        storage_dtype: str | torch.dtype | None = None,
        optimizer_state: bool = False,
        snapshots: str | os.PathLike | None = None,
    ) -> None:
        self.per_sample_loss = _check_loss(per_sample_loss, "AttributionCallback")
        if (optimizer_state or snapshots is not None) and per_sample_loss != "share":
            raise ValueError(
                f"AttributionCallback(optimizer_state=True, per_sample_loss={per_sample_loss!r}): "
                "the trajectory methods model each update as the sum of the stored rows, and a "
                "trainer's token-weighted loss is no sum of per-sample sums or means. Pass "
                "per_sample_loss='share' (each row the sample's share of the applied gradient)."
            )
        self.optimizer_state = bool(optimizer_state or snapshots is not None)
        self.snapshots = snapshots
        self.recorder: OptimizerStateCallback | None = None
        self._optimizer: Any = None
        if checkpoint_every not in _EVERY:
            raise ValueError(
                f"AttributionCallback(checkpoint_every={checkpoint_every!r}): expected 'epoch' "
                "(a checkpoint label per epoch) or 'save' (one per saved checkpoint)."
            )
        self.store_dir = os.fspath(store_dir)
        self.checkpoint_every = checkpoint_every
        self.config = config
        self.mode = mode
        self.keep_token_factors = keep_token_factors
        self.storage_dtype = storage_dtype
        self.manager: HookManager | None = None
        self.store: GradientStorageManager | None = None
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self._scale = _PerSampleScale(self.per_sample_loss)
        self._offload: OffloadCallback | None = None
        self._stack: contextlib.ExitStack | None = None
        self._written_at_label = 0
        self._declared = False
        self._accumulation = 1
        self._steps_in_epoch: int | None = None

    # ---- the trainer's events --------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        """Build the manager on the trainer's model and start capturing."""
        del state, control
        kind = _trainer_kind(args)
        self._scale.grpo = _check_grpo(args) if kind == "grpo" else None
        if model is None:
            raise ValueError("AttributionCallback: the trainer passed no model to on_train_begin.")
        if self.optimizer_state and float(args.max_grad_norm or 0.0) > 0.0:
            raise ValueError(
                f"AttributionCallback(optimizer_state=True): the trainer clips the gradient norm "
                f"to max_grad_norm={args.max_grad_norm}, so an update is not the sum of the "
                "stored rows. Train with TrainingArguments(max_grad_norm=0.0)."
            )
        self.close()
        self._optimizer = kw.get("optimizer")
        self._accumulation = int(args.gradient_accumulation_steps)
        loader = kw.get("train_dataloader")
        try:  # the micro-batches of an epoch: its last optimizer step may take fewer
            self._steps_in_epoch = len(loader) if loader is not None else None
        except TypeError:  # an iterable dataset: every step takes gradient_accumulation_steps
            self._steps_in_epoch = None
        self.store = GradientStorageManager(self.store_dir, mode=self.mode)
        self._offload = OffloadCallback(
            file_manager=self.store,
            gradient_accumulation_steps=self._accumulation,
            keep_token_factors=self.keep_token_factors,
            storage_dtype=self.storage_dtype,
            # the rows of an update sum to the applied gradient: what the trajectory methods read
            loss_reduction="sum" if self.per_sample_loss == "share" else None,
        )
        callbacks: list[Any] = [self._offload]
        self.recorder = None
        if self.optimizer_state:
            self.recorder = OptimizerStateCallback(
                model,
                self._trainer_optimizer,
                snapshots=self.snapshots,
                gradient_accumulation_steps=self._accumulation,
            )
            callbacks.append(self.recorder)
        manager = HookManager(model, config=self.config, callbacks=callbacks)
        batched = [s.name for s in manager.layers if s.hook_type == "param_grad"]
        if batched:
            manager.remove()
            raise ValueError(
                f"AttributionCallback: layers {batched} are captured from param.grad (one "
                "gradient per batch), which cannot be rescaled per sample; hook them as "
                "linear_io layers or exclude them (HookManagerConfig)."
            )
        manager.add_transform(self._scale.transform)
        self._scale.manager = manager
        stored = self.store.available_checkpoints() if len(self.store) else []
        manager.checkpoint = max(stored) + 1 if stored and self.mode == "append" else 0
        self.manager = manager
        stack = contextlib.ExitStack()
        handle = model.register_forward_hook(self._scale.on_forward, with_kwargs=True)
        stack.callback(handle.remove)
        stack.enter_context(manager.collect(deregister_on_exit=True))
        self._stack = stack
        self._written_at_label = 0
        self._declared = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any):
        """The stored step of this update's micro-batches: the trainer's optimizer step."""
        del args, control
        self._optimizer = kw.get("optimizer", self._optimizer)
        if self.manager is not None:
            self.manager.step = int(state.global_step) * self._accumulation
        if self._scale.grpo is not None:
            self._scale.grpo.accumulation = self._micro_batches(int(state.global_step))

    def _micro_batches(self, step: int) -> int:
        """Micro-batches of optimizer step ``step``, as the Trainer chunks an epoch."""
        ga, n = self._accumulation, self._steps_in_epoch
        if not n:
            return ga
        per_epoch = max(-(-n // ga), 1)
        last = n % ga or ga
        return last if step % per_epoch == per_epoch - 1 else ga

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any):
        """Record the moments the update left (``optimizer_state``)."""
        del args, control, kw
        if self.recorder is not None and self._stack is not None:
            self.recorder.record_post(int(state.global_step))  # incremented after this event

    def _trainer_optimizer(self) -> torch.optim.Optimizer:
        """The trainer's optimizer (unwrapped from accelerate's ``AcceleratedOptimizer``)."""
        opt = self._optimizer
        if opt is None:
            raise RuntimeError(
                "AttributionCallback(optimizer_state=True): the trainer passed no optimizer to "
                "its callbacks."
            )
        return getattr(opt, "optimizer", opt)

    def dynamics(self) -> Any:
        """The recorded optimizer dynamics (``optimizer_state=True``).

        What ``AdamWInfluenceAttributor`` / ``DVEmbAttributor(...).attribute_from_cache(...,
        dynamics=...)`` take.

        Raises:
            RuntimeError: the callback records no optimizer state, or nothing was recorded.
        """
        if self.recorder is None:
            raise RuntimeError(
                "AttributionCallback.dynamics(): no optimizer state was recorded; build the "
                "callback with optimizer_state=True, per_sample_loss='share'."
            )
        return self.recorder.dynamics()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kw: Any):
        """Close the epoch's label (``checkpoint_every="epoch"``)."""
        del args, control, kw
        if self.checkpoint_every == "epoch":
            self._close_label(state, "epoch")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any):
        """Close the label of the steps since the last save (``checkpoint_every="save"``)."""
        del control, kw
        if self.checkpoint_every == "save":
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self._close_label(state, "save", checkpoint_dir=path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any):
        """Close the last label (its weights: the final ones) and stop capturing."""
        del args, control, kw
        self._close_label(state, "end")
        self.close()

    def close(self) -> None:
        """Stop capturing: the records are made durable and the hooks come down (idempotent).

        ``on_train_end`` calls it; call it yourself after a training run that raised.
        """
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _close_label(self, state: Any, reason: str, **info: Any) -> None:
        """Declare the weights the current label stands for and start the next label."""
        if self.manager is None or self._offload is None or self._stack is None:
            return
        written = self._offload.num_written
        if written == self._written_at_label:
            return  # nothing captured under this label (a save right after an epoch's end)
        self._written_at_label = written
        label = int(self.manager.checkpoint)
        fingerprint = weights_fingerprint(self.manager.layer_parameters())
        entry = {
            "weights_fingerprint": fingerprint,
            "global_step": int(state.global_step),
            "epoch": float(state.epoch) if state.epoch is not None else None,
            "reason": reason,
            **info,
        }
        self.checkpoints[label] = entry
        if get_rank() == 0:
            if not self._declared:  # written beside the records (the store's meta.json first)
                facts = read_checkpoints_file(self.store_dir) if self.mode == "append" else {}
                facts.update(
                    per_sample_loss=self.per_sample_loss, checkpoint_every=self.checkpoint_every
                )
                grpo = self._scale.grpo
                # what a row is the gradient of: the sample's NLL, or GRPO's -A_i x its NLL
                facts["objective"] = "grpo" if grpo is not None else "log_likelihood"
                if grpo is not None:
                    facts["grpo_loss_type"] = grpo.loss_type
                if self.mode != "append":
                    facts["checkpoints"] = {}
                declare_capture(self.store_dir, **facts)
                self._declared = True
            info = {k: v for k, v in entry.items() if k != "weights_fingerprint"}
            declare_checkpoint(self.store_dir, label, fingerprint, **info)
        self.manager.checkpoint = label + 1

    # ---- the query side --------------------------------------------------------------------
    def capture_queries(
        self,
        model: nn.Module,
        data: Iterable[Mapping[str, Any]],
        store_dir: str | os.PathLike,
        **kwargs: Any,
    ) -> GradientStorageManager:
        """:func:`capture_queries` with this capture's store, layers and per-sample loss."""
        kwargs.setdefault("config", self.config)
        return capture_queries(
            model,
            data,
            store_dir,
            train_store=self.store_dir,
            # a share store's queries take their own loss (kwargs may choose "mean")
            per_sample_loss=kwargs.pop(
                "per_sample_loss", None if self.per_sample_loss == "share" else self.per_sample_loss
            ),
            **kwargs,
        )


def _stored_names(manager: HookManager) -> list[str]:
    """The layer names a record of ``manager`` holds (a tied group under its lead's name)."""
    tied = {s for lead, sites in manager.shared_groups.items() for s in sites if s != lead}
    return [n for n in manager.layer_names if n not in tied]


def capture_queries(
    model: nn.Module,
    data: Iterable[Mapping[str, Any]],
    store_dir: str | os.PathLike,
    *,
    train_store: str | os.PathLike | None = None,
    per_sample_loss: str | None = None,
    config: HookManagerConfig | None = None,
    batch_size: int = 8,
    checkpoint: int | None = None,
    mode: str = "create",
) -> GradientStorageManager:
    """Capture the per-sample gradients of queries into a store, the way the train side was.

    The model runs in eval mode for the duration (no dropout; its mode is restored after), each
    query's loss is the declared per-sample loss of its label tokens (``labels`` when a query
    has them, else its ``input_ids`` where ``attention_mask`` is 1, with the causal shift), and
    the queries' gradients never reach ``param.grad`` (restored as found). Each query is
    identified by ``hash_sample(query)`` of the query as given, whatever padding its batch gets.

    Args:
        model: The model at the weights to attribute at (a causal LM).
        data: The queries: mappings of 1-D tensors (``input_ids``, optionally
            ``attention_mask`` and ``labels``), padded per batch here.
        store_dir: The query store's directory.
        train_store: The train store these queries will be scored against: its per-sample loss
            (from ``checkpoints.json``) is used, its layers are checked, and the query store is
            labelled with the train checkpoint whose weights the model holds.
        per_sample_loss: ``"sum"`` or ``"mean"``; default: the train store's (else ``"sum"``).
        config: Which layers to hook; must give the train store's layers (default: every
            supported trainable layer). :meth:`AttributionCallback.capture_queries` passes the
            train capture's.
        batch_size: Queries per forward / backward.
        checkpoint: The label to store them under; default: the train label whose weights the
            model holds (``0`` without ``train_store``).
        mode: The query store's mode.

    Returns:
        The query store (closed; ready to read).

    Raises:
        ValueError: a per-sample loss other than the train store's, layers other than the
            train store's, or (``checkpoint=None``) weights that match no train label.
    """
    declared = None
    store = None
    if train_store is not None:
        store = GradientStorageManager(train_store)
        declared = read_checkpoints_file(train_store).get("per_sample_loss")
    if declared == "share":  # a query has no batch to have a share of: its own loss
        declared = None
    if per_sample_loss is None:
        per_sample_loss = declared or "sum"
    _check_loss(per_sample_loss, "capture_queries", QUERY_LOSSES)
    if declared is not None and per_sample_loss != declared:
        raise ValueError(
            f"capture_queries(per_sample_loss={per_sample_loss!r}): the train store {train_store} "
            f"was captured with per_sample_loss={declared!r}; both sides must use one "
            f"convention. Pass per_sample_loss={declared!r} (or leave it out)."
        )
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError("capture_queries supports causal (decoder-only) language models.")
    queries = [dict(q) for q in data]
    if not queries:
        raise ValueError("capture_queries: no queries given.")
    qstore = GradientStorageManager(store_dir, mode=mode)
    manager = HookManager(
        model,
        config=config,
        callbacks=[OffloadCallback(file_manager=qstore)],
        # queries at fixed weights: per-sample gradients only (a wrapper's reducer expects
        # the weights' gradients, so it keeps an ordinary backward)
        fixed_weights=not is_distributed_wrapper(model),
    )
    try:
        if store is not None and len(store):
            names, want = _stored_names(manager), store.layer_names
            if sorted(names) != sorted(want):
                raise ValueError(
                    "capture_queries: the hooks would capture layers "
                    f"{sorted(set(names) - set(want))} that the train store {train_store} "
                    "lacks, and miss "
                    f"{sorted(set(want) - set(names))}; pass config= with the train capture's "
                    "HookManagerConfig (AttributionCallback.capture_queries does)."
                )
        manager.checkpoint = _query_label(manager, store, checkpoint, train_store)
        _run_queries(model, manager, queries, per_sample_loss, batch_size)
    finally:
        manager.remove()
        qstore.close()
    return qstore


def _query_label(
    manager: HookManager, store: GradientStorageManager | None, checkpoint: int | None, where: Any
) -> int:
    if checkpoint is not None:
        return int(checkpoint)
    if store is None or not len(store):
        return 0
    fingerprint = weights_fingerprint(manager.layer_parameters())
    labels = label_weights(store)
    matching = [c for c, fps in sorted(labels.items()) if fps is not None and fingerprint in fps]
    if matching:
        return matching[-1]
    listed = "; ".join(
        f"label {c}: {', '.join(sorted(f)) if f else 'unknown'}" for c, f in sorted(labels.items())
    )
    raise ValueError(
        f"capture_queries: the model's weights (fingerprint {fingerprint}) match none of the "
        f"checkpoint labels of the train store {where} ({listed}); queries captured at other "
        "weights would be scored against gradients they are not comparable with. Load the "
        "weights of the checkpoint you attribute at (after trainer.train(): the final weights, "
        "the last label), or pass checkpoint=k to label them yourself."
    )


def _labelled(query: dict[str, Any]) -> dict[str, Any]:
    """The query with ``labels``: its own, else its ``input_ids`` where attended (unpadded)."""
    if "labels" in query:
        return query
    labels = torch.as_tensor(query["input_ids"]).clone()
    if "attention_mask" in query:
        labels = labels.masked_fill(torch.as_tensor(query["attention_mask"]) == 0, -100)
    return {**query, "labels": labels}


def _run_queries(
    model: nn.Module,
    manager: HookManager,
    queries: list[dict[str, Any]],
    per_sample_loss: str,
    batch_size: int,
) -> None:
    """Forward and backward every batch of queries in eval mode, ``param.grad`` untouched."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    was_training = model.training
    collate = pad_collate(0)
    device = next(iter(model.parameters())).device
    try:
        model.eval()
        for p in params:
            p.grad = None
        with manager.collect():
            for start in range(0, len(queries), batch_size):
                items = queries[start : start + batch_size]
                manager.set_sample_ids([hash_sample(q) for q in items])
                batch = {k: v.to(device) for k, v in collate([_labelled(q) for q in items]).items()}
                labels = batch.pop("labels")
                logits = model(**batch).logits
                per_sample = _sum_nll(logits, labels, shift=True)
                if per_sample_loss == "mean":
                    per_sample = per_sample / _label_counts(labels, True).clamp_min(1).to(
                        per_sample
                    )
                per_sample.sum().backward()
    finally:
        model.train(was_training)
        for p, g in zip(params, saved):
            p.grad = g
