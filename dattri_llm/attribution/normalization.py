"""TrackStar's gradient normalizations as attributor options (Chang et al., 2024).

Two per-sample maps shared by the attributors:

* **Unit normalization** (``normalized_grad=True``): every train and query vector divided by
  its Euclidean norm over all scored layers concatenated, so a score is a cosine. Where a
  method preconditions (K-FAC / EK-FAC: ``P = (F̂ + λI)^{-1}``), the normalization happens
  after the preconditioning, on both sides, as TrackStar normalizes ``R^{-1/2} g``: the score
  is ``cos(P^{1/2} g, P^{1/2} q) = gᵀ P q / (√(gᵀ P g) √(qᵀ P q))`` (:func:`unit_rows` with
  the ``P``-norms). The trajectory methods normalize each train sample's whole displacement
  (summed over its occurrences) and each query (see ``TrajectoryAttributor``).
* **Second-moment correction** (:class:`SecondMoment`): each coordinate of the train and query
  gradients multiplied by ``1/√(v + ε)``, ``v`` Adam's second moment (``exp_avg_sq`` as the
  optimizer holds it, no bias correction) from a recorded
  :class:`~dattri_llm.OptimizerStateCallback` or from a (loaded) optimizer. The map is
  per coordinate, so it is exact only on exact coordinates: raw gradients, or a ``"mask"``
  projection recorded with the same mask. A store captured with a coordinate-mixing projection
  (``"dense"``, ``"sparse"``, ``"logra"``) is refused: the correction must come before the
  projection, and a projected store no longer has the coordinates: for TrackStar's
  correct-then-project recipe, correct at capture instead,
  ``HookManager(model, optimizer=opt, precondition="second_moment")`` on both sides
  (:mod:`dattri_llm.gradient.optim.second_moment`, the same ``ε`` default, ``1/√(v + ε)`` and
  fingerprint; an attributor's ``second_moment=`` on such a capture is refused by
  :func:`refuse_double_correction`, as twice corrected). An attributor's
  ``second_moment=`` also takes one per checkpoint (:func:`check_second_moment`); the Fisher
  family fits its preconditioner on the corrected gradients
  (:mod:`dattri_llm.attribution.kronecker.second_moment`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.layer_gradient import Materialized
from dattri_llm.gradient.optim.second_moment import (
    DEFAULT_EPS,
    adam_second_moments,
    capture_correction,
    moment_fingerprint,
    moment_scales,
)

__all__ = [
    "SecondMoment",
    "check_second_moment",
    "check_exact_coords",
    "moment_at",
    "unit_rows",
    "unit_rows_dense",
    "unit_per_sample",
    "dense_row_dot",
    "check_flag",
    "refuse_double_correction",
]

#: Projected layer types whose coordinates are the original ones (a subset of them).
_EXACT_COORDS = ("projected.mask",)


def check_flag(value: Any, where: str) -> bool:
    """``value`` as a bool (numpy bools accepted); anything else raises naming ``where``."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"):  # numpy 1 / numpy 2
        return bool(value)
    raise TypeError(f"{where} must be True or False, got {value!r}.")


def unit_rows(gradient: Gradient, sq_norms: torch.Tensor) -> Gradient:
    """Each row of ``gradient`` divided by ``√sq_norms`` (a zero row stays zero)."""
    norms = sq_norms.clamp_min(0).sqrt()
    return gradient.scale(1.0 / norms.clamp_min(torch.finfo(norms.dtype).tiny))


def unit_rows_dense(rows: torch.Tensor) -> torch.Tensor:
    """Each row of a ``(N, P)`` tensor divided by its norm (a zero row stays zero)."""
    norms = rows.norm(dim=1, keepdim=True)
    return rows / norms.clamp_min(torch.finfo(rows.dtype).tiny)


def unit_per_sample(rows: torch.Tensor, hashes: list[str]) -> torch.Tensor:
    """Rows ``(N_occ, P)`` divided by the norm of their sample's sum over its occurrences.

    Rows with equal ``hashes`` are one sample's occurrences; afterwards their sum is a unit
    vector (or zero).
    """
    ids: dict[str, int] = {}
    index = torch.as_tensor([ids.setdefault(h, len(ids)) for h in hashes], dtype=torch.long)
    index = index.to(rows.device)
    totals = rows.new_zeros(len(ids), rows.shape[1]).index_add_(0, index, rows)
    norms = totals.norm(dim=1).clamp_min(torch.finfo(rows.dtype).tiny)
    return rows / norms[index, None]


