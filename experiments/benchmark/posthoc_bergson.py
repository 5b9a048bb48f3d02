"""Post-hoc capture beside bergson: ``dattri-llm capture`` vs ``bergson build``, same windows.

Both whole commands run as a user runs them, on one model directory (SmolLM-135M's shape:
30 x 576, 9 heads, MLP 1536, vocab 49152, untied head, 176M parameters, random weights, seed 0;
``--quick``: 2 x 64) and the same 512-word = 512-token windows of ``pydoc_data`` topics:

* bergson 2.5.1 (its own venv, ``--bergson-python``): ``bergson build --projection_dim 16``
  (16 x 16 per module, two-sided) on what it hooks by default (every ``nn.Linear`` of
  ``model.base_model``: not ``lm_head``), ``--loss_reduction sum --precision fp32
  --token_batch_size 512`` (one window per batch); ours: ``dattri-llm capture --projection
  logra:16x16 --layers 'model.layers.*_proj'`` (the same 210 layers), float32, batch 1.

The projections are different random matrices: the agreement check compares the windows'
gradient inner products (Pearson r of the off-diagonal Gram entries, median ratio of squared
norms) and runs both unprojected on window 0, where every module's gradient must agree
(largest difference / the module's largest entry). Commands run in fresh processes,
interleaved (bergson small, ours small, bergson big, ours big, repeated); CPU time is
``RUSAGE_CHILDREN``; the cost per window is the marginal ``(t_big - t_small) / (big - small)``
of the medians (start-up drops out). bergson's venv: ``docs/benchmarks/capture.md``.

    OMP_NUM_THREADS=1 python experiments/benchmark/posthoc_bergson.py --sizes 4 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from pydoc_data.topics import topics

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import RESULTS_DIR  # noqa: E402
from utils.models import ModelShape, build_model  # noqa: E402
from utils.table import fmt_x, md_table  # noqa: E402
from utils.timing import run_timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOL = ModelShape("llama", 30, 576, 9, 49152, 512, 1, intermediate=1536)
TINY = ModelShape("llama", 2, 64, 2, 512, 64, 1)
# bergson hooks every nn.Linear of ``model.base_model``: the blocks' 7 projections, not lm_head
LAYERS = ("model.layers.*_proj",)
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
VERSIONS = ("import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
            "('bergson', 'torch', 'transformers')))")  # fmt: skip


def prepare(shape: ModelShape, sizes: list[int], work: Path) -> tuple[str, dict[int, str]]:
    """The model directory and one dataset folder per size (the first ``n`` windows)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = " ".join(topics[k] for k in sorted(topics)).split()
    windows = [" ".join(words[i : i + shape.seq]) for i in range(0, len(words), shape.seq)]
    windows = windows[: max(sizes)]
    assert len(windows[-1].split()) == shape.seq, "not enough text for that many windows"
    common = [w for w, _ in Counter(w for t in windows for w in t.split()).most_common()]
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", *common[: shape.vocab - 2]])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.model_max_length = shape.seq
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        build_model(shape).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    data = {}
    for n in sizes:
        data[n] = str(work / f"data_{n}")
        shutil.rmtree(data[n], ignore_errors=True)
        Dataset.from_dict({"text": windows[:n]}).save_to_disk(data[n])
    return str(model_dir), data


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``cmd`` to completion: (wall s, CPU s of the process and its children)."""
    res, wall, cpu = run_timed(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"{cmd[2:4]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return wall, cpu


def commands(py: str, model: str, data: str, out: Path, dim: int, seq: int) -> dict[str, list]:
    shutil.rmtree(out, ignore_errors=True)
    return {
        "bergson": [py, "-m", "bergson", "build", str(out / "bergson"), "--model", model,
                    "--dataset", data, "--projection_dim", str(dim), "--loss_reduction", "sum",
                    "--precision", "fp32", "--token_batch_size", str(seq), "--overwrite"],
        "ours": [sys.executable, "-m", "dattri_llm", "capture", model, data, "--out",
                 str(out / "ours"), "--projection", f"logra:{dim}x{dim}" if dim else "none",
                 "--layers", *LAYERS, "--batch-size", "1", "--dtype", "float32", "--no-progress"],
    }  # fmt: skip


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def agreement(out: Path, exact: Path) -> dict[str, object]:
    """The Gram matrices of both stores, and both unprojected gradients of one window."""
    import numpy as np
    import torch

    from dattri_llm import GradientStorageManager

    sizes = json.loads((exact / "bergson" / "info.json").read_text())["grad_sizes"]
    flat = torch.from_file(str(exact / "bergson" / "gradients.bin"), size=sum(sizes.values()))
    mine = next(iter(GradientStorageManager(exact / "ours"))).gradient.layers
    assert len(mine) == len(sizes), (len(mine), len(sizes))  # the same modules, no more
    rel = [(mine[f"model.{n}"].materialize().data.reshape(-1) - t).abs().max() / t.abs().max()
           for n, t in zip(sizes, flat.split(list(sizes.values())))]  # fmt: skip
    info = json.loads((out / "bergson" / "info.json").read_text())
    dim = sum(info["grad_sizes"].values())
    theirs = np.fromfile(out / "bergson" / "gradients.bin", np.float32).reshape(-1, dim)
    ours = torch.cat([b.gradient.flatten() for b in GradientStorageManager(out / "ours")])
    grams = [x @ x.T for x in (ours.double().numpy(), theirs.astype(np.float64))]
    off = ~np.eye(len(theirs), dtype=bool)
    return {
        "numbers_per_sample": [ours.shape[1], dim],
        "gram_offdiag_pearson": float(np.corrcoef(grams[0][off], grams[1][off])[0, 1]),
        "sq_norm_ratio_ours_over_bergson": float(np.median(np.diag(grams[0] / grams[1]))),
        "unprojected_max_rel_diff": float(torch.stack(rel).max()),  # max keeps a NaN / inf
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2 x 64 Llama, 2 and 4 windows of 64")
    p.add_argument("--sizes", type=int, nargs=2, default=None, help="windows (default 4 16)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 1)")
    p.add_argument("--projection-dim", type=int, default=16)
    p.add_argument("--bergson-python", default=os.environ.get("DATTRI_LLM_BERGSON_PYTHON"),
                   help="default: $DATTRI_LLM_BERGSON_PYTHON")  # fmt: skip
    p.add_argument("--work", type=Path, default=RESULTS_DIR / "cache" / "posthoc_bergson")
    a = p.parse_args()
    py = a.bergson_python
    if not py or not os.access(py, os.X_OK):
        print(f"posthoc_bergson: skipped, no bergson python ({py or 'none given'}): give "
              "--bergson-python or DATTRI_LLM_BERGSON_PYTHON (see the docstring)")  # fmt: skip
        return
    shape = TINY if a.quick else SMOL
    small, big = a.sizes or ((2, 4) if a.quick else (4, 16))
    repeats = a.repeats or (1 if a.quick else 3)
    work = a.work / ("quick" if a.quick else "smol")
    work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(shape, [1, small, big], work)
    env = {**os.environ, **ENV}
    benv = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # bergson: its own venv only
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), env.get("PYTHONPATH")) if x)
    times: dict[str, dict[int, list]] = {t: {small: [], big: []} for t in ("bergson", "ours")}
    for r in range(repeats):  # interleaved: bergson small, ours small, bergson big, ours big
        for n in (small, big):
            cmds = commands(py, model, data[n], work / f"out_{n}", a.projection_dim, shape.seq)
            for tool, cmd in cmds.items():
                wall, cpu = timed(cmd, benv if tool == "bergson" else env)
                times[tool][n].append((wall, cpu))
                print(f"round {r + 1}: {tool}, {n} windows: {wall:.1f} s wall, {cpu:.1f} CPU-s",
                      file=sys.stderr, flush=True)  # fmt: skip
    res: dict = {"shape": shape.label, "sizes": [small, big], "times": times}
    for tool, t in times.items():
        (w0, c0), (w1, c1) = ([statistics.median(x[i] for x in t[n]) for i in (0, 1)]
                              for n in (small, big))  # fmt: skip
        nbytes = [dir_bytes(work / f"out_{n}" / tool) for n in (small, big)]
        res[tool] = {
            "cpu_s_per_window": (c1 - c0) / (big - small),
            "wall_s_per_window": (w1 - w0) / (big - small),
            "startup_cpu_s": c0 - small * (c1 - c0) / (big - small),
            "bytes_per_sample": (nbytes[1] - nbytes[0]) / (big - small),
        }
    for tool, cmd in commands(py, model, data[1], work / "out_exact", 0, shape.seq).items():
        timed(cmd, benv if tool == "bergson" else env)  # unprojected, window 0
    res["agreement"] = agreement(work / f"out_{big}", work / "out_exact")
    versions = subprocess.run([py, "-c", VERSIONS], capture_output=True, text=True).stdout
    res["versions"] = versions.strip()
    ratio = res["ours"]["cpu_s_per_window"] / res["bergson"]["cpu_s_per_window"]
    print(f"{shape.label}, seq {shape.seq}, {small} / {big} windows, {repeats} rounds; ours / "
          f"bergson CPU per window {fmt_x(ratio)}; {res['versions']}")  # fmt: skip
    keys = ("cpu_s_per_window", "wall_s_per_window", "startup_cpu_s", "bytes_per_sample")
    rows = [[tool, *(f"{res[tool][k]:,.2f}" for k in keys)] for tool in times]
    print(md_table(["tool", *keys], rows))
    print("agreement:", json.dumps(res["agreement"]))
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    name = "posthoc_bergson_quick.json" if a.quick else "posthoc_bergson.json"
    (RESULTS_DIR / name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
