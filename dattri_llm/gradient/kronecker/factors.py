"""The K-FAC fit: eigenbases of the covariances, and the damped preconditioner they make.

:func:`eigendecompose` turns :class:`KroneckerCovariances` into a damping-free
:class:`KroneckerFactors` (eigenvectors and eigenvalues of ``A`` and ``G`` per layer, float64
by default); :meth:`KroneckerFactors.precondition` applies ``(F̂ + λ I)^{-1}`` for any damping,
and :meth:`KroneckerFactors.save` / :meth:`~KroneckerFactors.load` are its files. EK-FAC keeps
this basis and replaces the eigenvalues (:mod:`.correction`). The conventions are those of
:mod:`dattri_llm.gradient.kronecker`.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, LayerGradient, Materialized
from dattri_llm.gradient.kronecker.covariances import (
    DiagonalFisher,
    KroneckerCovariances,
    acc_dtype,
    fit_progress,
    fit_shapes,
    get_diagonal,
    is_kronecker_layer,
    layer_sites,
    put_layers,
    read_bundle,
    read_layer,
    write_bundle,
)
from dattri_llm.gradient.layers import get_rule
from dattri_llm.utils.distributed import get_rank, get_world_size

__all__ = ["LayerEigen", "KroneckerFactors", "eigendecompose"]

#: Upper bound on the elements of one rotated ``(chunk, K, D)`` block.
ROTATE_CHUNK_ELEMENTS = 1 << 25


@dataclass
class LayerEigen:
    """One layer's damping-free fit.

    Attributes:
        layer_type: The layer's rule name.
        module_kwargs: Its hyper-parameters.
        q_a: Eigenvectors of ``A`` (columns), ``(D, D)``.
        s_a: Eigenvalues of ``A``, ``(D,)``.
        q_g: Eigenvectors of ``G``, ``(K, K)``.
        s_g: Eigenvalues of ``G``, ``(K,)``.
        corrected: EK-FAC eigenvalues ``(K, D)`` (``None`` for K-FAC).
        num_samples: Samples the fit used.

    A blocked layer (fused experts) has a leading ``E`` axis on every tensor.
    """

    layer_type: str
    module_kwargs: dict
    q_a: torch.Tensor
    s_a: torch.Tensor
    q_g: torch.Tensor
    s_g: torch.Tensor
    corrected: torch.Tensor | None = None
    num_samples: float = 0.0

    def eigenvalues(self) -> torch.Tensor:
        """``(K, D)`` eigenvalues of ``F̂`` in the ``Q_G ⊗ Q_A`` basis."""
        if self.corrected is not None:
            return self.corrected
        return self.s_g[..., :, None] * self.s_a[..., None, :]


@dataclass
class KroneckerFactors:
    """A damping-free K-FAC / EK-FAC fit; reused for any damping and any number of queries.

    Attributes:
        kind: ``"kfac"`` or ``"ekfac"``.
        layers: ``{name: LayerEigen}`` of the Kronecker-eligible layers.
        diagonal: ``{name: DiagonalFisher}`` (mean taken at use) for ``non_kronecker="diagonal"``.
        skipped: ``{name: layer_type}`` of the layers left out of the preconditioner.
        correction: Fingerprint of the per-coordinate correction the fit's gradients had
            (``SecondMoment.fingerprint()``), ``None`` for raw gradients; saved with the fit.
    """

    kind: Literal["kfac", "ekfac"]
    layers: dict[str, LayerEigen]
    diagonal: dict[str, DiagonalFisher] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    correction: str | None = None

    @property
    def layer_names(self) -> list[str]:
        """Names of every preconditioned layer (Kronecker, then diagonal)."""
        return list(self.layers) + list(self.diagonal)

    def precondition(
        self,
        gradient: Gradient,
        damping: float = 1e-3,
        relative: bool = False,
        dtype: torch.dtype | None = None,
    ) -> Gradient:
        """``(F̂ + λ I)^{-1} g`` for every preconditioned layer (skipped layers are dropped).

        Args:
            gradient: Per-sample gradients of (a superset of) the fitted layers.
            damping: ``λ`` (absolute), or its factor of the mean eigenvalue when ``relative``.
            relative: Scale ``damping`` by each layer's mean eigenvalue.
            dtype: Compute dtype (default: the gradient's, at least float32).

        Returns:
            A :class:`Gradient` of :class:`Materialized` layers, in the gradient's dtype.
        """
        if not isinstance(damping, (int, float)) or not math.isfinite(damping) or damping < 0:
            raise ValueError(f"damping must be a finite number >= 0, got {damping!r}")
        unknown = [
            n
            for n in gradient.layer_names
            if n not in self.layers and n not in self.diagonal and n not in self.skipped
        ]
        missing = [n for n in self.layer_names if n not in gradient.layers]
        if unknown or missing:
            raise ValueError(
                f"the gradient's layers do not match the Kronecker fit: not in the fit: {unknown}; "
                f"fitted but absent from the gradient: {missing}. Fit and score with the same "
                "hook configuration."
            )
        out: dict[str, Materialized] = {}
        for name, eig in self.layers.items():
            lg = gradient.layers[name]
            ref, ct, q_g, q_a = in_basis(name, lg, eig, dtype)
            ev = eig.eigenvalues().to(device=ref.device, dtype=ct)
            lam = damping * float(ev.mean()) if relative else float(damping)
            denom = ev + lam
            if float(denom.min()) <= 0:
                raise ValueError(
                    f"layer {name!r}: F̂ + damping is singular (damping={damping}); use a "
                    "positive damping."
                )
            parts = [torch.matmul(q_g, rot / denom) @ q_a.mT for rot in rotated(lg, q_g, q_a, ct)]
            data = torch.cat(parts).reshape(lg.batch_size, -1).to(ref.dtype)
            out[name] = Materialized(data, lg.layer_type, lg.module_kwargs)
        for name, diag in self.diagonal.items():
            lg = gradient.layers[name]
            dense = lg.materialize().data
            ct = dtype or acc_dtype(dense)
            fisher = (diag.sq_sum / max(diag.num_samples, 1.0)).to(device=dense.device, dtype=ct)
            lam = damping * float(fisher.mean()) if relative else float(damping)
            if float((fisher + lam).min()) <= 0:
                raise ValueError(
                    f"layer {name!r}: diagonal Fisher + damping is singular; use a "
                    "positive damping."
                )
            out[name] = Materialized(
                (dense.to(ct) / (fisher + lam)).to(dense.dtype), lg.layer_type, lg.module_kwargs
            )
        return Gradient(out)

    def save(self, path: str | os.PathLike) -> None:
        """Write ``kronecker_factors.{safetensors,json}`` into the directory ``path``."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {
            "kind": self.kind,
            "layers": put_layers(self.layers, tensors),
            "diagonal": put_layers(self.diagonal, tensors),
            "skipped": self.skipped,
            "correction": self.correction,
        }
        write_bundle(path, "kronecker_factors", tensors, meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KroneckerFactors:
        """Read what :meth:`save` wrote, validating format, version, layers and shapes."""
        tensors, meta = read_bundle(path, "kronecker_factors")
        kind = meta.get("kind")
        if kind not in ("kfac", "ekfac"):
            raise ValueError(f"{path}: unknown kind {kind!r} (expected 'kfac' or 'ekfac').")
        layers = {}
        for name, m in meta["layers"].items():
            lead, k, d = fit_shapes(m["layer_type"], m["module_kwargs"])
            shapes = {"q_a": (d, d), "s_a": (d,), "q_g": (k, k), "s_g": (k,)}
            shapes["corrected"] = (k, d) if kind == "ekfac" else None
            tensors_of = read_layer(tensors, path, name, lead, shapes)
            layers[name] = LayerEigen(
                m["layer_type"],
                m["module_kwargs"],
                num_samples=float(m["num_samples"]),
                **tensors_of,
            )
        diags = get_diagonal(tensors, meta, path)
        return cls(kind, layers, diags, dict(meta["skipped"]), meta.get("correction"))


def eigendecompose(
    covariances: KroneckerCovariances,
    dtype: torch.dtype = torch.float64,
    progress: bool | None = False,
    warn_skipped: bool = True,
) -> KroneckerFactors:
    """K-FAC fit: eigendecompose every layer's ``A`` and ``G`` (batched over equal sizes).

    All-reduces the covariances first under ``torch.distributed`` and broadcasts rank 0's
    eigenvectors, so every rank holds the same basis.

    Args:
        covariances: Accumulated sums.
        dtype: Eigendecomposition dtype (float64 by default even for float32 models).
        progress: Show a progress bar (``None``: only on a terminal).
        warn_skipped: Warn once, listing the layers left out.
    """
    covariances.all_reduce()
    if not covariances.layers and not covariances.diagonal:
        raise ValueError(
            "no Kronecker-eligible layer was seen: nothing to fit. Hook linear / "
            "convolution layers (linear_io) for K-FAC, or capture with a 'dense' / 'sparse' / "
            "'mask' projection (fitted with its exact Fisher) or a 'logra' one."
        )
    mats: dict[tuple[str, str], torch.Tensor] = {}
    for name, c in covariances.layers.items():
        if c.num_samples <= 0 or c.num_tokens <= 0:
            raise ValueError(f"layer {name!r} has no samples or no tokens carrying gradient.")
        mats[(name, "a")] = c.a_mean().to(dtype)
        mats[(name, "g")] = (c.g_sum / c.num_samples).to(dtype)
    eig: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}  # (Q, s)
    groups: dict[tuple[int, torch.device], list[tuple[str, str]]] = {}
    for key, m in mats.items():
        groups.setdefault((m.shape[-1], m.device), []).append(key)
    for (n, _), keys in fit_progress(list(groups.items()), "eigendecomposition", progress):
        # a blocked layer (fused experts) adds its E matrices to the batch
        stacked = torch.cat([(0.5 * (mats[k] + mats[k].mT)).reshape(-1, n, n) for k in keys])
        s, q = torch.linalg.eigh(stacked)
        start = 0
        for key in keys:
            lead = mats[key].shape[:-2]
            stop = start + math.prod(lead)
            eig[key] = (  # LayerEigen's order: eigenvectors, eigenvalues
                q[start:stop].reshape(*lead, n, n).contiguous(),
                s[start:stop].reshape(*lead, n).clamp_min(0),
            )
            start = stop
    if get_world_size() > 1:
        for key in sorted(eig):
            for t in eig[key]:
                torch.distributed.broadcast(t, src=0)
    layers = {
        name: LayerEigen(
            c.layer_type, c.module_kwargs, *eig[(name, "a")], *eig[(name, "g")], None, c.num_samples
        )
        for name, c in covariances.layers.items()
    }
    skipped = dict(covariances.skipped)
    if skipped and warn_skipped and get_rank() == 0:
        warnings.warn(
            "K-FAC/EK-FAC applies to linear, convolution and fused-expert layers and projected "
            "vectors only; "
            "these layers are left "
            f"out of the preconditioner and of the scores: {skipped}. Pass "
            "non_kronecker='diagonal' (to the attributor, and to the "
            "KroneckerCovarianceCallback whose covariances it fits) to precondition them with a "
            "diagonal Fisher instead, or exclude them from the hook config.",
            UserWarning,
            stacklevel=2,
        )
    return KroneckerFactors("kfac", layers, dict(covariances.diagonal), skipped)


