"""Diagnosis rows: why AdamW-influence trails on half-data LDS.

Each row is AdamW-influence on the same ``mask-2048`` recording of the gpt2 reference run (a
random 2048 coordinates per layer, so a row costs ~2 min instead of ~6), changed in one place
by a benchmark subclass, so the difference between two rows isolates one candidate cause:

* ``as defined``: the library's method (empirical-Fisher curvature, mean-loss removal push
  ``(B s_z − G)/(B − 1)``, Adam's first and second moment both perturbed);
* ``no second-moment sensitivity``: ``∂θ'/∂v = 0`` at every step, i.e. removing a sample changes
  ``m`` but not the normalization ``1/(√v̂ + ε)`` of the update: drops the part of the effect
  that depends on the removed sample's batch-mates through ``v``;
* ``own-gradient push``: the removal pushes ``s_z`` (the sample's own share) instead of
  ``(B s_z − G)/(B − 1)``: drops the mean's re-normalization over the batch-mates, a term common
  to every sample of a batch (LDS retrains keep batches full, so a removed sample is replaced,
  not averaged out);
* both changes at once;
* ``unit-normalized`` (``normalized_grad=True``, forward sweep): TrackStar's cosine of each
  sample's whole displacement with each query.

None of these is the exact derivative of the recorded run (``as defined`` is, up to the
curvature); they are measurements of which part of that derivative LDS over random halves
does not reward.
"""

from __future__ import annotations

import tempfile
from typing import Any

from experiments.benchmark.quality.methods import Context, Method
from experiments.benchmark.quality.methods.ours import _args

RECORDING = ("mask-2048", {"style": "mask", "proj_dim": 2048, "seed": 0})
#: The smaller recording of the quality benchmark's ``AdamW-influence mask-256`` row: the
#: forward sweep (memory and work ∝ samples) of the unit-normalized row fits it.
SMALL = ("mask-256", {"style": "mask", "proj_dim": 256, "seed": 0})


def _variant(no_v: bool, own_push: bool) -> Any:
    from dattri_llm import AdamWInfluenceAttributor

    class Variant(AdamWInfluenceAttributor):
        def _step(self, *args: Any, **kwargs: Any) -> Any:
            step = super()._step(*args, **kwargs)
            if no_v:
                step.d_v = step.d_v * 0
            return step

        def removal_pushes(self, shares: Any, step: int) -> Any:
            if own_push:
                return shares
            return super().removal_pushes(shares, step)

    return Variant


def row(
    no_v: bool = False, own_push: bool = False, normalized: bool = False, recording_=RECORDING
) -> Any:
    """AdamW-influence on a mask recording (default mask-2048) with the named change(s)."""

    def fn(ctx: Context) -> Any:
        from dattri_llm import HookManagerConfig, OptimizerDynamics, ProjectionConfig
        from experiments.benchmark.quality.methods.trajectory import _note, chunked, recording

        name, proj = recording_
        config = HookManagerConfig(
            capture_style="materialized", projection=ProjectionConfig(**proj)
        )
        rec = recording(ctx, name, config)
        dynamics = OptimizerDynamics(rec["trajectory"])
        cls = _variant(no_v, own_push)
        kw = {"method": "forward", "normalized_grad": True} if normalized else {}
        with tempfile.TemporaryDirectory() as tmp:
            att = cls(_args(tmp), loss_reduction="mean", **kw)
            if normalized:  # the forward sweep scores every query at once (memory ∝ samples)
                from experiments.benchmark.quality.methods.ours import _samples
                from experiments.benchmark.quality.methods.trajectory import queries

                blocks = queries(ctx, config, batch_size=10**6)
                score = att.attribute_from_cache(str(rec["store"]), blocks, dynamics=dynamics)
                test = [h for b in blocks for h in b.hashes]
                scores = score.query(_samples(ctx)[0], test)
            else:
                scores = chunked(
                    ctx,
                    config,
                    lambda q: att.attribute_from_cache(str(rec["store"]), q, dynamics=dynamics),
                    4,
                )
        ctx.extra["last_note"] = _note(rec)
        return scores

    return fn


