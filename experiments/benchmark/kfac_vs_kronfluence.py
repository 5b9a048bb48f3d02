"""EK-FAC influence: dattri_llm's ``EKFACAttributor`` vs kronfluence, same model, data, damping.

Each peer runs in its own subprocess on the same saved model and tokens (``--peer ours`` here,
``--peer kronfluence`` in ``experiments/benchmark/.venv-kronfluence``): fit + scores time, peak
RSS, score agreement, and a fit-time grid over depth and width. The model is a GPT-2 whose
``Conv1D`` layers are ``nn.Linear`` (kronfluence tracks only those), trained a few steps on
bytes of Python's documentation; every block linear layer tracked; summed next-token loss;
empirical Fisher; damping 0.1 x the mean eigenvalue per layer (kronfluence's
``damping_factor=None``; ours ``damping=0.1, relative=True``, ``tokens="all"``).

    OMP_NUM_THREADS=1 python experiments/benchmark/kfac_vs_kronfluence.py [--quick] [--float64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from utils.memory import status_bytes  # noqa: E402
from utils.table import md_table  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PEER_PY = HERE / ".venv-kronfluence" / "bin" / "python"
LAYER_REGEX = r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
VOCAB = 256


# ---- shared by both peers (no dattri_llm import here) --------------------------------------
def build_model(cfg: dict) -> nn.Module:
    """GPT-2 from a config, with every HF ``Conv1D`` replaced by an equivalent ``nn.Linear``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=cfg["seq"], n_embd=cfg["width"],
                        n_layer=cfg["layers"], n_head=max(1, cfg["width"] // 32), bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager", resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    for mod in list(model.modules()):
        for cname, child in list(mod.named_children()):
            if isinstance(child, Conv1D):
                nx, nf = child.weight.shape
                lin = nn.Linear(nx, nf)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    lin.bias.copy_(child.bias)
                setattr(mod, cname, lin)
    return model


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of a batch (the sum of per-sample losses)."""
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def peak_rss_mb() -> float:
    return status_bytes("VmHWM") / 2**20


def save(work: Path, name: str, scores: torch.Tensor) -> None:
    """A peer's ``(n_train, n_test)`` scores for :func:`agreement`."""
    from safetensors.torch import save_file

    save_file({"scores": scores.double().contiguous()}, str(work / f"{name}_scores.safetensors"))


def load_work(work: Path, cfg: dict) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    model = build_model(cfg)
    model.load_state_dict(load_file(str(work / "model.safetensors")), strict=False)
    model.eval()
    if cfg.get("dtype") == "float64":
        model.double()
    data = load_file(str(work / "data.safetensors"))
    return model, data["train"], data["test"]


# ---- peers ---------------------------------------------------------------------------------
def run_ours(work: Path, cfg: dict, fit_only: bool) -> dict:
    from dattri_llm import AttributionArguments, AttributionTask, EKFACAttributor
    from dattri_llm.gradient.hooks import HookManagerConfig

    model, train_ids, test_ids = load_work(work, cfg)
    base_rss = peak_rss_mb()
    train = [{"input_ids": r} for r in train_ids]
    test = [{"input_ids": r} for r in test_ids]
    b = cfg["batch"]
    sizes = {"per_device_train_batch_size": b, "per_device_eval_batch_size": b}
    out_dir = str(work / "ours_out")
    args = AttributionArguments(output_dir=out_dir, use_cpu=True, show_progress=False, **sizes)
    task = AttributionTask(lambda m, b: lm_loss(m, b["input_ids"]), model)
    att = EKFACAttributor(args, task=task, tokens="all")
    hook = HookManagerConfig(linear_io=[LAYER_REGEX])
    out: dict = {"base_rss_mb": base_rss}
    if fit_only:
        t0 = time.perf_counter()
        att.fit(train, hook_config=hook)
        out["fit_s"] = time.perf_counter() - t0
    else:
        # the user's path: one attribute() call fits on first use; the live train gradients
        # are kept in memory (AttributionArguments.live_cache_gb), so the covariance pass, the
        # eigenvalue pass and the scoring share one forward/backward over the train set
        t1 = time.perf_counter()
        score = att.attribute(train, test, hook_config=hook, damping=0.1, relative=True)
        out["fit_s"], out["score_s"] = 0.0, time.perf_counter() - t1
        save(work, "ours", score.query(train, test))
    out["layers"] = len(att.factors[0].layers)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


def run_kronfluence(work: Path, cfg: dict, fit_only: bool) -> dict:
    import logging

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from kronfluence.task import Task

    logging.disable(logging.WARNING)
    model, train_ids, test_ids = load_work(work, cfg)
    base_rss = peak_rss_mb()
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and re.fullmatch(LAYER_REGEX, n)]  # fmt: skip

    class LMTask(Task):
        def compute_train_loss(self, batch, model, sample=False):  # noqa: ANN001, ANN201
            return lm_loss(model, batch["input_ids"])

        def compute_measurement(self, batch, model):  # noqa: ANN001, ANN201
            return lm_loss(model, batch["input_ids"])

        def get_influence_tracked_modules(self):  # noqa: ANN201
            return names

    class DS(torch.utils.data.Dataset):
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i]}

    task = LMTask()
    model = prepare_model(model, task)
    out_dir = str(work / "kronfluence_out")
    analyzer = Analyzer("bench", model, task, cpu=True, disable_tqdm=True, output_dir=out_dir)
    f64 = cfg.get("dtype") == "float64"
    fit_dtypes = "activation_covariance gradient_covariance per_sample_gradient lambda".split()
    score_dtypes = "per_sample_gradient precondition score".split()
    f64_fit = {f"{k}_dtype": torch.float64 for k in fit_dtypes if f64}
    f64_score = {f"{k}_dtype": torch.float64 for k in score_dtypes if f64}
    fargs = FactorArguments(strategy="ekfac", use_empirical_fisher=True, **f64_fit)
    t0 = time.perf_counter()
    analyzer.fit_all_factors("ekfac", DS(train_ids), per_device_batch_size=cfg["batch"],
                             factor_args=fargs, overwrite_output_dir=True)  # fmt: skip
    out = {"fit_s": time.perf_counter() - t0, "base_rss_mb": base_rss, "layers": len(names)}
    if not fit_only:
        t1 = time.perf_counter()
        b = cfg["batch"]
        sizes = {"per_device_query_batch_size": b, "per_device_train_batch_size": b}
        analyzer.compute_pairwise_scores(
            "scores", "ekfac", DS(test_ids), DS(train_ids), overwrite_output_dir=True,
            score_args=ScoreArguments(damping_factor=None, **f64_score), **sizes
        )  # fmt: skip
        out["score_s"] = time.perf_counter() - t1
        save(work, "kronfluence", analyzer.load_pairwise_scores("scores")["all_modules"].T)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


