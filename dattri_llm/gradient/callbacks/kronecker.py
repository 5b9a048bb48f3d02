"""``KroneckerCovarianceCallback``: accumulate K-FAC covariances during capture (no extra pass)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.gradient import Gradient, Materialized, Shared
from dattri_llm.gradient.kronecker import (
    KroneckerCovariances,
    LayerCovariance,
    NonKronecker,
    TokenCount,
    is_kronecker_layer,
)

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord

__all__ = ["KroneckerCovarianceCallback"]


def _is_vector(lg: object) -> bool:
    """A projected vector layer: its record holds all K-FAC needs (its exact Fisher)."""
    from dattri_llm.gradient.layers import get_rule

    return get_rule(lg.layer_type).exact_fisher


class KroneckerCovarianceCallback(HookCallback):
    """Accumulate the K-FAC covariances ``A`` and ``G`` of every captured step.

    Pass ``callback.covariances`` (or a directory written by ``callback.save``) to
    ``KFACAttributor.fit(covariances=...)``/``EKFACAttributor.fit(covariances=...)``; the sums
    are all-reduced over ranks when the fit uses them. Conventions are those of
    :mod:`dattri_llm.gradient.kronecker`.

    The covariances are taken from each step's record, i.e. the same factors a store receives
    (after any transform). Layers the record holds materialised (``capture_style`` other than
    ``"factorized"``) are covered from the raw factors seen in the backward hook, which is
    exact as long as no transform (projection, preconditioned capture) rewrites them. Under a
    ``"logra"`` projection the record's factors are the projected ones (K-FAC in the projected
    space, as LoGra); a ``"dense"`` / ``"sparse"`` / ``"mask"`` vector gets its exact Fisher.

    Args:
        non_kronecker: ``"skip"`` or ``"diagonal"`` for layers K-FAC does not apply to.
        tokens: ``"gradient"`` or ``"all"``: which token positions ``A`` averages over.

    Example:
        ```python
        cov_cb = KroneckerCovarianceCallback()
        hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store), cov_cb])
        with hm.collect():
            trainer.train()
        EKFACAttributor(args).fit(store_dir, covariances=cov_cb.covariances)
        ```
    """

    def __init__(
        self, non_kronecker: NonKronecker = "skip", tokens: TokenCount = "gradient"
    ) -> None:
        self.covariances = KroneckerCovariances(non_kronecker=non_kronecker, tokens=tokens)
        self._raw: dict[str, KroneckerCovariances] = {}

    def _needs_raw(self) -> bool:
        m = self.manager
        return m is not None and m.config.capture_style != "factorized"

    def on_backward(self, layer: str, module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> None:
        if not self._needs_raw() or not a.is_floating_point():
            return
        from dattri_llm.gradient.layers import rule_for_module

        spec = next((s for s in self.manager.layers if s.name == layer), None)
        rule = spec.rule if spec is not None else rule_for_module(module)
        if rule is None or not rule.kronecker:
            return
        kw = spec.module_kwargs if spec is not None else rule.module_kwargs(module)
        raw = self._raw.setdefault(layer, KroneckerCovariances(tokens=self.covariances.tokens))
        raw.update_factors(layer, [(a, g)], rule.layer_type, kw, 0)

    def on_step_end(self, record: GradientRecord) -> None:
        grad = record.gradient
        direct = {}
        for name, lg in grad.layers.items():
            sites = lg.sites if isinstance(lg, Shared) else [lg]
            factors_gone = any(isinstance(s, Materialized) for s in sites)
            if is_kronecker_layer(lg) and factors_gone and not _is_vector(lg):
                self._from_raw(name, lg, grad.batch_size)
            else:
                direct[name] = lg
        if direct:
            self.covariances.update(Gradient(direct))
        self._raw.clear()

    def _from_raw(self, name: str, lg: object, batch_size: int) -> None:
        m = self.manager
        if m is not None and getattr(m, "_transforms", None):
            raise RuntimeError(
                f"layer {name!r} was captured materialized after a transform (projection or "
                "preconditioning), so its K-FAC factors cannot be recovered. Capture with "
                "capture_style='factorized', or fit the covariances from the store instead."
            )
        groups = getattr(m, "_shared_groups", {}) if m is not None else {}
        members = groups.get(name, [name])
        parts = [self._raw[n].layers[n] for n in members if n in self._raw]
        if not parts:
            raise RuntimeError(f"no raw factors were seen for layer {name!r} in this step.")
        target = self.covariances.layers.get(name)
        if target is None:
            first = parts[0]
            dt = self.covariances.dtype
            blocks = first.block_tokens
            target = self.covariances.layers[name] = LayerCovariance(
                lg.layer_type,
                dict(lg.module_kwargs),
                torch.zeros_like(first.a_sum, dtype=dt),
                torch.zeros_like(first.g_sum, dtype=dt),
                block_tokens=None if blocks is None else torch.zeros_like(blocks),
            )
        for p in parts:
            target.a_sum += p.a_sum
            target.g_sum += p.g_sum
            target.num_tokens += p.num_tokens
            if target.block_tokens is not None:
                target.block_tokens += p.block_tokens
        target.num_samples += float(batch_size)

    def save(self, path: str) -> None:
        """Persist the accumulated covariances (safetensors + JSON) into directory ``path``."""
        self.covariances.save(path)
