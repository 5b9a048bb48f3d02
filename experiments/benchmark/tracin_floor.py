"""The floor table: live TracIn's ``attribute()`` / one plain forward+backward over the same
samples, ours beside the published ``dattri-llm`` 0.1.0, each workload in a fresh subprocess
(rounds interleaved, the order alternating), with peak RSS. CPU, one thread; GPT-2 from config,
vocab 1000, seq 64, batch 8; every layer but ``wpe`` captured. 0.1.0 runs in
``experiments/benchmark/.venv-ref`` (``python -I``: never this checkout's ``dattri_llm``);
without that venv the table reports ours only.

    python experiments/benchmark/tracin_floor.py --parts floor --rounds 3
"""

# ruff: noqa: E402  (torch is imported after the re-execution with one thread)
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env

if __name__ == "__main__":
    ensure_env()  # a worker inherits the parent's one-thread environment and returns at once

import torch
from utils.env import header
from utils.models import (
    FLOOR_ROWS,
    batch_loss,
    build_model,
    floor_shape,
    make_batch,
    plain_fwd_bwd,
)
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table
from utils.timing import measure, med

REPO = os.path.dirname(os.path.dirname(BENCH_DIR))
REF_PY = os.path.join(BENCH_DIR, ".venv-ref", "bin", "python")


def workload(impl: str, spec: str, n: int, m: int, bs: int = 8) -> dict:
    """One round in this process: CPU / wall seconds and peak bytes of ``attribute()`` and of
    the plain forward+backward, with ``impl``'s ``dattri_llm`` (``ref``: 0.1.0 from PyPI)."""
    torch.set_num_threads(1)
    import dattri_llm
    from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
    from dattri_llm.gradient.hooks import HookManagerConfig

    if ("site-packages" in dattri_llm.__file__) != (impl == "ref"):
        raise SystemExit(f"--impl {impl} imported {dattri_llm.__file__}")
    # both leave out GPT-2's wpe: 0.1.0 captures it as one batch-summed row, which it cannot
    # score against several test batches
    if impl == "ref":
        hc = HookManagerConfig(linear_io=[r"^(?!transformer\.wpe$).*$"], param_grad=None)
        extra = {}
    else:
        hc, extra = HookManagerConfig(exclude=[r"transformer\.wpe"]), {"show_progress": False}
    shape = floor_shape(spec)
    model = build_model(shape)
    train, test = make_batch(shape, n=n, seed=1), make_batch(shape, n=m, seed=2)
    tr, te = [{"input_ids": t} for t in train], [{"input_ids": t} for t in test]

    def attribute() -> object:
        with tempfile.TemporaryDirectory() as out:
            sizes = {"per_device_train_batch_size": bs, "per_device_eval_batch_size": bs}
            args = AttributionArguments(output_dir=out, use_cpu=True, **sizes, **extra)
            task = AttributionTask(lambda mod, b: batch_loss(mod, b["input_ids"]), model)
            return TracInAttributor(args, task=task).attribute(tr, te, hook_config=hc)

    aw, ac, ap, _ = measure(attribute)
    pw, pc, pp, _ = measure(lambda: plain_fwd_bwd(model, torch.cat([train, test]), bs))
    return {"attr_cpu": ac, "attr_wall": aw, "attr_peak": ap,
            "plain_cpu": pc, "plain_wall": pw, "plain_peak": pp}  # fmt: skip


def run_one(impl: str, spec: str, n: int, m: int) -> dict:
    """:func:`workload` in a fresh subprocess (``ref``: in ``.venv-ref``, isolated)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable]
    if impl == "ref":
        env.pop("PYTHONPATH")
        cmd = [REF_PY, "-I"]
    cmd += [os.path.abspath(__file__), "--impl", impl, "--spec", spec, "--n", str(n), "--m", str(m)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    if res.returncode != 0:
        raise RuntimeError(f"{impl} {spec} {n}x{m} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def part_floor(rows_spec: list[tuple[str, int, int]], rounds: int) -> str:
    impls = ["ours", "ref"] if os.path.exists(REF_PY) else ["ours"]
    table = []
    for spec, n, m in rows_spec:
        got: dict[str, list[dict]] = {"ours": [], "ref": []}
        for r in range(rounds):
            for impl in impls if r % 2 == 0 else impls[::-1]:
                got[impl].append(x := run_one(impl, spec, n, m))
                msg = f"{spec} {n}x{m} {impl}: {x['attr_cpu'] / x['plain_cpu']:.2f}x"
                print(f"[floor] {msg}", file=sys.stderr, flush=True)
        o, f = (med([x["attr_cpu"] / x["plain_cpu"] for x in got[i]]) for i in ("ours", "ref"))
        po, pf = (max(x["attr_peak"] for x in got[i]) if got[i] else None for i in ("ours", "ref"))
        cpu = (med([x["attr_cpu"] for x in got[i]]) for i in ("ours", "ref"))
        table.append([spec, f"{n} x {m}", fmt_x(o), fmt_x(f), fmt_x(o / f) if f else "n/a",
                      fmt_bytes(po), fmt_bytes(pf), f"{po / pf:.2f}" if pf else "n/a",
                      *map(fmt_s, cpu)])  # fmt: skip
    heads = "model|train x test|ours|0.1.0|ours / 0.1.0|peak ours|peak 0.1.0|peak ours / 0.1.0|"
    return (
        f"### attribute() / plain forward+backward, ours vs dattri-llm 0.1.0 (median of {rounds} "
        "interleaved rounds, CPU time; peak RSS above the model and data)\n\n"
        + md_table(heads + "ours CPU|0.1.0 CPU", table)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="floor", help="kept for the documented command")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--impl", choices=("ours", "ref"), help="run one workload (a worker)")
    p.add_argument("--spec")
    p.add_argument("--n", type=int)
    p.add_argument("--m", type=int)
    a = p.parse_args()
    if a.impl:
        print(json.dumps(workload(a.impl, a.spec, a.n, a.m)))
        return
    models = "GPT-2 from GPT2Config (random weights), vocab 1000, seq 64, batch 8; every layer "
    models += "except wpe captured (both implementations)"
    timing = "process CPU time (steadier than wall clock under load)"
    print(header("Scoring at scale: the floor table", {"models": models, "timing": timing}))
    rows = [("4x256", 16, 8)] if a.quick else list(FLOOR_ROWS)
    print(part_floor(rows, 1 if a.quick else a.rounds), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
