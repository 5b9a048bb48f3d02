"""Capture-time projection: stored bytes, capture / scoring time and rank fidelity per style.

Workload: a GPT-2-shaped model from config (4 layers x 256, 4 heads, sequence 64, byte-level
vocabulary of 256) briefly trained on Python's own documentation text (``pydoc_data``), so the
gradients are those of a model that has learnt something. Every ``transformers.Conv1D`` and
LayerNorm of the blocks is hooked (the tied ``wte`` / ``lm_head`` and ``wpe`` are excluded: a
dense projection of a ``V x E`` table needs a ``V*E x proj_dim`` matrix).

For ``proj_dim`` in 16 / 64 / 256 (``logra`` also 1024 / 4096, i.e. 32 / 64 per side) and each
style (``logra``: sqrt split per side, e.g. 8 x 8 for
64; ``dense``; ``mask``; ``sparse`` with ``nnz`` 1 and 2; LayerNorms take ``mask`` under
``logra``, which they refuse) it
measures (``logra`` both kept factorised, with a token axis, and with ``capture_style="auto"``,
which stores the small ``k x d`` projected gradient when it is smaller than the factors): stored
bytes per train sample, one-time matrix generation, the cached projection state (matrices /
masks / hashes, MB), capture time of the train set and its ratio to the same forward + backward
passes without hooks (a plain step), Gram (TracIn / Grad-Dot) scoring time
``ops.cross_dot(train, test)`` with the cost-model route, and the Spearman rank correlation of
the projected scores with the exact ones (per test query over the train samples, averaged; and
over the whole score matrix).

Run::

    OMP_NUM_THREADS=1 python experiments/benchmark/projection.py            # full
    OMP_NUM_THREADS=1 python experiments/benchmark/projection.py --quick    # smaller
    OMP_NUM_THREADS=1 python experiments/benchmark/projection.py --styles dense sparse --dims 256
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utils.env import header  # noqa: E402

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig, ProjectionConfig
from dattri_llm.gradient import Gradient, ops
from dattri_llm.gradient.ops.projection import clear_projection_cache, projection_cache_info


def text_chunks(n: int, seq: int) -> torch.Tensor:
    """``n`` byte-level chunks of length ``seq`` from the pydoc topics (standard library)."""
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")
    ids = torch.tensor(list(data), dtype=torch.long)
    starts = torch.linspace(0, len(ids) - seq - 1, n).long()
    return torch.stack([ids[s : s + seq] for s in starts.tolist()])


def make_model(layers: int, width: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=4,
        n_positions=seq,
        vocab_size=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return GPT2LMHeadModel(cfg)


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def train(model: nn.Module, data: torch.Tensor, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    loss = torch.tensor(0.0)
    for s in range(steps):
        batch = data[(s * 16) % len(data) :][:16]
        loss = lm_loss(model, batch) / batch.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def workload(args: argparse.Namespace, n_train: int, n_test: int):
    """The pre-trained model (``args.layers / width / seq``, ``args.quick``) and the data.

    Returns:
        ``(model in eval mode, train ids, test ids, final pre-training loss per token)``.
    """
    model = make_model(args.layers, args.width, args.seq)
    data = text_chunks(n_train + n_test + 256, args.seq)
    pretrain, train_ids, test_ids = data[:256], data[256 : 256 + n_train], data[256 + n_train :]
    final = train(model, pretrain, steps=15 if args.quick else 40)
    model.eval()
    return model, train_ids, test_ids, final


def block_layers(model: nn.Module, types: tuple[str, ...]) -> list[str]:
    """Names of the transformer blocks' modules whose class name is in ``types``."""
    return [
        n
        for n, m in model.named_modules()
        if n.startswith("transformer.h.") and type(m).__name__ in types
    ]


def capture(model: nn.Module, data: torch.Tensor, config: HookManagerConfig, bs: int):
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, config=config, callbacks=[cb])
    t0 = time.perf_counter()
    with hm.collect():
        for i in range(0, len(data), bs):
            lm_loss(model, data[i : i + bs]).backward()
            model.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    hm.remove()
    return Gradient.concatenate([r.gradient for r in cb.records]), elapsed, hm


