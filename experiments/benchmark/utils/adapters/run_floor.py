"""One floor-table workload (live TracIn ``attribute()`` vs a plain forward+backward), one process.

``--impl ours`` runs this repository's dattri_llm (``PYTHONPATH`` = the repository root);
``--impl ref`` runs the published ``dattri-llm`` 0.1.0 from PyPI and must be executed by
``experiments/benchmark/.venv-ref/bin/python -I`` (a venv made with ``python -m venv`` *without*
system site packages: ``pip install torch==2.13.0 && pip install dattri-llm==0.1.0
transformers==<ours>``; ``-I`` keeps the working directory and ``PYTHONPATH`` off ``sys.path``),
so ``import dattri_llm`` there is the published package, never this repository's. Both capture
the same layers: every linear, norm and embedding layer except GPT-2's ``wpe`` (0.1.0 captures
it as one batch-summed row, which it cannot score against several test batches). Prints one
JSON line: CPU / wall seconds and peak RSS of ``attribute()`` and of
one plain forward+backward over the same samples, per round; optionally saves the score
matrix (``--scores``, a ``torch.save`` of one tensor, read back with ``weights_only=True``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # experiments/benchmark

import torch  # noqa: E402
from utils.memory import peak_rss_bytes  # noqa: E402
from utils.models import ModelShape, batch_loss, build_model, make_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", required=True, help="n_layer,width,n_head,vocab,seq")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--m", type=int, required=True)
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--scores", default=None)
    p.add_argument("--impl", choices=("ours", "ref"), required=True)
    p.add_argument("--budget-gb", type=float, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    import dattri_llm
    from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
    from dattri_llm.gradient.hooks import HookManagerConfig

    published = "site-packages" in dattri_llm.__file__
    if published != (a.impl == "ref"):
        raise SystemExit(f"--impl {a.impl} imported {dattri_llm.__file__}")
    if a.impl == "ref":
        hook_config = HookManagerConfig(linear_io=[r"^(?!transformer\.wpe$).*$"], param_grad=None)
    else:
        hook_config = HookManagerConfig(exclude=[r"transformer\.wpe"])
    extra = {}
    if a.impl == "ours":
        extra["show_progress"] = False
        if a.budget_gb is not None:
            extra["score_memory_gb"] = a.budget_gb
    nl, w, nh, v, s = (int(x) for x in a.shape.split(","))
    shape = ModelShape("gpt2", nl, w, nh, v, s, a.bs)
    model = build_model(shape)
    train, test = make_batch(shape, n=a.n, seed=1), make_batch(shape, n=a.m, seed=2)
    both = torch.cat([train, test])

    def loss_fn(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        return batch_loss(model, batch["input_ids"])

    tr = [{"input_ids": t} for t in train]
    te = [{"input_ids": t} for t in test]

    def attribute() -> object:
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            args = AttributionArguments(
                output_dir=out,
                use_cpu=True,
                per_device_train_batch_size=a.bs,
                per_device_eval_batch_size=a.bs,
                **extra,
            )
            att = TracInAttributor(args, task=AttributionTask(loss_fn, model))
            return att.attribute(tr, te, hook_config=hook_config)

    def plain() -> None:
        for i in range(0, len(both), a.bs):
            model.zero_grad(set_to_none=True)
            batch_loss(model, both[i : i + a.bs]).backward()
        model.zero_grad(set_to_none=True)

    def timed(fn: object) -> tuple[float, float, int, object]:
        box = {}

        def run() -> object:
            c0, t0 = time.process_time(), time.perf_counter()
            out = fn()
            box["w"], box["c"] = time.perf_counter() - t0, time.process_time() - c0
            return out

        peak, out = peak_rss_bytes(run)
        return box["c"], box["w"], peak, out

    out = {"impl": a.impl, "file": dattri_llm.__file__}
    rounds = []
    score = None
    for _ in range(a.rounds):
        ac, aw, ap, score = timed(attribute)
        pc, pw, pp, _ = timed(plain)
        rounds.append(
            {
                "attr_cpu": ac,
                "attr_wall": aw,
                "attr_peak": ap,
                "plain_cpu": pc,
                "plain_wall": pw,
                "plain_peak": pp,
            }
        )
    out["rounds"] = rounds
    if a.scores:
        torch.save({"scores": score.scores.detach().clone()}, a.scores)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
