"""A real attribution, offline, in about a minute on two CPU cores.

The corpus is Python's own documentation topics (``pydoc_data.topics``, shipped with the
standard library): paragraphs of eight topics (format strings, the debugger, ``import``, ...).
A small GPT-2 is built from a config with a byte-level BPE tokenizer trained on the fly and
trained on the paragraphs; then a :class:`~dattri_llm.HookManager` with an
:class:`~dattri_llm.OffloadCallback` writes every paragraph's per-sample gradient at the final
weights to disk (one ordinary forward/backward pass, no optimizer step). Held-out paragraphs
are attributed from the cache with Grad-Cos (``TracInAttributor(normalized_grad=True)``): a
score is the cosine between a training paragraph's loss gradient and the query's, in
``[-1, 1]``. For each query the demo prints its top proponents and the share of top-k
proponents that come from the query's own topic.

Run it with ``python -m dattri_llm demo`` (needs the ``transformers`` extra).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "run", "add_arguments", "load_corpus", "build_tokenizer"]

TOPICS = (
    "formatstrings",
    "debugger",
    "import",
    "try",
    "typesmapping",
    "comparisons",
    "execmodel",
    "string-methods",
)


def load_corpus(topics: Sequence[str] = TOPICS, min_words: int = 25) -> list[tuple[str, str]]:
    """Paragraphs ``(topic, text)`` of Python's documentation topics (standard library)."""
    from pydoc_data.topics import topics as pydoc_topics

    out = []
    for topic in topics:
        for para in re.split(r"\n\s*\n", pydoc_topics[topic]):
            text = " ".join(para.split())
            if len(text.split()) >= min_words and not set(text) <= set("*=- "):
                out.append((topic, text))
    return out


def build_tokenizer(texts: Sequence[str], vocab_size: int) -> object:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (offline, no download).

    Args:
        texts: Training text.
        vocab_size: Target vocabulary size (special tokens included).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>"], show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``python -m dattri_llm demo`` and :func:`main`)."""
    parser.add_argument("--per-topic", type=int, default=36, help="train paragraphs per topic")
    parser.add_argument(
        "--queries-per-topic", type=int, default=4, help="held-out query paragraphs per topic"
    )
    parser.add_argument("--seq-len", type=int, default=48, help="tokens per paragraph")
    parser.add_argument("--epochs", type=int, default=4, help="training epochs")
    parser.add_argument("--batch-size", type=int, default=16, help="training batch size")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--top-k", type=int, default=5, help="proponents per query")
    parser.add_argument("--show", type=int, default=6, help="queries printed in full")
    parser.add_argument(
        "--workdir",
        type=str,
        default=None,
        help="keep the gradient stores and the texts (JSON Lines) there, ready for the other "
        "dattri-llm commands (default: a temporary directory, removed at exit)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="then open the attribution explorer (dattri-llm serve) on the tiny model and its "
        "training paragraphs, at http://127.0.0.1:PORT/ (needs the serve extra)",
    )
    parser.add_argument("--port", type=int, default=8000, help="the explorer's port (--serve)")
    parser.add_argument(
        "--layers",
        choices=("all", "blocks"),
        default="all",
        help="hook every layer, or only the transformer blocks' linears",
    )


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the demo; returns a summary (``topic_share``, chance level, timings)."""
    parser = argparse.ArgumentParser(prog="dattri-llm demo", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Run the demo with parsed options (see :func:`add_arguments`)."""
    with tempfile.TemporaryDirectory(prefix="dattri_llm_demo_") as tmp:
        return _run(args, Path(args.workdir or tmp))


