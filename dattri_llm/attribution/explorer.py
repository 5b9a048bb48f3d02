"""Ask a captured corpus which documents a prompt's answer comes from: :class:`Explorer`.

An explorer holds a model, its tokenizer and a training store written by ``dattri-llm
capture``. For a prompt (and a completion, or the one the model generates greedily) it computes
the query's loss gradient live, exactly as ``capture`` would have captured that prompt and
completion (:mod:`dattri_llm.gradient.causal_lm`: the same layers, projection, formatting and
summed completion loss, the model in eval mode), and ranks the training samples with the
library's one scoring road, ``attribute_sources(..., top_k=k)`` (or a
:class:`~dattri_llm.GradientIndex` search when one is given). Its top-k is therefore the top-k
that ``attribute_from_cache(train_store, query_store, top_k=k)`` gives for a query store
captured from the same prompt and completion; through an approximate (IVF, HNSW) index the
answer says so (``Attribution.exact`` is ``False``).

The query's hooks are built once, on the first query, and stay on the model until
:meth:`Explorer.close` (or the end of a ``with`` block): building them costs as much as a
quarter of a small model's query.

A model, tokenizer or dtype other than the capture's, and layers or a projection other than the
store's, are refused with an error naming the difference: the scores would be silently wrong.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

__all__ = ["Explorer", "Attribution", "Hit", "EXPLORER_METHODS"]

#: Methods an explorer builds by name (any other attributor may be passed as an instance).
EXPLORER_METHODS = ("grad-cos", "grad-dot")


@dataclass(frozen=True)
class Hit:
    """One training sample of a ranking.

    Attributes:
        rank: 1 for the largest score.
        id: The sample's hash in the store.
        score: Its score against the query.
        text: Its text as captured (``None`` when the store kept none).
    """

    rank: int
    id: str
    score: float
    text: str | None


@dataclass(frozen=True)
class Attribution:
    """The answer of :meth:`Explorer.attribute`.

    Attributes:
        prompt: The prompt.
        completion: The completion attributed (given, or generated).
        generated: Whether the completion was generated.
        method: The method's name.
        query_id: The query sample's hash.
        results: The top proponents, by decreasing score.
        elapsed_ms: Wall time of the call.
        exact: Whether ``results`` is the exact top-k (a store scan or a ``flat`` index);
            ``False`` through an IVF or HNSW index, which may miss some of the top-k.
        expected_recall: The share of the exact top-k an approximate index is expected to
            find, measured at build (:attr:`dattri_llm.GradientIndex.expected_recall`),
            when it records one; else ``None``.
    """

    prompt: str
    completion: str
    generated: bool
    method: str
    query_id: str
    results: list[Hit] = field(default_factory=list)
    elapsed_ms: float = 0.0
    exact: bool = True
    expected_recall: float | None = None


class Explorer:
    """Live attribution of prompts against a captured training store.

    Args:
        model: The causal LM the store was captured from (same weights and dtype).
        tokenizer: Its tokenizer.
        train_store: The store directory written by ``dattri-llm capture`` (read, never
            written).
        method: ``"grad-cos"`` (default), ``"grad-dot"``, or an attributor instance whose
            ``attribute_sources`` scores the stores (a method that fits refits every call).
        index: A :class:`~dattri_llm.GradientIndex` over ``train_store`` (or its directory) to
            search instead of scanning the store; ``"auto"``: scan a small store, search a
            large one through an index built on first use and kept beside it
            (:mod:`~dattri_llm.attribution.index.cache`; needs faiss); ``None``: scan.
        layers: The layers (globs) the store must have been captured on (default: its own).
        projection: The projection (``"sparse:N"``, ... or a ``ProjectionConfig``) the store
            must have been captured with (default: its own).
        max_new_tokens: Length limit of a generated completion.
        device: Where queries run (default: the model's device).
        args: ``AttributionArguments`` of the scoring (default: no progress bars).

    Raises:
        ValueError: the store was not written by ``capture``, or a setting differs from the
            store's (:class:`~dattri_llm.gradient.causal_lm.CaptureMismatchError`, naming it).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        train_store: str | os.PathLike,
        method: str | Any = "grad-cos",
        *,
        index: Any = None,
        layers: Sequence[str] | None = None,
        projection: Any = None,
        max_new_tokens: int = 32,
        device: torch.device | str | None = None,
        args: Any = None,
    ) -> None:
        from dattri_llm.attribution.arguments import AttributionArguments
        from dattri_llm.gradient.causal_lm import (
            CaptureMismatchError,
            CaptureSettings,
            model_digest,
            parse_projection,
            projection_spec,
            read_settings,
            read_texts,
            tokenizer_digest,
        )
        from dattri_llm.gradient.store import GradientStorageManager

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
        path = os.fspath(train_store)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"train_store {path!r} is not a directory.")
        settings = read_settings(path)
        if settings is None:
            raise ValueError(
                f"train_store {path!r} was not written by dattri-llm capture (it has no "
                "capture.json, so how its gradients were computed is unknown): capture the "
                "corpus with `dattri-llm capture MODEL DATA --out STORE`."
            )
        if isinstance(projection, str):
            projection = parse_projection(projection)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        live = CaptureSettings(
            model=model_digest(model),
            tokenizer=tokenizer_digest(tokenizer),
            projection=settings.projection if projection is None else projection_spec(projection),
            layers=settings.layers if layers is None else tuple(layers),
            dtype=dtype,
        )
        diffs = settings.differences(live, CaptureSettings.QUERY_KEYS)
        if diffs:
            raise CaptureMismatchError(
                f"train_store {path!r} was captured with other settings than this explorer's "
                "(store vs explorer): "
                + "; ".join(diffs)
                + ". Load the model and tokenizer the store was captured from "
                f"({settings.model_path or 'see its capture.json'}) in {settings.dtype}, and "
                "leave layers / projection to the store."
            )
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings
        self.store = GradientStorageManager(path)
        if len(self.store) == 0:
            raise ValueError(f"train_store {path!r} holds no gradient records.")
        self.texts = read_texts(path)
        self.max_new_tokens = max_new_tokens
        self.device = device
        self.args = args if args is not None else AttributionArguments(show_progress=False)
        self.method_name, self.attributor = self._method(method)
        self.num_train = len(set(self.store.sample_hashes()))
        if isinstance(index, str) and index == "auto":
            index = self._auto_index(path)
        elif index is not None and not hasattr(index, "search"):
            from dattri_llm.attribution.index import GradientIndex

            index = GradientIndex.open(index, store=path)
        self.index = index
        kind = getattr(index, "kind", "flat")
        self.exact = kind == "flat"
        recall = getattr(index, "expected_recall", None) if not self.exact else None
        self.expected_recall = float(recall) if isinstance(recall, (int, float)) else None
        # one query at a time: the hooks and the model's gradients are shared state (reentrant:
        # attribute() holds it around query_blocks(), which a caller may also call alone)
        self.lock = threading.RLock()
        self._hooks: Any = None  # the query's HookManager, built by the first query

    def _auto_index(self, path: str) -> Any:
        """``index="auto"``: ``None`` (a scan) on a small store, else the cached index."""
        from dattri_llm.attribution.index.cache import cached_index, wants_index

        metric = {"grad-cos": "cosine", "grad-dot": "dot"}.get(self.method_name)
        if metric is None:
            raise ValueError(
                f"index='auto' searches Grad-Cos or Grad-Dot scores; the method "
                f"{self.method_name} scores otherwise: pass index=None to scan the store."
            )
        first = self.store.load_record(0).gradient
        dim = sum(int(lg.materialize().data[0].numel()) for lg in first.layers.values())
        if not wants_index(self.num_train, dim):
            return None
        try:
            import faiss  # noqa: F401
        except ImportError:
            warnings.warn(
                f"index='auto': the store holds {self.num_train} samples of {dim} numbers, "
                "which an index would search much faster than a scan, but faiss is not "
                "installed (pip install 'dattri_llm[index]'); every query scans the store.",
                stacklevel=3,
            )
            return None
        return cached_index(path, metric, log=lambda m: print(f"explorer: {m}", file=sys.stderr))

    def close(self) -> None:
        """Take the query's hooks off the model (idempotent; a later query puts them back)."""
        with self.lock:
            if self._hooks is not None:
                self._hooks.remove()
                self._hooks = None

    def __enter__(self) -> Explorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _method(self, method: str | Any) -> tuple[str, Any]:
        from dattri_llm.attribution.tracin import TracInAttributor

        if not isinstance(method, str):
            if not hasattr(method, "attribute_sources"):
                raise TypeError(
                    f"method must be one of {EXPLORER_METHODS} or an attributor, got "
                    f"{type(method).__name__}."
                )
            return type(method).__name__, method
        if method not in EXPLORER_METHODS:
            raise ValueError(f"method must be one of {EXPLORER_METHODS}, got {method!r}.")
        return method, TracInAttributor(self.args, normalized_grad=method == "grad-cos")

    def generate(self, prompt: str) -> str:
        """The model's greedy completion of ``prompt`` (at most ``max_new_tokens`` tokens)."""
        from dattri_llm.gradient.causal_lm import encode_prompt

        ids = encode_prompt(self.tokenizer, prompt, chat=self.settings.chat)
        device = self._device()
        x = torch.as_tensor(ids, device=device).reshape(1, -1)
        if x.shape[1] == 0:
            raise ValueError("prompt: it has no token (give a prompt or a completion).")
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        room = self._positions() - x.shape[1]
        if room < 1:
            raise ValueError(f"prompt: {x.shape[1]} tokens leave no room to generate.")
        with torch.no_grad():
            out = self.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=min(self.max_new_tokens, room),
                do_sample=False,
                pad_token_id=pad if pad is not None else eos,
            )
        return self.tokenizer.decode(out[0, x.shape[1] :], skip_special_tokens=True)

    def _positions(self) -> int:
        """The longest sequence the model takes (a large number when its config says none)."""
        config = getattr(self.model, "config", None)
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                return value
        return 1 << 30

    def _device(self) -> torch.device | str:
        if self.device is not None:
            return self.device
        return next(self.model.parameters()).device

    def query_blocks(self, prompt: str, completion: str) -> list[Any]:
        """The query's gradient, as the one block a query store captured by ``capture`` holds."""
        from dattri_llm.gradient.causal_lm import encode_sample, pad_batch, summed_loss
        from dattri_llm.gradient.streaming import GradientStreamer

        item = encode_sample(
            self.tokenizer,
            prompt,
            completion,
            chat=self.settings.chat,
            max_length=self.settings.max_length,
        )
        if item is None:
            raise ValueError(
                "completion: it has no token to predict after the prompt (give a non-empty "
                "completion, or None to generate one)."
            )
        if len(item["input_ids"]) > self._positions():
            raise ValueError(
                f"completion: the prompt and completion are {len(item['input_ids'])} tokens, "
                f"more than the model's {self._positions()} positions."
            )
        pad = self.tokenizer.pad_token_id
        with self.lock:
            streamer = GradientStreamer(
                self.model,
                [item],
                summed_loss,
                batch_size=1,
                checkpoint=self.settings.checkpoint,
                collate_fn=pad_batch(pad if pad is not None else 0),
                device=self.device,
                hook_manager=self._hook_manager(),
            )
            return list(streamer)

    def _hook_manager(self) -> Any:
        """The query's ``HookManager``: built by the first query, reused by every later one."""
        if self._hooks is None:
            from dattri_llm.gradient.callbacks.capture import CaptureCallback
            from dattri_llm.gradient.causal_lm import hook_config
            from dattri_llm.gradient.hooks import HookManager

            config = hook_config(self.settings.layers, self.settings.projection, self.model)
            # the store's capture checked these layers' coverage on this model; without the
            # check every query's backward stops at the per-sample gradients (fixed weights)
            config = replace(config, check_coverage=False)
            self._hooks = HookManager(self.model, config=config, callbacks=[CaptureCallback()])
        return self._hooks

    def attribute(self, prompt: str, completion: str | None = None, k: int = 10) -> Attribution:
        """The ``k`` training samples with the largest scores for ``prompt`` → ``completion``.

        Args:
            prompt: The prompt.
            completion: The answer to attribute; ``None`` generates it greedily.
            k: How many samples (at most the store's number of distinct samples).

        Raises:
            ValueError: ``k`` < 1, or a prompt / completion with no token to predict.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}.")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}.")
        t0 = time.perf_counter()
        k = min(k, self.num_train)
        with self.lock:
            generated = completion is None
            if completion is None:
                completion = self.generate(prompt)
            blocks = self.query_blocks(prompt, completion)
            if self.index is not None:
                score = self.index.search(blocks, k)
            else:
                score = self.attributor.attribute_sources(self._train_source(), blocks, top_k=k)
            top = score.top_k(k)
        hits = [
            Hit(rank, h, float(s), self.texts.get(h))
            for rank, (h, s) in enumerate(
                zip(top.proponent_hashes[0], top.proponent_scores[0].tolist()), 1
            )
        ]
        return Attribution(
            prompt,
            completion,
            generated,
            self.method_name,
            blocks[0].hashes[0],
            hits,
            (time.perf_counter() - t0) * 1000.0,
            self.exact,
            self.expected_recall,
        )

    def _train_source(self) -> Any:
        from dattri_llm.gradient.sources import DiskGradientSource

        return DiskGradientSource(self.store, checkpoints=[self.settings.checkpoint])

    def sample(self, sample_id: str) -> str | None:
        """The text of a training sample, by hash (``None`` when unknown)."""
        return self.texts.get(sample_id)
