"""Capture per-sample gradients from a TRL ``SFTTrainer`` run, then attribute from disk.

The training code is the stock ``SFTTrainer``: dattri_llm only adds one callback,
``AttributionCallback``, which stores each sample's gradient of its own summed token loss
(whatever ``num_items_in_batch`` and the accumulation do to SFT's token mean), one checkpoint
label per epoch; ``capture_queries`` captures the queries the same way at the final weights.
Offline: a tiny GPT-2 built from a config, a byte-level BPE tokenizer trained on the fly, and
short sentences of four of Python's documentation topics (``pydoc_data.topics``) as the SFT
dataset. Held-out sentences are then attributed to the training sentences with TracIn from the
two gradient stores.

Two things of ``SFTTrainer`` shape the capture (both explained where they are set below):

* its collator pads each batch to its longest row, and a sample's content hash covers its
  padded ``input_ids``: padding every batch to ``max_length`` (``pad_to_multiple_of``) gives a
  sample the same hash in every batch;
* it computes the loss with a fused LM head (a custom autograd function that uses
  ``lm_head.weight`` without calling the ``lm_head`` module), so hooks never see the head: the
  head is left out of the capture and the input embedding is untied from it.

    python examples/trainers/trl_sft.py
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    HookManagerConfig,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.integrations.hf_trainer import AttributionCallback

TOPICS = ("debugger", "comparisons", "formatstrings", "import")


def load_sentences(
    topics: Sequence[str] = TOPICS, min_words: int = 6, max_words: int = 16
) -> dict[str, list[str]]:
    """Short plain sentences of Python's documentation topics (standard library)."""
    from pydoc_data.topics import topics as pydoc_topics

    out: dict[str, list[str]] = {}
    for topic in topics:
        sentences = (" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", pydoc_topics[topic]))
        out[topic] = [
            s
            for s in sentences
            if min_words <= len(s.split()) <= max_words
            and re.fullmatch(r"[A-Za-z0-9 ,.;:'()_\-\"]+", s)
        ]
    return out


def build_tokenizer(texts: Sequence[str], vocab_size: int) -> object:
    """A byte-level BPE trained on ``texts``, wrapped as a Transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"], show_progress=False
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_model(tokenizer: object, seq_len: int, dtype: torch.dtype) -> torch.nn.Module:
    """A 2-layer, width-64 GPT-2 without dropout and with an untied LM head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=64,
        vocab_size=len(tokenizer),
        n_positions=seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # the fused LM head of TRL is invisible to hooks (see the module docstring); untied,
        # the input embedding is still captured exactly
        tie_word_embeddings=False,
    )
    return GPT2LMHeadModel(config).to(dtype)


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the example; returns what the test checks (paths, hashes, scores, weights)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-topic", type=int, default=12, help="train sentences per topic")
    parser.add_argument("--queries-per-topic", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=str,
        default=None,
        help="Trainer output, stores and scores (default: a temp dir, removed at exit)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dattri_llm_trl_sft_") as tmp:
        work = Path(args.workdir or tmp)
        kept = "" if args.workdir else " (temporary, removed at exit: --workdir DIR keeps them)"
        print(f"Trainer output, stores and scores go to {work}{kept}")
        return run(args, work)


def run(args: argparse.Namespace, work: Path) -> dict:
    """The example itself; everything is written under ``work``."""
    t0 = time.perf_counter()

    import datasets
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    by_topic = load_sentences()
    need = args.per_topic + args.queries_per_topic
    for topic, sents in by_topic.items():
        if len(sents) < need:
            raise ValueError(f"--per-topic + --queries-per-topic = {need} > {len(sents)} ({topic})")
    train = [(t, s) for t, sents in by_topic.items() for s in sents[: args.per_topic]]
    queries = [(t, s) for t, sents in by_topic.items() for s in sents[args.per_topic : need]]
    tokenizer = build_tokenizer([s for sents in by_topic.values() for s in sents], 384)
    model = build_model(tokenizer, args.seq_len, dtype)
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    for store_dir in ("train_grads", "test_grads"):
        if (work / store_dir).exists():  # a store appends: a second run would mix in the first
            raise FileExistsError(f"--workdir {work} already holds {store_dir}; pass a new one.")
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(
            output_dir=str(work / "run"),
            max_length=args.seq_len,
            # a sample's hash covers its padded input_ids: pad every batch to the same length
            pad_to_multiple_of=args.seq_len,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.grad_accum,
            num_train_epochs=args.epochs,
            learning_rate=args.lr,
            seed=args.seed,
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_dict({"text": [s for _, s in train]}),
        processing_class=tokenizer,
    )

    # (1) one callback: per-sample gradients of each sample's summed token loss go to disk
    capture = AttributionCallback(
        work / "train_grads", config=HookManagerConfig(linear_io=REGISTER_ALL, exclude=[r"lm_head"])
    )
    trainer.add_callback(capture)
    trainer.train()
    train_store = capture.store

    # the hash of each training row, as the collator pads it
    def padded(ids: Sequence[int]) -> torch.Tensor:
        ids = list(ids)[: args.seq_len]
        return torch.tensor(ids + [tokenizer.pad_token_id] * (args.seq_len - len(ids)))

    rows = trainer.train_dataset["input_ids"]
    train_hashes = [hash_sample({"input_ids": padded(ids)}) for ids in rows]

    # (2) query gradients at the final weights: eval mode, same loss, layers and label
    ids = [padded(tokenizer(s)["input_ids"] + [tokenizer.eos_token_id]) for _, s in queries]
    capture.capture_queries(
        model,
        [{"input_ids": i, "attention_mask": (i != tokenizer.pad_token_id).long()} for i in ids],
        work / "test_grads",
    )

    # (3) attribute from the cache: no model needed
    score = TracInAttributor(
        AttributionArguments(output_dir=str(work / "scores"), show_progress=False)
    ).attribute_from_cache(str(work / "train_grads"), str(work / "test_grads"))
    scores = score.query(train_hashes)  # (train, query), rows in dataset order
    hits = 0
    for j, (topic, text) in enumerate(queries):
        top = int(scores[:, j].argmax())
        hits += train[top][0] == topic
        if j < 4:
            best_topic, best_text = train[top]
            print(f"query [{topic}] {text[:56]}\n  top proponent [{best_topic}] {best_text[:56]}")
    share = hits / len(queries)
    seconds = time.perf_counter() - t0
    print(
        f"{len(train_store)} offloaded micro-batches, {train_store.num_samples} per-sample "
        f"gradients; top proponent from the query's topic: {share:.0%} "
        f"(chance {1 / len(TOPICS):.0%}); {seconds:.1f} s"
    )
    return {
        "workdir": str(work),
        "train_dir": str(work / "train_grads"),
        "test_dir": str(work / "test_grads"),
        "train": train,
        "queries": queries,
        "train_hashes": train_hashes,
        "scores": scores,
        "topic_share": share,
        "initial_state": initial_state,
        "model_config": model.config,
        "tokenizer": tokenizer,
        "seq_len": args.seq_len,
        "epochs": args.epochs,
        "grad_accum": args.grad_accum,
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
