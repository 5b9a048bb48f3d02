"""``DVEmbAttributor``: data value embeddings, trajectory-specific influence for SGD runs.

DVEmb (Wang et al., 2024) gives each occurrence of a training sample ``z`` at step ``t`` an
embedding, the first-order change of the final parameters had ``z`` been removed from that step:

    e_t(z) = η_t (I − η_{T−1} H_{T−1}) ⋯ (I − η_{t+1} H_{t+1}) s_z

for plain SGD (momentum and coupled weight decay are modelled too, see
:mod:`dattri_llm.attribution.trajectory.unroll`), and scores a query by
``⟨Σ_t e_t(z), ∇ℓ(q; θ_T)⟩`` — positive when the sample helped. Embeddings are computed once
(:meth:`DVEmbAttributor.embed`) and re-scored against any queries without the trajectory
(:class:`DataValueEmbeddings`).

Inputs: raw per-step per-sample gradients (a store, or a :class:`~dattri_llm.ReplayGradientSource`
recomputing them from parameter snapshots) and the learning-rate schedule ``learning_rate=``
(a number, a sequence by step, a mapping, a callable, or the record of an
``OptimizerStateCallback`` / ``ParameterSnapshotCallback(optimizer=...)``) — a missing one is an
error, never a silent 1.

Curvature ``H_k`` of each step's batch loss:

* ``"empirical_fisher"`` (the paper's): ``κ Σ_z s_z s_zᵀ`` from the captured gradients.
* ``"mc_fisher"``: the Monte-Carlo Fisher, ``κ Σ_z (1/n) Σ_draws ŝ_z ŝ_zᵀ`` with ``ŝ`` the
  gradients of the loss at labels *sampled from the model's prediction*
  (:func:`sampled_cross_entropy`, with the training loss's reduction), captured through the same
  hooks into a second store or replayed (``curvature_source=``); for cross-entropy it is an
  unbiased estimate of the Gauss-Newton matrix, and far more accurate than the empirical Fisher
  on small checks. The ``n`` draws of a sample at one step may be laid out as repeated rows of
  one curvature batch or as several micro-batches: each row's share is rescaled to the
  sample's own gradient before averaging.
* an :class:`~dattri_llm.attribution.trajectory.curvature.ExactHessian`: the true Hessian of
  each step's batch loss (Hessian-vector products replayed from the recorded parameters and
  batches); with it the embeddings are the exact first-order effect of removing the sample.
* ``"none"``: no propagation (``e_t(z) = η_t s_z``).

A run trained with Adam / AdamW gets a warning pointing to ``AdamWInfluenceAttributor``: DVEmb's
propagation assumes SGD. Gradient clipping is not modelled.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dattri_llm.attribution.adamw_influence import (
    check_dynamics_layout,
    coerce_dynamics,
    refuse_mixed_coordinates,
)
from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.trajectory.base import (
    StepIndex,
    TrajectoryAttributor,
    as_schedule,
    dense_rows,
    layer_widths,
    step_index,
)
from dattri_llm.attribution.trajectory.curvature import ExactHessian
from dattri_llm.attribution.trajectory.unroll import (
    Curvature,
    SGDStep,
    StepPushes,
    forward_sweep,
)
from dattri_llm.utils.files import atomic_write

__all__ = ["DVEmbAttributor", "DataValueEmbeddings", "sampled_cross_entropy"]

_FORMAT = "dattri_llm.data_value_embeddings"


def sampled_cross_entropy(
    logits: torch.Tensor,
    reduction: str = "sum",
    generator: torch.Generator | None = None,
    ignore_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross-entropy at labels sampled from the model's own prediction (Monte-Carlo Fisher).

    The gradient of this loss is ``ŝ`` of the ``"mc_fisher"`` curvature: its outer products
    average to the Fisher (= Gauss-Newton for softmax cross-entropy) of the model. Use it as the
    loss of a curvature capture, with the same reduction as the training loss.

    Args:
        logits: ``(..., C)`` the model's logits (e.g. ``(B, C)`` or ``(B, T, V)``).
        reduction: ``"sum"`` or ``"mean"`` over the batch (as the training loss).
        generator: Random generator of the sampled labels (reproducibility).
        ignore_mask: Optional boolean ``logits.shape[:-1]`` mask of the positions in the loss.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    probs = torch.softmax(flat.detach().double(), dim=-1)
    labels = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    losses = torch.nn.functional.cross_entropy(flat, labels, reduction="none")
    losses = losses.reshape(logits.shape[:-1])
    if ignore_mask is not None:
        losses = losses * ignore_mask.to(losses.dtype)
    per_sample = losses.reshape(logits.shape[0], -1).sum(1)
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "mean":
        return per_sample.mean()
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}.")


class DataValueEmbeddings:
    """Data value embeddings: one row ``Σ``-ready per sample occurrence, re-scorable.

    Attributes:
        embeddings: ``(N_occ, P)`` the rows (layers concatenated in ``layers`` order).
        hashes: Sample identity per row; steps: the step of each row.
        layers: ``{layer name: captured coordinates}`` in row order.
    """

    def __init__(
        self,
        embeddings: torch.Tensor,
        hashes: Sequence[str],
        steps: Sequence[int],
        layers: dict[str, int],
        output_dir: str | None = None,
    ) -> None:
        if embeddings.shape[0] != len(hashes) or len(hashes) != len(steps):
            raise ValueError("DataValueEmbeddings: one hash and one step per embedding row.")
        if embeddings.shape[1] != sum(layers.values()):
            raise ValueError("DataValueEmbeddings: the layer widths do not add up to the rows.")
        self.embeddings = embeddings
        self.hashes = [str(h) for h in hashes]
        self.steps = [int(s) for s in steps]
        self.layers = dict(layers)
        self.output_dir = output_dir

    def score(self, test: Any, device: str | torch.device = "cpu") -> AttributionScore:
        """Scores against the queries of a store / directory / source (gradients at θ_T)."""
        from dattri_llm.gradient.sources import DiskGradientSource

        if isinstance(test, (str, os.PathLike)):
            test = DiskGradientSource(test, device=device)
        blocks = list(test)
        if not blocks:
            raise ValueError("the test source yielded no gradients.")
        names = list(self.layers)
        widths = {
            n: int(blocks[0].gradient.layers[n].materialize().data.shape[1])
            for n in blocks[0].gradient.layer_names
        }
        if widths != self.layers:
            raise ValueError(
                f"the queries hold layers {widths} (coordinates), the embeddings {self.layers}; "
                "capture the queries like the training run."
            )
        dtype = torch.promote_types(self.embeddings.dtype, blocks[0].gradient.dtype)
        queries, query_hashes = dense_rows(blocks, names, dtype, device)
        if len(set(query_hashes)) != len(query_hashes):
            raise ValueError("a query has several gradients; capture each query once.")
        scores = self.embeddings.to(device, dtype) @ queries.T
        return AttributionScore(
            scores.cpu(), self.hashes, self.steps, query_hashes, output_dir=self.output_dir
        )

    def save(self, path: str | os.PathLike) -> str:
        """Write ``embeddings.safetensors`` + ``embeddings.json`` (no pickle)."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        tmp = os.path.join(path, ".embeddings.safetensors.tmp")
        save_file({"embeddings": self.embeddings.detach().cpu().contiguous()}, tmp)
        os.replace(tmp, os.path.join(path, "embeddings.safetensors"))
        meta = {
            "format": _FORMAT,
            "version": 1,
            "hashes": self.hashes,
            "steps": self.steps,
            "layers": list(self.layers.items()),
        }
        atomic_write(os.path.join(path, "embeddings.json"), json.dumps(meta))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DataValueEmbeddings:
        """Read embeddings written by :meth:`save`."""
        from safetensors.torch import load_file

        path = os.fspath(path)
        meta_path = os.path.join(path, "embeddings.json")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{meta_path}: not readable data value embeddings ({e}).") from None
        if meta.get("format") != _FORMAT or meta.get("version") != 1:
            raise ValueError(f"{meta_path} does not describe data value embeddings (version 1).")
        tensors = load_file(os.path.join(path, "embeddings.safetensors"))
        return cls(
            tensors["embeddings"],
            meta["hashes"],
            meta["steps"],
            {n: int(w) for n, w in meta["layers"]},
            output_dir=path,
        )

    def __repr__(self) -> str:
        return (
            f"DataValueEmbeddings(rows={len(self.hashes)}, samples={len(set(self.hashes))}, "
            f"dim={self.embeddings.shape[1]})"
        )


