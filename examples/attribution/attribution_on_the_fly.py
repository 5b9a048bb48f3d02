"""Attribution on-the-fly: the specification's opening example, fully offline.

A tiny GPT-2 built from a config stands in for the pretrained one, and a byte-level BPE
tokenizer is trained on the fly on Python's own documentation (``pydoc_data.topics``), so no
model hub is needed. The attributor streams per-sample gradients live (one forward and one
backward per batch, with the model frozen so no weight gradient is formed) and scores them;
nothing is written to disk.

    OMP_NUM_THREADS=1 python examples/attribution/attribution_on_the_fly.py
"""

from __future__ import annotations

from pydoc_data.topics import topics

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor


def offline_tokenizer(vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained in a second on the standard library's docs."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(topics.values(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def main() -> None:
    torch.manual_seed(0)
    tok = offline_tokenizer()
    tok.pad_token = tok.eos_token
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=64,
            n_positions=64,
            vocab_size=len(tok),
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )

    def encode(*texts):
        ids = tok(
            list(texts), padding="max_length", truncation=True, max_length=32, return_tensors="pt"
        )["input_ids"]
        return [{"input_ids": i} for i in ids]

    train_set = encode(
        "Influence functions trace a model's predictions back to its training data.",
        "Preheat the oven and mix flour, sugar, and butter until crumbly.",
    )
    val_set = encode("Which training examples shaped this language model's behavior?")

    def loss_fn(model, batch):  # (model, batch) -> loss, evaluated on the live model
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss * len(ids)

    task = AttributionTask(loss_func=loss_fn, model=model)  # scores at the current weights
    attributor = TracInAttributor(
        AttributionArguments(output_dir="scores", use_cpu=True, show_progress=False), task=task
    )
    score = attributor.attribute(train_set, val_set)
    train_ids, matrix = score.agnostic_matrix()
    print(matrix)  # (num_train, num_val) influence scores
    assert matrix.shape == (2, 1) and torch.isfinite(matrix).all()
    # scores are keyed by content: look samples up by identity, whatever their position
    assert torch.equal(score.query(train_set[::-1], val_set), matrix.flip(0))


if __name__ == "__main__":
    main()
