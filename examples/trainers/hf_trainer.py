"""Capture per-sample gradients from a Hugging Face ``Trainer`` run, then attribute from disk.

The training code is the stock ``Trainer``: dattri_llm only wraps ``trainer.train()`` in a
``HookManager`` context with an ``OffloadCallback``. Offline: a tiny GPT-2 built from a config
and a byte-level tokenizer trained on the fly on Python's documentation topics.

    python examples/trainers/hf_trainer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.demo import load_corpus

SEQ = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        default=None,
        help="Trainer output, stores and scores (default: a temp dir, removed at exit)",
    )
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dattri_llm_trainer_") as tmp:
        work = Path(opts.out or tmp)
        kept = "" if opts.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"Trainer output, stores and scores go to {work}{kept}")
        run(work)


def run(work: Path) -> None:
    """Train with the stock Trainer while offloading, then attribute from the stores."""
    torch.manual_seed(0)
    corpus = load_corpus(("try", "import", "comparisons"))[:60]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        [t for _, t in corpus],
        trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>"], show_progress=False),
    )

    def encode(text: str) -> dict:
        ids = tok.encode(text).ids[:SEQ]
        ids = torch.tensor(ids + [0] * (SEQ - len(ids)))
        return {
            "input_ids": ids,
            "attention_mask": (ids != 0).long(),
            "labels": ids.masked_fill(ids == 0, -100),
        }

    train = [encode(t) for _, t in corpus[:48]]
    test = [encode(t) for _, t in corpus[48:52]]
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=64,
            vocab_size=512,
            n_positions=SEQ,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=str(work / "run"),
            per_device_train_batch_size=8,
            num_train_epochs=1,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=train,
    )

    # (1) wrap the unchanged training run: per-sample gradients go to disk as it trains
    train_store = GradientStorageManager(str(work / "train_grads"))
    hm = HookManager(
        model,
        config=HookManagerConfig(linear_io=REGISTER_ALL),
        callbacks=[
            OffloadCallback(
                offload_interval=1, file_manager=train_store, recording_type="per_sample"
            )
        ],
    )
    with hm.collect(deregister_on_exit=True):
        trainer.train()
    train_store.close()

    # (2) query gradients at the final weights, through the same hooks
    test_store = GradientStorageManager(str(work / "test_grads"))
    hm = HookManager(
        model,
        config=HookManagerConfig(linear_io=REGISTER_ALL),
        callbacks=[OffloadCallback(file_manager=test_store)],
    )
    batch = {k: torch.stack([t[k] for t in test]) for k in test[0]}
    with hm.collect(deregister_on_exit=True):
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    test_store.close()

    # (3) attribute from the cache: no model needed
    score = TracInAttributor(
        AttributionArguments(output_dir=str(work / "scores"))
    ).attribute_from_cache(str(work / "train_grads"), str(work / "test_grads"))
    train_ids, matrix = score.agnostic_matrix()
    print(f"scores: {tuple(matrix.shape)} (train x test), from {len(train_store)} offloaded steps")
    text_of = {hash_sample(x): t for x, (_, t) in zip(train, corpus)}
    for j, (_, text) in enumerate(corpus[48:52]):
        best = int(matrix[:, j].argmax())
        print(f"query: {text[:60]}...\n  top proponent: {text_of[train_ids[best]][:60]}...")


if __name__ == "__main__":
    main()
