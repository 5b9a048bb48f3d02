"""Trajectory methods (LESS, AdamW-influence, DVEmb) on the reference run, recorded once more.

Trajectory methods read the run itself, not only its checkpoints: every step's per-sample
gradients and the optimizer's state around every update. The reference run is therefore
re-trained once more with the setting's own ``train_func`` (seed, batch order and schedule of
the reference run) under a ``HookManager``, through the loop's observer
(:class:`~experiments.benchmark.quality.common.TrainObserver`):

* an ``OffloadCallback`` writes each step's per-sample gradients to a gradient store, or a
  ``ParameterSnapshotCallback`` (+ the batches) writes θ_t for a ``ReplayGradientSource``;
* an ``OptimizerStateCallback`` records the moments / hyper-parameters around each update
  (``record_post(step)`` right after ``optimizer.step()``);
* the optimizer state at the 4 TracIn checkpoints is kept (LESS's frozen form).

Each sample's identity is ``hash_sample`` of its benchmark dict ``{"x", "y", "index"}``
(``HookManager.set_sample_ids`` before each forward, as the ``GradientStreamer`` does), so the
scores realign with ``score.query(train, test)``. The recording must reproduce the cached
reference weights bit for bit (it is refused otherwise: the trajectory would not be the
attributed one). Recordings are cached beside the ground truth (``<cache>/trajectory/``) with
their time and peak memory, which every row that reads them reports in its note.
"""

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


# ---- recording ---------------------------------------------------------------------------------
class Recorder(TrainObserver):
    """Runs the setting's loop under a ``HookManager`` and records the trajectory.

    Args:
        ids: The sample identity of every train index.
        hook_config: Layers / projection of the capture (``None``: every supported layer).
        root: Where the store (``grads/``) and the trajectory (``trajectory/``) go.
        store: Write per-sample gradients to a gradient store.
        snapshots: Write θ_t and the batches (replay) instead.
        keep_optimizer_at: 1-based steps after which to keep ``optimizer.state_dict()``.
    """

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
        from dattri_llm import (
            GradientStorageManager,
            HookManager,
            OffloadCallback,
            OptimizerStateCallback,
            ParameterSnapshotCallback,
            TrajectorySnapshots,
        )

        self.optimizer = optimizer
        self.traj = TrajectorySnapshots(self.root / "trajectory")
        callbacks: list[Any] = []
        store = None
        if self.use_store:
            store = GradientStorageManager(str(self.root / "grads"))
            callbacks.append(OffloadCallback(file_manager=store))
        if self.use_snapshots:
            callbacks.append(ParameterSnapshotCallback(model, self.traj, optimizer=optimizer))
        self.recorder = OptimizerStateCallback(model, optimizer, snapshots=self.traj)
        callbacks.append(self.recorder)
        self.hm = HookManager(model, self.hook_config, callbacks)
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


def _cache_root(ctx: Context) -> Path:
    root = ctx.extra.get("cache_dir")
    if root is None:  # tests: a temporary folder removed with the process
        if "tmp_root" not in ctx.extra:
            ctx.extra["tmp_root"] = tempfile.TemporaryDirectory(prefix="quality-traj-")
        root = ctx.extra["tmp_root"].name
    return Path(root) / "trajectory"