def _run(args: argparse.Namespace, workdir: Path) -> dict:
    import torch
    from torch import nn

    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(
            'the demo needs the transformers extra: pip install -e ".[transformers]"'
        ) from e
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

    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    corpus = load_corpus()
    by_topic: dict[str, list[str]] = {}
    for topic, text in corpus:
        by_topic.setdefault(topic, []).append(text)
    tok = build_tokenizer([t for _, t in corpus], vocab_size=2048)
    gen = torch.Generator().manual_seed(args.seed)
    train, queries = [], []
    for topic, paras in by_topic.items():
        order = torch.randperm(len(paras), generator=gen).tolist()
        q = order[: args.queries_per_topic]
        tr = order[args.queries_per_topic : args.queries_per_topic + args.per_topic]
        queries += [(topic, paras[i]) for i in q]
        train += [(topic, paras[i]) for i in tr]

    def encode(text: str) -> torch.Tensor:
        ids = tok.encode(text).ids[: args.seq_len]
        return torch.tensor(ids + [0] * (args.seq_len - len(ids)))

    # paragraphs identical within the first seq_len tokens would be one sample: keep one each
    train_items, unique, seen = [], [], set()
    for topic, text in train:
        item = {"input_ids": encode(text)}
        h = hash_sample(item)
        if h not in seen:
            seen.add(h)
            train_items.append(item)
            unique.append((topic, text))
    dropped, train = len(train) - len(unique), unique
    query_items = [{"input_ids": encode(t)} for _, t in queries]

    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=4,
        n_embd=128,
        vocab_size=2048,
        n_positions=args.seq_len,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        labels = batch.masked_fill(batch == 0, -100)  # padding contributes nothing
        out = model(input_ids=batch, attention_mask=(batch != 0).long())
        logits = out.logits[:, :-1]
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=-100,
            reduction="sum",
        ) / max(1, batch.shape[0])

    ids = torch.stack([x["input_ids"] for x in train_items])
    store = GradientStorageManager(str(workdir / "train_grads"))
    layers = HookManagerConfig(
        linear_io=REGISTER_ALL
        if args.layers == "all"
        else [r"transformer\.h\.\d+\.(attn|mlp)\.c_(attn|proj|fc)"],
        capture_style="auto",  # keep whichever of factors / dense gradient is smaller
    )
    print(
        f"corpus: {len(train)} training paragraphs"
        + (
            f" ({dropped} identical in their first {args.seq_len} tokens dropped)"
            if dropped
            else ""
        )
        + f" and {len(queries)} held-out queries from "
        f"{len(by_topic)} Python documentation topics; GPT-2 2x128 from a config"
    )
    kept = " (temporary, removed at exit; --workdir DIR keeps them)" if args.workdir is None else ""
    print(f"per-sample gradients go to {workdir}{kept}")
    for epoch in range(args.epochs):
        perm = torch.randperm(len(ids), generator=gen)
        total = 0.0
        for i in range(0, len(ids), args.batch_size):
            batch = ids[perm[i : i + args.batch_size]]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(batch)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(batch)
        print(f"epoch {epoch + 1}: train loss {total / len(ids):.3f}")

    # Grad-Cos reads one set of weights: capture every training paragraph at the final ones
    # (a pass with no optimizer step; the same hooks would capture inside a training loop)
    hm = HookManager(
        model,
        config=layers,
        callbacks=[
            OffloadCallback(  # factors kept: the workdir serves kfac / token-level runs too
                offload_interval=1,
                file_manager=store,
                recording_type="per_sample",
                keep_token_factors=True,
            )
        ],
    )
    with hm.collect(deregister_on_exit=True):
        for i in range(0, len(ids), args.batch_size):
            model.zero_grad(set_to_none=True)
            loss_fn(ids[i : i + args.batch_size]).backward()
    model.zero_grad(set_to_none=True)
    print(f"per-sample gradients of the {len(ids)} training paragraphs offloaded")

    test_store = GradientStorageManager(str(workdir / "query_grads"))
    hm = HookManager(
        model,
        config=layers,
        callbacks=[
            OffloadCallback(
                offload_interval=1, file_manager=test_store, recording_type="per_sample"
            )
        ],
    )
    qids = torch.stack([x["input_ids"] for x in query_items])
    with hm.collect(deregister_on_exit=True):
        model.zero_grad(set_to_none=True)
        loss_fn(qids).backward()  # query gradients at the final weights
    model.zero_grad(set_to_none=True)
    for s in (store, test_store):
        if hasattr(s, "close"):
            s.close()

    attributor = TracInAttributor(
        AttributionArguments(output_dir=str(workdir / "scores"), show_progress=_terminal()),
        normalized_grad=True,
    )
    score = attributor.attribute_from_cache(
        str(workdir / "train_grads"), str(workdir / "query_grads")
    )
    train_ids, matrix = score.agnostic_matrix()
    print(
        "method: Grad-Cos at the final weights (TracInAttributor(normalized_grad=True)); each "
        "score is the cosine, in [-1, 1], between a training paragraph's loss gradient and the "
        "query's (positive: the paragraph helped the query)"
    )
    text_of = {hash_sample(x): (topic, text) for x, (topic, text) in zip(train_items, train)}
    query_hashes = [hash_sample(x) for x in query_items]
    col = (
        {h: i for i, h in enumerate(score.test_hashes)}
        if hasattr(score, "test_hashes")
        else {h: i for i, h in enumerate(query_hashes)}
    )
    per_topic: dict[str, list[int]] = {}
    for n, ((topic, text), qh) in enumerate(zip(queries, query_hashes)):
        column = matrix[:, col[qh]]
        top = column.topk(args.top_k).indices.tolist()
        tops = [text_of[train_ids[i]] for i in top]
        same = sum(t == topic for t, _ in tops)
        per_topic.setdefault(topic, []).append(same)
        if n % args.queries_per_topic == 0 and n // args.queries_per_topic < args.show:
            print(f"\nquery [{topic}] {text[:90]}...")
            for rank, (i, (t, tx)) in enumerate(zip(top, tops), 1):
                print(f"  {rank}. {float(column[i]):+.3f} [{t}] {tx[:80]}...")
            print(f"  -> {same}/{args.top_k} top proponents share the query's topic")
    print(f"\nshare of top-{args.top_k} proponents from the query's own topic, per topic:")
    for topic, counts in per_topic.items():
        print(f"  {topic:<16} {sum(counts) / (len(counts) * args.top_k):>5.0%}")
    hits = sum(sum(c) for c in per_topic.values())
    share = hits / (len(queries) * args.top_k)
    chance = 1 / len(by_topic)
    elapsed = time.perf_counter() - t0
    print(f"overall: {share:.0%} (chance: {chance:.0%}); {elapsed:.0f} s")
    if args.workdir is not None:
        _write_texts(workdir / "train_texts.jsonl", train_items, train, hash_sample)
        _write_texts(workdir / "query_texts.jsonl", query_items, queries, hash_sample)
        w = workdir
        print(
            f"\ngradient stores and texts kept in {w}; explore them with the command line:\n"
            f"  dattri-llm inspect {w / 'train_grads'} --verify\n"
            f"  dattri-llm attribute --method grad-cos --train {w / 'train_grads'} "
            f"--test {w / 'query_grads'} --out {w / 'scores'}\n"
            f"  dattri-llm top {w / 'scores'} --texts {w / 'train_texts.jsonl'} --k 5\n"
            f"  dattri-llm report {w / 'scores'} --train-texts {w / 'train_texts.jsonl'} "
            f"--test-texts {w / 'query_texts.jsonl'} -o {w / 'report.html'}"
        )
    summary = {"topic_share": share, "chance": chance, "seconds": elapsed, "workdir": str(workdir)}
    if getattr(args, "serve", False):
        summary.update(_explorer_files(model, tok, train, workdir, args.seq_len))
    return summary


