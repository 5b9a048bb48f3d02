"""dattri 0.3.0's own attributors on the same reference checkpoints: TracIn / Grad-Dot with
its projector disabled (the same maths as ours), TRAK over half-data models (projected to 512,
``p = exp(-loss)``), IF-explicit (regularization = weight decay, the full train set in one
batch) and IF-EKFAC on every ``nn.Linear``, as shipped and with two bugs worked around."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from experiments.benchmark.quality.methods import Context, Method, Skipped
from experiments.benchmark.quality.methods.reference import MAX_EXACT_PARAMS

TRAK_SEED = 777_000


def _task(ctx: Context, checkpoints: Any) -> Any:
    from dattri.task import AttributionTask

    model, s = ctx.model(), ctx.setting
    target = None if s.make_target_single is None else s.make_target_single(model)
    return AttributionTask(s.make_loss_single(model), model, checkpoints, target_func=target)


def _loaders(ctx: Context, bs: int = 100) -> tuple[DataLoader, DataLoader]:
    return DataLoader(ctx.setting.train, batch_size=bs), DataLoader(ctx.setting.test, batch_size=bs)


def tracin(trajectory: bool = False) -> Any:
    """dattri's TracIn with its projector disabled (the same maths as ours)."""

    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm.tracin import TracInAttributor

        ckpts = ctx.trajectory if trajectory else [ctx.final]
        weights = ctx.setting.tracin_weights(len(ckpts)) if trajectory else [1.0] * len(ckpts)
        weights = torch.tensor(weights)
        attributor = TracInAttributor(_task(ctx, ckpts), weight_list=weights, normalized_grad=False)
        attributor.projector_kwargs = None  # its default projects to 512 dimensions
        train, test = _loaders(ctx)
        return attributor.attribute(train, test)

    return fn


