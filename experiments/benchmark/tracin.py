"""TracIn end to end, CPU, one thread, GPT-2 from config (random weights = the checkpoint).

1. **vs dattri**: live ``TracInAttributor.attribute`` against dattri 0.3.0's as shipped (512-dim
   random projection) and unprojected (``projector_kwargs = None`` after construction), each
   side's scores against float64 ``torch.func`` brute force ``<grad l(z_train), grad l(z_test)>``.
2. **floor**: ``attribute()`` / one plain forward+backward over the same samples (vocab 50257).
3. **n**: our time and peak memory against the number of train samples.

    OMP_NUM_THREADS=1 python experiments/benchmark/tracin.py [--quick] [--parts dattri,floor,n]
"""

# ruff: noqa: E402  (torch is imported after the re-execution with one thread)
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import ensure_env

if __name__ == "__main__":
    ensure_env()

import torch
from torch.func import functional_call
from utils.env import header
from utils.models import ModelShape, batch_loss, build_model, describe, make_batch, plain_fwd_bwd
from utils.reference import rel_err, vmap_per_sample_grads
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table
from utils.timing import measure, med

from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor


def log(msg: str) -> None:
    print(f"[tracin] {msg}", file=sys.stderr, flush=True)


def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return batch_loss(model, batch["input_ids"])


def ours(model: torch.nn.Module, train: torch.Tensor, test: torch.Tensor, bs: int) -> torch.Tensor:
    """Live TracIn scores ``(N, M)`` in dataset order."""
    train_set, test_set = [{"input_ids": t} for t in train], [{"input_ids": t} for t in test]
    with tempfile.TemporaryDirectory() as out_dir:
        sizes = {"per_device_train_batch_size": bs, "per_device_eval_batch_size": bs}
        args = AttributionArguments(output_dir=out_dir, use_cpu=True, show_progress=False, **sizes)
        att = TracInAttributor(args, task=AttributionTask(loss_func=loss_fn, model=model))
        return att.attribute(train_set, test_set).query(train_set, test_set)


def dattri_scores(
    model: torch.nn.Module, train: torch.Tensor, test: torch.Tensor, bs: int, projected: bool
) -> torch.Tensor:
    """dattri 0.3.0 ``TracInAttributor`` (Grad-Dot at one checkpoint)."""
    from dattri.algorithm.tracin import TracInAttributor as DattriTracIn
    from dattri.task import AttributionTask as DattriTask
    from torch.utils.data import DataLoader, TensorDataset

    def f(params: dict, data: tuple) -> torch.Tensor:
        ids = data[0].unsqueeze(0)
        return functional_call(model, params, (), {"input_ids": ids, "labels": ids}).loss

    task = DattriTask(
        loss_func=f,
        model=model,
        checkpoints={k: v.detach().clone() for k, v in model.state_dict().items()},
    )
    att = DattriTracIn(task=task, weight_list=torch.ones(1), normalized_grad=False, device="cpu")
    if not projected:
        att.projector_kwargs = None
    tr = DataLoader(TensorDataset(train), batch_size=bs, shuffle=False)
    te = DataLoader(TensorDataset(test), batch_size=bs, shuffle=False)
    return att.attribute(tr, te)


