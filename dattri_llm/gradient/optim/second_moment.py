"""TrackStar's second-moment correction at capture time, before a coordinate-mixing projection.

With ``HookManager(model, optimizer=opt, precondition="second_moment")`` every captured
per-sample gradient becomes ``g̃ = s·g / √(v + ε)`` per coordinate (Chang et al., 2024), with
``v`` Adam's ``exp_avg_sq`` as the optimizer holds it when the step's backward ends (no bias
correction), ``ε`` = :data:`DEFAULT_EPS` (the default of
:class:`~dattri_llm.attribution.normalization.SecondMoment`, so a raw capture corrected by
``SecondMoment.from_optimizer(opt, hm)`` at scoring time equals this capture) and ``s`` the
``precondition_scale``. TrackStar corrects, then projects: like LESS's map
(:mod:`dattri_llm.gradient.optim.precondition`), this one runs on each parameter's complete
gradient (materialised, or the exact entries of a ``"mask"`` projection) and *before* a
``"dense"`` / ``"sparse"`` projection; ``"logra"`` and ``param_grad`` layers are refused, and so
is any parameter not trained by Adam / AdamW (SGD keeps no second moment).

Records carry ``metadata["preconditioned"] = {"kind": "second_moment", "optimizer", "scale",
"eps", "second_moment": <SHA-256 of ε and v>, "updates"}`` (``updates``: the optimizer's
update count behind ``v``) (the fingerprint is
:func:`moment_fingerprint`, the definition ``SecondMoment.fingerprint()`` uses). The correction
must be on both sides of a score: :func:`check_same_correction` refuses a corrected train side
against an uncorrected or differently corrected test side, naming both and the fix. The score
loop checks every train block against the test side it is paired with (its checkpoint), and
every test block against the first of its pairing key; the store-level compatibility check
(also ``GradientIndex.search``'s) compares only whether each side is corrected, and ``ε``, since
a store's checkpoints may each carry their own ``v``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch

from dattri_llm.gradient.layer_gradient import LayerGradient
from dattri_llm.gradient.optim.kinds import (
    OptimizerLike,
    param_hypers,
    param_state,
    resolve_optimizer,
)
from dattri_llm.gradient.optim.layout import LayerLayout
from dattri_llm.gradient.optim.precondition import Preconditioner, map_and_project

__all__ = [
    "DEFAULT_EPS",
    "KIND",
    "SecondMomentPreconditioner",
    "capture_map",
    "moment_fingerprint",
    "moment_scales",
    "adam_second_moments",
    "capture_correction",
    "check_same_correction",
]

#: ``ε`` of TrackStar's ``1/√(v + ε)``: the capture-time map's and ``SecondMoment``'s default.
DEFAULT_EPS = 1e-8
#: ``metadata["preconditioned"]["kind"]`` of a second-moment corrected record (LESS's has none).
KIND = "second_moment"
_WHERE = 'HookManager(optimizer=..., precondition="second_moment")'


def moment_fingerprint(second_moment: Mapping[str, torch.Tensor], eps: float) -> str:
    """A SHA-256 of ``ε`` and every layer's name, dtype, size and ``v`` bytes (sorted by name)."""
    h = hashlib.sha256(f"eps={float(eps)!r}".encode())
    for name in sorted(second_moment):
        v = second_moment[name]
        h.update(f"|{name}|{v.dtype}|{v.numel()}|".encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def moment_scales(v: torch.Tensor, eps: float, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """``1/√(v + ε)``, computed in float64 and returned in ``dtype`` on ``device``."""
    return (v.to(device=device, dtype=torch.float64) + eps).rsqrt().to(dtype)


def adam_second_moments(
    optimizer: torch.optim.Optimizer, layouts: Mapping[str, LayerLayout], where: str
) -> dict[str, torch.Tensor]:
    """``{layer: exp_avg_sq at its captured coordinates}`` (zeros before a parameter's 1st step).

    Raises:
        ValueError: a parameter the optimizer does not update, or one it updates without a
            second moment (SGD), naming the parameter, the layer and the fix.
    """
    hypers = param_hypers(optimizer, where)
    out = {}
    for name, layout in layouts.items():
        state = {}
        for pname, p in layout.params:
            h = hypers.get(id(p))
            if h is None or h.kind != "adam":
                what = "not updated by the optimizer" if h is None else f"trained by {h.optimizer}"
                raise ValueError(
                    f"{where}: parameter {pname!r} of layer {name!r} is {what}, so it has no "
                    "second moment (Adam's exp_avg_sq). The correction needs an Adam / AdamW "
                    "optimizer over every captured parameter: pass it, or exclude the layer."
                )
            state[pname] = param_state(optimizer, p, h)["exp_avg_sq"].detach()
        out[name] = layout.gather(state)
    return out


class SecondMomentPreconditioner(Preconditioner):
    """Maps a step's per-sample gradients to ``s·g / √(v + ε)`` (TrackStar's correction).

    Built by :class:`~dattri_llm.HookManager` for ``precondition="second_moment"``; shares
    LESS's checks and its raw pass (:meth:`disabled`, ``HookManager.raw_gradients()``).

    Args:
        optimizer: The Adam / AdamW optimizer (or a callable returning it) whose
            ``exp_avg_sq`` is read at every step.
        scale: ``"batch_size"`` or a number multiplying each captured gradient.
        eps: ``ε`` inside the root.
    """

    def __init__(
        self, optimizer: OptimizerLike, scale: float | str = 1.0, eps: float = DEFAULT_EPS
    ) -> None:
        super().__init__(optimizer, scale)
        if isinstance(optimizer, torch.optim.Optimizer):
            hypers = param_hypers(optimizer, _WHERE).values()
            if any(h.kind != "adam" for h in hypers):
                raise ValueError(
                    f"{_WHERE}: the optimizer is {type(optimizer).__name__}, which keeps no "
                    "second moment; "
                    "TrackStar's correction 1/sqrt(v + eps) reads Adam's exp_avg_sq. Pass the "
                    "Adam / AdamW optimizer of the run (or precondition=True for the update "
                    "direction, LESS)."
                )
        self.eps = float(eps)
        self._cached: tuple[Any, str] | None = None  # (state key, fingerprint)

    def apply(
        self, layers: dict[str, LayerGradient], batch_size: int, projection: Any
    ) -> tuple[dict[str, LayerGradient], dict[str, Any]]:
        """Correct every layer of one step; returns the new layers and the record's metadata."""
        opt = resolve_optimizer(self.optimizer, _WHERE)
        layouts = {n: self.layouts[n] for n in layers}
        v = adam_second_moments(opt, layouts, _WHERE)

        def correct(name: str, g: torch.Tensor) -> torch.Tensor:
            if v[name].numel() != g.shape[1]:  # pragma: no cover - layouts follow the capture
                raise RuntimeError(f"{_WHERE}: layer {name!r}: {g.shape[1]} != {v[name].numel()}")
            return g * moment_scales(v[name], self.eps, g.device, g.dtype)

        out = map_and_project(layers, projection, correct, self.step_scale(batch_size))
        counts = {
            int(float(opt.state.get(p, {}).get("step", 0)))
            for lay in layouts.values()
            for _, p in lay.params
        }
        meta: dict[str, Any] = {
            "kind": KIND,
            "optimizer": type(opt).__name__,
            "scale": self.scale,
            "eps": self.eps,
            KIND: self._fingerprint(opt, layouts, v),
        }
        if len(counts) == 1:
            meta["updates"] = counts.pop()
        return out, {"preconditioned": meta}

    def _fingerprint(
        self,
        opt: torch.optim.Optimizer,
        layouts: Mapping[str, LayerLayout],
        v: Mapping[str, torch.Tensor],
    ) -> str:
        """:func:`moment_fingerprint` of ``v``, recomputed only when the optimizer state changed.

        The state's identity is each ``exp_avg_sq`` tensor's id, storage, version counter (every
        in-place update bumps it) and the update count, so a capture after training hashes the
        moments once, not at every batch.
        """
        key: list[Any] = [self.eps, sorted(layouts)]
        for lay in layouts.values():
            for _, p in lay.params:
                st = opt.state.get(p, {})
                t = st.get("exp_avg_sq")
                step = st.get("step", 0)
                key.append(
                    None
                    if t is None
                    else (id(p), id(t), t.data_ptr(), t._version, float(step), str(t.dtype))
                )
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, moment_fingerprint(v, self.eps))
        return self._cached[1]


def capture_map(
    optimizer: OptimizerLike | None, precondition: Any, scale: float | str
) -> Preconditioner | None:
    """The capture-time map ``HookManager(optimizer=, precondition=)`` asks for (or ``None``).

    Args:
        optimizer: The training optimizer, a callable returning it, or ``None``.
        precondition: ``True``: LESS's update direction (with an optimizer);
            ``False``: none; ``"second_moment"``: TrackStar's ``1/√(v + ε)``.
        scale: ``precondition_scale``.

    Raises:
        ValueError: another ``precondition``, or ``"second_moment"`` without an optimizer.
    """
    if isinstance(precondition, bool) or type(precondition).__name__ in ("bool_", "bool"):
        if optimizer is None or not bool(precondition):
            return None
        return Preconditioner(optimizer, scale)
    if isinstance(precondition, str) and precondition == KIND:
        if optimizer is None:
            raise ValueError(
                'HookManager(precondition="second_moment") needs optimizer=: the Adam / AdamW '
                "optimizer whose exp_avg_sq the correction 1/sqrt(v + eps) reads."
            )
        return SecondMomentPreconditioner(optimizer, scale)
    raise ValueError(
        "HookManager(precondition=...) must be True (with optimizer=: LESS's update "
        'direction), False (raw capture) or "second_moment" (TrackStar\'s 1/sqrt(v + eps) '
        f"correction before any projection), got {precondition!r}."
    )


def capture_correction(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{"eps", "second_moment"}`` of a record corrected at capture, else ``None``."""
    pre = (metadata or {}).get("preconditioned")
    if isinstance(pre, Mapping) and pre.get("kind") == KIND:
        return {"eps": pre.get("eps"), KIND: pre.get(KIND)}
    return None


def _describe(corr: dict[str, Any] | None) -> str:
    if corr is None:
        return "not corrected at capture"
    return (
        f"corrected at capture by 1/sqrt(v + eps) (eps {corr['eps']}, second moment "
        f"{str(corr[KIND])[:12]}...)"
    )


def check_same_correction(
    first: Mapping[str, Any] | None,
    second: Mapping[str, Any] | None,
    first_name: str = "the train gradients",
    second_name: str = "the test gradients",
    strict: bool = True,
) -> None:
    """Refuse two captures that do not carry the same capture-time second-moment correction.

    Args:
        first: Record metadata of one side (e.g. the train block's).
        second: Record metadata of the other side.
        first_name: How to call the first side in the message (its source).
        second_name: How to call the second side.
        strict: Compare the second moments' fingerprints too (blocks that are scored against
            each other); ``False``: only whether each side is corrected, and with which ``ε``
            (whole stores, whose checkpoints may each carry their own ``v``).

    Raises:
        ValueError: naming both sides, what each carries and the fix.
    """
    a, b = capture_correction(first), capture_correction(second)
    if a == b or (
        not strict and (a is None) == (b is None) and (a is None or a["eps"] == b["eps"])
    ):
        return
    raise ValueError(
        f"{first_name} are {_describe(a)} but {second_name} are {_describe(b)}: TrackStar's "
        "correction must be the same on both sides of a score. Capture both with "
        'HookManager(model, optimizer=opt, precondition="second_moment") from the same '
        "optimizer state (for live queries: GradientStreamer(..., optimizer=opt, "
        'precondition="second_moment")), or capture both raw and pass '
        "second_moment=SecondMoment.from_optimizer(opt, hook_manager) to the attributor "
        "(exact without a coordinate-mixing projection)."
    )
