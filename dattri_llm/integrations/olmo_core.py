"""OLMo-core: capture per-sample gradients from a stock ``Trainer.fit()``.

OLMo-core's ``Trainer.fit()`` first runs a *dry-run batch* of random tokens (a forward and a
backward, to compile and catch out-of-memory errors early) before the first training step. A
:class:`~dattri_llm.HookManager` context wrapped around ``fit()`` would capture that batch as
step 0. :class:`GradientCaptureCallback` is a trainer callback that opens the manager's
``collect()`` context at the first real step's ``pre_step`` instead and closes it when training
ends (normally, with an error, or at ``close``), so only real batches enter the store::

    from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig, OffloadCallback
    from dattri_llm.integrations.olmo_core import GradientCaptureCallback, olmo_core_layer_types

    model = TransformerConfig.olmo2_30M(vocab_size=...).build(init_device="cpu")
    train_module = TransformerTrainModuleConfig(...).build(model)
    hm = HookManager(
        model,
        config=HookManagerConfig(layer_types=olmo_core_layer_types(model)),  # every layer
        callbacks=[OffloadCallback(file_manager=GradientStorageManager("train_grads"),
                                   gradient_accumulation_steps=num_micro_batches)],
    )
    trainer = TrainerConfig(...).build(train_module, data_loader)
    trainer.add_callback("dattri_llm", GradientCaptureCallback(hook_manager=hm))
    trainer.fit()

The stored step ``s`` is the trainer's step ``first_step + s`` (``first_step`` is recorded on the
callback). A training module that splits each batch into micro-batches runs one backward pass
per micro-batch: callbacks with a ``gradient_accumulation_steps`` (``OffloadCallback``,
``OptimizerStateCallback``, ...) must declare that many, which the callback checks at every
step for OLMo-core's ``TransformerTrainModule`` (``rank_microbatch_size``).

OLMo-core's norm classes are not ``torch.nn`` norms: :func:`olmo_core_layer_types` declares
them (``RMSNorm`` and its kernels as ``"nn.RMSNorm"``, ``LayerNorm`` as ``"nn.LayerNorm"``, with
or without a bias; ``eps`` and the shapes are read off the modules). A tied LM head
(``tie_word_embeddings=True``) shares the embedding's parameter between two modules and is
captured exactly as one parameter. The ``"fused_linear"`` loss reads ``lm_head.w_out.weight``
without calling ``w_out``: the manager warns that the head's gradient cannot be captured then.

Needs OLMo-core (the ``olmo-core`` extra, ``ai2-olmo-core==2.6.0``), ideally in its own virtual
environment; ``import dattri_llm`` never imports this module.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

try:
    from olmo_core.nn.layer_norm import LayerNorm as _CoreLayerNorm
    from olmo_core.nn.layer_norm import RMSNorm as _CoreRMSNorm
    from olmo_core.train.callbacks import Callback
except ImportError as err:  # pragma: no cover - exercised in the OLMo-core environment
    raise ImportError(
        "dattri_llm.integrations.olmo_core needs OLMo-core: pip install -e '.[olmo-core]' "
        "(ai2-olmo-core==2.6.0), preferably in a virtual environment of its own (it cannot "
        f"share one with ai2-olmo). Import failed with: {err}"
    ) from err

from dattri_llm.gradient.hooks.manager import HookManager

__all__ = ["GradientCaptureCallback", "olmo_core_layer_types"]


def olmo_core_layer_types(model: nn.Module) -> dict[str, str]:
    """``HookManagerConfig.layer_types`` declaring every OLMo-core norm of ``model``.

    ``olmo_core.nn.layer_norm.RMSNorm`` (and its subclasses: ``QwenRMSNorm``, the fused and CuTe
    kernels, which compute the same function) is declared ``"nn.RMSNorm"``, ``LayerNorm``
    ``"nn.LayerNorm"``; a norm's ``bias``, when it has one, is captured with its weight. Norms
    without parameters (``elementwise_affine=False``, ``L2Norm``) have nothing to capture and
    are left out.

    Args:
        model: The OLMo-core model (or any module containing OLMo-core norms).

    Returns:
        ``{module name: layer type}`` for :class:`~dattri_llm.HookManagerConfig`.
    """
    out: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name or getattr(module, "weight", None) is None:
            continue
        if isinstance(module, _CoreRMSNorm):
            out[name] = "nn.RMSNorm"
        elif isinstance(module, _CoreLayerNorm):
            out[name] = "nn.LayerNorm"
    return out


@dataclass
class GradientCaptureCallback(Callback):
    """Capture with a :class:`~dattri_llm.HookManager` from the first real training step on.

    Opens ``hook_manager.collect()`` at the first ``pre_step`` (after ``fit()``'s dry-run batch,
    which is never captured) and closes it at ``post_train``, ``on_error`` or ``close``,
    whichever comes first; its callbacks' ``on_context_end`` then runs (``OffloadCallback``
    makes its records durable and releases the store).

    Attributes:
        hook_manager: The manager to capture with, built on the trainer's model.
        deregister_on_exit: Remove the manager's hooks when capture ends.
        first_step: The trainer step capture started at (set at that step); the stored step
            ``s`` is trainer step ``first_step + s``.
    """

    hook_manager: Any = None
    deregister_on_exit: bool = True
    first_step: int | None = None
    _stack: contextlib.ExitStack | None = field(default=None, init=False, repr=False)

    def post_attach(self) -> None:
        """Check the manager when the trainer attaches the callback."""
        if not isinstance(self.hook_manager, HookManager):
            raise TypeError(
                "GradientCaptureCallback(hook_manager=...): expected a dattri_llm.HookManager "
                f"built on the trainer's model, got {type(self.hook_manager).__name__}."
            )

    def pre_step(self, batch: dict[str, Any]) -> None:
        """Start capturing at the first real step (checks the micro-batch count every step)."""
        self._check_micro_batches(batch)
        if self._stack is not None:
            return
        stack = contextlib.ExitStack()
        stack.enter_context(self.hook_manager.collect(deregister_on_exit=self.deregister_on_exit))
        self._stack = stack
        self.first_step = int(self.trainer.global_step)

    def post_train(self) -> None:
        """End capture: training completed."""
        self._end()

    def on_error(self, exc: BaseException) -> None:
        """End capture: training failed (the records so far stay durable)."""
        del exc
        self._end()

    def close(self) -> None:
        """End capture if still open (``fit()`` always calls this last)."""
        self._end()

    def _end(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _check_micro_batches(self, batch: dict[str, Any]) -> None:
        """Callbacks counting micro-batches must count as many as the train module runs."""
        tokens = getattr(self.trainer.train_module, "rank_microbatch_size", None)
        ids = batch.get("input_ids")
        if not isinstance(tokens, int) or ids is None or ids.dim() != 2:
            return
        per_micro = max(tokens // int(ids.shape[1]), 1)
        n = math.ceil(int(ids.shape[0]) / per_micro)
        for cb in self.hook_manager.callbacks:
            declared = getattr(cb, "gradient_accumulation_steps", None)
            if declared is not None and declared != n:
                raise ValueError(
                    f"{type(cb).__name__}(gradient_accumulation_steps={declared}): the train "
                    f"module splits each batch of {ids.shape[0]} instances into {n} "
                    f"micro-batch(es) of at most {per_micro} (rank_microbatch_size={tokens} "
                    f"tokens, sequence length {ids.shape[1]}), one backward pass each; pass "
                    f"gradient_accumulation_steps={n} so each optimizer step is one stored step."
                )
