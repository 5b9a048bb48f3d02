"""Ground truth with dattri 0.3.0's own retraining and ground-truth functions, cached on disk.

LDS: ``retrain_lds`` (random halves, seeds ``seed + i * runs + j``) and
``calculate_lds_ground_truth``, plus each run's targets (the split-run reliability). LOO:
``retrain_loo`` and ``calculate_loo_ground_truth``. Trajectory LOO: each sample masked out of its
batches in a run otherwise identical to the reference run, the full-data run every attributor
scores. Only small tensors are kept, ``<cache>/<setting>-<key>/<name>.{safetensors,json}``; the
key hashes everything that changes the numbers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader

from experiments.benchmark.quality.common import CACHE_DIR, Setting

FORMAT_VERSION = 1
Cached = tuple[dict[str, torch.Tensor], dict]


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
    return CACHE_DIR / f"{setting.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _cached(
    folder: Path, name: str, build: Callable[[], Cached], valid: Callable[[dict], bool] = bool
) -> Cached:
    """``name``'s tensors and metadata from ``folder``, else ``build()``'s, timed and written."""
    st, js = folder / f"{name}.safetensors", folder / f"{name}.json"
    if st.exists() and js.exists():
        meta = json.loads(js.read_text())
        if meta.get("format_version") == FORMAT_VERSION and valid(meta):
            return load_file(str(st)), meta
    t0 = time.perf_counter()
    tensors, meta = build()
    meta = {**meta, "seconds": time.perf_counter() - t0, "format_version": FORMAT_VERSION}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(st))
    js.write_text(json.dumps(meta, indent=1, default=str))
    return tensors, meta


@contextlib.contextmanager
def _scratch(folder: Path, prefix: str) -> Iterator[Path]:
    """A temporary folder for dattri's retrained weights, deleted afterwards."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=folder))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _model(setting: Setting, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = setting.make_model()
    model.load_state_dict(state)
    return model.eval()


def _loaders(setting: Setting) -> tuple[DataLoader, DataLoader]:
    """The unshuffled train loader and the one-batch test loader."""
    return (
        DataLoader(setting.train, batch_size=setting.batch_size),
        DataLoader(setting.test, batch_size=max(1, len(setting.test))),
    )


def reference_run(setting: Setting, folder: Path, seed: int) -> tuple[list[dict], dict]:
    """Train (or load) the full-data reference run; returns its checkpoints (last = final)."""

    def build() -> Cached:
        model, ckpts = setting.train_func(_loaders(setting)[0], seed=seed, return_checkpoints=True)
        ckpts = [*ckpts, {k: v.detach().clone() for k, v in model.state_dict().items()}]
        tensors = {f"ckpt{i}/{k}": v for i, c in enumerate(ckpts) for k, v in c.items()}
        meta = {"seed": seed, "num_checkpoints": len(ckpts)}
        return tensors, {**meta, "checkpoint_epochs": setting.checkpoint_epochs + ["final"]}

    tensors, meta = _cached(folder, "reference", build)
    ckpts = [dict() for _ in range(meta["num_checkpoints"])]
    for name, v in tensors.items():
        i, k = name.split("/", 1)
        ckpts[int(i[4:])][k] = v
    return ckpts, meta