def _dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def recording(
    ctx: Context,
    name: str,
    hook_config: Any = None,
    store: bool = True,
    snapshots: bool = False,
) -> dict[str, Any]:
    """Record (or reload) the reference run; returns paths, facts and the optimizer states."""
    key = ("recording", name)
    if key in ctx.extra:
        return ctx.extra[key]
    from experiments.benchmark.utils.memory import peak_rss_bytes

    root = _cache_root(ctx) / name
    marker = root / "recording.json"
    setting = ctx.setting
    ckpt_steps = tuple(setting.checkpoint_epochs) if setting.task_kind == "lm" else ()
    states_file = root / "optimizer_states.safetensors"
    if marker.exists():
        facts = json.loads(marker.read_text())
        if facts.get("version") != RECORDING_VERSION:
            shutil.rmtree(root)
    if not marker.exists():
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        train_dicts, _ = _samples(ctx)
        from dattri_llm import hash_sample

        ids = [hash_sample(d) for d in train_dicts]
        rec = Recorder(ids, hook_config, root, store, snapshots, ckpt_steps)
        loader = DataLoader(setting.train, batch_size=setting.batch_size)
        t0 = time.perf_counter()
        peak, model = peak_rss_bytes(
            lambda: setting.train_func(loader, seed=ctx.extra.get("loo_seed", 0), observer=rec)
        )
        seconds = time.perf_counter() - t0
        drift = max(
            float((v.detach() - ctx.final[k]).abs().max())
            for k, v in model.state_dict().items()
            if k in ctx.final
        )
        if drift != 0.0:
            shutil.rmtree(root)
            raise RuntimeError(
                f"recording '{name}': the reference run re-trained under the HookManager moved "
                f"the final weights by {drift:.3e}; the recorded trajectory is not the "
                "attributed one."
            )
        _save_states(states_file, rec.optimizer_states)
        facts = {
            "version": RECORDING_VERSION,
            "steps": rec.steps,
            "seconds": seconds,
            "peak_mb": peak / 1e6,
            "disk_mb": _dir_mb(root),
            "bit_exact": True,
        }
        marker.write_text(json.dumps(facts, indent=1))
    facts = json.loads(marker.read_text())
    out = {
        "root": root,
        "store": root / "grads",
        "trajectory": root / "trajectory",
        "facts": facts,
        "optimizer_states": _load_states(states_file),
        "hook_config": hook_config,
    }
    ctx.extra[key] = out
    return out


def _save_states(path: Path, states: list[dict]) -> None:
    """Optimizer state dicts as safetensors + JSON (no pickle)."""
    from safetensors.torch import save_file

    tensors, meta = {}, []
    for i, sd in enumerate(states):
        for pid, st in sd["state"].items():
            for k, v in st.items():
                tensors[f"{i}/{pid}/{k}"] = v.detach().clone().contiguous().reshape(v.shape)
        meta.append({"param_groups": sd["param_groups"]})
    if tensors:
        save_file(tensors, str(path))
    path.with_suffix(".json").write_text(json.dumps(meta))


def _load_states(path: Path) -> list[dict]:
    from safetensors.torch import load_file

    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        return []
    meta = json.loads(meta_path.read_text())
    tensors = load_file(str(path)) if path.exists() else {}
    states: list[dict] = [{"state": {}, "param_groups": m["param_groups"]} for m in meta]
    for name, v in tensors.items():
        i, pid, k = name.split("/")
        states[int(i)]["state"].setdefault(int(pid), {})[k] = v
    return states


def _note(rec: dict, extra: str = "") -> str:
    f = rec["facts"]
    return (
        f"{extra}; recording (shared by the rows on it): re-run of the reference run under the "
        f"hooks, bit-exact, {f['steps']} steps, {f['seconds']:.0f} s, peak RSS +"
        f"{f['peak_mb']:.0f} MB, {f['disk_mb']:.0f} MB on disk"
    ).lstrip("; ")


#: Queries are unrolled in chunks of at most this many bytes of (rows x coordinates): the
#: adjoint sweep makes a fresh (rows, P) tensor per elementwise op, and above glibc's 32 MB
#: mmap threshold every one of them is page-faulted in anew (5-9x slower on this machine); the
#: chunks' sweeps re-read each step, which costs less. Scores do not depend on the chunking.
QUERY_CHUNK_BYTES = 8_000_000


def queries(
    ctx: Context, hook_config: Any, batch_size: int = 250, limit: int | None = None
) -> list:
    """The test targets' raw gradients at the final weights (the same hooks as the run), in
    blocks of ``batch_size`` (``limit``: the first test samples only)."""
    from dattri_llm.gradient.streaming import GradientStreamer

    test = _samples(ctx)[1][:limit]
    loss = ctx.setting.target_sum or ctx.setting.loss_sum
    return list(
        GradientStreamer(ctx.model(), test, loss, hook_config=hook_config, batch_size=batch_size)
    )


