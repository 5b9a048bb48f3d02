"""Trajectory methods (LESS, AdamW-influence, DVEmb) on the reference run, recorded once more:
re-trained with the setting's own loop under a ``HookManager`` (through its observer), which
must reproduce the cached reference weights bit for bit. Recordings are cached beside the
ground truth with their time and peak memory, which every row on them reports in its note."""

from __future__ import annotations

import contextlib
import copy
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from experiments.benchmark.quality.common import TrainObserver
from experiments.benchmark.quality.methods import Context, Method, Skipped
from experiments.benchmark.quality.methods.ours import _args, _samples, _task

RECORDING_VERSION = 1


class Recorder(TrainObserver):
    """Runs the setting's loop under a ``HookManager`` and records the trajectory: per-sample
    gradients to ``root/grads`` (``store``) and / or θ_t and the batches (``snapshots``), the
    optimizer around every update, its ``state_dict()`` after the 1-based steps
    ``keep_optimizer_at``. ``ids`` is each train index's sample identity."""

    def __init__(
        self,
        ids: list[str],
        hook_config: Any,
        root: Path,
        store: bool = True,
        snapshots: bool = False,
        keep_optimizer_at: tuple[int, ...] = (),
    ) -> None:
        self.ids, self.hook_config, self.root = ids, hook_config, root
        self.use_store, self.use_snapshots = store, snapshots
        self.keep_optimizer_at = set(keep_optimizer_at)
        self.optimizer_states: list[dict] = []
        self.steps = 0

    @contextlib.contextmanager
    def run(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        import dattri_llm as dl

        self.optimizer = optimizer
        self.traj = dl.TrajectorySnapshots(self.root / "trajectory")
        store = dl.GradientStorageManager(str(self.root / "grads")) if self.use_store else None
        callbacks: list[Any] = [] if store is None else [dl.OffloadCallback(file_manager=store)]
        if self.use_snapshots:
            callbacks.append(dl.ParameterSnapshotCallback(model, self.traj, optimizer=optimizer))
        self.recorder = dl.OptimizerStateCallback(model, optimizer, snapshots=self.traj)
        callbacks.append(self.recorder)
        self.hm = dl.HookManager(model, self.hook_config, callbacks)
        try:
            with self.hm.collect(deregister_on_exit=True):
                yield
        finally:
            if store is not None:
                store.close()
            self.traj.close()

    def before_backward(self, step: int, index: torch.Tensor, batch: dict) -> None:
        self.hm.set_sample_ids([self.ids[int(i)] for i in index])
        if self.use_snapshots:
            self.traj.save_batch(step, {"x": batch["x"], "y": batch["y"]})

    def after_step(self, step: int) -> None:
        self.recorder.record_post(step)
        self.steps = step + 1
        if step + 1 in self.keep_optimizer_at:
            self.optimizer_states.append(copy.deepcopy(self.optimizer.state_dict()))


def _full_config() -> Any:
    from dattri_llm import HookManagerConfig

    return HookManagerConfig(capture_style="materialized")


def recording(ctx: Context, name: str, store: bool = True, snapshots: bool = False) -> dict:
    """Record (or reload) the reference run: its folders, facts and optimizer states."""
    if ("recording", name) in ctx.extra:
        return ctx.extra[("recording", name)]
    from safetensors.torch import load_file, save_file

    from dattri_llm import hash_sample
    from experiments.benchmark.utils.memory import peak_rss_bytes

    if ctx.extra.get("cache_dir") is None and "tmp_root" not in ctx.extra:  # tests
        ctx.extra["tmp_root"] = tempfile.TemporaryDirectory(prefix="quality-traj-")
    base = ctx.extra.get("cache_dir") or ctx.extra["tmp_root"].name
    root = Path(base) / "trajectory" / name
    marker, states_file = root / "recording.json", root / "optimizer_states.safetensors"
    meta_file = states_file.with_suffix(".json")
    if not marker.exists() or json.loads(marker.read_text()).get("version") != RECORDING_VERSION:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        s = ctx.setting
        ids = [hash_sample(d) for d in _samples(ctx)[0]]
        keep = tuple(s.checkpoint_epochs) if s.task_kind == "lm" else ()
        rec = Recorder(ids, _full_config(), root, store, snapshots, keep)
        loader = DataLoader(s.train, batch_size=s.batch_size)
        seed = ctx.extra.get("loo_seed", 0)
        t0 = time.perf_counter()
        peak, model = peak_rss_bytes(lambda: s.train_func(loader, seed=seed, observer=rec))
        seconds = time.perf_counter() - t0
        state = model.state_dict()
        drift = max(float((state[k] - v).abs().max()) for k, v in ctx.final.items() if k in state)
        if drift != 0.0:
            shutil.rmtree(root)
            raise RuntimeError(
                f"recording '{name}': the reference run re-trained under the hooks moved the "
                f"final weights by {drift:.3e}; the recorded trajectory is not the attributed one."
            )
        # optimizer state dicts as safetensors + JSON (no pickle)
        tensors = {
            f"{i}/{pid}/{k}": v.detach().clone().contiguous()
            for i, sd in enumerate(rec.optimizer_states)
            for pid, st in sd["state"].items()
            for k, v in st.items()
        }
        if tensors:
            save_file(tensors, str(states_file))
        groups = [{"param_groups": sd["param_groups"]} for sd in rec.optimizer_states]
        meta_file.write_text(json.dumps(groups))
        disk_mb = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6
        facts = {"version": RECORDING_VERSION, "steps": rec.steps, "seconds": seconds}
        facts |= {"peak_mb": peak / 1e6, "disk_mb": disk_mb, "bit_exact": True}
        marker.write_text(json.dumps(facts, indent=1))
    states = [{"state": {}, **g} for g in json.loads(meta_file.read_text())]
    for key, v in (load_file(str(states_file)) if states_file.exists() else {}).items():
        i, pid, k = key.split("/")
        states[int(i)]["state"].setdefault(int(pid), {})[k] = v
    out = {"store": root / "grads", "trajectory": root / "trajectory", "optimizer_states": states}
    ctx.extra[("recording", name)] = out | {"facts": json.loads(marker.read_text())}
    return ctx.extra[("recording", name)]


def _note(rec: dict, extra: str = "") -> str:
    f = rec["facts"]
    return (
        f"{extra}; recording (shared by the rows on it): re-run of the reference run under the "
        f"hooks, bit-exact, {f['steps']} steps, {f['seconds']:.0f} s, peak RSS +"
        f"{f['peak_mb']:.0f} MB, {f['disk_mb']:.0f} MB on disk"
    ).lstrip("; ")


#: Query chunks of at most this many bytes of (rows x coordinates): above glibc's 32 MB mmap
#: threshold every temporary of the adjoint sweep is page-faulted in anew (5-9x slower).
QUERY_CHUNK_BYTES = 8_000_000


def queries(ctx: Context, batch_size: int = 250, limit: int | None = None) -> list:
    """The test targets' raw gradients at the final weights, in blocks of ``batch_size``."""
    from dattri_llm.gradient.streaming import GradientStreamer

    test, loss = _samples(ctx)[1][:limit], ctx.setting.target_sum or ctx.setting.loss_sum
    kw = {"hook_config": _full_config(), "batch_size": batch_size}
    return list(GradientStreamer(ctx.model(), test, loss, **kw))


def _sweep(ctx: Context, cls: Any, source: Any, rec: dict, train: Any = None, **kw: Any) -> Any:
    """``(n_train, n_test)`` scores of trajectory attributor ``cls`` over every step of the
    recording ``rec``, its train gradients read from ``source``; query chunks of
    ``QUERY_CHUNK_BYTES``; train rows in the order of ``train`` (default the train set)."""
    from dattri_llm import OptimizerDynamics

    dynamics = OptimizerDynamics(rec["trajectory"])
    width = int(queries(ctx, batch_size=1, limit=1)[0].gradient.flatten().shape[1])
    train = _samples(ctx)[0] if train is None else train
    cols = []
    with tempfile.TemporaryDirectory() as tmp:
        attributor = cls(_args(tmp), loss_reduction="mean", **kw)
        for block in queries(ctx, batch_size=max(1, QUERY_CHUNK_BYTES // (4 * width))):
            score = attributor.attribute_from_cache(source, [block], dynamics=dynamics)
            cols.append(score.query(train, list(block.hashes)))
    return torch.cat(cols, dim=1)


# ---- AdamW runs --------------------------------------------------------------------------------
def adamw_influence(name: str) -> Any:
    """AdamW-influence over every step of the recording ``name`` (adjoint sweep)."""

    def fn(ctx: Context) -> torch.Tensor:
        from dattri_llm import AdamWInfluenceAttributor

        rec = recording(ctx, name)
        scores = _sweep(ctx, AdamWInfluenceAttributor, str(rec["store"]), rec)
        ctx.extra["last_note"] = _note(rec)
        return scores

    return fn


def adamw_influence_exact_hessian(ctx: Context) -> torch.Tensor:
    """AdamW-influence with each step's true batch-loss Hessian (``ExactHessian``: products at
    θ_t on the step's batch, replayed from a parameter-snapshot recording of the same run);
    language-model settings (the batch loss is the mean next-token CE)."""
    from dattri_llm import AdamWInfluenceAttributor, ExactHessian
    from experiments.benchmark.quality.common import per_sample_ce

    rec, snaps = recording(ctx, "full"), recording(ctx, "snapshots", False, True)

    def batch_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return per_sample_ce(model, batch["x"], batch["y"]).mean()

    curvature = ExactHessian(ctx.model(), snaps["trajectory"], batch_loss, _full_config())
    store = str(rec["store"])
    scores = _sweep(ctx, AdamWInfluenceAttributor, store, rec, curvature=curvature)
    note = f"curvature replayed from a parameter-snapshot recording ({_note(snaps)})"
    ctx.extra["last_note"] = _note(rec, note)
    return scores


def less(ctx: Context) -> torch.Tensor:
    """LESS's frozen form: Γ at each of the 4 checkpoints with the run's optimizer state there,
    weights = the learning rates (TracIn's), queries = raw target gradients."""
    from dattri_llm import LESSAttributor

    rec = recording(ctx, "full")
    task = _task(ctx, ctx.trajectory)
    s, optimizers = ctx.setting, []
    for sd in rec["optimizer_states"]:  # on the run's parameter groups, so the state loads
        opt = s.make_optimizer(task.model) if s.make_optimizer else None
        opt = opt or torch.optim.AdamW(task.model.parameters(), lr=s.lr)
        opt.load_state_dict(sd)
        optimizers.append(opt)
    kw = {"optimizers": optimizers, "checkpoint_weights": s.tracin_weights(len(ctx.trajectory))}
    train, test = _samples(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        score = LESSAttributor(_args(tmp), task=task, **kw).attribute(train, test)
    ctx.extra["last_note"] = _note(rec, "optimizer states taken from the recording")
    return score.query(train, test)


def dvemb_on_adam(ctx: Context) -> torch.Tensor:
    """DVEmb on the AdamW run (it assumes SGD: run anyway, with the warning recorded)."""
    from dattri_llm import DVEmbAttributor

    rec = recording(ctx, "full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = _sweep(ctx, DVEmbAttributor, str(rec["store"]), rec, method="adjoint")
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    warned = next((w for w in said if "assumes SGD" in w), None)
    note = "warned: " + warned.split(";")[0] if warned else "NO WARNING (expected one: Adam run)"
    ctx.extra["last_note"] = _note(rec, note)
    return scores


# ---- SGD runs ----------------------------------------------------------------------------------
def _replay(ctx: Context) -> tuple[dict, Any]:
    """The parameter-snapshot recording and a gradient source replaying it (the loss as
    trained: the batch's mean cross-entropy)."""
    from dattri_llm import ReplayGradientSource

    def train_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(batch["x"]), batch["y"])

    rec = recording(ctx, "replay", store=False, snapshots=True)
    return rec, ReplayGradientSource(ctx.model(), rec["trajectory"], train_loss, _full_config())


def dvemb_sgd(ctx: Context) -> torch.Tensor:
    """DVEmb (empirical Fisher) over every step of the recorded SGD run, replayed."""
    from dattri_llm import DVEmbAttributor, hash_sample

    rec, source = _replay(ctx)
    # a replayed step's identity of a sample is the content hash of the model's input
    hashes = [hash_sample(x) for x in ctx.setting.train.x]
    scores = _sweep(ctx, DVEmbAttributor, source, rec, train=hashes, method="adjoint")
    ctx.extra["last_note"] = _note(rec, "replayed from parameter snapshots")
    return scores


def adamw_influence_on_sgd(ctx: Context) -> torch.Tensor:
    """AdamW-influence on the SGD run: the library refuses it (the refusal is the row's note)."""
    from dattri_llm import AdamWInfluenceAttributor, OptimizerDynamics

    rec, source = _replay(ctx)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            AdamWInfluenceAttributor(_args(tmp), loss_reduction="mean").attribute_from_cache(
                source, queries(ctx), dynamics=OptimizerDynamics(rec["trajectory"])
            )
    except ValueError as e:
        raise Skipped(f"N/A, refused by the library: {e}") from None
    raise RuntimeError("AdamW-influence accepted an SGD run")


# ---- rows --------------------------------------------------------------------------------------
def methods(quick: bool, kind: str) -> list[Method]:
    """The trajectory rows of a run of optimizer family ``kind`` (``Setting.trajectory``)."""
    every = "(every step, all coordinates)"
    hessian = (
        "curvature=ExactHessian(...): each step's batch-loss Hessian by Hessian-vector products"
    )
    rows = {
        "adamw": [
            (f"AdamW-influence {every}", adamw_influence("full"), "adjoint sweep, float32"),
            (f"AdamW-influence, exact Hessian {every}", adamw_influence_exact_hessian, hessian),
            ("LESS (4 ckpts, frozen form)", less, ""),
            ("DVEmb (assumes SGD)", dvemb_on_adam, ""),
        ],
        "sgd": [
            ("DVEmb (empirical Fisher)", dvemb_sgd, ""),
            ("AdamW-influence", adamw_influence_on_sgd, ""),
        ],
    }.get(kind, [])
    # --quick leaves out the exact-Hessian row: one more sweep over the whole run
    rows = [r for r in rows if not (quick and r[1] is adamw_influence_exact_hessian)]
    return [Method(name, "dattri_llm", fn, note) for name, fn, note in rows]