def _mask_row(cls_name: str, second_moment: bool, **kw: Any) -> Any:
    """A final-weights row of ``dattri_llm.<cls_name>(**kw)`` on the recording's mask-2048
    coordinates, with TrackStar's ``1/sqrt(v + eps)`` (the run's last ``exp_avg_sq``, eps 1e-8)
    as its ``second_moment=`` or without it."""

    def fn(ctx: Context) -> Any:
        import dattri_llm
        from dattri_llm import HookManagerConfig, ProjectionConfig, SecondMoment
        from experiments.benchmark.quality.methods.ours import _score, _task
        from experiments.benchmark.quality.methods.trajectory import _note, recording

        name, proj = RECORDING
        config = HookManagerConfig(
            capture_style="materialized", projection=ProjectionConfig(**proj)
        )
        rec = recording(ctx, name, config)
        sm = SecondMoment.from_dynamics(rec["trajectory"]) if second_moment else None
        with tempfile.TemporaryDirectory() as tmp:
            att = getattr(dattri_llm, cls_name)(
                _args(tmp), task=_task(ctx, [ctx.final]), second_moment=sm, **kw
            )
            scores = _score(ctx, att, hook_config=config)
        ctx.extra["last_note"] = _note(rec)
        return scores

    return fn


def trackstar(normalized: bool, second_moment: bool) -> Any:
    """Grad-Dot / Grad-Cos at the final weights on the recording's mask-2048 coordinates, with
    or without TrackStar's ``1/sqrt(v + eps)``."""
    return _mask_row("TracInAttributor", second_moment, normalized_grad=normalized)


def trackstar_fisher(second_moment: bool) -> Any:
    """``ProjectedFisherAttributor(normalized_grad=True)`` at the final weights on the
    recording's mask-2048 coordinates: ``cos(R^{-1/2} g̃, R^{-1/2} q̃)`` with ``R`` the exact
    per-layer second-moment matrix of the (corrected) train gradients, default relative damping;
    with ``second_moment`` the gradients are TrackStar's ``g / sqrt(v + eps)``: TrackStar's
    recipe with its ``R``, on a coordinate subsample."""
    return _mask_row("ProjectedFisherAttributor", second_moment, normalized_grad=True)


def methods() -> list[Method]:
    """The diagnosis rows (gpt2, AdamW runs)."""
    base = "AdamW-influence mask-2048"
    return [
        Method(f"{base} as defined (diagnosis)", "dattri_llm", row(), "the library's method"),
        Method(
            f"{base} no second-moment sensitivity (diagnosis)",
            "dattri_llm",
            row(no_v=True),
            "benchmark subclass: d theta'/d v = 0 at every step",
        ),
        Method(
            f"{base} own-gradient push (diagnosis)",
            "dattri_llm",
            row(own_push=True),
            "benchmark subclass: removal push s_z instead of (B s_z - G)/(B - 1)",
        ),
        Method(
            f"{base} both (diagnosis)",
            "dattri_llm",
            row(no_v=True, own_push=True),
            "benchmark subclass: both changes above",
        ),
        Method(
            f"{base} unit-normalized (normalized_grad=True)",
            "dattri_llm",
            row(normalized=True),
            "forward sweep; cosine of each sample's summed displacement with each query",
        ),
        Method(
            "AdamW-influence mask-256 unit-normalized (normalized_grad=True)",
            "dattri_llm",
            row(normalized=True, recording_=SMALL),
            "forward sweep; cosine of each sample's summed displacement with each query",
        ),
        Method("Grad-Dot mask-2048", "dattri_llm", trackstar(False, False), "final weights"),
        Method("Grad-Cos mask-2048", "dattri_llm", trackstar(True, False), "final weights"),
        Method(
            "Grad-Dot mask-2048 + second moment",
            "dattri_llm",
            trackstar(False, True),
            "TrackStar's 1/sqrt(v + eps) from the run's last exp_avg_sq (SecondMoment)",
        ),
        Method(
            "Grad-Cos mask-2048 + second moment (TrackStar, R = I)",
            "dattri_llm",
            trackstar(True, True),
            "TrackStar's 1/sqrt(v + eps), then unit norm",
        ),
        Method(
            "ProjectedFisher mask-2048 unit-normalized",
            "dattri_llm",
            trackstar_fisher(False),
            "exact per-layer Fisher of the mask coordinates, then the cosine",
        ),
        Method(
            "ProjectedFisher mask-2048 unit + second moment (TrackStar with R)",
            "dattri_llm",
            trackstar_fisher(True),
            "TrackStar's 1/sqrt(v + eps), R = exact per-layer Fisher of the corrected "
            "gradients, then the cosine",
        ),
    ]
