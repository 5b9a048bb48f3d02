"""Capture per-sample gradients from a Hugging Face ``Trainer`` run, then attribute from disk.

The training code is the stock ``Trainer``: dattri_llm only adds one callback,
``AttributionCallback``, which stores each sample's gradient of its own summed token loss
(whatever the padding and the accumulation do to the batch mean), one checkpoint label per
epoch; ``capture_queries`` captures the queries the same way at the final weights. Offline: a
tiny GPT-2 built from a config and a byte-level tokenizer trained on the fly on Python's
documentation topics.

    python examples/trainers/hf_trainer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from dattri_llm import AttributionArguments, TracInAttributor, hash_sample
from dattri_llm.demo import load_corpus
from dattri_llm.integrations.hf_trainer import AttributionCallback

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
    model.loss_type = "ForCausalLM"  # the default, declared (transformers says so otherwise)
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

    # (1) one callback: per-sample gradients go to disk as it trains, a label per epoch
    capture = AttributionCallback(work / "train_grads")  # per_sample_loss="sum"
    trainer.add_callback(capture)
    trainer.train()

    # (2) query gradients at the final weights: eval mode, same loss, layers and label
    capture.capture_queries(model, [encode(t) for _, t in corpus[48:52]], work / "test_grads")

    # (3) attribute from the cache: no model needed
    score = TracInAttributor(
        AttributionArguments(output_dir=str(work / "scores"))
    ).attribute_from_cache(str(work / "train_grads"), str(work / "test_grads"))
    train_ids, matrix = score.agnostic_matrix()
    print(f"scores: {tuple(matrix.shape)} (train x test), from {len(capture.store)} records")
    text_of = {hash_sample(x): t for x, (_, t) in zip(train, corpus)}
    for j, (_, text) in enumerate(corpus[48:52]):
        best = int(matrix[:, j].argmax())
        print(f"query: {text[:60]}...\n  top proponent: {text_of[train_ids[best]][:60]}...")


if __name__ == "__main__":
    main()