def exact_scores(model: torch.nn.Module, train: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """Brute force in float64: per-sample gradients by vmap(grad), 8 samples at a time."""
    m64 = copy.deepcopy(model).double()

    def flat(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([v.flatten(1) for v in vmap_per_sample_grads(m64, x).values()], 1)

    t = torch.cat([flat(test[i : i + 8]) for i in range(0, len(test), 8)])
    return torch.cat([flat(train[i : i + 8]) @ t.T for i in range(0, len(train), 8)])


def part_vs_dattri(
    shape: ModelShape, n: int, m: int, bs: int, with_projected: bool, proj_rows: int
) -> str:
    model = build_model(shape)
    train, test = make_batch(shape, n=n, seed=1), make_batch(shape, n=m, seed=2)
    log(f"vs dattri: {describe(shape, model)}, {n} x {m}")
    results = {}
    runs = [("dattri_llm TracInAttributor (auto routing)", lambda: ours(model, train, test, bs))]
    n_d = min(n, proj_rows)
    suffix = f", first {n_d} train rows, time x{n / n_d:g}" if n_d < n else ""
    peer = "dattri 0.3.0 TracInAttributor"
    for proj in (False, True)[: 1 + with_projected]:
        name = f"{peer} as shipped (proj_dim 512)" if proj else f"{peer}, unprojected"
        runs.append((name + suffix, lambda p=proj: dattri_scores(model, train[:n_d], test, bs, p)))
    for name, fn in runs:
        results[name] = measure(fn)
        log(f"{name}: {results[name][0]:.1f}s wall")
    log("exact float64 reference")
    ref = exact_scores(model, train, test)
    base = results[runs[0][0]]
    rows = []
    for name, (wall, cpu, peak, scores) in results.items():
        scale = n / scores.shape[0]  # dattri as shipped runs on a prefix; its cost is linear in N
        ratios = [fmt_x(cpu * scale / base[1]), fmt_x(wall * scale / base[0]), fmt_bytes(peak)]
        err = f"{rel_err(scores, ref[: scores.shape[0]]):.1e}"
        rows.append([name, fmt_s(wall * scale), fmt_s(cpu * scale), *ratios, err])
    heads = "method|wall|CPU|time / ours (CPU)|time / ours (wall)|peak memory|"
    return (
        f"### vs dattri: {describe(shape, model)}; {n} train x {m} test, batch {bs}\n\n"
        + md_table(heads + "max rel. err vs exact f64", rows)
        + "\nmax rel. err = max |S - S_exact| / max |S_exact| over the N x M matrix.\n"
    )


def part_floor(shapes: list[ModelShape], n: int, m: int, bs: int, rounds: int) -> str:
    rows = []
    for shape in shapes:
        model = build_model(shape)
        train, test = make_batch(shape, n=n, seed=1), make_batch(shape, n=m, seed=2)
        both = torch.cat([train, test])
        att, pl = [], []
        for _ in range(rounds):
            att.append(measure(lambda m=model, a=train, b=test: ours(m, a, b, bs)))
            pl.append(measure(lambda m=model, a=both: plain_fwd_bwd(m, a, bs)))
        ratio_cpu, ratio_wall = (med([a[i] / p[i] for a, p in zip(att, pl)]) for i in (1, 0))
        a_cpu, p_cpu = med([a[1] for a in att]), med([p[1] for p in pl])
        met = f"<= 1.3x: {'met' if ratio_cpu <= 1.3 else 'MISSED'}"
        peaks = fmt_bytes(max(a[2] for a in att)), fmt_bytes(max(p[2] for p in pl))
        row = [fmt_s(a_cpu), fmt_s(p_cpu), fmt_x(ratio_cpu), fmt_x(ratio_wall), met, *peaks]
        rows.append([describe(shape, model), f"{n} x {m}", *row])
        log(f"floor {shape.label}: {ratio_cpu:.2f}x")
    heads = "model|train x test|attribute() CPU|plain fwd+bwd CPU|ratio (CPU)|ratio (wall)|"
    return (
        f"### Physical floor: attribute() / one plain forward+backward over the same "
        f"samples (batch {bs}, median of {rounds} paired runs)\n\n"
        + md_table(heads + "target (CPU)|peak attribute()|peak plain", rows)
    )


def part_scaling_n(shape: ModelShape, ns: list[int], m: int, bs: int) -> str:
    model = build_model(shape)
    test = make_batch(shape, n=m, seed=2)
    rows = []
    for n in ns:
        train = make_batch(shape, n=n, seed=1)
        wall, cpu, peak, _ = measure(lambda a=train: ours(model, a, test, bs))
        rows.append([n, fmt_s(wall), fmt_s(cpu), f"{cpu / n * 1e3:.1f} ms", fmt_bytes(peak)])
        log(f"scaling N={n}: {wall:.1f}s")
    return (
        f"### Scaling with N train: {describe(shape, model)}, {m} test, batch {bs}\n\n"
        + md_table(["N train", "wall", "CPU", "CPU / train sample", "peak memory"], rows)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--parts", default="dattri,floor,n")
    p.add_argument("--no-projected", action="store_true", help="skip dattri as shipped (slow)")
    # dattri scores only this many train rows: its cost is linear in the train batches (each
    # recomputes the test gradients), so its time is scaled to N
    p.add_argument("--proj-rows", type=int, default=32)
    args = p.parse_args()
    parts = args.parts.split(",")
    q = args.quick
    vocab = 2048 if q else 8192
    models = "GPT-2 architecture from GPT2Config, random weights (the checkpoint), dropout off, "
    models += "eager attention; token ids uniform random"
    vocabulary = f"{vocab} in parts 1, 3 (dattri's CPU projector draws a dense (P x 100) "
    vocabulary += "Gaussian block 6 times per batch, which at GPT-2's 50257 does not finish "
    vocabulary += "here); 50257 in part 2"
    timing = "single runs (CPU = process CPU time, steadier than wall clock under load); peak = "
    timing += "resident-set high-water mark above the level before the call"
    extra = {"models": models, "vocabulary": vocabulary, "timing": timing}
    print(header("TracIn end to end", extra))
    if "dattri" in parts:
        shape = ModelShape("gpt2", 2 if q else 4, 128 if q else 256, 4, vocab, 32 if q else 64, 8)
        n, m = (64, 8) if q else (512, 32)
        bs, proj = 8 if q else 32, not args.no_projected
        print(part_vs_dattri(shape, n, m, bs, proj, args.proj_rows), flush=True)
    if "floor" in parts:
        sizes = [(2, 128, 4, 32)] if q else [(4, 256, 4, 64), (6, 512, 8, 64)]
        shapes = [ModelShape("gpt2", nl, w, h, 50257, seq, 8) for nl, w, h, seq in sizes]
        n, m = (16, 8) if q else (64, 16)
        print(part_floor(shapes, n, m, 16, 1 if q else 2), flush=True)
    if "n" in parts:
        shape = ModelShape("gpt2", 2, 128, 4, vocab, 32 if q else 64, 8)
        ns = [32, 128] if q else [256, 1024, 4096]
        print(part_scaling_n(shape, ns, 8 if q else 32, 32), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