class DVEmbAttributor(TrajectoryAttributor):
    """Data value embeddings for an SGD run (positive score = the sample helped the query).

    Regime: the first-order effect of removing a few samples from *this* SGD run (small
    removals). Measured on digits-LR (SGD; docs/benchmarks/quality.md): LDS 0.73-0.75 at
    1 / 5 / 10 / 50 % removals against the recorded run with the default empirical-Fisher
    curvature (EK-FAC 0.67 at 1 %, 0.74-0.76 above), where the same propagation with each step's
    exact Hessian reaches 0.98 at 1 % and 0.92 at 50 %; half-data LDS 0.79 on digits-LR (EK-FAC
    0.83) and 0.51 on the non-convex digits-MLP (EK-FAC 0.47). On an Adam run it is the wrong
    model: it warns, and lands at Grad-Dot's level (GPT-2 fine-tuning: 0.19 vs 0.20 half-data
    LDS); use AdamW-influence or LESS. See docs/benchmarks/quality.md ("why do the trajectory
    methods trail on LDS").

    Args:
        args: Run options.
        task: For the live path.
        learning_rate: Default schedule (a number, sequence by step, mapping or callable).
        momentum: ``torch.optim.SGD``'s ``momentum`` (ignored when the call passes recorded
            ``dynamics=``, which carry it; so are the next three).
        dampening: ``torch.optim.SGD``'s ``dampening``.
        nesterov: ``torch.optim.SGD``'s ``nesterov``.
        weight_decay: ``torch.optim.SGD``'s ``weight_decay``.
        momentum_buffer_existed: Without ``dynamics=``: whether the momentum buffer existed
            before the first captured step (a window captured mid-training). Needed with
            momentum and dampening, where it sets the first step's gain (1 or 1 - dampening).
        curvature: ``"empirical_fisher"``, ``"mc_fisher"``, ``"none"``, or an
            :class:`~dattri_llm.attribution.trajectory.curvature.ExactHessian` (the true Hessian
            of each step's batch loss, replayed from parameter snapshots).
        loss_reduction: ``"sum"`` or ``"mean"``: how the training loss combined each batch.
            ``None``: what the capture recorded (``OffloadCallback(loss_reduction=...)``); an
            argument that contradicts the recording is an error. Declared nowhere, a store is
            refused (a ValueError naming both ways); the live ``attribute`` uses ``"sum"``.
        method: ``"auto"`` (default: ``"adjoint"``, or ``"forward"`` with ``normalized_grad``),
            ``"forward"`` (every occurrence's embedding carried forward: memory and work ∝
            samples) or ``"adjoint"`` (the queries carried backward: ∝ queries; no embeddings
            kept). Both give the same scores; :meth:`embed` always runs forward. On a 1000-sample
            run scored for 100 queries the forward sweep took 26× the adjoint's time
            (``experiments/benchmark/trajectory_cost.py`` at commit 0a80d14).
        compute_dtype: Raise the propagation's precision.
        normalized_grad: TrackStar's unit normalization of both sides: each sample's
            embedding summed over its occurrences and each query divided by its norm (see
            :class:`TrajectoryAttributor`).
        dynamics: A recorded SGD run (``OptimizerStateCallback.dynamics()``), whose learning
            rates, momentum and weight decay are used instead of the arguments above.
        curvature_source: With ``curvature="mc_fisher"``: the store / source of the
            sampled-label gradients.
        live_run: The run the live ``attribute`` trains and records (a
            :class:`~dattri_llm.LiveRunArguments`; default: SGD, its default settings).
        repeats: ``"sum"`` only (see :class:`~dattri_llm.TrajectoryAttributor`).

    ``learning_rate=``, ``dynamics=`` and ``curvature_source=`` may also be passed to a call
    (:meth:`attribute_from_cache`, :meth:`embed`, ...): they hold for that call alone.
    """

    default_optimizer = "sgd"
    curvatures = ("empirical_fisher", "mc_fisher", "none")

    def __init__(
        self,
        args: Any = None,
        task: Any = None,
        learning_rate: Any = None,
        momentum: float = 0.0,
        dampening: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        momentum_buffer_existed: bool | None = None,
        curvature: str | ExactHessian = "empirical_fisher",
        loss_reduction: str | None = None,
        method: str = "auto",
        compute_dtype: torch.dtype | None = None,
        normalized_grad: bool = False,
        dynamics: Any = None,
        curvature_source: Any = None,
        live_run: Any = None,
        repeats: str | None = None,
    ) -> None:
        if method == "auto":
            method = "forward" if normalized_grad is True else "adjoint"
        super().__init__(
            args,
            task,
            loss_reduction=loss_reduction,
            compute_dtype=compute_dtype,
            method=method,
            normalized_grad=normalized_grad,
            live_run=live_run,
            repeats=repeats,
            curvature=curvature,
        )
        self.learning_rate = learning_rate
        self.momentum, self.dampening = float(momentum), float(dampening)
        self.nesterov, self.weight_decay = bool(nesterov), float(weight_decay)
        self.momentum_buffer_existed = momentum_buffer_existed
        self._first_step = 0
        self.dynamics = dynamics
        self.curvature_source = curvature_source

    call_options = ("learning_rate", "dynamics", "curvature_source")

    def embed(
        self,
        train: Any,
        learning_rate: Any = None,
        dynamics: Any = None,
        curvature_source: Any = None,
        save_to: str | os.PathLike | None = None,
    ) -> DataValueEmbeddings:
        """Compute (and optionally save) the data value embeddings of a captured run.

        Args:
            train: The run's per-step per-sample gradients (a store, a source).
            learning_rate: The schedule, for this call (``None``: the constructor's).
            dynamics: A recorded SGD run, for this call.
            curvature_source: ``"mc_fisher"``'s sampled-label gradients, for this call.
            save_to: Save the embeddings in this directory.
        """
        options = {
            "learning_rate": learning_rate,
            "dynamics": dynamics,
            "curvature_source": curvature_source,
        }
        with self._plan(options, "embed"):
            return self._embed(train, save_to)

    def _embed(self, train: Any, save_to: str | os.PathLike | None) -> DataValueEmbeddings:
        index = step_index(train, device=self.device)
        index.check_contiguous(type(self).__name__)
        first = index.load(index.steps[0])[0].gradient
        layers = first.layer_names
        dtype = (
            first.dtype
            if self.compute_dtype is None
            else torch.promote_types(first.dtype, self.compute_dtype)
        )
        with self.declared_reduction("embed", index=index) as index:
            load = self.step_loader(index, layers, dtype)
            emb, hashes, steps = forward_sweep(index.steps, load, self._bar("embed"))
        out = DataValueEmbeddings(emb.cpu(), hashes, steps, layer_widths(first, layers))
        if save_to is not None:
            out.save(save_to)
            out.output_dir = os.fspath(save_to)
        return out

    # ---- per-step operators -------------------------------------------------------------------
    def step_loader(
        self,
        index: StepIndex,
        layers: list[str],
        dtype: torch.dtype,
    ) -> Callable[[int], tuple[SGDStep, StepPushes]]:
        """Each step's linearised SGD update (schedule, momentum, decay) and curvature."""
        where = type(self).__name__
        learning_rate, dynamics = self.learning_rate, self.dynamics
        curvature_source = self.curvature_source
        device = self.device
        dyn = None
        first = index.load(index.steps[0])[0].gradient
        if isinstance(self.curvature, ExactHessian):
            refuse_mixed_coordinates(first, layers, where, "the Hessian's entries")
        if dynamics is not None:
            dyn = coerce_dynamics(dynamics, where)
            refuse_mixed_coordinates(first, layers, where, "the recorded hyper-parameters")
            check_dynamics_layout(dyn, layers, layer_widths(first, layers), where)
            if dyn.kind != "sgd":
                warnings.warn(
                    f"{where}: this run was trained with {dyn.optimizer}, but DVEmb's propagation "
                    "assumes SGD; its scores can be far from the run's real influence. Use "
                    "AdamWInfluenceAttributor for Adam / AdamW runs (its learning rates are used "
                    "here as an SGD schedule).",
                    UserWarning,
                    stacklevel=3,
                )
            missing = sorted(set(index.steps) - set(dyn.steps))
            if missing:
                raise ValueError(f"{where}: no recorded dynamics for steps {missing[:10]}.")
        schedule = self._schedule(learning_rate, dyn, where)
        curv_index = None
        if self.curvature == "mc_fisher":
            if curvature_source is None:
                raise ValueError(
                    f"{where}(curvature='mc_fisher') needs curvature_source=: the per-sample "
                    "gradients of the loss at sampled labels (sampled_cross_entropy), captured "
                    "with the same hooks at every step."
                )
            curv_index = step_index(curvature_source, device=device)
            missing = sorted(set(index.steps) - set(curv_index.steps))
            if missing:
                raise ValueError(f"{where}: curvature_source lacks steps {missing[:10]}.")
        elif curvature_source is not None:
            raise ValueError(f"{where}: curvature_source= is used with curvature='mc_fisher' only.")
        self._check_warm_start(dyn, index.steps[0])

        def load(step: int) -> tuple[SGDStep, StepPushes]:
            shares, hashes = dense_rows(index.load(step), layers, dtype, device)
            kappa = self.kappa(shares.shape[0])
            vectors, weights = shares, None
            if curv_index is not None:
                vectors, weights, kappa = self._curvature_rows(
                    curv_index.load(step), layers, dtype, device, shares.shape[0]
                )
            elif self.curvature == "none" or isinstance(self.curvature, ExactHessian):
                vectors = None
            p = shares.shape[1]
            if schedule is None:  # the record's per-parameter learning rates
                sd = dyn.step(step, device)
                lr = torch.cat([sd.hyper_vector(n, "lr", dtype, device) for n in layers])
            else:
                lr = torch.full((p,), schedule(step), dtype=dtype, device=device)
            hyper = self._sgd_hyper(dyn, step, layers, p, dtype, device, lr)
            exact = isinstance(self.curvature, ExactHessian)
            curvature = Curvature(
                operator=self.curvature.operator(step, layers, dtype, device) if exact else None,
                vectors=vectors,
                kappa=kappa,
                weights=weights,
                coupled_decay=hyper["weight_decay"]
                if bool((hyper["weight_decay"] != 0).any())
                else None,
            )
            op = SGDStep(
                curvature,
                lr=hyper["lr"],
                momentum=hyper["momentum"],
                dampening=hyper["dampening"],
                nesterov=hyper["nesterov"],
                first_buffer=hyper["first"] if dyn is not None else self._first_buffer(step),
            )
            return op, StepPushes(step, self.removal_pushes(shares, step), hashes)

        return load

    def _check_warm_start(self, dyn: Any, first_step: int) -> None:
        """Without a record, dampened momentum needs to know whether the buffer existed."""
        self._first_step = first_step
        if (
            dyn is None
            and self.momentum
            and self.dampening
            and self.momentum_buffer_existed is None
        ):
            raise ValueError(
                f"{type(self).__name__}: with momentum and dampening the first captured step's "
                "gain is 1 if the momentum buffer starts there, 1 - dampening if it existed "
                "before (a window captured mid-training). Pass momentum_buffer_existed=True / "
                "False, or dynamics= recorded with OptimizerStateCallback."
            )

    def _first_buffer(self, step: int) -> bool:
        return step == self._first_step and not self.momentum_buffer_existed

    def _curvature_rows(
        self, blocks: list[Any], layers: list[str], dtype: Any, device: Any, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Monte-Carlo Fisher rows ``(vectors, weights, κ)`` of one step.

        ``H = (κ_B) Σ_z (1/n_z) Σ_draws ŝ ŝᵀ`` over per-sample gradients of the sampled loss,
        whatever the layout of the draws: a row of a mean-reduced curvature block is the share
        ``∇ℓ/R`` of that block's ``R`` rows, so it is scaled back by ``R`` and the mean's
        ``1/B`` (``B`` the training batch) goes into ``κ``; a sum-reduced row is ``∇ℓ``.
        """
        mats, rows = [], []
        for b in blocks:
            m, h = dense_rows([b], layers, dtype, device)
            mats.append(m * m.shape[0] if self.require_reduction("embed") == "mean" else m)
            rows += h
        counts: dict[str, int] = {}
        for h in rows:
            counts[h] = counts.get(h, 0) + 1
        weights = torch.tensor([1.0 / counts[h] for h in rows], dtype=dtype, device=device)
        kappa = 1.0 / batch if self.require_reduction("embed") == "mean" else 1.0
        return torch.cat(mats), weights, kappa

    def _schedule(self, learning_rate: Any, dyn: Any, where: str) -> Any:
        """The schedule given, or ``None``: the recorded per-parameter learning rates."""
        value = learning_rate if learning_rate is not None else self.learning_rate
        if value is not None and dyn is not None:
            raise ValueError(
                f"{where}: pass learning_rate= or dynamics=, not both: the recorded dynamics "
                "carry the learning rate of every parameter at every step."
            )
        if value is not None:
            return as_schedule(value, "learning_rate")
        if dyn is not None:
            return None
        raise ValueError(
            f"{where} needs the learning-rate schedule: pass learning_rate= (a number, a sequence "
            "by step, a {step: lr} mapping or a callable), or dynamics= recorded with "
            "OptimizerStateCallback. It is never assumed to be 1."
        )

    def _sgd_hyper(
        self, dyn: Any, step: int, layers: list[str], p: int, dtype: Any, device: Any, lr: Any
    ) -> dict[str, Any]:
        def full(v: float) -> torch.Tensor:
            return torch.full((p,), float(v), dtype=dtype, device=device)

        if dyn is None or dyn.kind != "sgd":
            return {
                "lr": lr,
                "momentum": full(self.momentum),
                "dampening": full(self.dampening),
                "nesterov": full(float(self.nesterov)),
                "weight_decay": full(self.weight_decay),
                "first": False,
            }
        sd = dyn.step(step, device)

        def cat(field: str) -> torch.Tensor:
            return torch.cat([sd.hyper_vector(n, field, dtype, device) for n in layers])

        if bool((cat("maximize") > 0).any()):
            raise ValueError(f"{type(self).__name__}: step {step} maximizes; not modelled.")
        has_buf = [sd.has(n, "momentum_buffer") for n in layers]
        return {
            "lr": lr,
            "momentum": cat("momentum"),
            "dampening": cat("dampening"),
            "nesterov": cat("nesterov"),
            "weight_decay": cat("weight_decay"),
            "first": not any(has_buf),
        }