def dense_row_dot(x: Gradient, y: Gradient) -> torch.Tensor:
    """``<x_i, y_i>`` per row over the layers of ``y`` (each materialized once)."""
    out = None
    for name, ly in y.layers.items():
        a = x.layers[name].materialize().data
        b = ly.materialize().data
        ct = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
        part = (a.to(ct) * b.to(ct)).sum(1)
        out = part if out is None else out + part
    if out is None:
        raise ValueError("no layer to normalize over: the gradient has no scored layers.")
    return out


def check_exact_coords(name: str, layer_type: str) -> None:
    """Refuse a layer captured with a coordinate-mixing projection (no per-coordinate map)."""
    lt = str(layer_type)
    if lt.startswith("projected.") and lt not in _EXACT_COORDS:
        raise ValueError(
            f"SecondMoment: layer {name!r} was captured with a {lt!r} projection, which "
            "mixes coordinates; the per-coordinate correction 1/sqrt(v + eps) must come "
            "before such a projection, so it is refused on this store. Correct at capture "
            "instead, before the projection, on both the train and the query side: "
            'HookManager(model, optimizer=opt, precondition="second_moment") (TrackStar\'s '
            "recipe; then score without second_moment=), or capture raw gradients (or a "
            "'mask' projection) and keep second_moment=."
        )


def refuse_double_correction(attributor: Any, train: Any) -> None:
    """Refuse ``second_moment=`` on gradients already corrected at capture (twice corrected).

    Args:
        attributor: The attributor (its ``second_moment`` attribute, if any, is read).
        train: The train side's :class:`~dattri_llm.gradient.compat.CaptureFacts`.
    """
    if getattr(attributor, "second_moment", None) is None:
        return
    if capture_correction(train.metadata) is not None:
        name = type(attributor).__name__
        raise ValueError(
            f"{name}(second_moment=...): the train gradients ({train.source or 'train'}) were "
            'already corrected at capture (HookManager(..., precondition="second_moment")); '
            f"correcting them again would divide by sqrt(v + eps) twice. Use {name} without "
            "second_moment= on corrected captures."
        )