# ---- driver --------------------------------------------------------------------------------
def prepare(work: Path, cfg: dict) -> None:
    """Tokenise real text, train the model a few steps, save model + data (safetensors)."""
    from pydoc_data.topics import topics

    from safetensors.torch import save_file

    text = " ".join(topics[k] for k in sorted(topics)).encode("utf-8", "ignore")
    data = torch.tensor(list(text), dtype=torch.long)
    s, n = cfg["seq"], cfg["n_train"] + cfg["n_test"]
    g = torch.Generator().manual_seed(0)
    rows, seen = [], set()
    for i in torch.randperm(len(data) - s, generator=g).tolist():
        chunk = data[i : i + s]
        key = bytes(chunk.to(torch.uint8).tolist())
        if key not in seen:  # dattri_llm identifies samples by content: keep them distinct
            seen.add(key)
            rows.append(chunk)
        if len(rows) == n:
            break
    rows = torch.stack(rows)
    model = build_model(cfg)  # trained in float32 in either case
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    train = rows[: cfg["n_train"]]
    for _step in range(cfg["train_steps"]):
        batch = train[torch.randint(0, len(train), (16,), generator=g)]
        opt.zero_grad()
        (lm_loss(model, batch) / batch.numel()).backward()
        opt.step()
    state = model.state_dict()
    state = {k: v.detach().clone().contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(state, str(work / "model.safetensors"))  # lm_head is tied to transformer.wte
    data = {"train": train.contiguous(), "test": rows[cfg["n_train"] :].contiguous()}
    save_file(data, str(work / "data.safetensors"))


def launch(peer: str, work: Path, cfg: dict, fit_only: bool) -> dict:
    py = sys.executable if peer == "ours" else str(PEER_PY)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [py, str(Path(__file__).resolve()), "--peer", peer, "--work", str(work)]
    cmd += ["--cfg", json.dumps(cfg)] + (["--fit-only"] if fit_only else [])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
    if res.returncode != 0:
        raise RuntimeError(f"peer {peer} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def agreement(work: Path) -> dict:
    from safetensors.torch import load_file

    a = load_file(str(work / "ours_scores.safetensors"))["scores"].double()
    b = load_file(str(work / "kronfluence_scores.safetensors"))["scores"].double()

    def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
        x, y = x - x.mean(), y - y.mean()
        return float((x @ y) / (x.norm() * y.norm()))

    def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
        return pearson(x.argsort().argsort().double(), y.argsort().argsort().double())

    per_query = [spearman(a[:, j], b[:, j]) for j in range(a.shape[1])]
    return {
        "pearson": pearson(a.flatten(), b.flatten()),
        "spearman": spearman(a.flatten(), b.flatten()),
        "spearman_per_query_mean": sum(per_query) / len(per_query),
        "max_rel_diff": float((a - b).abs().max() / b.abs().max()),
    }


def versions() -> dict:
    import transformers

    peer = ["?", "?"]
    if PEER_PY.exists():
        code = "import kronfluence,torch;print(kronfluence.__version__,torch.__version__)"
        res = subprocess.run([str(PEER_PY), "-c", code], capture_output=True, text=True)
        peer = res.stdout.split() + peer
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "kronfluence": peer[0],
            "peer_torch": peer[1], "threads": os.environ.get("OMP_NUM_THREADS"),
            "cpus": os.cpu_count()}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    p.add_argument("--peer", choices=["ours", "kronfluence"])
    p.add_argument("--work")
    p.add_argument("--cfg")
    p.add_argument("--fit-only", action="store_true")
    p.add_argument("--no-scaling", action="store_true", help="skip the fit-time scaling grid")
    p.add_argument("--float64", action="store_true", help="both peers in float64 (agreement)")
    p.add_argument("--out", default=None, help="write the JSON results here")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.peer:
        fn = run_ours if a.peer == "ours" else run_kronfluence
        print(json.dumps(fn(Path(a.work), json.loads(a.cfg), a.fit_only)))
        return
    peers: tuple[str, ...] = ("ours", "kronfluence")
    if not PEER_PY.exists():  # our rows still run; the peer's are left out, with a note
        peers = ("ours",)
        print(f"note: kronfluence skipped, no venv at {PEER_PY} (experiments/benchmark/README.md)")
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(sys.argv)
    print(f"command: {cmd}\nversions: {versions()}")
    main_cfg = (
        dict(layers=2, width=64, seq=32, n_train=128, n_test=16, batch=16, train_steps=30)
        if a.quick
        else dict(layers=4, width=128, seq=64, n_train=512, n_test=32, batch=16, train_steps=60)
    )
    main_cfg["dtype"] = "float64" if a.float64 else "float32"
    results: dict = {"command": cmd, "versions": versions(), "main": {"config": main_cfg}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "main"
        work.mkdir()
        prepare(work, main_cfg)
        for peer in peers:
            r = launch(peer, work, main_cfg, fit_only=False)
            r["total_s"] = r["fit_s"] + r["score_s"]
            results["main"][peer] = r
            print(peer, r)
        if "kronfluence" in peers:
            results["main"]["agreement"] = agreement(work)
            print("agreement", results["main"]["agreement"])
        n_fit = 128 if a.quick else 256  # the fit-time grid: float32 always
        base = dict(main_cfg, n_train=n_fit, n_test=4, train_steps=0, dtype="float32")
        grid = [dict(base, layers=n, width=64) for n in (1, 2, 4)]
        grid += [dict(base, layers=2, width=w) for w in (32, 128, 256)]
        grid = [] if a.no_scaling else grid
        results["scaling"] = []
        for i, cfg in enumerate(grid):
            w = Path(tmp) / f"s{i}"
            w.mkdir()
            prepare(w, cfg)
            row = {"layers": cfg["layers"], "width": cfg["width"]}
            for peer in peers:
                row[peer] = launch(peer, w, cfg, fit_only=True)["fit_s"]
            results["scaling"].append(row)
            print("scaling", row)
    rows = [[p, *(f"{results['main'][p][k]:.2f}" for k in ("fit_s", "score_s", "total_s"))]
            for p in peers]  # fmt: skip
    print("\n" + md_table(["peer", "fit (s)", "score (s)", "total (s)"], rows))
    rows = [[r["layers"], r["width"], *(f"{r[p]:.2f}" for p in peers)] for r in results["scaling"]]
    print(md_table(["layers", "width", *(f"{p} fit (s)" for p in peers)], rows))
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
