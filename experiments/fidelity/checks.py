"""The fidelity checks on an OLMo-core run: exactness, coverage, overhead, attribution quality."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import torch
from olmo_core.data.utils import get_labels

from dattri_llm import (
    AttributionArguments,
    CaptureCallback,
    DVEmbAttributor,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.integrations.olmo_core import olmo_core_layer_types
from experiments.fidelity.training import (
    Data,
    RunResult,
    build_model,
    model_config,
    train,
    train_to_store,
)

LABEL_IGNORE = -100


def olmo_core_loss(model: torch.nn.Module, ids: torch.Tensor, div: float) -> torch.Tensor:
    """``TransformerTrainModule.train_batch``'s loss of ``ids``: summed CE / ``div``."""
    labels = get_labels({"input_ids": ids}, label_ignore_index=LABEL_IGNORE)
    out = model(
        ids,
        labels=labels,
        ignore_index=LABEL_IGNORE,
        loss_reduction="sum",
        loss_div_factor=div,
        return_logits=False,
    )
    return out.loss


def shared_modules(model: torch.nn.Module) -> set[str]:
    """Names of the modules whose parameter another module shares (tied weights)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    return {m for mods in owners.values() if len(mods) > 1 for m in mods}


def row_kind(layer: str, pname: str, tied: bool) -> str:
    """A table row: the layer's role (block index dropped) and the parameter."""
    kind = re.sub(r"^blocks\.\d+\.", "", layer)
    if tied and layer == "embeddings":
        kind = "embeddings + lm_head.w_out (tied)"
    return f"{kind}.{pname}"


def exactness(
    store: GradientStorageManager, run: RunResult, model_cfg: Any, data: Data
) -> dict[str, float]:
    """Max relative error per row of every stored per-sample gradient vs one-sample backward.

    Each stored step's samples are recomputed one at a time at that step's weights (recorded
    before the step), with the training module's loss normaliser of that step's batch.
    """
    by_hash = dict(zip(data.hashes(), data.windows))
    ref = build_model(model_cfg)
    params = dict(ref.named_parameters())
    worst: dict[str, float] = {}
    for i, info in enumerate(store.records()):
        step = run.steps[info.step]
        div = float((get_labels({"input_ids": step["input_ids"]}) != LABEL_IGNORE).sum())
        ref.load_state_dict(step["state"])
        grad = store.load_record(i).gradient
        dense = {n: grad.layers[n].materialize().parameters() for n in grad.layer_names}
        tied = set(grad.layer_names) & shared_modules(ref)  # a compact store sums tied sites
        for row, h in enumerate(info.hashes):
            ref.zero_grad(set_to_none=True)
            olmo_core_loss(ref, by_hash[h][None], div).backward()
            for layer, parts in dense.items():
                for pname, g in parts.items():
                    r = params[f"{layer}.{pname}"].grad
                    err = float((g[row].to(r) - r).norm() / r.norm().clamp_min(1e-30))
                    key = row_kind(layer, pname, layer in tied)
                    worst[key] = max(worst.get(key, 0.0), err)
    return worst


def coverage(run: RunResult, data: Data, store: GradientStorageManager) -> dict[str, Any]:
    """Trainable parameters vs captured ones, warnings, and whether the dry run was stored."""
    model = run.model
    names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    captured = {
        id(p) for parts in run.hook_manager.layer_parameters().values() for p in parts.values()
    }
    known = set(data.hashes())
    stored = [h for r in store.records() for h in r.hashes]
    return {
        "trainable": len(names),
        "captured": len(set(names) & captured),
        "missing": sorted(n for pid, n in names.items() if pid not in captured),
        "warnings": list(run.warnings),
        "real_steps": len(run.steps),
        "stored_steps": len({r.step for r in store.records()}),
        "foreign_samples": sum(h not in known for h in stored),
        "first_step": run.capture.first_step if run.capture is not None else None,
    }


