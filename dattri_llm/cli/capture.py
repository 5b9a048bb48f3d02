"""``dattri-llm capture MODEL DATA --out STORE``: per-sample gradients of a corpus, no code."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from dattri_llm.cli._common import HelpFormatter, UsageError, add_progress_flag, show_progress

DESCRIPTION = """Load a causal language model and its tokenizer from MODEL (a directory that
transformers' AutoModelForCausalLM / AutoTokenizer.from_pretrained read), read the documents of
DATA and write each document's loss gradient at the model's weights to the gradient store --out,
ready for dattri-llm attribute / top / report / serve. Queries are captured the same way, into
their own store.

DATA: a JSON Lines (.jsonl), JSON (.json), CSV (.csv) or Parquet (.parquet) file, a folder
written by datasets' save_to_disk, or any other file read as plain text, one document per
paragraph (paragraphs are separated by blank lines).

A sample's loss is the sum of its tokens' cross-entropies (the model in eval mode, weights
fixed), computed per sample: the batch size changes nothing. With --text-field every token of
the document after the first carries loss; with --prompt-field and --completion-field only the
completion's tokens do (the prompt is the user turn of the tokenizer's chat template when it has
one). The store keeps each sample's text (texts.jsonl) and the capture settings (capture.json).

Interrupted (Ctrl-C)? Run the same command with --resume: finished batches are kept and
skipped. A store captured with another model, tokenizer, projection or layer set is refused.

Several processes: torchrun --nproc_per_node N -m dattri_llm capture MODEL DATA --out STORE ...
Every rank reads DATA and captures its share (the k-th new distinct sample goes to rank
k % N) into its own partition of STORE (rank_0/, rank_1/, ...); the store then holds the same
samples, texts and settings as a one-process capture, and --resume works the same way (with any
number of processes). --device cuda uses each rank's own GPU (cuda:LOCAL_RANK)."""


def add_parser(sub: Any) -> None:
    """Register the command."""
    from dattri_llm.gradient.causal_lm import DEFAULT_PROJECTION

    p = sub.add_parser(
        "capture",
        help="capture the per-sample gradients of a corpus (or of queries) into a store",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="a model directory (save_pretrained)")
    p.add_argument("data", metavar="DATA", help="the documents (see above)")
    p.add_argument("--out", required=True, metavar="STORE", help="the gradient store to write")
    p.add_argument("--text-field", metavar="NAME", help="the documents' column (default: text)")
    p.add_argument("--prompt-field", metavar="NAME", help="the prompts' column")
    p.add_argument(
        "--completion-field", metavar="NAME", help="the completions' column (the loss is on them)"
    )
    p.add_argument("--split", help="the split of a DatasetDict folder (default: its only one)")
    p.add_argument("--max-length", type=int, default=None, help="tokens kept per sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward/backward")
    p.add_argument(
        "--projection",
        default=DEFAULT_PROJECTION,
        help="per-layer random projection: sparse:N, dense:N, logra:AxB or none (exact)",
    )
    p.add_argument(
        "--layers",
        nargs="+",
        metavar="GLOB",
        default=None,
        help="only the layers whose module names match these globs, e.g. 'transformer.h.*' "
        "(default: every supported layer)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--device",
        default="cpu",
        help="torch device of the model ('cuda' under torchrun: each rank's own GPU)",
    )
    p.add_argument("--checkpoint", type=int, default=0, help="the checkpoint label of the records")
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted capture into --out"
    )
    add_progress_flag(p)
    p.set_defaults(run=run)


