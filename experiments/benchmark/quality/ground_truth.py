"""Ground truth with dattri 0.3.0's own retraining and ground-truth functions, cached on disk.

* LDS: ``dattri.model_util.retrain.retrain_lds`` (random 50 % subsets, several runs each, seeds
  ``seed + i * runs + j`` as dattri sets them) then ``dattri.metric.ground_truth.
  calculate_lds_ground_truth`` (mean over runs, sign flipped so higher = better). The target of
  every single checkpoint is also kept, for the split-run reliability of the ground truth.
* LOO: ``retrain_loo`` (fixed, unshuffled loader, fixed seed) then ``calculate_loo_ground_truth``.
  ``retrain_loo`` saves whatever the train function returns with ``torch.save``; we return a
  state dict (tensors only), so nothing is pickled and ``torch.load`` stays ``weights_only``.
* The reference run (the checkpoints every attributor scores) is the full-data run of the same
  train function with the unshuffled loader and the LOO seed, so LOO differences are relative
  to exactly the attributed model.

The retrained weights live in a temporary folder and are deleted; only small tensors are kept:
``<cache>/<setting>-<key>/{lds,loo,reference}.safetensors`` plus a JSON with the metadata (seeds,
slices, config, versions). The key hashes everything that changes the numbers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from experiments.benchmark.quality.common import CACHE_DIR, Setting, environment

FORMAT_VERSION = 1


def cache_dir(setting: Setting, spec: dict[str, Any]) -> Path:
    """The cache folder of one (setting, protocol) pair."""
    # the trajectory-LOO indices are checked by their own file's metadata: adding them must
    # not invalidate an already built LDS ground truth
    spec = {k: v for k, v in spec.items() if k != "trajectory_loo_indices"}
    blob = json.dumps(
        {"setting": setting.name, "config": setting.config, "spec": spec, "v": FORMAT_VERSION},
        sort_keys=True,
        default=str,
    )
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    return CACHE_DIR / f"{setting.name}-{key}"


def _load_model(setting: Setting, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = setting.make_model()
    model.load_state_dict(state)
    model.eval()
    return model


def _write(folder: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / f"{name}.safetensors"))
    meta = {**meta, "format_version": FORMAT_VERSION, "environment": environment()}
    (folder / f"{name}.json").write_text(json.dumps(meta, indent=1, default=str))


def _read(folder: Path, name: str) -> tuple[dict[str, torch.Tensor], dict] | None:
    st, js = folder / f"{name}.safetensors", folder / f"{name}.json"
    if not (st.exists() and js.exists()):
        return None
    meta = json.loads(js.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        return None
    return load_file(str(st)), meta


def reference_run(setting: Setting, folder: Path, seed: int) -> tuple[list[dict], dict]:
    """Train (or load) the full-data reference run; returns its checkpoints (last = final)."""
    cached = _read(folder, "reference")
    if cached is None:
        t0 = time.perf_counter()
        loader = DataLoader(setting.train, batch_size=setting.batch_size)
        model, ckpts = setting.train_func(loader, seed=seed, return_checkpoints=True)
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ckpts = [c for c in ckpts] + [final]
        tensors = {f"ckpt{i}/{k}": v for i, c in enumerate(ckpts) for k, v in c.items()}
        meta = {
            "seed": seed,
            "num_checkpoints": len(ckpts),
            "checkpoint_epochs": setting.checkpoint_epochs + ["final"],
            "seconds": time.perf_counter() - t0,
        }
        _write(folder, "reference", tensors, meta)
        cached = _read(folder, "reference")
    tensors, meta = cached
    ckpts = [dict() for _ in range(meta["num_checkpoints"])]
    for name, v in tensors.items():
        i, k = name.split("/", 1)
        ckpts[int(i[4:])][k] = v
    return ckpts, meta


def lds_ground_truth(
    setting: Setting, folder: Path, num_subsets: int, runs: int, seed: int, **train_kwargs: Any
) -> tuple[dict[str, torch.Tensor], dict]:
    """dattri's LDS ground truth (``gt`` (S, n_test), ``indices`` (S, m)) plus ``per_run``."""
    from dattri.metric.ground_truth import calculate_lds_ground_truth
    from dattri.model_util.retrain import retrain_lds

    cached = _read(folder, "lds")
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    test_loader = DataLoader(setting.test, batch_size=max(1, len(setting.test)))
    tmp = Path(tempfile.mkdtemp(prefix="lds-", dir=folder))
    try:
        loader = DataLoader(setting.train, batch_size=setting.batch_size)
        retrain_lds(
            setting.train_func,
            loader,
            str(tmp),
            num_subsets=num_subsets,
            subset_ratio=0.5,
            num_runs_per_subset=runs,
            seed=seed,
            **train_kwargs,
        )
        per_ckpt: dict[str, torch.Tensor] = {}

        def target_func(ckpt_path: Any, dataloader: Any) -> torch.Tensor:
            state = torch.load(ckpt_path, weights_only=True)
            values = setting.target(_load_model(setting, state), dataloader)
            per_ckpt[str(Path(ckpt_path))] = values
            return values

        gt, indices = calculate_lds_ground_truth(target_func, str(tmp), test_loader)
        per_run = torch.stack(
            [
                torch.stack(
                    [-per_ckpt[str(tmp / str(i) / f"model_weights_{j}.pt")] for j in range(runs)]
                )
                for i in range(num_subsets)
            ]
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "num_subsets": num_subsets,
        "subset_ratio": 0.5,
        "runs_per_subset": runs,
        "seed": seed,
        "subset_seeds": f"numpy default_rng(seed + i), i = 0..{num_subsets - 1}",
        "train_seeds": f"seed + i * {runs} + j",
        "train_kwargs": train_kwargs,
        "seconds": time.perf_counter() - t0,
    }
    tensors = {"gt": gt.to(torch.float64), "indices": indices.long(), "per_run": per_run}
    _write(folder, "lds", tensors, meta)
    return tensors, meta