def overhead(
    work: Path,
    data: Data,
    variant: str,
    *,
    d_model: int | None,
    steps: int,
    repeats: int,
    batch: int,
    micro_batch: int,
) -> dict[str, float]:
    """Median step time of the run with capture over the same run without hooks.

    Three arms from the same initial weights, interleaved ``repeats`` times: no hooks, capture
    kept in memory (``CaptureCallback``, the last record only), capture offloaded to a store.
    Step times come from the trainer's own ``pre_step`` .. ``post_step`` (optimizer included,
    ``fit()``'s dry run and set-up excluded), first step of each run dropped.
    """
    from olmo_core.optim import AdamWConfig

    cfg = model_config(variant, d_model)
    tag = f"{variant}_{d_model or 'olmo2_1M'}"
    init = build_model(cfg).state_dict()
    times: dict[str, list[float]] = {"plain": [], "capture": [], "offload": []}
    for r in range(repeats):
        for arm in times:
            model = build_model(cfg)
            model.load_state_dict(init)
            cbs = None
            store = None
            if arm == "capture":
                cbs = [CaptureCallback()]
            elif arm == "offload":
                store = GradientStorageManager(str(work / f"ovh_{tag}_{r}"))
                cbs = [OffloadCallback(file_manager=store, gradient_accumulation_steps=2)]
            run = train(
                work / f"ovh_run_{tag}_{arm}_{r}",
                data,
                model,
                batch=batch,
                micro_batch=micro_batch,
                steps=steps,
                optim=AdamWConfig(lr=1e-3),
                capture_callbacks=cbs,
            )
            if store is not None:
                store.close()
            times[arm].extend(s["seconds"] for s in run.steps[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in build_model(cfg).parameters())
    return {
        "params": params,
        "plain_ms": 1e3 * med["plain"],
        "capture_ratio": med["capture"] / med["plain"],
        "offload_ratio": med["offload"] / med["plain"],
        "steps_timed": len(times["plain"]),
    }


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    rx = x.argsort().argsort().double()
    ry = y.argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def query_losses(model: torch.nn.Module, queries: torch.Tensor) -> torch.Tensor:
    """Each query's summed next-token loss (the attributed quantity)."""
    with torch.no_grad():
        return torch.stack([olmo_core_loss(model, q[None], 1.0) for q in queries]).double()


def attribution_quality(
    work: Path,
    data: Data,
    *,
    steps: int,
    batch: int,
    micro_batch: int,
    lr: float,
    subsets: int,
    seed: int = 0,
) -> dict[str, Any]:
    """LDS of TracIn and DVEmb on an SGD run of ``steps`` steps, against masked retraining.

    The run is captured once (per step, to a store) and the queries' gradients are taken at
    the final weights. Ground truth: for ``subsets`` random halves of the training windows, the
    same run (same initial weights, same batches in the same order) is repeated with the other
    half masked out of their batches (``instance_mask``: their loss terms dropped, the loss
    normaliser unchanged), and each query's summed loss is measured at the end. LDS is the
    Spearman correlation, across subsets, between minus that loss and the sum of the kept
    windows' scores, averaged over queries. The retraining is deterministic (no dropout, same
    order), so the ground truth has no noise: what separates LDS from 1 is the methods'
    first-order approximation, which grows with the learning rate.
    """
    from experiments.fidelity.training import SGDConfig

    tag = f"lr{lr:g}"
    cfg = model_config("untied")
    init = build_model(cfg).state_dict()
    model = build_model(cfg)
    _, train_store = train_to_store(
        work,
        f"lds_{tag}",
        data,
        model,
        batch=batch,
        micro_batch=micro_batch,
        steps=steps,
        optim=SGDConfig(lr=lr),
    )
    train_dir, test_dir = Path(train_store.save_dir), work / f"lds_test_{tag}"
    test_store = GradientStorageManager(str(test_dir))
    hm = HookManager(
        model,
        config=HookManagerConfig(layer_types=olmo_core_layer_types(model)),
        callbacks=[OffloadCallback(file_manager=test_store)],
    )
    with hm.collect(deregister_on_exit=True):
        olmo_core_loss(model, data.queries, 1.0).backward()
    model.zero_grad(set_to_none=True)
    test_store.close()
    full = query_losses(model, data.queries)

    args = AttributionArguments(output_dir=str(work / f"lds_scores_{tag}"), show_progress=False)
    hashes = data.hashes()
    scores: dict[str, torch.Tensor] = {}
    for name, attributor, kwargs in (
        ("TracIn", TracInAttributor(args), {}),
        # loss_reduction: "sum", the default this check was measured with (the train module
        # divides the summed loss by a fixed loss_div_factor, not by the batch)
        ("DVEmb", DVEmbAttributor(args, loss_reduction="sum"), {"learning_rate": lr}),
    ):
        ids, matrix = attributor.attribute_from_cache(
            str(train_dir), str(test_dir), **kwargs
        ).agnostic_matrix()
        if sorted(ids) != sorted(hashes):
            raise RuntimeError(f"{name}: the scored samples are not the training windows")
        scores[name] = matrix[[ids.index(h) for h in hashes]].double()

    gen = torch.Generator().manual_seed(seed)
    n = len(hashes)
    kept = torch.zeros(subsets, n, dtype=torch.float64)
    losses = []
    for k in range(subsets):
        kept[k, torch.randperm(n, generator=gen)[: n // 2]] = 1.0
        model = build_model(cfg)
        model.load_state_dict(init)
        train(
            work / f"lds_sub_{tag}_{k}",
            data,
            model,
            batch=batch,
            micro_batch=micro_batch,
            steps=steps,
            optim=SGDConfig(lr=lr),
            mask_hashes={h for h, m in zip(hashes, kept[k]) if not m},
        )
        losses.append(query_losses(model, data.queries))
    actual = -torch.stack(losses)  # (M, Q): higher is better
    scores["random scores"] = torch.randn(n, len(data.queries), generator=gen).double()
    lds = {
        name: statistics.mean(
            spearman((kept @ s)[:, q], actual[:, q]) for q in range(actual.shape[1])
        )
        for name, s in scores.items()
    }
    return {
        "lr": lr,
        "steps": steps,
        "subsets": subsets,
        "queries": len(data.queries),
        "train": n,
        "query_loss_change": float((torch.stack(losses) - full).abs().mean()),
        "lds": lds,
    }
