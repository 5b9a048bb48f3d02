"""Token-level attribution: which training tokens raised or lowered a query's loss. Offline.

1. A tiny GPT-2 (from a config) with a byte-level BPE tokenizer trained on the fly is trained
   briefly on paragraphs of Python's own documentation (``pydoc_data.topics``).
2. ``TracInAttributor(...).attribute(train, test, attribution_granularity="token")`` splits
   every (train sample, query) score over the train sample's token positions. The split is
   exact: a layer's per-sample gradient is a sum over positions of ``g_t a_t^T``, so each
   position's share of the inner product is computed from the factors. The script asserts that
   the token scores sum to the instance scores and that padding scores exactly zero.
3. For the top proponents and the top opponent of each query it prints a terminal heatmap
   (green: training on the token lowers the query's loss; red: it raises it) and writes the
   same as a self-contained HTML page (hover a token for its score).

    OMP_NUM_THREADS=1 python examples/attribution/token_attribution.py [--out DIR] [--no-color]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
from dattri_llm.attribution.views.token_view import (
    TokenHeatmap,
    terminal_heatmap,
    token_window,
    write_html,
)
from dattri_llm.demo import load_corpus
from dattri_llm.utils.hashing import hash_sample

SEQ = 40
TOPICS = ("formatstrings", "debugger", "import", "try")


def offline_tokenizer(texts: list[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained in a second on the given texts."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tok.pad_token = tok.eos_token
    return tok


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    """Sum over the batch of each sample's mean next-token loss (padding excluded)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return (per_token.sum(1) / (labels != -100).sum(1).clamp_min(1)).sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="scores and HTML page (default: a temp dir, removed at exit)"
    )
    parser.add_argument("--top-k", type=int, default=2, help="proponents shown per query")
    parser.add_argument("--queries", type=int, default=2, help="queries printed")
    parser.add_argument(
        "--no-color",
        action="store_true",
        help="plain-text heatmaps (the default when stdout is not a terminal or NO_COLOR is set)",
    )
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dattri_llm_tokens_") as tmp:
        out = opts.out or tmp
        kept = "" if opts.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"scores and the HTML page go to {out}{kept}")
        run(opts, out)


def run(opts: argparse.Namespace, out: str) -> None:
    """Train, attribute per token, print heatmaps and write the page under ``out``."""
    color = False if opts.no_color else None  # None: colours only on a terminal, no NO_COLOR
    start = time.perf_counter()
    torch.manual_seed(0)

    corpus = load_corpus(TOPICS)  # (topic, paragraph) pairs of the standard library's docs
    tok = offline_tokenizer([text for _, text in corpus])
    by_topic: dict[str, list[str]] = {}
    for topic, text in corpus:
        by_topic.setdefault(topic, []).append(text)
    train = [(topic, t) for topic in TOPICS for t in by_topic[topic][1:7]]  # 6 per topic
    train_topics, train_texts = [t for t, _ in train], [x for _, x in train]
    query_texts = [by_topic[topic][0] for topic in TOPICS]  # one held-out paragraph per topic

    def encode(texts: list[str]) -> tuple[list[dict], list[list[str]]]:
        """Samples, and the text of each real token (from the tokenizer's offsets)."""
        enc = tok(
            texts,
            padding="max_length",
            truncation=True,
            max_length=SEQ,
            return_tensors="pt",
            return_offsets_mapping=True,
        )
        samples, pieces = [], []
        for text, ids, mask, offsets in zip(
            texts, enc["input_ids"], enc["attention_mask"], enc["offset_mapping"]
        ):
            samples.append({"input_ids": ids, "attention_mask": mask})
            # (two byte-level tokens of one multi-byte character both show that character)
            pieces.append([text[a:b] for a, b in offsets[: int(mask.sum())].tolist()])
        return samples, pieces

    (train_set, train_tokens), (test_set, _) = encode(train_texts), encode(query_texts)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=64,
            n_positions=SEQ,
            vocab_size=len(tok),
            bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = {k: torch.stack([s[k] for s in train_set]) for k in train_set[0]}
    for _ in range(25):  # a short plain training run
        opt.zero_grad()
        loss_fn(model, batch).backward()
        opt.step()
    model.eval()

    args = AttributionArguments(
        output_dir=f"{out}/scores",
        use_cpu=True,
        show_progress=False,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
    )
    task = AttributionTask(loss_func=loss_fn, model=model)
    score = TracInAttributor(args, task=task).attribute(
        train_set, test_set, attribution_granularity="token"
    )
    # the instance scores of a plain (sample-granularity) run: another code path
    instance = TracInAttributor(args, task=task).attribute(train_set, test_set)
    matrix = instance.query(train_set, test_set)  # (num_train, num_test), by content hash

    # token scores sum to the instance scores; padding (and the last real token, whose target
    # is padding) scores exactly zero
    worst = 0.0
    for sample, tokens, row in zip(train_set, train_tokens, matrix):
        positions, ts = score.token_scores(sample)  # (T,), (T, num_test)
        worst = max(worst, float((ts.sum(0) - row).abs().max() / matrix.abs().max()))
        assert torch.all(ts[len(tokens) - 1 :] == 0), "padding must score exactly zero"
    print(f"token scores sum to instance scores: max relative difference {worst:.1e}")
    assert worst <= 1e-5, worst

    row_of = {hash_sample(sample): i for i, sample in enumerate(train_set)}
    top = score.top_k(opts.top_k)
    heatmaps: list[TokenHeatmap] = []
    lines: list[tuple[int, str, list[str], torch.Tensor]] = []
    shown = min(opts.queries, len(query_texts))
    for j in range(shown):
        picks = [
            ("proponent", h, s) for h, s in zip(top.proponent_hashes[j], top.proponent_scores[j])
        ]
        picks.append(("opponent", top.opponent_hashes[j][0], top.opponent_scores[j][0]))
        for kind, h, s in picks:
            i = row_of[h]
            tokens = train_tokens[i]
            per = score.token_scores(h)[1]
            token_scores = per[token_window(tokens, per), j]  # placed by padding, not cut
            head = f"{kind}: train #{i} ({train_topics[i]}), score {float(s):+.3e}"
            lines.append((j, head, tokens, token_scores))
            note = f"query {j} ({TOPICS[j]}): {query_texts[j]}"
            heatmaps.append(TokenHeatmap(f"query {j} <- {head}", tokens, token_scores, note=note))

    scale = max(float(t.abs().max()) for *_, t in lines)  # one colour scale for every line
    print("green: training on the token lowers the query's loss; red: it raises it\n")
    for j in range(shown):
        print(f"query {j} ({TOPICS[j]}): {query_texts[j][:90]!r}...")
        for _, head, tokens, ts in (line for line in lines if line[0] == j):
            print(f"  {head}")
            print("   ", terminal_heatmap(tokens, ts, scale=scale, color=color))
        print()

    page = write_html(
        os.path.join(out, "token_attribution.html"),
        heatmaps,
        title="Token-level TracIn on a tiny GPT-2",
        description=(
            "Each train sample's tokens coloured by their share of the sample's TracIn score "
            "for the query (the shares sum to the score)."
        ),
        scale=scale,
    )
    print(f"HTML heatmap: {page}")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
