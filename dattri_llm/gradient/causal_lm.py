"""Per-sample gradients of texts under a causal language model, written to a store.

What ``dattri-llm capture`` and :class:`~dattri_llm.Explorer` share, so that a query gradient
computed live lives in the same space as the captured training gradients:

* **a sample** is a prompt and a completion: token ids ``prompt_ids + completion_ids``, the loss
  on the completion's tokens only. A plain document is the completion of an empty prompt (every
  token after the first is predicted). The prompt is tokenized with the tokenizer's special
  tokens (e.g. a BOS), the completion without; with ``chat=True`` the prompt is the user turn of
  the tokenizer's chat template, with the generation prompt added. Nothing is appended (no EOS).
  ``max_length`` cuts the ids from the right.
* **the loss** of a sample is the *sum* of its tokens' cross-entropies (float32 logits), and a
  batch's loss is the sum over its samples: each sample's captured gradient is its own, whatever
  the batch (right padding, masked, contributes nothing), with no reweighting by token counts.
  The model is in eval mode (no dropout) at fixed weights (no optimizer step).
* **the capture settings** (:class:`CaptureSettings`): a digest of the model's weights and of
  the tokenizer, the projection, the layer patterns, the sample format and the dtype. They are
  written into the store directory as ``capture.json`` (next to ``texts.jsonl``: one
  ``{"id": sample hash, "text": ...}`` per captured sample); resuming a capture, or computing a
  query against the store, refuses different settings naming each difference.

A sample is identified by the content hash of its ``input_ids`` and ``labels``
(:func:`~dattri_llm.hash_sample`), so the same text as a prompt and as a completion are two
samples. The digest of the weights reads every parameter once (seconds for a 7B model).

Under an initialised ``torch.distributed`` group (``torchrun``) every rank reads every sample
and captures its share: the ``k``-th new distinct sample, in data order, goes to rank
``k % world_size``. Each rank writes its own ``rank_N/`` partition (and its texts there, folded
into the store's ``texts.jsonl`` when the capture ends), so the store holds the samples, texts
and settings of a one-process capture.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.gradient import GradientRecord
from dattri_llm.gradient.hooks import REGISTER_ALL, HookManagerConfig
from dattri_llm.gradient.ops.projection import ProjectionConfig
from dattri_llm.gradient.streaming import GradientStreamer, sample_id
from dattri_llm.utils.distributed import (
    all_reduce_sum,
    barrier,
    get_rank,
    get_world_size,
    is_distributed,
)
from dattri_llm.utils.files import atomic_write
from dattri_llm.utils.progress import progress_bar

__all__ = [
    "MANIFEST_FILE",
    "TEXTS_FILE",
    "IGNORE_INDEX",
    "HASH_KEYS",
    "DEFAULT_PROJECTION",
    "CaptureSettings",
    "CaptureMismatchError",
    "parse_projection",
    "projection_spec",
    "encode_prompt",
    "encode_sample",
    "pad_batch",
    "summed_loss",
    "model_digest",
    "tokenizer_digest",
    "hook_config",
    "read_settings",
    "read_texts",
    "fold_texts",
    "capture_samples",
]

#: The capture settings, in the store directory.
MANIFEST_FILE = "capture.json"
#: The captured samples' texts, in the store directory: ``{"id": hash, "text": ...}`` per line.
TEXTS_FILE = "texts.jsonl"
#: The label of a token that carries no loss (the prompt, the padding).
IGNORE_INDEX = -100
#: The fields a sample's hash covers.
HASH_KEYS = ("input_ids", "labels")
#: The default projection: a sparse JL sketch of 1024 numbers per layer. Every layer type
#: accepts it (norms and tied embeddings included) and it needs no optional dependency.
DEFAULT_PROJECTION = "sparse:1024"


class CaptureMismatchError(ValueError):
    """A capture's settings differ from a store's (resume, or a live query against it)."""


def parse_projection(spec: str) -> ProjectionConfig | None:
    """A projection from ``"sparse:N"``, ``"dense:N"``, ``"logra:AxB"`` or ``"none"``.

    ``logra:AxB`` projects the activation side of each layer to ``A`` and the output-gradient
    side to ``B`` numbers (``A*B`` per layer); the seed is 0.

    Raises:
        ValueError: naming the accepted forms.
    """
    forms = "'sparse:N', 'dense:N', 'logra:AxB' or 'none'"
    text = spec.strip().lower()
    if text == "none":
        return None
    style, _, size = text.partition(":")
    try:
        if style == "logra":
            a, _, b = size.partition("x")
            return ProjectionConfig("logra", proj_dim_in=int(a), proj_dim_out=int(b))
        if style in ("sparse", "dense"):
            return ProjectionConfig(style, int(size))
    except ValueError as e:
        raise ValueError(f"projection {spec!r}: {e} (expected {forms}).") from None
    raise ValueError(f"projection {spec!r} is not one of {forms}.")


def projection_spec(projection: ProjectionConfig | None) -> dict | None:
    """The JSON form of a projection kept in :class:`CaptureSettings`."""
    return None if projection is None else projection.to_dict()


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = False) -> list[int]:
    """A prompt's token ids: with the tokenizer's special tokens, or as a chat user turn.

    Args:
        tokenizer: A Hugging Face tokenizer.
        prompt: The prompt.
        chat: Format it as a user turn of the tokenizer's chat template, with the generation
            prompt added.
    """
    if chat:
        return list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def encode_sample(
    tokenizer: Any,
    prompt: str,
    completion: str,
    *,
    chat: bool = False,
    max_length: int | None = None,
) -> dict[str, torch.Tensor] | None:
    """``{"input_ids", "labels"}`` (1-D) of one sample; ``None`` when no token is predicted.

    Args:
        tokenizer: A Hugging Face tokenizer.
        prompt: The context (``""`` for a plain document).
        completion: The text the loss is on.
        chat: Format the prompt as a user turn of the tokenizer's chat template.
        max_length: Keep at most this many tokens (from the start).
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat=chat)
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    ids = prompt_ids + completion_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    # the first token is never predicted: a sample needs a labelled token after it
    if not any(t != IGNORE_INDEX for t in labels[1:]):
        return None
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