def chunked(
    ctx: Context, hook_config: Any, score_fn: Any, itemsize: int, train: Any = None
) -> torch.Tensor:
    """``(n_train, n_test)`` scores of ``score_fn(query_blocks) -> AttributionScore`` over
    query chunks of ``QUERY_CHUNK_BYTES`` (``itemsize`` bytes per coordinate); train rows in
    the order of ``train`` (samples or hashes; default the train set)."""
    probe = queries(ctx, hook_config, batch_size=1, limit=1)[0]
    width = int(probe.gradient.flatten().shape[1])
    rows = max(1, QUERY_CHUNK_BYTES // (itemsize * width))
    train = _samples(ctx)[0] if train is None else train
    cols = []
    for block in queries(ctx, hook_config, batch_size=rows):
        cols.append(score_fn([block]).query(train, list(block.hashes)))
    return torch.cat(cols, dim=1)


# ---- AdamW-influence ---------------------------------------------------------------------------
def adamw_influence(name: str) -> Any:
    """AdamW-influence over every step of the recorded reference run (adjoint sweep), on the
    recording ``name``."""

    def fn(ctx: Context) -> torch.Tensor:
        from dattri_llm import AdamWInfluenceAttributor, OptimizerDynamics

        config = _full_config()
        rec = recording(ctx, name, config)
        dynamics = OptimizerDynamics(rec["trajectory"])
        with tempfile.TemporaryDirectory() as tmp:
            attributor = AdamWInfluenceAttributor(_args(tmp), loss_reduction="mean")
            scores = chunked(
                ctx,
                config,
                lambda q: attributor.attribute_from_cache(str(rec["store"]), q, dynamics=dynamics),
                4,
            )
        ctx.extra["last_note"] = _note(rec)
        return scores

    return fn


def adamw_influence_exact_hessian(ctx: Context) -> torch.Tensor:
    """AdamW-influence with each step's true batch-loss Hessian (the library's
    ``ExactHessian``: Hessian-vector products at θ_t on the step's batch, both replayed from
    a parameter-snapshot recording of the same run); every step, every coordinate, float32.
    Language-model settings only (the loss is the gpt2 setting's mean next-token CE)."""
    from dattri_llm import AdamWInfluenceAttributor, ExactHessian, OptimizerDynamics
    from experiments.benchmark.quality.gpt2 import per_sample_ce

    config = _full_config()
    rec = recording(ctx, "full", config)
    snaps = recording(ctx, "snapshots", config, False, True)
    curvature = ExactHessian(
        ctx.model(),
        snaps["trajectory"],
        lambda model, batch: per_sample_ce(model, batch["x"], batch["y"]).mean(),
        hook_config=config,
    )
    dynamics = OptimizerDynamics(rec["trajectory"])
    with tempfile.TemporaryDirectory() as tmp:
        attributor = AdamWInfluenceAttributor(
            _args(tmp),
            loss_reduction="mean",
            curvature=curvature,
        )
        scores = chunked(
            ctx,
            config,
            lambda q: attributor.attribute_from_cache(str(rec["store"]), q, dynamics=dynamics),
            4,
        )
    ctx.extra["last_note"] = _note(
        rec, f"curvature replayed from a parameter-snapshot recording ({_note(snaps)})"
    )
    return scores


# ---- LESS (frozen form at the reference run's checkpoints) -----------------------------------
def less(ctx: Context) -> torch.Tensor:
    """LESS's frozen form: Γ at each of the 4 checkpoints with the run's optimizer state there,
    weights = the learning rates (TracIn's), queries = raw target gradients."""
    from dattri_llm import LESSAttributor

    rec = recording(ctx, "full", _full_config())
    states = rec["optimizer_states"]
    if len(states) != len(ctx.trajectory):
        raise RuntimeError(f"{len(states)} optimizer states for {len(ctx.trajectory)} checkpoints")
    task = _task(ctx, ctx.trajectory)
    optimizers = []
    make_optimizer = ctx.setting.make_optimizer or (
        lambda model: torch.optim.AdamW(model.parameters(), lr=ctx.setting.lr)
    )
    for sd in states:
        opt = make_optimizer(task.model)  # the run's parameter groups, so the state loads
        opt.load_state_dict(sd)
        optimizers.append(opt)
    with tempfile.TemporaryDirectory() as tmp:
        attributor = LESSAttributor(
            _args(tmp),
            task=task,
            optimizers=optimizers,
            checkpoint_weights=ctx.setting.tracin_weights(len(ctx.trajectory)),
        )
        train, test = _samples(ctx)
        score = attributor.attribute(train, test)
    ctx.extra["last_note"] = _note(rec, "optimizer states taken from the recording")
    return score.query(train, test)


def _full_config() -> Any:
    from dattri_llm import HookManagerConfig

    return HookManagerConfig(capture_style="materialized")


# ---- DVEmb -------------------------------------------------------------------------------------
def dvemb_on_adam(ctx: Context) -> torch.Tensor:
    """DVEmb on the AdamW run (it assumes SGD: run anyway, with the warning recorded)."""
    from dattri_llm import DVEmbAttributor, OptimizerDynamics

    config = _full_config()
    rec = recording(ctx, "full", config)
    dynamics = OptimizerDynamics(rec["trajectory"])
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attributor = DVEmbAttributor(_args(tmp), loss_reduction="mean", method="adjoint")
        scores = chunked(
            ctx,
            config,
            lambda q: attributor.attribute_from_cache(str(rec["store"]), q, dynamics=dynamics),
            4,
        )
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    warned = next((w for w in said if "assumes SGD" in w), None)
    ctx.extra["last_note"] = _note(
        rec,
        "warned: " + warned.split(";")[0] if warned else "NO WARNING (expected one: Adam run)",
    )
    return scores


def _replay_hashes(ctx: Context) -> list[str]:
    """The identity a replayed step gives each train sample: the content hash of the model's
    input (a bare first positional tensor is ``hash_sample(x)``, whatever ``forward`` names it)."""
    from dattri_llm import hash_sample

    hashes = [hash_sample(x) for x in ctx.setting.train.x]
    if len(set(hashes)) != len(hashes):
        raise RuntimeError("two train inputs are identical: replayed identities would collide")
    return hashes


def dvemb_sgd(ctx: Context) -> torch.Tensor:
    """DVEmb (empirical Fisher) over every step of the recorded SGD run, replayed from
    parameter snapshots."""
    from dattri_llm import DVEmbAttributor, OptimizerDynamics, ReplayGradientSource

    config = _full_config()
    rec = recording(ctx, "replay", config, store=False, snapshots=True)

    def train_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(batch["x"]), batch["y"])  # as trained

    train_src = ReplayGradientSource(ctx.model(), rec["trajectory"], train_loss, config)
    dynamics = OptimizerDynamics(rec["trajectory"])
    with tempfile.TemporaryDirectory() as tmp:
        attributor = DVEmbAttributor(_args(tmp), loss_reduction="mean", method="adjoint")
        scores = chunked(
            ctx,
            config,
            lambda q: attributor.attribute_from_cache(train_src, q, dynamics=dynamics),
            4,
            train=_replay_hashes(ctx),
        )
    ctx.extra["last_note"] = _note(rec, "replayed from parameter snapshots")
    return scores