def _explorer_files(model, tok, train: list[tuple[str, str]], workdir: Path, seq_len: int) -> dict:
    """Save the model and its tokenizer; capture the paragraphs as ``dattri-llm capture`` would.

    That is what ``dattri-llm serve`` reads (``demo --serve``).
    """
    from transformers import PreTrainedTokenizerFast

    from dattri_llm.gradient.causal_lm import (
        DEFAULT_PROJECTION,
        CaptureSettings,
        capture_samples,
        model_digest,
        parse_projection,
        projection_spec,
        tokenizer_digest,
    )
    from dattri_llm.gradient.store import GradientStorageManager

    model_dir, store_dir = workdir / "model", workdir / "explorer_train"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    settings = CaptureSettings(
        model=model_digest(model),
        tokenizer=tokenizer_digest(tokenizer),
        projection=projection_spec(parse_projection(DEFAULT_PROJECTION)),
        layers=None,
        max_length=seq_len,
        model_path=str(model_dir),
    )
    store = GradientStorageManager(store_dir, mode="overwrite")
    rows = [(text, "", text) for _, text in train]
    counts = capture_samples(model, tokenizer, rows, store, settings, show_progress=_terminal())
    print(f"explorer: {counts['captured']} paragraphs captured into {store_dir}")
    return {"model_dir": str(model_dir), "explorer_store": str(store_dir)}


def _write_texts(path: Path, items: list[dict], texts: list[tuple[str, str]], hash_fn) -> None:
    """JSON Lines ``{"id", "text", "topic"}`` for ``dattri-llm top`` / ``report``."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        for item, (topic, text) in zip(items, texts):
            f.write(json.dumps({"id": hash_fn(item), "text": text, "topic": topic}) + "\n")


def _terminal() -> bool:
    """Progress bars only on a terminal (they are noise in a log or a pipe)."""
    return sys.stderr.isatty()