def half_models(ctx: Context, k: int) -> list[dict]:
    """k models trained on random halves of the train set (cached on the context)."""
    have = ctx.extra.setdefault("half_models", [])
    n = len(ctx.setting.train)
    while len(have) < k:
        i = len(have)
        idx = np.random.default_rng(TRAK_SEED + i).choice(n, n // 2, replace=False)
        half = Subset(ctx.setting.train, idx)
        loader = DataLoader(half, batch_size=ctx.setting.batch_size, shuffle=True)
        model = ctx.setting.train_func(loader, seed=TRAK_SEED + i)
        have.append({key: v.detach().clone() for key, v in model.state_dict().items()})
    return have[:k]


def trak(k: int) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm.trak import TRAKAttributor

        task = _task(ctx, half_models(ctx, k))
        # p = exp(-loss) of one sample: the correct-class probability of a classifier, the
        # geometric-mean token probability of a language model (as dattri's GPT-2 scripts)
        loss_single = ctx.setting.make_loss_single(task.get_model())

        def correct_probability(params: dict, data: Any) -> torch.Tensor:
            return torch.exp(-loss_single(params, data))

        attributor = TRAKAttributor(
            task,
            correct_probability_func=correct_probability,
            projector_kwargs={"proj_dim": 512, "device": "cpu"},
        )
        train, test = _loaders(ctx)
        attributor.cache(train)
        return attributor.attribute(test)

    return fn


def if_explicit(ctx: Context) -> torch.Tensor:
    from dattri.algorithm import IFAttributorExplicit

    n_params = sum(p.numel() for p in ctx.model().parameters())
    if n_params > MAX_EXACT_PARAMS:
        raise Skipped(f"{n_params} parameters: explicit Hessian too large")
    task, wd = _task(ctx, ctx.final), ctx.setting.weight_decay
    attributor = IFAttributorExplicit(task, regularization=wd)
    attributor.cache(DataLoader(ctx.setting.train, batch_size=len(ctx.setting.train)))
    train, test = _loaders(ctx)
    return attributor.attribute(train, test)


def _patched_ekfac_class() -> Any:
    """dattri 0.3.0's ``IFAttributorEKFAC`` with its two bugs worked around: ``eigh``'s
    eigenvectors are columns but it rotates with ``q @ X @ q.T`` (handed ``Qᵀ`` it computes
    ``Qᵀ X Q``), and it reshapes the test gradient ``[weight.flatten(), bias]`` to
    ``(out, in + 1)``, so the bias misses the last column where its hook put the constant 1."""
    import dattri.func.fisher as fisher
    from dattri.algorithm import IFAttributorEKFAC

    class PatchedEKFAC(IFAttributorEKFAC):
        def cache(self, loader: Any, max_iter: Any = None) -> None:
            orig = fisher.estimate_eigenvector
            fisher.estimate_eigenvector = lambda cov: {
                k: (q_a.T, q_s.T) for k, (q_a, q_s) in orig(cov).items()
            }
            try:
                super().cache(loader, max_iter)
            finally:
                fisher.estimate_eigenvector = orig

        def transform_test_rep(self, ckpt_idx: int, test_rep: torch.Tensor) -> torch.Tensor:
            out, i = [], 0
            for name in self.module_name:
                module = self.name_to_module[name]
                o, n_in = module.weight.shape
                v = test_rep[:, i : i + o * n_in].reshape(-1, o, n_in)
                i += o * n_in
                if module.bias is not None:  # the bias is the last column, as in the hook
                    v = torch.cat([v, test_rep[:, i : i + o].reshape(-1, o, 1)], -1)
                    i += o
                lam, (q_a, q_s) = self.cached_lambdas[name], self.cached_q[name]
                r = q_s.T @ ((q_s @ v @ q_a.T) / (lam + self.damping)) @ q_a
                out.append(r[..., :n_in].flatten(1))  # back to [weight.flatten(), bias]
                if module.bias is not None:
                    out.append(r[..., n_in])
            return torch.cat(out, 1)

    return PatchedEKFAC


def if_ekfac(damping: float, patched: bool = False) -> Any:
    def fn(ctx: Context) -> torch.Tensor:
        from dattri.algorithm import IFAttributorEKFAC

        if ctx.setting.task_kind == "lm":
            raise Skipped(
                "dattri 0.3.0's EK-FAC takes 2-D layer inputs only: on (B, T, D) activations "
                "dattri/func/fisher.py:267-270 leaves a_prev unset (UnboundLocalError)"
            )
        cls = _patched_ekfac_class() if patched else IFAttributorEKFAC
        attributor = cls(_task(ctx, ctx.final), damping=damping)
        train, test = _loaders(ctx)
        attributor.cache(train)
        return attributor.attribute(train, test)

    return fn


def methods(quick: bool, classifier: bool = True) -> list[Method]:
    src, k = "dattri 0.3.0", 2 if quick else 5
    rows = [
        ("Grad-Dot (unprojected)", tracin(), "projector disabled"),
        ("TracIn (4 ckpts, unprojected)", tracin(trajectory=True), ""),
        (f"TRAK-{k} (half-data models)", trak(k), "proj 512"),
    ]
    if classifier:  # a language model has too many parameters
        rows.append(("IF-explicit", if_explicit, "regularization = weight decay"))
    for d in (1e-3,) if quick else (1e-4, 1e-3, 1e-2):
        rows.append((f"IF-EKFAC (damping={d})", if_ekfac(d), ""))
    fixed = "eigenvector rows/columns and the bias column fixed by the benchmark"
    for d in (1e-3,) if quick else (1e-4, 1e-3):
        note = f"{fixed} (see dattri_peer._patched_ekfac_class)"
        rows.append((f"IF-EKFAC, 2 bugs patched (damping={d})", if_ekfac(d, patched=True), note))
    # quiet: dattri prints a tqdm bar per batch
    out = [Method(name, src, fn, note, quiet=True) for name, fn, note in rows]
    return out