def load_model(path: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local directory; errors name ``MODEL``."""
    import torch

    if not os.path.isdir(path):
        raise UsageError("MODEL", f"{path!r} is not a directory (expected save_pretrained's).")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:  # pragma: no cover - depends on the install
        raise UsageError(
            "MODEL", 'loading a model needs transformers: pip install "dattri_llm[transformers]"'
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as e:
        raise UsageError("MODEL", f"{path!r} could not be loaded: {e}") from None
    return model.to(device).eval(), tokenizer


def _builder(path: str) -> str | None:
    """The ``datasets`` builder of a file (``None``: plain text)."""
    ext = os.path.splitext(path)[1].lower()
    return {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}.get(ext)


def _load_data(path: str, split: str | None) -> Any:
    import datasets

    if os.path.isdir(path):
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            names = list(data)
            if split is None and len(names) != 1:
                raise UsageError("--split", f"{path!r} holds the splits {names}: choose one.")
            if split is not None and split not in data:
                raise UsageError("--split", f"{split!r} is not a split of {path!r}: {names}.")
            data = data[split or names[0]]
        return data
    if not os.path.isfile(path):
        raise UsageError("DATA", f"{path!r} does not exist.")
    builder = _builder(path)
    kwargs: dict = {} if builder else {"sample_by": "paragraph"}
    try:
        return datasets.load_dataset(builder or "text", data_files=path, split="train", **kwargs)
    except Exception as e:  # datasets raises many types; the message says what is wrong
        raise UsageError(
            "DATA", f"{path!r} could not be read as {builder or 'text'}: {e}"
        ) from None


def samples(args: argparse.Namespace) -> tuple[Iterator[tuple[str, str, str]], int]:
    """``(text, prompt, completion)`` of each row of DATA, and their number."""
    data = _load_data(args.data, args.split)
    # a paragraph of a text file keeps its line breaks but not the blank line's newline
    plain = list(data.column_names) == ["text"] and not os.path.isdir(args.data)
    plain = plain and _builder(args.data) is None
    columns = list(data.column_names)
    pair = args.prompt_field is not None or args.completion_field is not None
    if pair and args.text_field is not None:
        raise UsageError("--text-field", "give it, or --prompt-field and --completion-field.")
    if pair:
        fields = [
            ("--prompt-field", args.prompt_field),
            ("--completion-field", args.completion_field),
        ]
    else:
        fields = [("--text-field", args.text_field or "text")]
    for flag, name in fields:
        if name is None:
            raise UsageError(flag, "--prompt-field and --completion-field go together.")
        if name not in columns:
            raise UsageError(flag, f"{name!r} is not a column of {args.data}: it has {columns}.")

    def rows() -> Iterator[tuple[str, str, str]]:
        for row in data:
            if pair:
                prompt, completion = str(row[args.prompt_field]), str(row[args.completion_field])
                yield f"{prompt}\n{completion}", prompt, completion
            else:
                text = str(row[fields[0][1]])
                text = text.strip() if plain else text
                yield text, "", text

    return rows(), len(data)


@contextlib.contextmanager
def _torchrun_group() -> Iterator[bool]:
    """A gloo process group while the command runs under ``torchrun`` (``WORLD_SIZE`` > 1).

    Yields whether a group is initialised. A group that the caller already formed is used
    as it is (and left open). The group only synchronises the ranks and sums their counts
    (no tensor of the model travels), so gloo serves CPU and GPU captures alike.
    """
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_initialized() or world <= 1:
        yield dist.is_initialized()
        return
    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's env
    try:
        yield True
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    with _torchrun_group() as distributed:
        if distributed and args.device == "cuda":  # one GPU per rank, as torchrun numbers them
            args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from dattri_llm.gradient.causal_lm import (
        CaptureSettings,
        capture_samples,
        model_digest,
        parse_projection,
        projection_spec,
        read_settings,
        tokenizer_digest,
    )
    from dattri_llm.gradient.store import GradientStorageManager

    for flag, value in (("--batch-size", args.batch_size), ("--max-length", args.max_length)):
        if value is not None and value < 2 - (flag == "--batch-size"):
            raise UsageError(flag, f"must be >= {2 - (flag == '--batch-size')}, got {value}.")
    try:
        projection = parse_projection(args.projection)
    except ValueError as e:
        raise UsageError("--projection", str(e)) from None
    rows, total = samples(args)
    model, tokenizer = load_model(args.model, args.dtype, args.device)
    pair = args.prompt_field is not None
    settings = CaptureSettings(
        model=model_digest(model),
        tokenizer=tokenizer_digest(tokenizer),
        projection=projection_spec(projection),
        layers=None if args.layers is None else tuple(args.layers),
        chat=pair and getattr(tokenizer, "chat_template", None) is not None,
        max_length=args.max_length,
        dtype=args.dtype,
        checkpoint=args.checkpoint,
        model_path=os.path.abspath(args.model),
    )
    store = GradientStorageManager(args.out, mode="append" if args.resume else "create")
    if len(store) and not args.resume:
        raise UsageError(
            "--out",
            f"{args.out!r} already holds {store.num_samples} captured samples: add --resume "
            "to continue that capture, or choose a new --out.",
        )
    if len(store):
        before = read_settings(args.out)
        if before is None:
            raise UsageError(
                "--resume", f"{args.out!r} was not written by dattri-llm capture (no capture.json)."
            )
        diffs = before.differences(settings, CaptureSettings.RESUME_KEYS)
        if diffs:
            raise UsageError(
                "--resume",
                f"{args.out!r} was captured with other settings (store vs now): "
                + "; ".join(diffs)
                + ". Resume with the same MODEL and options, or capture into a new --out.",
            )
    try:
        counts = capture_samples(
            model,
            tokenizer,
            rows,
            store,
            settings,
            batch_size=args.batch_size,
            show_progress=show_progress(args),
            total=total,
        )
    except KeyboardInterrupt:
        print(
            f"dattri-llm capture: the finished batches are kept in {args.out}; run the same "
            "command with --resume to continue.",
            file=sys.stderr,
        )
        raise
    except Exception as e:
        if "layers" in str(e) and args.layers:
            raise UsageError("--layers", str(e)) from None
        raise
    skipped = [
        f"{counts[k]} {what}"
        for k, what in (
            ("already", "already in the store"),
            ("repeated", "repeated"),
            (
                "empty",
                f"with no token to predict{' within --max-length' if args.max_length else ''}",
            ),
        )
        if counts[k]
    ]
    from dattri_llm.utils.distributed import get_rank

    if get_rank() != 0:  # the counts are the whole store's on every rank: one line is enough
        return 0
    proj = "none (exact)" if projection is None else args.projection
    print(
        f"captured {counts['captured']} samples into {args.out}"
        + (f" ({', '.join(skipped)} skipped)" if skipped else "")
        + f"; projection {proj}, layers {'all' if args.layers is None else args.layers}"
    )
    return 0
