"""A tiny OLMo-2-style model trained by OLMo-core's stock ``TransformerTrainModule`` + ``Trainer``.

What the fidelity checks share: byte-level windows of Python's documentation topics, the model
variants, and :func:`train`: ``Trainer.fit()`` from a fixed initial state, with optional
dattri_llm capture (``GradientCaptureCallback``), per-step weight snapshots and step times.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import OptimConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModuleConfig

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    hash_sample,
)
from dattri_llm.integrations.olmo_core import GradientCaptureCallback, olmo_core_layer_types

VOCAB = 384  # bytes 0..255, EOS 256, PAD 257, padded to a multiple of 128
EOS, PAD = 256, 257
SEQ = 64
TOPICS = ("try", "import", "comparisons", "assignment")


@dataclass
class Data:
    """Training windows (one per instance, byte-level) and their token file."""

    windows: torch.Tensor  # (N, SEQ) long
    token_file: Path

    def hashes(self) -> list[str]:
        return [hash_sample({"input_ids": w}) for w in self.windows]


def make_data(work: Path, per_topic: int) -> Data:
    """The first ``per_topic`` windows of each topic's text."""
    from dattri_llm.demo import load_corpus

    corpus = load_corpus(TOPICS)
    windows = []
    for topic in TOPICS:
        ids: list[int] = []
        for _, text in (c for c in corpus if c[0] == topic):
            ids += list(text.encode("utf-8")) + [EOS]
        windows += [ids[i * SEQ : (i + 1) * SEQ] for i in range(per_topic)]
    token_file = work / "tokens.npy"
    # a raw uint16 memmap (no .npy header), as OLMo-core reads its token files
    np.asarray([t for w in windows for t in w], dtype=np.uint16).tofile(token_file)
    return Data(torch.tensor(windows, dtype=torch.long), token_file)


def model_config(variant: str, d_model: int | None = None) -> TransformerConfig:
    """``"untied"``, ``"tied"`` (``tie_word_embeddings``) or ``"norm-bias"`` (norms with bias).

    OLMo-2 layout: reordered-norm blocks, QK-norms, SwiGLU MLP, RoPE, RMS norms.
    """
    kwargs: dict[str, Any] = {"n_layers": 2}
    if variant == "tied":
        kwargs["tie_word_embeddings"] = True
    if d_model is None:
        cfg = TransformerConfig.olmo2_1M(vocab_size=VOCAB, **kwargs)
    else:
        cfg = TransformerConfig.llama_like(d_model=d_model, vocab_size=VOCAB, n_heads=4,
                                           block_name="reordered_norm", qk_norm=True, **kwargs,
                                           rope_theta=500_000, layer_norm_eps=1e-6)  # fmt: skip
    if variant == "norm-bias":
        for ln in _layer_norm_configs(cfg):
            ln.bias = True
    elif variant not in ("untied", "tied"):
        raise ValueError(f"unknown variant {variant!r}")
    return cfg


def _layer_norm_configs(cfg: TransformerConfig) -> list[Any]:
    out = [cfg.block.layer_norm, cfg.lm_head.layer_norm]
    attn = cfg.block.sequence_mixer if hasattr(cfg.block, "sequence_mixer") else None
    attn = attn or getattr(cfg.block, "attention", None)
    if attn is not None and getattr(attn, "qk_norm", None) is not None:
        out.append(attn.qk_norm)
    return [ln for ln in out if ln is not None]


