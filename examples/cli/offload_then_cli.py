"""From a training script that offloads gradients to an HTML report, with ``dattri-llm`` commands.

The Python part is what your own training script does: train a model (here a tiny GPT-2 from a
config, on paragraphs of Python's documentation, offline) inside a ``HookManager`` with an
``OffloadCallback``, capture the queries' gradients the same way, and write the texts as JSON
Lines (``{"id": hash_sample(sample), "text": ...}``) so the commands can show them. The rest is
the command line, printed and run:

    dattri-llm inspect OUT/train_grads --verify
    dattri-llm attribute --method tracin --train OUT/train_grads --test OUT/query_grads --out OUT/scores
    dattri-llm top OUT/scores --texts OUT/train.jsonl --k 3
    dattri-llm report OUT/scores --train-texts OUT/train.jsonl --test-texts OUT/queries.jsonl -o OUT/report.html

    OMP_NUM_THREADS=1 python examples/cli/offload_then_cli.py [--out DIR]
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    hash_sample,
)
from dattri_llm.demo import build_tokenizer, load_corpus

SEQ = 32
TOPICS = ("import", "try", "comparisons", "debugger")


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum of the per-sample losses (each sample's own next-token loss; padding excluded)."""
    logits = model(input_ids=ids, attention_mask=(ids != 0).long()).logits[:, :-1]
    labels = ids[:, 1:].masked_fill(ids[:, 1:] == 0, -100)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
    )


def train_and_offload(out: Path) -> None:
    """What a training script does: train while offloading; queries; texts as JSON Lines."""
    torch.manual_seed(0)
    corpus = [(t, x) for t, x in load_corpus(TOPICS)]
    tok = build_tokenizer([x for _, x in corpus], vocab_size=512)

    def encode(text: str) -> torch.Tensor:
        ids = tok.encode(text).ids[:SEQ]
        return torch.tensor(ids + [0] * (SEQ - len(ids)))

    by_topic: dict[str, list[str]] = {}
    for topic, text in corpus:
        by_topic.setdefault(topic, []).append(text)
    train = [(t, x) for t in TOPICS for x in by_topic[t][1:9]]  # 8 paragraphs per topic
    queries = [(t, by_topic[t][0]) for t in TOPICS]  # 1 held-out paragraph per topic
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    hooks = HookManagerConfig(linear_io=[r"transformer\.h\.\d+\.(attn|mlp)\.c_(attn|proj|fc)"])
    ids = torch.stack([encode(x) for _, x in train])

    def epoch() -> None:  # an ordinary training loop (equal batches of 8)
        for i in range(0, len(ids), 8):
            opt.zero_grad(set_to_none=True)
            (loss_fn(model, ids[i : i + 8]) / 8).backward()
            opt.step()

    epoch()
    epoch()
    store = GradientStorageManager(out / "train_grads")
    hm = HookManager(model, config=hooks, callbacks=[OffloadCallback(file_manager=store)])
    with hm.collect(deregister_on_exit=True):  # the last epoch's per-sample gradients
        epoch()
    store.close()

    qstore = GradientStorageManager(out / "query_grads")
    hm = HookManager(model, config=hooks, callbacks=[OffloadCallback(file_manager=qstore)])
    with hm.collect(deregister_on_exit=True):
        model.zero_grad(set_to_none=True)
        loss_fn(model, torch.stack([encode(x) for _, x in queries])).backward()
    model.zero_grad(set_to_none=True)
    qstore.close()

    for name, rows in (("train.jsonl", train), ("queries.jsonl", queries)):
        with open(out / name, "w", encoding="utf-8") as f:
            for topic, text in rows:
                sample = {"input_ids": encode(text)}
                f.write(json.dumps({"id": hash_sample(sample), "text": text, "topic": topic}))
                f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="stores, scores and report (default: a temp dir, removed)"
    )
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dattri_llm_cli_") as tmp:
        out = Path(opts.out or tmp)
        kept = "" if opts.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"stores, scores and the report go to {out}{kept}")
        out.mkdir(parents=True, exist_ok=True)
        train_and_offload(out)
        commands = [
            ["inspect", out / "train_grads", "--verify"],
            ["attribute", "--method", "tracin", "--train", out / "train_grads",
             "--test", out / "query_grads", "--out", out / "scores"],
            ["top", out / "scores", "--texts", out / "train.jsonl", "--k", "3", "--query", "0"],
            ["report", out / "scores", "--train-texts", out / "train.jsonl",
             "--test-texts", out / "queries.jsonl", "-o", out / "report.html"],
        ]  # fmt: skip
        for args in commands:
            args = [str(a) for a in args]
            print("\n$ dattri-llm " + " ".join(args), flush=True)
            # the console script `dattri-llm` is `python -m dattri_llm`
            subprocess.run([sys.executable, "-m", "dattri_llm", *args], check=True)


if __name__ == "__main__":
    main()
