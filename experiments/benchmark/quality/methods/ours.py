"""dattri_llm attributors on the reference checkpoints (live ``attribute`` path).

Samples are dicts ``{"x", "y", "index"}`` (the ``index`` field makes every content hash unique
even if two images were identical); rows are realigned to dataset order with
``score.query(train_samples, test_samples)``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from experiments.benchmark.quality.common import as_dicts
from experiments.benchmark.quality.methods import Context, Method, Pending

#: Damping values swept for K-FAC / EK-FAC (absolute, added to the eigenvalues of the mean
#: per-sample Fisher); ``None`` = the attributor's default, 0.1 x each layer's mean eigenvalue.
DAMPINGS: list[float | None] = [None, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
#: Language models (per-sample loss = mean token cross-entropy): a wider sweep.
DAMPINGS_LM: list[float | None] = [None, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]

#: ``non_kronecker="diagonal"`` rows (language models): a short sweep.
DAMPINGS_LM_DIAGONAL: list[float] = [1e-7, 1e-5, 1e-3]


def dampings(classifier: bool) -> list[float | None]:
    """The damping sweep of a setting (``None`` = the attributor's default)."""
    return DAMPINGS if classifier else DAMPINGS_LM


def _import(name: str) -> Any:
    import dattri_llm

    try:
        return getattr(dattri_llm, name)
    except AttributeError:
        raise Pending(f"dattri_llm.{name} not available yet") from None


def _args(tmp: str) -> Any:
    arguments = _import("AttributionArguments")
    return arguments(
        output_dir=tmp,
        use_cpu=True,
        per_device_train_batch_size=250,
        per_device_eval_batch_size=250,
        show_progress=False,
    )


def _task(ctx: Context, checkpoints: list[dict]) -> Any:
    task_cls = _import("AttributionTask")
    return task_cls(
        loss_func=ctx.setting.loss_sum,
        model=ctx.model(),
        checkpoints=checkpoints,
        target_func=ctx.setting.target_sum,
    )


def _score(ctx: Context, attributor: Any, **kwargs: Any) -> torch.Tensor:
    train, test = _samples(ctx)
    score = attributor.attribute(train, test, **kwargs)
    return score.query(train, test)


def _samples(ctx: Context) -> tuple[list[dict], list[dict]]:
    if "dicts" not in ctx.extra:
        ctx.extra["dicts"] = (as_dicts(ctx.setting.train), as_dicts(ctx.setting.test))
    return ctx.extra["dicts"]


def tracin_family(
    normalized: bool = False, trajectory: bool = False, projection: dict | None = None
) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        cls = _import("TracInAttributor")
        ckpts = ctx.trajectory if trajectory else [ctx.final]
        weights = ctx.setting.tracin_weights(len(ckpts)) if trajectory else None
        kwargs: dict[str, Any] = {}
        if projection is not None:
            proj_cls = _import("ProjectionConfig")
            from dattri_llm import HookManagerConfig

            proj: Any = proj_cls(**projection)
            if projection["style"] == "logra" and ctx.setting.task_kind == "lm":
                # norms (and, to be safe, embeddings and the HF lm_head tied to wte) take no
                # logra: dense at the same size
                dense = proj_cls(**{**projection, "style": "dense"})
                skip = r"(.*\.)?(wte|wpe|ln_f|(blocks|h)\.\d+\.ln_\d)|gpt\.lm_head"
                proj = {skip: dense, r".*": proj}
            kwargs["hook_config"] = HookManagerConfig(projection=proj)
        with tempfile.TemporaryDirectory() as tmp:
            attributor = cls(
                _args(tmp),
                task=_task(ctx, ckpts),
                normalized_grad=normalized,
                checkpoint_weights=weights,
            )
            return _score(ctx, attributor, **kwargs)

    return fn


def _kronecker_class(name: str) -> Any:
    import dattri_llm

    cls = getattr(dattri_llm, name, None)
    if cls is None:
        try:
            from dattri_llm.attribution import kronecker as module
        except ImportError:
            raise Pending(f"dattri_llm.{name} not available yet") from None
        cls = getattr(module, name, None)
    if cls is None:
        raise Pending(f"dattri_llm.{name} not available yet")
    return cls


def sampled_label_dataset(ctx: Context, draws: int = 4, seed: int = 0) -> list[dict]:
    """Train inputs with labels drawn from the model's predictive distribution (true Fisher)."""
    model = ctx.model()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        probs = torch.softmax(model(ctx.setting.train.x), -1)
    out = []
    for d in range(draws):
        y = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        for i in range(len(y)):
            out.append(
                {
                    "x": ctx.setting.train.x[i],
                    "y": y[i],
                    "index": torch.tensor(d * len(y) + i, dtype=torch.long),
                }
            )
    return out


def final_blocks(ctx: Context, attributor: Any) -> tuple[list, list]:
    """Train / test gradient blocks at the final checkpoint, captured once per context.

    The damping sweep then re-scores these blocks (``attribute_sources``) instead of running
    the model over the train set again for every row: same gradients, same maths as the live
    ``attribute`` path, which the Grad-Dot rows exercise.
    """
    if "final_blocks" not in ctx.extra:
        from dattri_llm.gradient.streaming import GradientStreamer, pad_collate

        train, test = _samples(ctx)
        task, args = attributor.task, attributor.args
        collate = (
            pad_collate(args.dataloader_pad_value) if args.dataloader_collate == "pad" else None
        )
        task.load_checkpoint(0)

        def capture(ds: list[dict], loss: Any, bs: int) -> list:
            return list(GradientStreamer(task.model, ds, loss, batch_size=bs, collate_fn=collate))

        ctx.extra["final_blocks"] = (
            capture(train, task.train_loss, args.per_device_train_batch_size),
            capture(test, task.test_loss, args.per_device_eval_batch_size),
        )
    return ctx.extra["final_blocks"]


def kronecker(
    name: str,
    damping: float | None,
    fisher: str = "empirical",
    non_kronecker: str = "skip",
    options: dict | None = None,
) -> Any:
    """K-FAC / EK-FAC row; one damping-free fit per (class, Fisher, non-Kronecker handling)
    serves every damping. ``non_kronecker="diagonal"`` also preconditions embeddings, norms
    and tied groups with a non-linear site with their diagonal Fisher (default: left out)."""

    def fn(ctx: Context) -> torch.Tensor:
        cls = _kronecker_class(name)
        opts = dict(options or {})  # TrackStar's normalized_grad / mix
        key = ("kronecker", name, fisher, non_kronecker, tuple(sorted(opts.items())))
        # None = the attributor's default (0.1 x each layer's mean eigenvalue), spelled out so
        # the row does not depend on the damping of the row before it
        kwargs: dict[str, Any] = (
            {"damping": 0.1, "relative": True} if damping is None else {"damping": damping}
        )
        if key not in ctx.extra:
            tmp = os.path.join(tempfile.gettempdir(), "quality-unsaved")  # nothing is saved
            attributor = cls(
                _args(tmp), task=_task(ctx, [ctx.final]), non_kronecker=non_kronecker, **opts
            )
            factors = None
            if fisher == "sampled":  # fit on sampled labels, score the real train gradients
                fitter = cls(_args(tmp), task=_task(ctx, [ctx.final]))
                factors = fitter.fit(sampled_label_dataset(ctx))
            ctx.extra[key] = (attributor, factors)
        attributor, factors = ctx.extra[key]
        if factors is not None:
            kwargs["factors"] = factors
        if ctx.setting.task_kind != "lm" and not opts.get("mix"):
            return _score(ctx, attributor, **kwargs)
        train_blocks, test_blocks = final_blocks(ctx, attributor)
        train, test = _samples(ctx)
        return attributor.attribute_sources(train_blocks, test_blocks, **kwargs).query(train, test)

    return fn


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    out = [
        Method("Grad-Dot", "dattri_llm", tracin_family()),
        Method("Grad-Cos", "dattri_llm", tracin_family(normalized=True)),
        Method("TracIn (4 ckpts, w=lr)", "dattri_llm", tracin_family(trajectory=True)),
    ]
    dims = (16, 64) if quick else (16, 64, 256)
    if not classifier:  # each projected row is a live pass over the train set: keep it short
        dims = (64,) if quick else (64, 256)
    for style in ("logra", "dense", "mask"):
        for dim in dims:
            out.append(
                Method(
                    f"Grad-Dot proj {style}-{dim}",
                    "dattri_llm",
                    tracin_family(projection={"style": style, "proj_dim": dim, "seed": 0}),
                    f"capture-time {style} projection, {dim} per layer"
                    + ("" if classifier or style != "logra" else " (dense on embeddings/norms)"),
                )
            )
    for name, label in (("KFACAttributor", "K-FAC"), ("EKFACAttributor", "EK-FAC")):
        for d in dampings(classifier):
            out.append(
                Method(
                    f"{label} (damping={'default' if d is None else d})",
                    "dattri_llm",
                    kronecker(name, d),
                    "empirical Fisher"
                    + (
                        "; default damping = 0.1 x each layer's mean eigenvalue"
                        if d is None
                        else ""
                    ),
                )
            )
    if not classifier:
        for d in [None, *DAMPINGS_LM_DIAGONAL]:
            out.append(
                Method(
                    f"EK-FAC + diagonal (damping={'default' if d is None else d})",
                    "dattri_llm",
                    kronecker("EKFACAttributor", d, non_kronecker="diagonal"),
                    "empirical Fisher; embeddings, norms and tied groups preconditioned by "
                    "their diagonal Fisher (non_kronecker='diagonal')",
                )
            )
    for opts, label in (
        ({"normalized_grad": True}, "unit-normalized (normalized_grad=True)"),
        ({"mix": 0.1}, "fit on train + queries (mix=0.1)"),
        ({"mix": 0.5}, "fit on train + queries (mix=0.5)"),
    ):
        out.append(
            Method(
                f"EK-FAC {label} (damping=default)",
                "dattri_llm",
                kronecker("EKFACAttributor", None, options=opts),
                "empirical Fisher; TrackStar option",
            )
        )
    if classifier:
        for d in DAMPINGS[1:]:
            out.append(
                Method(
                    f"EK-FAC sampled-label Fisher (damping={d})",
                    "dattri_llm",
                    kronecker("EKFACAttributor", d, "sampled"),
                    "fit on 4 labels/sample drawn from the model (true Fisher)",
                )
            )
    return out