# ---- a layer's gradients in the fit's eigenbasis -----------------------------------------------
def in_basis(
    name: str, lg: LayerGradient, eig: LayerEigen, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor]:
    """Check ``lg`` against its layer's fit; return what rotating it into the basis needs.

    Returns:
        ``(ref, ct, Q_G, Q_A)``: a tensor of the layer's first site (its device and dtype are
        the computation's), the compute dtype (``dtype``, default the input's raised to at least
        float32) and the fit's eigenvectors on that device in that dtype.

    Raises:
        ValueError: the layer is not Kronecker-eligible or not of the fit's type and shape.
    """
    if not is_kronecker_layer(lg):
        raise ValueError(f"layer {name!r} of type {lg.layer_type} is not Kronecker-eligible.")
    kd = tuple(get_rule(lg.layer_type).matrix_shape(lg.module_kwargs))
    blocks = eig.q_g.shape[0] if eig.q_g.dim() == 3 else 1
    fit = (blocks * eig.q_g.shape[-1], eig.q_a.shape[-1])
    if kd != fit or lg.layer_type != eig.layer_type:
        raise ValueError(
            f"layer {name!r}: the gradients are {lg.layer_type} {kd}, the fit {eig.layer_type} "
            f"{fit}; the fit belongs to another model, hook configuration or projection (fit "
            "covariances under the store's HookManagerConfig(projection=...))."
        )
    s = layer_sites(lg)[0]
    ref = s.g if isinstance(s, Factorized) else s.data
    ct = dtype or acc_dtype(ref)
    return ref, ct, eig.q_g.to(device=ref.device, dtype=ct), eig.q_a.to(device=ref.device, dtype=ct)