class _Recorder(Callback):
    """Per real step: the batch's input rows, the weights before it (``snapshot``), wall time."""

    priority = -10  # after the capture callback's pre_step

    def __init__(self, snapshot: bool) -> None:
        self.snapshot = snapshot
        self.steps: list[dict[str, Any]] = []
        self._t0 = 0.0

    def pre_step(self, batch: dict[str, Any]) -> None:
        step: dict[str, Any] = {"input_ids": batch["input_ids"].detach().clone()}
        if self.snapshot:
            model = self.trainer.train_module.model
            step["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.steps.append(step)
        self._t0 = time.perf_counter()

    def post_step(self) -> None:
        self.steps[-1]["seconds"] = time.perf_counter() - self._t0


@dataclass
class RunResult:
    """What :func:`train` returns."""

    model: torch.nn.Module
    steps: list[dict[str, Any]]
    hook_manager: HookManager | None = None
    capture: GradientCaptureCallback | None = None
    warnings: list[str] = field(default_factory=list)


def build_model(cfg: TransformerConfig, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cfg.build(init_device="cpu")


def train(
    work: Path,
    data: Data,
    model: torch.nn.Module,
    *,
    batch: int,
    micro_batch: int,
    steps: int,
    optim: OptimConfig,
    capture_callbacks: Sequence[Any] | None = None,
    snapshot: bool = False,
    wrap_fit: bool = False,
    declare_norms: bool = True,
) -> RunResult:
    """Run OLMo-core's ``Trainer.fit()`` on ``data`` (``model`` is trained in place).

    Args:
        work: A fresh directory for OLMo-core's save / work folders.
        data: The windows (their token file).
        model: The model, at its initial weights.
        batch: Instances per step.
        micro_batch: Instances per micro-batch (one backward pass each).
        steps: Training steps.
        optim: The optimizer config.
        capture_callbacks: dattri_llm callbacks: capture with a ``HookManager`` and
            ``GradientCaptureCallback``; ``None`` trains without hooks.
        snapshot: Record the weights before every step.
        wrap_fit: Capture with ``hook_manager.collect()`` around ``fit()`` instead of the
            callback (the naive way, which also captures ``fit()``'s dry-run batch).
        declare_norms: Declare OLMo-core's norms (``olmo_core_layer_types``); without, they
            are not captured (and named in a warning).
    """
    logging.getLogger("olmo_core").setLevel(logging.WARNING)
    work.mkdir(parents=True, exist_ok=True)
    dataset = NumpyFSLDatasetConfig(
        tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=EOS, pad_token_id=PAD),
        paths=[str(data.token_file)],
        sequence_length=SEQ,
        work_dir=str(work / "dataset"),
    ).build()
    loader = NumpyDataLoaderConfig(
        global_batch_size=batch * SEQ, seed=0, num_workers=0, work_dir=str(work / "loader")
    ).build(dataset)
    train_module = TransformerTrainModuleConfig(
        rank_microbatch_size=micro_batch * SEQ, max_sequence_length=SEQ, optim=optim
    ).build(model)
    trainer = TrainerConfig(
        save_folder=str(work / "save"), work_dir=str(work / "trainer"), save_overwrite=True,
        max_duration=Duration.steps(steps), no_checkpoints=True,
        metrics_collect_interval=10**6, cancel_check_interval=10**6,
    ).build(train_module, loader)  # fmt: skip
    recorder = _Recorder(snapshot)
    trainer.add_callback("fidelity_recorder", recorder)
    result = RunResult(model, recorder.steps)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if capture_callbacks is not None:
            norms = olmo_core_layer_types(model) if declare_norms else {}
            config = HookManagerConfig(layer_types=norms)
            result.hook_manager = HookManager(model, config, callbacks=list(capture_callbacks))
            if not wrap_fit:
                result.capture = GradientCaptureCallback(hook_manager=result.hook_manager)
                trainer.add_callback("dattri_llm", result.capture)
        if wrap_fit and result.hook_manager is not None:
            with result.hook_manager.collect(deregister_on_exit=True):
                trainer.fit()
        else:
            trainer.fit()
    mine = ("/dattri_llm/", "HookManager", "REGISTER_ALL")  # its file, or its remedies named
    result.warnings = [str(w.message) for w in caught
                       if any(k in w.filename + str(w.message) for k in mine)]  # fmt: skip
    return result


def train_to_store(
    work: Path, name: str, data: Data, model: torch.nn.Module, **kwargs: Any
) -> tuple[RunResult, GradientStorageManager]:
    """:func:`train` with per-sample gradients offloaded to the store ``work/<name>_grads``.

    ``kwargs`` go to :func:`train`; one stored step per optimizer step (the micro-batches of a
    step share it).
    """
    store = GradientStorageManager(str(work / f"{name}_grads"))
    steps = kwargs["batch"] // kwargs["micro_batch"]
    offload = OffloadCallback(file_manager=store, gradient_accumulation_steps=steps)
    run = train(work / f"{name}_run", data, model, capture_callbacks=[offload], **kwargs)
    store.close()
    return run, store