def loo_ground_truth(
    setting: Setting, folder: Path, indices: list[int], seed: int
) -> tuple[dict[str, torch.Tensor], dict]:
    """dattri's LOO ground truth: ``gt`` (num_removed, n_test), ``indices`` (num_removed,)."""
    from dattri.metric.ground_truth import calculate_loo_ground_truth
    from dattri.model_util.retrain import retrain_loo

    cached = _read(folder, "loo")
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    test_loader = DataLoader(setting.test, batch_size=max(1, len(setting.test)))
    tmp = Path(tempfile.mkdtemp(prefix="loo-", dir=folder))

    def train_state_dict(dataloader: Any, seed: int | None = None, **kw: Any) -> dict:
        model = setting.train_func(dataloader, seed=seed, **kw)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def target_func(state: dict, dataloader: Any) -> torch.Tensor:
        return setting.target(_load_model(setting, state), dataloader)

    try:
        loader = DataLoader(setting.train, batch_size=setting.batch_size)
        retrain_loo(train_state_dict, loader, str(tmp), indices=list(indices), seed=seed)
        gt, removed = calculate_loo_ground_truth(target_func, str(tmp), test_loader)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "removed_indices": list(indices),
        "seed": seed,
        "loader": "unshuffled",
        "seconds": time.perf_counter() - t0,
    }
    tensors = {"gt": gt.to(torch.float64), "indices": removed.long()}
    _write(folder, "loo", tensors, meta)
    return tensors, meta


def trajectory_loo_ground_truth(
    setting: Setting,
    folder: Path,
    indices: list[int],
    seed: int,
    reference: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict]:
    """Trajectory-specific LOO: each removed sample is *masked out of its batch* in a run that
    is otherwise identical to the reference run (same seed, batch order, step count and
    schedule; ``setting.train_func(..., mask_index=i)``), so the target difference isolates
    that sample's contribution along the reference trajectory.

    Layout as dattri's ``calculate_loo_ground_truth``: ``gt`` (num_removed, n_test) holds the
    masked models' targets (a per-test-sample constant shift does not change the Pearson
    correlation ``loo_corr`` takes), ``indices`` (num_removed,). ``delta`` = masked minus
    reference target. The reference run is re-trained once first and must reproduce
    ``reference`` (the cached final checkpoint) bit for bit, or the comparison is meaningless.
    """
    from tqdm.auto import tqdm

    cached = _read(folder, "trajectory_loo")
    if cached is not None and cached[1].get("removed_indices") == list(indices):
        return cached
    t0 = time.perf_counter()
    test_loader = DataLoader(setting.test, batch_size=max(1, len(setting.test)))
    loader = DataLoader(setting.train, batch_size=setting.batch_size)
    base_model = setting.train_func(loader, seed=seed)
    drift = max(
        float((v.detach() - reference[k]).abs().max())
        for k, v in base_model.state_dict().items()
        if k in reference
    )
    if drift != 0.0:
        raise RuntimeError(
            f"trajectory LOO: re-training the reference run (seed {seed}) moved the weights by "
            f"{drift:.3e}; the run is not deterministic, so masked runs cannot be compared."
        )
    base = setting.target(base_model, test_loader)
    rows = []
    for i in tqdm(list(indices), desc="trajectory LOO runs", leave=False):
        model = setting.train_func(loader, seed=seed, mask_index=int(i))
        rows.append(setting.target(model, test_loader))
    gt = torch.stack(rows)
    delta = gt - base
    meta = {
        "removed_indices": list(indices),
        "seed": seed,
        "kind": "trajectory-specific: sample masked out of its batch, all else identical",
        "reference_reproduced": "bit-exact (max |weight difference| = 0)",
        "mean_abs_delta": float(delta.abs().mean()),
        "max_abs_delta": float(delta.abs().max()),
        "seconds": time.perf_counter() - t0,
    }
    tensors = {
        "gt": gt.to(torch.float64),
        "indices": torch.as_tensor(list(indices), dtype=torch.long),
        "delta": delta.to(torch.float64),
        "base": base.to(torch.float64),
    }
    _write(folder, "trajectory_loo", tensors, meta)
    return tensors, meta