def pad_batch(pad_id: int) -> Any:
    """A collate: right-pads ``input_ids`` with ``pad_id`` and ``labels`` with the ignore index.

    Right padding keeps every real token's attention and positions as in a batch of one.
    """

    def collate(items: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        n = max(len(x["input_ids"]) for x in items)
        ids = torch.full((len(items), n), pad_id, dtype=torch.long)
        labels = torch.full((len(items), n), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(items), n), dtype=torch.long)
        for i, x in enumerate(items):
            t = len(x["input_ids"])
            ids[i, :t], labels[i, :t], mask[i, :t] = x["input_ids"], x["labels"], 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    return collate


def summed_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The sum over the batch's samples of each sample's summed token cross-entropy."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # shift the labels, not the logits: slicing off the last position would copy the
    # (tokens x vocabulary) logits forward and back (~2 % of a 134M Llama's capture)
    labels = nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    return nn.functional.cross_entropy(
        logits.flatten(0, 1).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def model_digest(model: nn.Module) -> str:
    """A SHA-256 (16 hex digits) of every parameter and buffer: names, dtypes, shapes, bytes."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_digest(tokenizer: Any) -> str:
    """A SHA-256 (16 hex digits) of the tokenizer: its vocabulary, rules and chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = (
        backend.to_str()
        if backend is not None
        else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    )
    extra = json.dumps(
        [getattr(tokenizer, "chat_template", None), str(tokenizer.all_special_tokens)]
    )
    return hashlib.sha256((body + extra).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class CaptureSettings:
    """What a store's gradients depend on, beyond the samples.

    Attributes:
        model: :func:`model_digest` of the model.
        tokenizer: :func:`tokenizer_digest` of the tokenizer.
        projection: :func:`projection_spec` of the projection (``None``: exact gradients).
        layers: The captured layers' patterns (shell globs of module names, e.g.
            ``"transformer.h.*"``), ``None`` for every layer.
        chat: Prompts formatted with the chat template.
        max_length: Tokens kept per sample (``None``: all).
        dtype: The model's dtype during capture.
        checkpoint: The checkpoint label of the records.
        model_path: Where the model was loaded from (shown, not compared).
    """

    model: str
    tokenizer: str
    projection: dict | None
    layers: tuple[str, ...] | None
    chat: bool = False
    max_length: int | None = None
    dtype: str = "float32"
    checkpoint: int = 0
    model_path: str = ""

    #: compared on resume (a query may differ in chat formatting and length)
    RESUME_KEYS = (
        "model", "tokenizer", "projection", "layers", "chat", "max_length", "dtype", "checkpoint"
    )  # fmt: skip
    #: compared between a store and a live query against it
    QUERY_KEYS = ("model", "tokenizer", "projection", "layers", "dtype")

    def to_json(self) -> dict:
        """A JSON object (:meth:`from_json` rebuilds it)."""
        d = dataclasses.asdict(self)
        d["layers"] = None if self.layers is None else list(self.layers)
        return {"format": "dattri_llm.capture", "version": 1, **d}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CaptureSettings:
        """Settings from :meth:`to_json`'s object."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if kw.get("layers") is not None:
            kw["layers"] = tuple(kw["layers"])
        return cls(**kw)

    def differences(self, other: CaptureSettings, keys: Sequence[str]) -> list[str]:
        """``"name: mine vs other's"`` for each of ``keys`` that differs."""
        return [
            f"{k}: {getattr(self, k)!r} vs {getattr(other, k)!r}"
            for k in keys
            if getattr(self, k) != getattr(other, k)
        ]

    def write(self, store_dir: str | os.PathLike) -> None:
        """Write ``capture.json`` into ``store_dir`` (atomically)."""
        path = Path(store_dir) / MANIFEST_FILE
        # one temporary file per process: the ranks of a distributed capture all write it
        tmp = path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1), encoding="utf-8")
        os.replace(tmp, path)


def read_settings(store_dir: str | os.PathLike) -> CaptureSettings | None:
    """The settings of a store written by :func:`capture_samples`; ``None`` when it has none."""
    path = Path(store_dir) / MANIFEST_FILE
    if not path.is_file():
        return None
    return CaptureSettings.from_json(json.loads(path.read_text(encoding="utf-8")))


def _texts_files(store_dir: Path) -> list[Path]:
    """The store's ``texts.jsonl``, then the ``rank_N/texts.jsonl`` of a distributed capture."""
    ranks = sorted(
        (p for p in store_dir.glob(f"rank_*/{TEXTS_FILE}") if p.parent.name[5:].isdigit()),
        key=lambda p: int(p.parent.name[5:]),
    )
    return [store_dir / TEXTS_FILE, *ranks]


def _text_rows(path: Path) -> Iterator[dict]:
    if not path.is_file():
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interrupted capture: its record is not kept


def read_texts(store_dir: str | os.PathLike) -> dict[str, str]:
    """``{sample hash: text}`` of a store's texts (``{}`` when it has none).

    Read from ``texts.jsonl`` and from the ranks' ``rank_N/texts.jsonl`` that an interrupted
    distributed capture leaves (a finished one folds them into ``texts.jsonl``).
    """
    out: dict[str, str] = {}
    for path in _texts_files(Path(store_dir)):
        for row in _text_rows(path):
            out.setdefault(row["id"], row["text"])
    return out


def fold_texts(store_dir: str | os.PathLike) -> None:
    """Fold the ranks' ``rank_N/texts.jsonl`` into the store's ``texts.jsonl``, each id once.

    Run by one process once every rank has finished writing. The new ``texts.jsonl`` replaces
    the old one atomically before the rank files are removed, so a process killed in between
    leaves every text readable (:func:`read_texts` reads both, each id once).
    """
    root, *ranks = _texts_files(Path(store_dir))
    if not ranks:
        return
    rows: dict[str, str] = {}
    for path in (root, *ranks):
        for row in _text_rows(path):
            rows.setdefault(row["id"], row["text"])
    body = "".join(json.dumps({"id": h, "text": t}) + "\n" for h, t in rows.items())
    atomic_write(root, body, fsync=True)
    for path in ranks:
        path.unlink()


def hook_config(
    layers: Sequence[str] | None,
    projection: ProjectionConfig | dict | None,
    model: nn.Module | None = None,
) -> HookManagerConfig:
    """The hook config of a capture: ``layers`` (shell globs of module names) or every layer.

    A layer that does not accept the projection's style (a norm under ``logra``) gets the
    nearest form it takes (:func:`~dattri_llm.gradient.ops.projection.nearest_projection`).
    With ``model``, each glob selects the model's capturable layers it matches
    (a layer rule's module with trainable parameters of its own: ``"transformer.h.*"`` selects
    the blocks' linears and norms, not the blocks); a glob that matches none is refused.

    Raises:
        ValueError: ``layers: ...`` naming a glob that matches no capturable layer.
    """
    if isinstance(projection, Mapping):
        projection = ProjectionConfig(**projection)
    names: list[str] = []
    if model is not None:
        from dattri_llm.gradient.layers import rule_for_module

        rules = {
            n: rule_for_module(m)
            for n, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
        }
        rules = {n: r for n, r in rules.items() if r is not None}
        names = list(rules)
    if layers is None:
        selector: Any = REGISTER_ALL
    elif model is None:
        selector = [fnmatch.translate(g) for g in layers]
    else:
        chosen: set[str] = set()
        for glob in layers:
            hits = fnmatch.filter(names, glob)
            if not hits:
                raise ValueError(
                    f"layers: {glob!r} matches no capturable layer of the model; its layers are "
                    f"{names[:6]}{' ...' if len(names) > 6 else ''}."
                )
            chosen.update(hits)
        selector = [re.escape(n) for n in names if n in chosen]
        names = [n for n in names if n in chosen]
    return HookManagerConfig(
        linear_io=selector,
        capture_style="auto",  # whichever of factors / dense gradient is smaller, per layer
        projection=projection,
        hash_keys=list(HASH_KEYS),
    )


def capture_samples(
    model: nn.Module,
    tokenizer: Any,
    samples: Iterable[tuple[str, str, str]],
    store: Any,
    settings: CaptureSettings,
    *,
    batch_size: int = 8,
    device: torch.device | str | None = None,
    show_progress: bool | None = None,
    total: int | None = None,
    desc: str = "capture",
) -> dict[str, int]:
    """Capture ``(text, prompt, completion)`` samples into ``store`` (a writable manager).

    Samples already in the store (a resumed capture) and repeated samples are skipped, as
    are samples with no predicted token. Records are durable one batch at a time, with their
    texts in ``texts.jsonl``; an interrupted capture keeps every finished batch.

    Under an initialised ``torch.distributed`` group, call it on every rank with the same
    samples and a manager of the same store, opened before the call: every rank reads every
    sample, the ``k``-th new distinct one (in order) is captured by rank ``k % world_size``
    into that rank's partition, and the ranks' texts are folded into ``texts.jsonl`` at the
    end. The counts returned are the whole store's, on every rank, equal to a one-process
    capture's.

    Args:
        model: The causal LM (put in eval mode; its weights are not changed).
        tokenizer: Its tokenizer.
        samples: ``(text shown for the sample, prompt, completion)`` triples.
        store: A ``GradientStorageManager`` opened for writing (``mode="append"`` to resume).
        settings: The settings (written into the store before the first record).
        batch_size: Samples per forward / backward.
        device: Where batches go (default: the model's device).
        show_progress: A progress bar (``None``: only on a terminal).
        total: The number of samples, for the bar.
        desc: The bar's label.

    Returns:
        ``{"captured", "already", "repeated", "empty"}`` counts.
    """
    config = hook_config(settings.layers, settings.projection, model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rank, world = get_rank(), get_world_size()
    in_store = set(store.sample_hashes()) if len(store) else set()
    # the shares depend on what the store holds: no rank writes before every rank has read it
    barrier()
    seen = set(in_store)
    counts = {"captured": 0, "already": 0, "repeated": 0, "empty": 0}
    new = [0]  # new distinct samples met so far (every rank meets the same ones, in order)
    step = max(store.available_steps(), default=-1) + 1
    bar = progress_bar(show_progress if rank == 0 else False, total=total, desc=desc, unit="sample")
    pending: dict[str, str] = {}  # hash -> text of the samples handed to the streamer
    # a distributed rank keeps its texts in its own partition (one writer per file)
    texts_dir = Path(store.save_dir) / f"rank_{rank}" if is_distributed() else store.save_dir

    def skip(kind: str) -> None:
        counts[kind] += 1
        if bar is not None:
            bar.update(1)

    class Items(torch.utils.data.IterableDataset):
        # read lazily (the corpus may not fit in memory); the streamer batches and pads
        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            for text, prompt, completion in samples:
                item = encode_sample(
                    tokenizer,
                    prompt,
                    completion,
                    chat=settings.chat,
                    max_length=settings.max_length,
                )
                if item is None:
                    skip("empty")
                    continue
                h = sample_id(item, config)
                if h in seen:
                    skip("already" if h in in_store else "repeated")
                    continue
                seen.add(h)
                new[0] += 1
                if (new[0] - 1) % world != rank:  # another rank's share
                    if bar is not None:
                        bar.update(1)
                    continue
                pending[h] = text
                yield item

    streamer = GradientStreamer(
        model,
        Items(),
        summed_loss,
        hook_config=config,
        batch_size=batch_size,
        checkpoint=settings.checkpoint,
        collate_fn=pad_batch(pad),
        device=device,
    )
    texts = None  # opened after the first record: the directory is a store by then
    try:
        for block in streamer:
            meta = {**dict(block.metadata), "loss_reduction": "sum"}
            hashes = list(block.hashes)
            store.write(GradientRecord(step, hashes, block.gradient, settings.checkpoint, meta))
            store.flush()  # the record is durable before its texts say it is there
            if texts is None:
                settings.write(store.save_dir)
                texts = open(Path(texts_dir) / TEXTS_FILE, "a", encoding="utf-8")
            for h in hashes:
                texts.write(json.dumps({"id": h, "text": pending.pop(h)}) + "\n")
            texts.flush()
            step += 1
            counts["captured"] += len(hashes)
            if bar is not None:
                bar.update(len(hashes))
    finally:
        if texts is not None:
            texts.close()
        if bar is not None:
            bar.close()
        store.close()
    if world > 1:  # the other counts are already the whole store's: every rank saw every row
        device = next(iter(model.parameters())).device
        captured = torch.tensor([counts["captured"]], dtype=torch.float64, device=device)
        counts["captured"] = int(all_reduce_sum(captured).item())
    barrier()  # every rank's texts are written
    if rank == 0:
        fold_texts(store.save_dir)
    barrier()  # a rank returns once the store is whole
    return counts
