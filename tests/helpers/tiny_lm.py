"""A tiny GPT-2 and a word-level tokenizer saved to a directory (offline), and a small corpus.

The model loads with ``AutoModelForCausalLM.from_pretrained(dir)`` and the tokenizer with
``AutoTokenizer.from_pretrained(dir)``, as ``dattri-llm capture`` / ``serve`` load them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INJECTIONS = (
    "cat <script>document.body.setAttribute('data-pwned','1')</script> purr",
    "ship \"><img src=x onerror=\"document.body.setAttribute('data-pwned','2')\"> sail",
)

TOPICS = {
    "cats": "cat kitten purr whisker meow fur paw milk",
    "ships": "ship sail harbor anchor captain deck wave port",
    "math": "number prime sum proof equation zero angle graph",
}


def corpus(n_per_topic: int = 6, seed: int = 0) -> list[str]:
    """Documents of three topics (word salads of each topic's words)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for words in TOPICS.values():
        w = words.split()
        for _ in range(n_per_topic):
            n = int(torch.randint(4, 12, (1,), generator=g))
            out.append(" ".join(w[int(i)] for i in torch.randint(len(w), (n,), generator=g)))
    return out


def vocabulary(extra: tuple[str, ...] = ()) -> list[str]:
    words = {w for ws in TOPICS.values() for w in ws.split()}
    words |= {w for text in extra for w in text.split()}
    return ["[PAD]", "[UNK]", "[BOS]", *sorted(words)]


def save_tiny_lm(directory: Path, seed: int = 0, extra_words: tuple[str, ...] = ()) -> Path:
    """Save a 2-layer GPT-2 (float32, dropout as configured: 0.1) and its tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary(extra_words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[BOS]"
    )
    torch.manual_seed(seed)
    cfg = GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=len(vocab), n_positions=32,
        bos_token_id=2, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)  # dropout stays on: capture must switch to eval mode itself
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


#: Prompts and completions the explorer tests ask (also captured as a query store).
QUERIES = [
    {"prompt": "cat kitten", "completion": "purr meow fur"},
    {"prompt": "", "completion": "ship sail harbor deck"},
    {"prompt": "number prime", "completion": "proof zero"},
]


def captured_stores(root: Path, docs: list[str]) -> tuple[Path, Path, Path]:
    """``(model dir, train store, query store)`` written by ``dattri-llm capture``: ``docs`` as
    the corpus, :data:`QUERIES` (one per batch) as the queries, ``sparse:256``."""
    from dattri_llm.cli import main

    model_dir = save_tiny_lm(root / "model")
    data = write_jsonl(root / "train.jsonl", [{"text": t} for t in docs])
    queries = write_jsonl(root / "queries.jsonl", QUERIES)
    common = ["--projection", "sparse:256", "--no-progress"]
    assert main(["capture", str(model_dir), str(data), "--out", str(root / "train"), *common]) == 0
    assert main(["capture", str(model_dir), str(queries), "--out", str(root / "query"),
                 "--prompt-field", "prompt", "--completion-field", "completion",
                 "--batch-size", "1", *common]) == 0  # fmt: skip
    return model_dir, root / "train", root / "query"