def lds_ground_truth(
    setting: Setting, folder: Path, num_subsets: int, runs: int, seed: int
) -> Cached:
    """dattri's LDS ground truth (``gt`` (S, n_test), ``indices`` (S, m)) plus ``per_run``."""
    from dattri.metric.ground_truth import calculate_lds_ground_truth
    from dattri.model_util.retrain import retrain_lds

    def build() -> Cached:
        train_loader, test_loader = _loaders(setting)
        per_ckpt: dict[str, torch.Tensor] = {}

        def target_func(path: Any, dataloader: Any) -> torch.Tensor:
            state = torch.load(path, weights_only=True)
            per_ckpt[str(Path(path))] = setting.target(_model(setting, state), dataloader)
            return per_ckpt[str(Path(path))]

        kw = {"num_subsets": num_subsets, "subset_ratio": 0.5, "num_runs_per_subset": runs}
        with _scratch(folder, "lds-") as tmp:
            retrain_lds(setting.train_func, train_loader, str(tmp), seed=seed, **kw)
            gt, indices = calculate_lds_ground_truth(target_func, str(tmp), test_loader)
            path = str(tmp / "{}" / "model_weights_{}.pt")
            runs_of = [
                [-per_ckpt[path.format(i, j)] for j in range(runs)] for i in range(num_subsets)
            ]
            per_run = torch.stack([torch.stack(row) for row in runs_of])
        meta = {"num_subsets": num_subsets, "subset_ratio": 0.5, "runs_per_subset": runs}
        meta |= {"seed": seed, "train_seeds": f"seed + i * {runs} + j"}
        meta["subset_seeds"] = f"numpy default_rng(seed + i), i = 0..{num_subsets - 1}"
        return {"gt": gt.to(torch.float64), "indices": indices.long(), "per_run": per_run}, meta

    return _cached(folder, "lds", build)


def loo_ground_truth(setting: Setting, folder: Path, indices: list[int], seed: int) -> Cached:
    """dattri's LOO ground truth: ``gt`` (num_removed, n_test), ``indices`` (num_removed,)."""
    from dattri.metric.ground_truth import calculate_loo_ground_truth
    from dattri.model_util.retrain import retrain_loo

    # retrain_loo saves what the train function returns: a state dict, so nothing is pickled
    def train_state_dict(dataloader: Any, seed: int | None = None, **kw: Any) -> dict:
        model = setting.train_func(dataloader, seed=seed, **kw)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def target_func(state: dict, dataloader: Any) -> torch.Tensor:
        return setting.target(_model(setting, state), dataloader)

    def build() -> Cached:
        train_loader, test_loader = _loaders(setting)
        with _scratch(folder, "loo-") as tmp:
            retrain_loo(train_state_dict, train_loader, str(tmp), indices=list(indices), seed=seed)
            gt, removed = calculate_loo_ground_truth(target_func, str(tmp), test_loader)
        meta = {"removed_indices": list(indices), "seed": seed, "loader": "unshuffled"}
        return {"gt": gt.to(torch.float64), "indices": removed.long()}, meta

    return _cached(folder, "loo", build)


def trajectory_loo_ground_truth(
    setting: Setting, folder: Path, indices: list[int], seed: int, reference: dict
) -> Cached:
    """Trajectory-specific LOO, laid out as dattri's LOO ground truth (``gt`` holds the masked
    runs' targets, ``delta`` minus the reference run's). The reference run is re-trained first
    and must reproduce ``reference`` bit for bit, or the masked runs are not comparable."""
    from tqdm.auto import tqdm

    def build() -> Cached:
        loader, test_loader = _loaders(setting)
        base_model = setting.train_func(loader, seed=seed)
        state = base_model.state_dict()
        drift = max(float((state[k] - v).abs().max()) for k, v in reference.items() if k in state)
        if drift != 0.0:
            raise RuntimeError(f"trajectory LOO: the reference run re-trained moved by {drift:.3e}")
        base = setting.target(base_model, test_loader)

        def masked(i: int) -> torch.Tensor:
            model = setting.train_func(loader, seed=seed, mask_index=int(i))
            return setting.target(model, test_loader)

        gt = torch.stack(
            [masked(i) for i in tqdm(indices, desc="trajectory LOO runs", leave=False)]
        )
        delta = gt - base
        meta = {"removed_indices": list(indices), "seed": seed}
        meta["kind"] = "trajectory-specific: sample masked out of its batch, all else identical"
        meta["reference_reproduced"] = "bit-exact (max |weight difference| = 0)"
        meta["mean_abs_delta"] = float(delta.abs().mean())
        meta["max_abs_delta"] = float(delta.abs().max())
        index = torch.as_tensor(list(indices), dtype=torch.long)
        tensors = {"gt": gt.to(torch.float64), "indices": index, "delta": delta.to(torch.float64)}
        return {**tensors, "base": base.to(torch.float64)}, meta

    return _cached(
        folder, "trajectory_loo", build, lambda meta: meta.get("removed_indices") == list(indices)
    )