def rotated(
    lg: LayerGradient, q_g: torch.Tensor, q_a: torch.Tensor, ct: torch.dtype
) -> Iterable[torch.Tensor]:
    """Yield ``Q_G^T M_n Q_A`` as ``(chunk, K, D)`` blocks over the samples of ``lg``.

    Factorised sites rotate their factors first, ``(g Q_G)^T (a Q_A)``, when
    ``T (K^2 + D^2) <= E K D (K + D)`` (``E = 1`` but for blocked layers, whose rule rotates each
    slot in its own block's basis, :meth:`LayerRule.kronecker_rotate`); otherwise the dense
    gradient is rotated (per block: ``Q`` then has a leading ``E`` axis).
    """
    k, d = q_g.shape[-1], q_a.shape[-1]
    lead = tuple(q_g.shape[:-2])
    b = lg.batch_size
    step = max(1, ROTATE_CHUNK_ELEMENTS // max(1, math.prod(lead) * k * d))
    for lo in range(0, b, step):
        idx = slice(lo, min(b, lo + step))
        total = None
        for site in layer_sites(lg.slice(idx)):
            blocks = math.prod(lead)
            cheap = isinstance(site, Factorized) and site.num_tokens * (
                k * k + d * d
            ) <= blocks * k * d * (k + d)
            if cheap and not lead:
                part = torch.bmm((site.g.to(ct) @ q_g).transpose(1, 2), site.a.to(ct) @ q_a)
            elif cheap:  # per-block eigenbases: the rule turns each slot in its own block's
                rule, kw = get_rule(site.layer_type), site.module_kwargs
                a2, g2 = rule.kronecker_rotate(site.a.to(ct), site.g.to(ct), q_a, q_g, kw)
                part = rule.materialize(a2, g2, kw).reshape(-1, *lead, k, d)
            else:
                m = site.materialize().data.to(ct).reshape(-1, *lead, k, d)
                part = torch.matmul(q_g.mT, m) @ q_a
            total = part if total is None else total + part
        yield total