class SecondMoment:
    """Adam's second moment per captured coordinate: the map ``g ↦ g / √(v + ε)``.

    Build it with :meth:`from_dynamics` (a recorded run) or :meth:`from_optimizer` (a live or
    loaded optimizer and the :class:`~dattri_llm.HookManager` that lays out its layers), or
    directly from ``{layer name: v}`` with ``v`` laid out like the layer's captured gradient
    (matrix form, or the coordinates of a ``"mask"`` projection).

    ``v`` is the optimizer's ``exp_avg_sq`` as stored, without Adam's bias correction
    ``1/(1 − β₂ᶜ)``: with one update count for every parameter that correction is one global
    factor (up to ``ε``), which a unit normalization cancels and which scales every score alike.

    Args:
        second_moment: ``{layer name: (P,) tensor}``, non-negative.
        eps: ``ε`` inside the root (TrackStar's ``1/√(v + ε)``), ``> 0``.

    Raises:
        ValueError: a negative or non-finite ``v``, or ``eps <= 0``.
    """

    def __init__(self, second_moment: Mapping[str, torch.Tensor], eps: float = DEFAULT_EPS) -> None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"SecondMoment(eps=) must be a number > 0, got {eps!r}.")
        if not isinstance(second_moment, Mapping) or not second_moment:
            raise ValueError(
                "SecondMoment needs {layer name: exp_avg_sq laid out like the captured "
                "gradient}; build it with SecondMoment.from_dynamics(callback.dynamics()) or "
                "SecondMoment.from_optimizer(optimizer, hook_manager)."
            )
        self.eps = float(eps)
        self.v: dict[str, torch.Tensor] = {}
        for name, v in second_moment.items():
            v = torch.as_tensor(v).detach().reshape(-1)
            if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
                raise ValueError(
                    f"SecondMoment: layer {name!r}'s second moment has negative or non-finite "
                    "entries; pass the optimizer's exp_avg_sq."
                )
            self.v[name] = v
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """A SHA-256 of ``ε`` and every layer's name, dtype and ``v`` (what a saved fit records).

        The same definition (:func:`~dattri_llm.gradient.optim.second_moment.moment_fingerprint`)
        as the one a corrected capture records in its metadata.
        """
        if self._fingerprint is None:
            self._fingerprint = moment_fingerprint(self.v, self.eps)
        return self._fingerprint

    @classmethod
    def from_dynamics(cls, dynamics: Any, step: int | None = None, eps: float = DEFAULT_EPS) -> Any:
        """The second moment an Adam run left after update ``step`` (default: the last).

        Args:
            dynamics: ``OptimizerStateCallback.dynamics()`` (an ``OptimizerDynamics``), a
                ``TrajectorySnapshots`` or its directory.
            step: A recorded step (its ``exp_avg_sq.post``); ``None``: the last one.
            eps: ``ε``.
        """
        from dattri_llm.gradient.trajectory.dynamics import OptimizerDynamics

        dyn = dynamics if isinstance(dynamics, OptimizerDynamics) else OptimizerDynamics(dynamics)
        if dyn.kind != "adam":
            raise ValueError(
                f"SecondMoment.from_dynamics: the run was trained with {dyn.optimizer}, which "
                "keeps no second moment; record an Adam / AdamW run."
            )
        if not dyn.steps:
            raise ValueError("SecondMoment.from_dynamics: the dynamics hold no recorded step.")
        step = dyn.steps[-1] if step is None else int(step)
        sd = dyn.step(step)
        return cls({n: sd.tensor(n, "exp_avg_sq.post") for n in dyn.layer_names}, eps=eps)

    @classmethod
    def from_optimizer(cls, optimizer: Any, hook_manager: Any, eps: float = DEFAULT_EPS) -> Any:
        """The current second moment of an Adam / AdamW optimizer (e.g. after ``load_state_dict``).

        Args:
            optimizer: A ``torch.optim.Adam`` / ``AdamW`` over the model's parameters.
            hook_manager: The :class:`~dattri_llm.HookManager` whose layers the gradients are
                captured with (it lays the moments out like them).
            eps: ``ε``.
        """
        from dattri_llm.gradient.optim.kinds import resolve_optimizer
        from dattri_llm.gradient.optim.layout import layer_layouts

        opt = resolve_optimizer(optimizer, "SecondMoment.from_optimizer")
        layouts = layer_layouts(hook_manager)
        return cls(adam_second_moments(opt, layouts, "SecondMoment.from_optimizer"), eps=eps)

    def scales(self, name: str, width: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
        """``1/√(v + ε)`` of layer ``name`` ``(P,)``; refuses a width that does not match."""
        if name not in self.v:
            raise ValueError(
                f"SecondMoment has no second moment for layer {name!r} (it covers "
                f"{sorted(self.v)}); record the optimizer state over the same hooked layers."
            )
        v = self.v[name]
        if v.numel() != width:
            raise ValueError(
                f"SecondMoment: layer {name!r} has {width} captured coordinates but its second "
                f"moment {v.numel()}; capture and record with the same layers and mask."
            )
        return moment_scales(v, self.eps, device, dtype)

    def apply(self, gradient: Gradient) -> Gradient:
        """Every layer of ``gradient`` (materialized) times ``1/√(v + ε)`` per coordinate.

        Raises:
            ValueError: a layer captured with a coordinate-mixing projection, or one the
                second moment does not cover.
        """
        out = {}
        for name, lg in gradient.layers.items():
            dense = lg.materialize()
            check_exact_coords(name, dense.layer_type)
            d = self.scales(name, dense.data.shape[1], dense.data.device, dense.data.dtype)
            out[name] = Materialized(dense.data * d, dense.layer_type, dense.module_kwargs)
        return Gradient(out)


def check_second_moment(value: Any, where: str) -> SecondMoment | dict[int, SecondMoment] | None:
    """A checked ``second_moment=``: ``None``, a :class:`SecondMoment` or one per checkpoint.

    One :class:`SecondMoment` serves every checkpoint; one per checkpoint is a sequence indexed
    by checkpoint label or a ``{checkpoint: SecondMoment}`` mapping (returned as a dict).

    Raises:
        TypeError: anything else, naming ``where`` and how to build one.
    """
    if value is None or isinstance(value, SecondMoment):
        return value
    items = None
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = list(enumerate(value))
    if items and all(
        isinstance(m, SecondMoment) and isinstance(c, int) and not isinstance(c, bool)
        for c, m in items
    ):
        return dict(items)
    raise TypeError(
        f"{where} must be a SecondMoment (e.g. SecondMoment.from_dynamics(callback.dynamics())), "
        "or one per checkpoint: a list indexed by checkpoint label or {checkpoint: SecondMoment}; "
        f"got {type(value).__name__}."
    )


def moment_at(value: SecondMoment | dict[int, SecondMoment] | None, checkpoint: int) -> Any:
    """The :class:`SecondMoment` of ``checkpoint`` (``value`` from :func:`check_second_moment`)."""
    if not isinstance(value, dict):
        return value
    if checkpoint not in value:
        raise ValueError(
            f"second_moment has no SecondMoment for checkpoint {checkpoint} (it covers "
            f"{sorted(value)}); give one per checkpoint label of the gradients."
        )
    return value[checkpoint]
