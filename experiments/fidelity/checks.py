"""The fidelity checks on an OLMo-core run: exactness, coverage, overhead."""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

import torch
from olmo_core.data.utils import get_labels

from dattri_llm import CaptureCallback, GradientStorageManager, OffloadCallback
from experiments.fidelity.training import Data, RunResult, build_model, model_config, train

LABEL_IGNORE = -100


def olmo_core_loss(model: torch.nn.Module, ids: torch.Tensor, div: float) -> torch.Tensor:
    """``TransformerTrainModule.train_batch``'s loss of ``ids``: summed CE / ``div``."""
    labels = get_labels({"input_ids": ids}, label_ignore_index=LABEL_IGNORE)
    kw = {"ignore_index": LABEL_IGNORE, "loss_reduction": "sum", "return_logits": False}
    return model(ids, labels=labels, loss_div_factor=div, **kw).loss


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
    layers = run.hook_manager.layer_parameters().values()
    captured = {id(p) for parts in layers for p in parts.values()}
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
    work: Path, data: Data, variant: str, *, d_model: int | None, steps: int, repeats: int,
    batch: int, micro_batch: int
) -> dict[str, float]:  # fmt: skip
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
            cbs, store = None, None
            if arm == "capture":
                cbs = [CaptureCallback()]
            elif arm == "offload":
                store = GradientStorageManager(str(work / f"ovh_{tag}_{r}"))
                cbs = [OffloadCallback(file_manager=store, gradient_accumulation_steps=2)]
            sizes = {"batch": batch, "micro_batch": micro_batch, "steps": steps}
            run = train(work / f"ovh_run_{tag}_{arm}_{r}", data, model,
                        optim=AdamWConfig(lr=1e-3), capture_callbacks=cbs, **sizes)  # fmt: skip
            if store is not None:
                store.close()
            times[arm].extend(s["seconds"] for s in run.steps[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "params": sum(p.numel() for p in build_model(cfg).parameters()),
        "plain_ms": 1e3 * med["plain"],
        "capture_ratio": med["capture"] / med["plain"],
        "offload_ratio": med["offload"] / med["plain"],
        "steps_timed": len(times["plain"]),
    }