def adamw_influence_on_sgd(ctx: Context) -> torch.Tensor:
    """AdamW-influence on the SGD run: the library refuses it (the refusal is the row's note)."""
    from dattri_llm import AdamWInfluenceAttributor, OptimizerDynamics, ReplayGradientSource

    config = _full_config()
    rec = recording(ctx, "replay", config, store=False, snapshots=True)

    def train_loss(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(m(batch["x"]), batch["y"])

    source = ReplayGradientSource(ctx.model(), rec["trajectory"], train_loss, config)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            AdamWInfluenceAttributor(_args(tmp), loss_reduction="mean").attribute_from_cache(
                source, queries(ctx, config), dynamics=OptimizerDynamics(rec["trajectory"])
            )
    except ValueError as e:
        raise Skipped(f"N/A, refused by the library: {e}") from None
    raise RuntimeError("AdamW-influence accepted an SGD run")


def exact_unroll(ctx: Context) -> torch.Tensor:
    """Reference for DVEmb: the first-order removal effect unrolled through the recorded SGD run
    with each step's *exact* batch Hessian (explicit, float64; small models only).

    SGD with coupled weight decay, ``θ' = θ − η (∇L_B(θ) + λθ)`` with ``L_B`` the batch's mean
    loss: removing ``z`` from its batch changes the step by ``−η (G − g_z)/(B − 1)`` (``G`` the
    batch mean gradient), and every later step carries the change through its Jacobian
    ``I − η (H_B + λ I)``. An adjoint sweep (the queries' test-loss gradients at θ_T carried
    backwards) scores every occurrence; a sample's score sums its occurrences. DVEmb computes
    the same thing with ``H_B`` replaced by a rank-``B`` empirical / Monte-Carlo Fisher.
    """
    from torch.func import functional_call, grad, hessian, vmap

    from dattri_llm import OptimizerDynamics, TrajectorySnapshots
    from experiments.benchmark.quality.methods.reference import (
        MAX_EXACT_PARAMS,
        per_sample_flat_grads,
    )

    model = ctx.model().to(torch.float64)
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    n_params = sum(sizes)
    if n_params > MAX_EXACT_PARAMS:
        raise Skipped(f"{n_params} parameters: explicit per-step Hessians too large")
    rec = recording(ctx, "replay", _full_config(), store=False, snapshots=True)
    snaps = TrajectorySnapshots(rec["trajectory"])
    lrs = OptimizerDynamics(rec["trajectory"]).learning_rates()
    wd = ctx.setting.weight_decay
    train = ctx.setting.train
    where = {train.x[i].numpy().tobytes(): i for i in range(len(train))}

    def unflat(theta: torch.Tensor) -> dict:
        return {n: t.view(s) for n, t, s in zip(names, theta.split(sizes), shapes)}

    def mean_loss(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, unflat(theta), (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    def one(theta: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return mean_loss(theta, xi[None], yi[None])

    adj = per_sample_flat_grads(ctx, ctx.final, ctx.setting.test)  # (M, P) at θ_T
    scores = torch.zeros(len(train), adj.shape[0], dtype=torch.float64)
    eye = torch.eye(n_params, dtype=torch.float64)
    for step in sorted(snaps.steps("parameters"), reverse=True):
        params, _ = snaps.load_parameters(step)
        theta = torch.cat([params[n].to(torch.float64).reshape(-1) for n in names])
        batch = snaps.load_batch(step)
        x, y = batch["x"].to(torch.float64), batch["y"]
        idx = torch.as_tensor([where[r.numpy().tobytes()] for r in batch["x"]])
        eta, b = float(lrs[step]), len(idx)
        g = vmap(grad(one), in_dims=(None, 0, 0))(theta, x, y)  # (B, P)
        push = -eta * (g.mean(0) - g) / (b - 1)  # δθ' of removing each sample
        scores.index_add_(0, idx, push @ adj.T)
        h = hessian(mean_loss)(theta, x, y) + wd * eye
        adj = adj - eta * adj @ h
    return scores


# ---- rows --------------------------------------------------------------------------------------
def methods(quick: bool, kind: str) -> list[Method]:
    """The trajectory rows of a setting whose run is ``kind`` (``Setting.trajectory``): AdamW
    runs get AdamW-influence, LESS and DVEmb (with its warning); SGD runs get DVEmb, its exact
    reference and AdamW-influence's refusal."""
    if kind == "adamw":
        out = [
            Method(
                "AdamW-influence (every step, all coordinates)",
                "dattri_llm",
                adamw_influence("full"),
                "adjoint sweep, float32",
            ),
        ]
        if not quick:  # one more sweep over the whole run
            out.append(
                Method(
                    "AdamW-influence, exact Hessian (every step, all coordinates)",
                    "dattri_llm",
                    adamw_influence_exact_hessian,
                    "curvature=ExactHessian(...): each step's batch-loss Hessian by "
                    "Hessian-vector products",
                )
            )
        return out + [
            Method("LESS (4 ckpts, frozen form)", "dattri_llm", less),
            Method("DVEmb (assumes SGD)", "dattri_llm", dvemb_on_adam),
        ]
    if kind == "sgd":
        return [
            Method(
                "Exact unrolled influence (explicit per-step Hessians)",
                "reference",
                exact_unroll,
                "float64; DVEmb's maths with each step's exact batch Hessian",
            ),
            Method("DVEmb (empirical Fisher)", "dattri_llm", dvemb_sgd),
            Method("AdamW-influence", "dattri_llm", adamw_influence_on_sgd),
        ]
    return []
