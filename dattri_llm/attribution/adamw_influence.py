"""``AdamWInfluenceAttributor``: first-order influence unrolled through an Adam / AdamW run.

Removing a training sample ``z`` from its step ``t`` changes that step's consumed gradient by
``−s_z``, hence the moments and parameters the step leaves; every later update carries the
perturbation forward through the recorded moments and the batch curvature (Deng et al., 2026;
the maths is in :mod:`dattri_llm.attribution.trajectory.unroll`). The score is the first-order
change of the query loss at the end of the run, ``q_Tᵀ δθ_T`` — positive when removing ``z``
would raise the query's loss (the sample helped), summed over the steps ``z`` occurs at by
``AttributionScore.agnostic_matrix``.

Exactly what the optimizer did, from :class:`~dattri_llm.OptimizerStateCallback`'s record:
the optimizer's own update counts (bias corrections), per-parameter learning rates (the
schedule), betas, ``ε``, AdamW's decoupled or Adam's coupled weight decay, AMSGrad's running
maximum, and gradient-norm clipping — detected by comparing the consumed gradient (recovered
from the moments, ``(m_post − β₁ m_pre)/(1−β₁)``) with the captured batch gradient, and
modelled exactly (``κ_c (I − u uᵀ)`` on the push and the curvature) when every trainable
parameter was captured without a mask; refused otherwise. ``maximize`` is refused. A consumed
gradient that is not a multiple of the captured one (samples missing from the capture, noise,
per-layer clipping, loss scaling) is refused with the step named.

Curvature: the empirical Fisher of each step's batch loss from the captured per-sample
gradients, ``κ Σ s sᵀ`` (``κ = B`` for a mean loss — pass ``loss_reduction="mean"`` — 1 for a
sum), or the true Hessian (``curvature=ExactHessian(model, snapshots, loss_fn)``: Hessian-vector
products of each step's batch loss, replayed from the recorded parameters and batches).
Per-layer random masks (``ProjectionConfig("mask", ...)`` at capture, recorded by the
callback at the same coordinates) keep the propagated state small; the result then equals the
full computation restricted to the masked coordinates.

The default evaluation carries only the queries' adjoints backward through the run (memory
``∝ queries × parameters``, never parameters²); ``method="forward"`` carries every sample's
perturbation forward instead (the same numbers).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dattri_llm.attribution.trajectory.base import (
    StepIndex,
    TrajectoryAttributor,
    dense_rows,
    layer_widths,
)
from dattri_llm.attribution.trajectory.curvature import ExactHessian
from dattri_llm.attribution.trajectory.unroll import AdamStep, Curvature, StepPushes
from dattri_llm.gradient.trajectory.dynamics import OptimizerDynamics
from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

__all__ = ["AdamWInfluenceAttributor", "coerce_dynamics"]


_ADAM_HYPERS = ("lr", "beta1", "beta2", "eps", "weight_decay", "decoupled", "maximize", "amsgrad")


def coerce_dynamics(dynamics: Any, where: str) -> OptimizerDynamics:
    """An :class:`OptimizerDynamics` from itself, a ``TrajectorySnapshots`` or a directory."""
    if isinstance(dynamics, OptimizerDynamics):
        return dynamics
    if isinstance(dynamics, (TrajectorySnapshots, str, os.PathLike)):
        return OptimizerDynamics(dynamics)
    if dynamics is None:
        raise ValueError(
            f"{where} needs dynamics=: the optimizer moments around every update, recorded with "
            "OptimizerStateCallback (pass callback.dynamics(), or the TrajectorySnapshots "
            "directory it wrote)."
        )
    raise TypeError(
        f"{where}: dynamics must be an OptimizerDynamics, a TrajectorySnapshots or its directory, "
        f"got {type(dynamics).__name__}."
    )


#: Projected layer types whose coordinates mix the parameters' (a ``"mask"`` keeps them).
MIXING_PROJECTIONS = ("projected.dense", "projected.sparse", "projected.logra")


def refuse_mixed_coordinates(gradient: Any, layers: list[str], where: str, needs: str) -> None:
    """Refuse layers stored with a projection that mixes coordinates when ``needs`` them.

    Per-coordinate quantities (Adam's moments, per-parameter hyper-parameters, a Hessian
    restricted to captured coordinates) have no exact counterpart in a ``"dense"`` /
    ``"sparse"`` / ``"logra"`` projected space.

    Raises:
        ValueError: naming the layers, their projection and the fix.
    """
    mixed = {n: gradient.layers[n].layer_type for n in layers}
    mixed = {n: t for n, t in mixed.items() if t in MIXING_PROJECTIONS}
    if mixed:
        raise ValueError(
            f"{where}: layers {mixed} are stored with a projection that mixes coordinates, but "
            f"{needs} are per coordinate, so the method cannot be computed exactly on them. "
            "Capture without a projection or with ProjectionConfig('mask', ...)."
        )


def check_dynamics_layout(
    dyn: OptimizerDynamics, layers: list[str], widths: dict[str, int], where: str
) -> None:
    """The dynamics must cover exactly the captured layers, coordinate for coordinate."""
    if set(dyn.layer_names) != set(layers):
        raise ValueError(
            f"{where}: the dynamics cover layers {sorted(dyn.layer_names)} but the gradients hold "
            f"{sorted(layers)}; record them with the same HookManager as the gradients."
        )
    bad = {n: (dyn.num_coords(n), widths[n]) for n in layers if dyn.num_coords(n) != widths[n]}
    if bad:
        raise ValueError(
            f"{where}: dynamics and gradients disagree on the coordinates of {bad} (recorded, "
            "captured); a 'mask' projection must be the same for both (same HookManager)."
        )


class AdamWInfluenceAttributor(TrajectoryAttributor):
    """Influence of each training sample unrolled through the recorded Adam / AdamW run.

    Regime: the effect of removing a few samples from *this* run (small removals; the quality
    benchmark's trajectory-specific LOO and LDS at 1-10 % removals). Measured on the GPT-2
    fine-tuning setting (docs/benchmarks/quality.md; LDS against the recorded run):
    with ``curvature=ExactHessian(...), push="exact", exact_steps=2`` 0.975 at 1 % removals
    (100 subsets), 0.94 / 0.93 / 0.75 at 5 / 10 / 50 %; with ``ExactHessian`` alone (the
    derivative of the run) 0.85 / 0.58 / 0.39 / 0.18; with the default empirical Fisher
    0.29-0.39 (0.42-0.49 with ``push="exact", exact_steps=2``; EK-FAC 0.48-0.60). For
    half-data LDS, where each half is retrained with its own batch order, a final-weights
    influence function ranks better (EK-FAC 0.67 against 0.34 with the empirical Fisher);
    see docs/benchmarks/quality.md ("why do the trajectory methods trail on LDS").

    Args:
        args: Run options.
        task: For the live path.
        dynamics: Default ``dynamics=`` of the calls (``OptimizerStateCallback.dynamics()``, a
            ``TrajectorySnapshots`` or its directory); a call's own ``dynamics=`` wins.
        loss_reduction: ``"sum"`` or ``"mean"``: how the training loss combined each batch.
            ``None``: what the capture recorded (``OffloadCallback(loss_reduction=...)``); an
            argument that contradicts the recording is an error. Declared nowhere, a store is
            refused (a ValueError naming both ways); the live ``attribute`` uses ``"sum"``.
        method: ``"adjoint"`` (memory ∝ queries) or ``"forward"`` (memory ∝ samples).
        compute_dtype: Raise the propagation's precision (e.g. ``torch.float64``).
        normalized_grad: TrackStar's unit normalization of both sides (needs
            ``method="forward"``; see :class:`TrajectoryAttributor`).
        curvature: Each step's batch-loss curvature: ``"empirical_fisher"`` (``κ Σ s sᵀ`` from
            the captured gradients), an
            :class:`~dattri_llm.attribution.trajectory.curvature.ExactHessian` (the true
            Hessian, replayed from parameter snapshots) or ``"none"``.
        push: How a removal changes the update of its own step: ``"linear"`` (the derivative,
            default) or ``"exact"`` (torch's Adam update recomputed from the recorded pre-step
            state without the sample; the later steps stay linear). The derivative of Adam's
            update is unbounded where ``v`` is young (``ε/(|g|+ε)²`` per coordinate at the
            first update, ``≈ sign(g)``) while the update itself is bounded, so the samples of
            a fresh optimizer's first updates get derivatives far larger than their effect
            (on the GPT-2 setting the 8 samples of the first batch: 5-57x). Not with AMSGrad
            or gradient clipping (refused).
        exact_steps: With ``push="exact"``, the first ``exact_steps`` steps of the recorded run
            also carry earlier removals through torch's exact update (the gradient change
            ``A δθ`` stays linear), where a young ``v`` makes the linearised carry as wrong as
            the linearised push; their removals are carried forward through those steps and
            scored against the adjoint after them (memory ∝ their samples × 3 P). ``0``: only
            the own step is exact. ``2`` for a run that starts from a fresh optimizer without
            warm-up (measured on GPT-2: 2 and 4 level, 16 worse; docs/benchmarks/quality.md).
        live_run: The run the live ``attribute`` trains and records (a
            :class:`~dattri_llm.LiveRunArguments`; default: AdamW, its default settings).
        repeats: ``"sum"`` only (see :class:`~dattri_llm.TrajectoryAttributor`).

    Example:
        ```python
        rec = OptimizerStateCallback(model, opt)
        ...  # train under HookManager(..., callbacks=[OffloadCallback(...), rec]),
        ...  # rec.record_post(step) after each opt.step(); capture the queries at the end
        score = AdamWInfluenceAttributor(args, loss_reduction="sum").attribute_from_cache(
            "train_grads", "query_grads", dynamics=rec.dynamics())
        ```
    """

    def __init__(
        self,
        args: Any = None,
        task: Any = None,
        dynamics: Any = None,
        loss_reduction: str | None = None,
        method: str = "adjoint",
        compute_dtype: torch.dtype | None = None,
        curvature: str | ExactHessian = "empirical_fisher",
        normalized_grad: bool = False,
        push: str = "linear",
        exact_steps: int = 0,
        live_run: Any = None,
        repeats: str | None = None,
    ) -> None:
        if push not in ("linear", "exact"):
            raise ValueError(
                f"AdamWInfluenceAttributor(push=): expected 'linear' (the derivative) or "
                f"'exact' (the removal's own step taken exactly), got {push!r}."
            )
        if isinstance(exact_steps, bool) or not isinstance(exact_steps, int) or exact_steps < 0:
            raise ValueError(
                f"AdamWInfluenceAttributor(exact_steps=): expected an int >= 0 (how many of "
                f"the run's first steps carry perturbations exactly), got {exact_steps!r}."
            )
        if exact_steps and push != "exact":
            raise ValueError(
                "AdamWInfluenceAttributor(exact_steps=) needs push='exact' (the steps it "
                f"takes exactly include the removals' own), got push={push!r}."
            )
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
        self.dynamics = dynamics
        self.push = push
        self.exact_steps = exact_steps

    #: ``dynamics=`` of a call holds for that call alone (the specification passes it there).
    call_options = ("dynamics",)

    def step_loader(
        self, index: StepIndex, layers: list[str], dtype: torch.dtype
    ) -> Callable[[int], tuple[AdamStep, StepPushes]]:
        """Each step's linearised Adam / AdamW update from the recorded dynamics."""
        where = type(self).__name__
        dyn = coerce_dynamics(self.dynamics, where)
        if dyn.kind != "adam":
            raise ValueError(
                f"{where}: the run was trained with {dyn.optimizer}; AdamW-influence models "
                "torch.optim.Adam / AdamW. For SGD use DVEmbAttributor."
            )
        missing = sorted(set(index.steps) - set(dyn.steps))
        if missing:
            raise ValueError(
                f"{where}: no optimizer dynamics for steps {missing[:10]}; record_post(step) must "
                "follow every optimizer.step() of the captured run."
            )
        first = index.load(index.steps[0])[0].gradient
        refuse_mixed_coordinates(first, layers, where, "Adam's moments")
        check_dynamics_layout(dyn, layers, layer_widths(first, layers), where)
        device = self.device

        def load(step: int) -> tuple[AdamStep, StepPushes]:
            shares, hashes = dense_rows(index.load(step), layers, dtype, device)
            pushes = self.removal_pushes(shares, step)
            early = step in index.steps[: self.exact_steps]
            return self._step(dyn, step, layers, shares, dtype, device, early), StepPushes(
                step, pushes, hashes
            )

        return load

    def _step(
        self,
        dyn: OptimizerDynamics,
        step: int,
        layers: list[str],
        shares: torch.Tensor,
        dtype: torch.dtype,
        device: Any,
        nonlinear: bool = False,
    ) -> AdamStep:
        where = f"{type(self).__name__} (step {step})"
        sd = dyn.step(step, device)

        def cat(get: Any) -> torch.Tensor:
            return torch.cat([get(n).to(device=device, dtype=dtype).reshape(-1) for n in layers])

        h = {f: cat(lambda n, f=f: sd.hyper_vector(n, f, dtype, device)) for f in _ADAM_HYPERS}
        if bool((h["maximize"] > 0).any()):
            raise ValueError(f"{where}: the optimizer maximizes (maximize=True); not modelled.")
        amsgrad = bool((h["amsgrad"] > 0).any())
        if amsgrad and not bool((h["amsgrad"] > 0).all()):
            raise ValueError(f"{where}: AMSGrad is on for some parameters only; not modelled.")
        beta1 = h["beta1"]
        if bool((beta1 >= 1).any()):
            raise ValueError(f"{where}: beta1 = 1 leaves the consumed gradient unrecoverable.")
        count = cat(lambda n: sd.count_vector(n, dtype, device))
        m_pre, m_post = (
            cat(lambda n: sd.tensor(n, "exp_avg")),
            cat(lambda n: sd.tensor(n, "exp_avg.post")),
        )
        v_post = cat(lambda n: sd.tensor(n, "exp_avg_sq.post"))
        consumed = (m_post - beta1 * m_pre) / (1 - beta1)
        coupled = h["weight_decay"] * (1 - h["decoupled"])
        decoupled = h["weight_decay"] * h["decoupled"]
        batch_grad = consumed
        if bool((coupled != 0).any()):
            theta = cat(lambda n: sd.tensor(n, "param"))
            batch_grad = consumed - coupled * theta
        # the check's tolerance follows the precision the run was recorded in, not the
        # (possibly raised) compute dtype
        recorded = sd.tensor(layers[0], "exp_avg").dtype
        clip, unit = self._clip(dyn, shares.sum(0), batch_grad, where, recorded)
        exact = isinstance(self.curvature, ExactHessian)
        curvature = Curvature(
            vectors=shares if self.curvature == "empirical_fisher" else None,
            kappa=self.kappa(shares.shape[0]),
            clip=clip,
            unit=unit,
            coupled_decay=coupled if bool((coupled != 0).any()) else None,
            operator=self.curvature.operator(step, layers, dtype, device) if exact else None,
        )
        exact_push = self.push == "exact"
        if exact_push and (amsgrad or unit is not None or clip != 1.0):
            why = "AMSGrad" if amsgrad else f"gradient norm clipping (factor {clip:.4g})"
            raise ValueError(
                f"{where}: push='exact' recomputes the step's update without the sample, but "
                f"the run used {why}, which it does not model. Use push='linear' (the "
                "derivative, which models it)."
            )
        vmax = vmax_pre = None
        if amsgrad:
            vmax = cat(lambda n: sd.tensor(n, "max_exp_avg_sq.post"))
            vmax_pre = cat(lambda n: sd.tensor(n, "max_exp_avg_sq"))
        return AdamStep(
            curvature,
            lr=h["lr"],
            beta1=beta1,
            beta2=h["beta2"],
            eps=h["eps"],
            count=count,
            decoupled_decay=decoupled,
            grad=consumed,
            exp_avg=m_post,
            exp_avg_sq=v_post,
            max_exp_avg_sq=vmax,
            max_exp_avg_sq_pre=vmax_pre,
            exact_push=exact_push,
            nonlinear=nonlinear,
        )

    def _clip(
        self,
        dyn: OptimizerDynamics,
        captured: torch.Tensor,
        consumed: torch.Tensor,
        where: str,
        recorded: torch.dtype,
    ) -> tuple[float, torch.Tensor | None]:
        """The clip factor ``κ_c`` and unit gradient ``u`` (``1, None`` without clipping)."""
        eps = max(torch.finfo(consumed.dtype).eps, torch.finfo(recorded).eps)
        tol = 10 * eps**0.5
        norm_sq = float(captured @ captured)
        scale = max(float(consumed.norm()), float(captured.norm()))
        if norm_sq == 0.0 or scale == 0.0:
            return 1.0, None
        c = float(consumed @ captured) / norm_sq
        residual = float((consumed - c * captured).norm()) / scale
        if residual > tol:
            raise ValueError(
                f"{where}: the gradient the optimizer consumed (recovered from the moments) is "
                "not a multiple of the captured batch gradient (relative residual "
                f"{residual:.2e}). Every sample of the step must be captured, and the loop may "
                "change the gradient only by global norm clipping (no noise, per-layer "
                "clipping, dropped samples or loss scaling left in the gradient)."
            )
        if abs(c - 1.0) <= tol:
            return 1.0, None
        if dyn.uncovered_parameters or dyn.masked:
            what = (
                f"trainable parameters {dyn.uncovered_parameters[:5]} were not captured"
                if dyn.uncovered_parameters
                else "the capture holds only masked coordinates"
            )
            raise ValueError(
                f"{where}: gradient norm clipping was active (factor {c:.4g}), which acts through "
                f"the norm of the whole gradient, but {what}. Capture every trainable parameter "
                "without a mask to model it, or train without clipping."
            )
        return c, captured / norm_sq**0.5