def plain(model: nn.Module, data: torch.Tensor, bs: int) -> float:
    """Seconds of the same forward + backward passes without any hook (a plain step)."""
    t0 = time.perf_counter()
    for i in range(0, len(data), bs):
        lm_loss(model, data[i : i + bs]).backward()
        model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman correlation of two 1-D tensors (ranks by argsort; ties are negligible here)."""
    rx = x.double().argsort().argsort().double()
    ry = y.double().argsort().argsort().double()
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / (rx.norm() * ry.norm()))


def mask_rescaled(train: Gradient, test: Gradient) -> torch.Tensor:
    """Scores with every ``mask`` layer scaled by ``P / proj_dim`` (its unbiased estimate)."""
    parts = ops.cross_dot(train, test, per_layer=True)
    total = 0
    for name, part in parts.items():
        kw = train.layers[name].module_kwargs
        if train.layers[name].layer_type == "projected.mask":
            src = kw["source_module_kwargs"]
            part = part * (src["_k"] * src["_d"] / kw["proj_dim"])
        total = total + part
    return total


def timed(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, dims 16 and 64")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--styles", nargs="+", default=None, help="only these styles (and exact)")
    p.add_argument("--dims", nargs="+", type=int, default=None, help="only these proj_dims")
    args = p.parse_args()
    n_train, n_test = (32, 8) if args.quick else (64, 16)
    dims = (16, 64) if args.quick else (16, 64, 256)
    if args.dims:
        dims = tuple(args.dims)
    repeat = 1 if args.quick else 3

    print(header("Capture-time projection"))
    torch.manual_seed(0)
    model, train_ids, test_ids, final = workload(args, n_train, n_test)
    print(
        f"model: GPT-2 {args.layers}x{args.width}, seq {args.seq}, vocab 256; pre-trained to "
        f"loss {final:.2f}/token; train {n_train}, test {n_test} samples"
    )
    hooked = block_layers(model, ("Conv1D", "LayerNorm")) + ["transformer.ln_f"]
    base = {"linear_io": hooked}

    t_plain = min(plain(model, train_ids, 8) for _ in range(repeat))
    print(f"plain step (no hooks) over the train set: {t_plain:.2f}s")
    exact_tr, t_cap, _ = capture(model, train_ids, HookManagerConfig(**base), 8)
    exact_te, _, _ = capture(model, test_ids, HookManagerConfig(**base), 8)
    t_score, exact = timed(lambda: ops.cross_dot(exact_tr, exact_te), repeat)
    dense_bytes = exact_tr.materialize().nbytes / n_train
    rows = [("exact (factorized)", "-", exact_tr.nbytes / n_train, 0.0, 0, t_cap, t_score, 1, 1, 1)]
    print(
        f"exact: {len(exact_tr.layers)} layers, factors {exact_tr.nbytes / n_train / 1e6:.2f} "
        f"MB/sample, dense gradient {dense_bytes / 1e6:.2f} MB/sample"
    )

    wide = () if args.quick or args.dims else (1024, 4096)  # logra: 32 x 32 and 64 x 64 per side
    plan = (
        ("logra", "factorized", dims, {}),
        ("logra", "auto", dims + wide, {}),
        ("dense", "factorized", dims, {}),
        ("mask", "factorized", dims, {}),
        ("sparse", "factorized", dims, {"nnz": 1}),
        ("sparse", "factorized", dims, {"nnz": 2}),
    )
    for style, capture_style, style_dims, opts in plan:
        if args.styles and style not in args.styles:
            continue
        for dim in style_dims:
            main_cfg = ProjectionConfig(style, proj_dim=dim, seed=0, **opts)
            norm_style = "mask" if style == "logra" else style
            norm_cfg = ProjectionConfig(norm_style, proj_dim=dim, **opts)
            proj = {".*ln_.*": norm_cfg, ".*": main_cfg}
            cfg = HookManagerConfig(**base, projection=proj, capture_style=capture_style)
            clear_projection_cache()
            hm = HookManager(model, config=cfg)
            t0 = time.perf_counter()
            for name in hm.layer_names:  # one-time generation (then cached)
                hm.projection[name].matrices(torch.float32)
            t_gen = time.perf_counter() - t0
            hm.remove()
            tr, t_cap, _ = capture(model, train_ids, cfg, 8)
            te, _, _ = capture(model, test_ids, cfg, 8)
            cached_mb = projection_cache_info()["bytes"] / 1e6  # everything capture cached
            t_score, scores = timed(lambda tr=tr, te=te: ops.cross_dot(tr, te), repeat)
            per_query = sum(spearman(scores[:, j], exact[:, j]) for j in range(n_test)) / n_test
            overall = spearman(scores.flatten(), exact.flatten())
            rescaled = mask_rescaled(tr, te)
            per_query_rs = sum(spearman(rescaled[:, j], exact[:, j]) for j in range(n_test))
            per_query_rs /= n_test
            label = f"{style} ({capture_style})" if style == "logra" else style
            if opts:
                label += " (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"
            rows.append(
                (
                    label,
                    str(dim),
                    tr.nbytes / n_train,
                    t_gen,
                    cached_mb,
                    t_cap,
                    t_score,
                    per_query,
                    overall,
                    per_query_rs,
                )
            )
            print(
                f"  {label:18s} {dim:4d}: {tr.nbytes / n_train:10.0f} B/sample, gen {t_gen:6.2f}s,"
                f" cached {cached_mb:7.2f} MB, capture {t_cap:6.2f}s "
                f"({t_cap / t_plain:.2f}x plain), score {t_score * 1e3:8.1f} ms, spearman "
                f"{per_query:.3f} / {overall:.3f} (masks rescaled: {per_query_rs:.3f})"
            )
        clear_projection_cache()

    print()
    print(
        f"plain step over the train set: {t_plain:.2f}s\n\n"
        "| style | proj_dim | bytes / sample | vs exact factors | matrix gen (s) | cached (MB) "
        "| capture (s) | vs plain step | scoring (ms) | vs exact scoring | Spearman per query "
        "| Spearman all | Spearman per query, masks x P/d |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ref_bytes, ref_score = rows[0][2], rows[0][6]
    for style, dim, nbytes, t_gen, mb, t_cap, t_score, sq, sa, sr in rows:
        print(
            f"| {style} | {dim} | {nbytes:,.0f} | {ref_bytes / nbytes:.0f}x smaller "
            f"| {t_gen:.2f} | {mb:.2f} | {t_cap:.2f} | {t_cap / t_plain:.2f}x "
            f"| {t_score * 1e3:.1f} | {ref_score / t_score:.1f}x "
            f"| {sq:.3f} | {sa:.3f} | {sr:.3f} |"
        )


if __name__ == "__main__":
    main()
