"""dattri_llm attributors on the reference checkpoints (live ``attribute`` path); samples are
``{"x", "y", "index"}`` dicts, rows realigned with ``score.query(train, test)``."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from experiments.benchmark.quality.common import as_dicts
from experiments.benchmark.quality.methods import Context, Method

#: Absolute dampings swept for K-FAC / EK-FAC (wider for the language models, shorter with
#: ``non_kronecker="diagonal"``); ``None``: the default, 0.1 x each layer's mean eigenvalue.
DAMPINGS: list[float | None] = [None, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
DAMPINGS_LM: list[float | None] = [None, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1]
DAMPINGS_LM_DIAGONAL: list[float] = [1e-7, 1e-5, 1e-3]


def _args(tmp: str) -> Any:
    from dattri_llm import AttributionArguments

    batches = {"per_device_train_batch_size": 250, "per_device_eval_batch_size": 250}
    return AttributionArguments(output_dir=tmp, use_cpu=True, show_progress=False, **batches)


def _task(ctx: Context, checkpoints: list[dict]) -> Any:
    from dattri_llm import AttributionTask

    s, model = ctx.setting, ctx.model()
    return AttributionTask(s.loss_sum, model, checkpoints=checkpoints, target_func=s.target_sum)


def _score(ctx: Context, attributor: Any, **kwargs: Any) -> torch.Tensor:
    train, test = _samples(ctx)
    return attributor.attribute(train, test, **kwargs).query(train, test)


def _samples(ctx: Context) -> tuple[list[dict], list[dict]]:
    if "dicts" not in ctx.extra:
        ctx.extra["dicts"] = (as_dicts(ctx.setting.train), as_dicts(ctx.setting.test))
    return ctx.extra["dicts"]


def tracin_family(normalized: bool = False, trajectory: bool = False) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri_llm import TracInAttributor

        ckpts = ctx.trajectory if trajectory else [ctx.final]
        weights = ctx.setting.tracin_weights(len(ckpts)) if trajectory else None
        task = _task(ctx, ckpts)
        with tempfile.TemporaryDirectory() as tmp:
            kw = {"normalized_grad": normalized, "checkpoint_weights": weights}
            return _score(ctx, TracInAttributor(_args(tmp), task=task, **kw))

    return fn


def final_blocks(ctx: Context, attributor: Any) -> tuple[list, list]:
    """Train / test gradient blocks at the final checkpoint, captured once per context: the
    language models' damping sweep re-scores them (``attribute_sources``, the same maths as the
    live path) instead of running the model over the train set for every row."""
    if "final_blocks" not in ctx.extra:
        from dattri_llm.gradient.streaming import GradientStreamer, pad_collate

        train, test = _samples(ctx)
        task, args = attributor.task, attributor.args
        pad = args.dataloader_collate == "pad"
        collate = pad_collate(args.dataloader_pad_value) if pad else None
        task.load_checkpoint(0)

        def capture(ds: list[dict], loss: Any, bs: int) -> list:
            return list(GradientStreamer(task.model, ds, loss, batch_size=bs, collate_fn=collate))

        ctx.extra["final_blocks"] = (
            capture(train, task.train_loss, args.per_device_train_batch_size),
            capture(test, task.test_loss, args.per_device_eval_batch_size),
        )
    return ctx.extra["final_blocks"]


def kronecker(name: str, damping: float | None, non_kronecker: str = "skip") -> Any:
    """K-FAC / EK-FAC row; one fit per (class, ``non_kronecker``) serves every damping."""

    def fn(ctx: Context) -> torch.Tensor:
        import dattri_llm

        key = ("kronecker", name, non_kronecker)
        # the default spelled out: the row must not depend on the damping of the row before
        kwargs: dict[str, Any] = (
            {"damping": 0.1, "relative": True} if damping is None else {"damping": damping}
        )
        if key not in ctx.extra:
            tmp = os.path.join(tempfile.gettempdir(), "quality-unsaved")  # nothing is saved
            cls = getattr(dattri_llm, name)
            ctx.extra[key] = cls(
                _args(tmp), task=_task(ctx, [ctx.final]), non_kronecker=non_kronecker
            )
        attributor = ctx.extra[key]
        if ctx.setting.task_kind != "lm":
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
    fisher, default = "empirical Fisher", "; default damping = 0.1 x each layer's mean eigenvalue"
    sweeps = [
        ("KFACAttributor", "K-FAC", "skip", DAMPINGS if classifier else DAMPINGS_LM, fisher),
        ("EKFACAttributor", "EK-FAC", "skip", DAMPINGS if classifier else DAMPINGS_LM, fisher),
    ]
    if not classifier:
        diagonal = (
            f"{fisher}; embeddings, norms and tied groups preconditioned by their diagonal "
            "Fisher (non_kronecker='diagonal')"
        )
        sweeps.append(
            (
                "EKFACAttributor",
                "EK-FAC + diagonal",
                "diagonal",
                [None, *DAMPINGS_LM_DIAGONAL],
                diagonal,
            )
        )
    for cls, label, handling, sweep, note in sweeps:
        for d in sweep:
            name = f"{label} (damping={'default' if d is None else d})"
            suffix = default if d is None and handling == "skip" else ""
            out.append(Method(name, "dattri_llm", kronecker(cls, d, handling), note + suffix))
    return out
