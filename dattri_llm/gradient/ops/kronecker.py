"""Kronecker-factored curvature: K-FAC / EK-FAC covariances, eigenbases and preconditioning.

Conventions (row-major matrix form, as everywhere in the library). A Kronecker-eligible layer
(``rule.kronecker``: linear, HF ``Conv1D``, convolutions via im2col) has the per-sample gradient
``M_n = sum_t g_{n,t} a_{n,t}^T`` of shape ``(K, D)``; its dense vector is ``vec(M_n)``
flattened row-major, so ``vec(g a^T) = g ⊗ a`` and ``vec(B X C^T) = (B ⊗ C) vec(X)``.

* **Fisher.** ``F = (1/N) sum_n vec(M_n) vec(M_n)^T``: the *mean* over the ``N`` training
  samples of per-sample gradient outer products (empirical Fisher), so a damping value means the
  same thing whatever the dataset size.
* **K-FAC.** ``F ≈ G ⊗ A`` (this order, because of the row-major ``vec``) with
  ``G = (1/N) sum_n sum_t g_{n,t} g_{n,t}^T`` (mean over samples of the per-sample sum over
  tokens) and ``A = (1/N_tok) sum_{n,t} a_{n,t} a_{n,t}^T`` (mean over tokens). That is the
  token-independence approximation ``F ≈ (1/N) sum_n sum_t (g g^T) ⊗ (a a^T)`` with activations
  and output gradients assumed independent: its scale grows with the tokens per sample like ``F``
  does. ``N_tok`` counts the positions that carry gradient (neither ``g`` nor ``a`` identically
  zero; a ``logra`` embedding's index side ``R[idx]`` never is), so zero padding and positions
  outside the loss (pad tokens, a causal LM's last position) are left out of ``A`` and ``G``
  just as they are absent from ``F``; ``tokens="all"`` counts every position (what
  kronfluence does without an attention mask). With one token per sample (an MLP) this is
  exactly Martens & Grosse's K-FAC. A conv layer's tokens are its output positions.
* **Eigenbasis.** ``A = Q_A diag(s_A) Q_A^T``, ``G = Q_G diag(s_G) Q_G^T`` (float64 by
  default, eigenvalues clamped at 0); K-FAC eigenvalues are ``s_G s_A^T`` (``(K, D)``).
* **EK-FAC.** Same basis, eigenvalues replaced by the empirical second moments in it:
  ``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` (elementwise), computed from the rotated factors
  ``(g Q_G)^T (a Q_A)`` when cheaper than rotating the dense gradient.
* **Preconditioning.** ``(F̂ + λ I)^{-1} vec(M) = vec(Q_G [(Q_G^T M Q_A) / (E + λ)] Q_A^T)`` with
  ``E`` the eigenvalues above; ``λ = damping`` (absolute), or ``damping * mean(E)`` per layer when
  ``relative=True``. The result is a :class:`Materialized` layer: the damped inverse is not a
  Kronecker product, so an exact factorised preconditioned gradient does not exist (only the
  undamped ``G^{-1} ⊗ A^{-1}`` would be); a preconditioned query is one dense ``(K, D)`` per
  sample, and scoring it against factorised training gradients stays factorised on the train
  side (``rule.dense_per_token``), which is what keeps token granularity exact.
* **Vector layers** (``rule.exact_fisher``: a ``"dense"`` / ``"sparse"`` / ``"mask"`` projection,
  matrix form ``(1, P)``): one token with ``a = v``, ``g = 1``, so ``G ⊗ A`` is the exact Fisher
  ``(1/N) sum_n v_n v_n^T`` and K-FAC and EK-FAC agree; damping as above.
* **Other layers** (embeddings, norms, ``param_grad``, tied groups with a non-eligible site):
  ``non_kronecker="skip"`` (default) leaves them out of the fit and of the scores, with one
  warning that lists them; ``"diagonal"`` preconditions them with the exact diagonal empirical
  Fisher ``(1/N) sum_n m_n^2`` (EK-FAC in the identity basis; it materialises their gradients
  during the fit, fine for norms, costly for large embeddings).

* **Fused experts** (``rule.kronecker_blocks(kw) = E > 1``, ``"moe.experts"``): the matrix
  form stacks ``E`` expert matrices ``M_e`` ``(K, D)``, and K-FAC is block-diagonal,
  ``F ≈ blockdiag_e(G_e ⊗ A_e)`` with ``G_e = (1/N) sum_n sum_{t->e} g g^T`` (``N``: *every*
  sample, as for a linear layer: the Fisher is a mean over samples, and a sample that did not
  reach expert ``e`` contributes its zero block) and ``A_e = (1/N_e) sum_{t->e} a a^T``
  (``N_e``: the counted routed (token, expert = e) slots, ``tokens`` as above). Covariances,
  eigenvectors and eigenvalues carry a leading expert axis (``A``: ``(E, D, D)``, EK-FAC
  eigenvalues ``(E, K, D)``); preconditioning is per expert,
  ``Q_{G_e} [(Q_{G_e}^T M_e Q_{A_e}) / (E_e + λ)] Q_{A_e}^T``, with ``relative`` damping
  scaled by the mean eigenvalue of the whole layer. An expert no counted slot of the fit data
  reached has ``A_e = G_e = 0`` (and zero EK-FAC eigenvalues): its block is preconditioned by
  damping alone, ``M_e / λ`` (refused as singular when ``λ = 0``).

Tied weights whose sites are all eligible (a :class:`Shared` layer) are one layer whose tokens
are the union of the sites' tokens. Under ``torch.distributed`` every accumulator is
all-reduced (sums and counts), and rank 0's eigenvectors are broadcast, so every rank holds the
same fit. Persistence (:meth:`KroneckerCovariances.save`, :meth:`KroneckerFactors.save`):
safetensors + JSON metadata, versioned and validated on load; no pickle.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, LayerGradient, Materialized, Shared
from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.ops.kronecker_io import checked_tensor, read_bundle, write_bundle
from dattri_llm.gradient.ops.kronecker_util import (
    DiagonalFisher,
    _as_gradient,
    _check_same_layers,
    _get_diagonal,
    _progress,
    _put_diagonal,
    fit_shapes,
)
from dattri_llm.utils.distributed import all_reduce_sum, get_world_size, is_distributed

__all__ = [
    "FORMAT_VERSION",
    "LayerCovariance",
    "KroneckerCovariances",
    "LayerEigen",
    "KroneckerFactors",
    "is_kronecker_layer",
    "fit_shapes",
]

#: Version of the on-disk format of covariances and factors.
FORMAT_VERSION = 1

#: Upper bound on the elements of one rotated ``(chunk, K, D)`` block.
ROTATE_CHUNK_ELEMENTS = 1 << 25

NonKronecker = Literal["skip", "diagonal"]
TokenCount = Literal["gradient", "all"]


def _sites(lg: LayerGradient) -> list[Factorized | Materialized]:
    return list(lg.sites) if isinstance(lg, Shared) else [lg]


def is_kronecker_layer(lg: LayerGradient) -> bool:
    """Whether K-FAC applies: every site has a ``kronecker`` rule and one matrix shape."""
    try:
        rules = [(get_rule(s.layer_type), s.module_kwargs) for s in _sites(lg)]
    except ValueError:  # e.g. "param_grad", which has no rule
        return False
    if not all(r.kronecker for r, _ in rules):
        return False
    return len({tuple(r.matrix_shape(kw)) for r, kw in rules}) == 1


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """GEMM dtype: the input's, raised to at least float32 (never lowered)."""
    return torch.promote_types(t.dtype, torch.float32)


def _token_mask(g: torch.Tensor, a: torch.Tensor, tokens: TokenCount) -> torch.Tensor:
    if tokens == "all":
        return torch.ones(g.shape[:2], dtype=torch.bool, device=g.device)
    return (g != 0).any(-1) & (a != 0).any(-1)  # g a^T = 0 when either factor is


@dataclass
class LayerCovariance:
    """Running sums of one layer (see the module docstring for the conventions).

    Attributes:
        layer_type: The layer's rule name.
        module_kwargs: Its hyper-parameters.
        a_sum: ``sum_{n,t} a a^T`` over counted tokens, ``(D, D)``.
        g_sum: ``sum_{n,t} g g^T``, ``(K, K)``.
        num_tokens: Counted token positions ``N_tok``.
        num_samples: Samples ``N``.
        block_tokens: Counted slots per block ``(E,)`` of a blocked layer (fused experts;
            ``a_sum`` / ``g_sum`` then have a leading ``E`` axis), else ``None``.
    """

    layer_type: str
    module_kwargs: dict
    a_sum: torch.Tensor
    g_sum: torch.Tensor
    num_tokens: float = 0.0
    num_samples: float = 0.0
    block_tokens: torch.Tensor | None = None

    def a_mean(self) -> torch.Tensor:
        """``A``: ``a_sum`` over the counted tokens (per block; an empty block stays zero)."""
        if self.block_tokens is None:
            return self.a_sum / self.num_tokens
        return self.a_sum / self.block_tokens.clamp_min(1.0).to(self.a_sum)[:, None, None]


class KroneckerCovariances:
    """Accumulates K-FAC covariances (and diagonal Fishers) from per-sample gradients.

    Feed it :class:`Gradient` blocks with :meth:`update` (or raw factors with
    :meth:`update_factors`); :meth:`all_reduce` sums the accumulators over ranks (done once,
    automatically, by :func:`eigendecompose`).

    Args:
        non_kronecker: ``"skip"`` or ``"diagonal"`` for layers K-FAC does not apply to.
        tokens: ``"gradient"`` (count positions whose output gradient is non-zero) or ``"all"``.
        dtype: Accumulator dtype (float64 by default; sums of float32 GEMMs).
    """

    def __init__(
        self,
        non_kronecker: NonKronecker = "skip",
        tokens: TokenCount = "gradient",
        dtype: torch.dtype = torch.float64,
    ) -> None:
        if non_kronecker not in ("skip", "diagonal"):
            raise ValueError(f"non_kronecker must be 'skip' or 'diagonal', got {non_kronecker!r}")
        if tokens not in ("gradient", "all"):
            raise ValueError(f"tokens must be 'gradient' or 'all', got {tokens!r}")
        self.non_kronecker = non_kronecker
        self.tokens = tokens
        self.dtype = dtype
        self.layers: dict[str, LayerCovariance] = {}
        self.diagonal: dict[str, DiagonalFisher] = {}
        self.skipped: dict[str, str] = {}
        self.reduced = False

    # ---- accumulation ----------------------------------------------------------------------
    def update(self, gradient: Gradient) -> None:
        """Add one block of per-sample gradients.

        Raises:
            ValueError: when an eligible layer was captured materialised (its factors are gone).
        """
        b = gradient.batch_size
        for name, lg in gradient.layers.items():
            if is_kronecker_layer(lg):
                pairs = _kronecker_pairs(name, lg)
                every = "all" if get_rule(lg.layer_type).exact_fisher else None  # F: 1/N
                self.update_factors(name, pairs, lg.layer_type, lg.module_kwargs, b, every)
            elif self.non_kronecker == "diagonal":
                self._update_diagonal(name, lg, b)
            else:
                self.skipped[name] = lg.layer_type

    def update_factors(
        self,
        name: str,
        factors: list[tuple[torch.Tensor, torch.Tensor]],
        layer_type: str,
        module_kwargs: dict,
        num_samples: int,
        tokens: TokenCount | None = None,
    ) -> None:
        """Add the ``(a, g)`` factors of one layer (several pairs: calls / tied sites).

        ``tokens`` overrides the accumulator's token counting for these factors.
        """
        lead, k, d = fit_shapes(layer_type, module_kwargs)
        cov = self.layers.get(name)
        if cov is None:
            dev = factors[0][1].device
            cov = LayerCovariance(
                layer_type,
                dict(module_kwargs),
                torch.zeros(*lead, d, d, dtype=self.dtype, device=dev),
                torch.zeros(*lead, k, k, dtype=self.dtype, device=dev),
                block_tokens=torch.zeros(*lead, dtype=torch.float64, device=dev) if lead else None,
            )
            self.layers[name] = cov
        for a, g in factors:
            if cov.block_tokens is not None:  # per-block sums: the rule knows the slot layout
                sa, sg, cnt = get_rule(layer_type).kronecker_sums(
                    a, g, module_kwargs, tokens or self.tokens
                )
                cov.a_sum += sa.to(self.dtype)
                cov.g_sum += sg.to(self.dtype)
                cov.block_tokens += cnt.to(cov.block_tokens)
                cov.num_tokens += float(cnt.sum())
                continue
            ct = _acc_dtype(g)
            mask = _token_mask(g, a, tokens or self.tokens)
            af = a.to(ct).reshape(-1, a.shape[-1])
            gf = g.to(ct).reshape(-1, g.shape[-1])
            if not bool(mask.all()):
                af, gf = af[mask.reshape(-1)], gf[mask.reshape(-1)]
            cov.a_sum += (af.T @ af).to(self.dtype)
            cov.g_sum += (gf.T @ gf).to(self.dtype)
            cov.num_tokens += float(mask.sum())
        cov.num_samples += float(num_samples)

    def _update_diagonal(self, name: str, lg: LayerGradient, b: int) -> None:
        dense = lg.materialize().data
        diag = self.diagonal.get(name)
        if diag is None:
            diag = DiagonalFisher(
                lg.layer_type,
                dict(lg.module_kwargs),
                torch.zeros(dense.shape[1], dtype=self.dtype, device=dense.device),
            )
            self.diagonal[name] = diag
        diag.sq_sum += dense.to(_acc_dtype(dense)).pow(2).sum(0).to(self.dtype)
        diag.num_samples += float(b)

    def accumulate(
        self, gradients: Iterable, progress: bool | None = False
    ) -> KroneckerCovariances:
        """:meth:`update` with every item of ``gradients`` (Gradients or GradientBlocks)."""
        for item in _progress(gradients, "K-FAC covariances", progress):
            self.update(_as_gradient(item))
        return self

    # ---- distributed -----------------------------------------------------------------------
    def all_reduce(self) -> KroneckerCovariances:
        """Sum every accumulator over ranks (no-op without a process group, or if done)."""
        if self.reduced or not is_distributed() or get_world_size() == 1:
            self.reduced = True
            return self
        _check_same_layers(sorted(self.layers) + ["|"] + sorted(self.diagonal), self._device())
        for name in sorted(self.layers):
            cov = self.layers[name]
            all_reduce_sum(cov.a_sum)
            all_reduce_sum(cov.g_sum)
            if cov.block_tokens is not None:
                all_reduce_sum(cov.block_tokens)
            counts = all_reduce_sum(
                torch.tensor(
                    [cov.num_tokens, cov.num_samples], dtype=torch.float64, device=cov.a_sum.device
                )
            )
            cov.num_tokens, cov.num_samples = float(counts[0]), float(counts[1])
        for name in sorted(self.diagonal):
            diag = self.diagonal[name]
            all_reduce_sum(diag.sq_sum)
            n = all_reduce_sum(
                torch.tensor([diag.num_samples], dtype=torch.float64, device=diag.sq_sum.device)
            )
            diag.num_samples = float(n[0])
        self.reduced = True
        return self

    def _device(self) -> torch.device | None:
        for c in self.layers.values():
            return c.a_sum.device
        for dg in self.diagonal.values():
            return dg.sq_sum.device
        return None

    def save(self, path: str | os.PathLike) -> None:
        """Write ``kronecker_covariances.{safetensors,json}`` into the directory ``path``."""
        tensors, layers = {}, {}
        for name, c in self.layers.items():
            tensors[f"{name}|a_sum"], tensors[f"{name}|g_sum"] = c.a_sum, c.g_sum
            if c.block_tokens is not None:
                tensors[f"{name}|block_tokens"] = c.block_tokens
            layers[name] = {
                "layer_type": c.layer_type,
                "module_kwargs": c.module_kwargs,
                "num_tokens": c.num_tokens,
                "num_samples": c.num_samples,
            }
        meta = {
            "non_kronecker": self.non_kronecker,
            "tokens": self.tokens,
            "reduced": self.reduced,
            "layers": layers,
            "diagonal": _put_diagonal(self.diagonal, tensors),
            "skipped": self.skipped,
        }
        write_bundle(path, "kronecker_covariances", tensors, meta, FORMAT_VERSION)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KroneckerCovariances:
        """Read what :meth:`save` wrote, checking the format, version and shapes."""
        tensors, meta = read_bundle(path, "kronecker_covariances", FORMAT_VERSION)
        out = cls(meta["non_kronecker"], meta["tokens"])
        out.reduced, out.skipped = bool(meta["reduced"]), dict(meta["skipped"])
        for name, m in meta["layers"].items():
            lead, k, d = fit_shapes(m["layer_type"], m["module_kwargs"])
            out.layers[name] = LayerCovariance(
                m["layer_type"],
                m["module_kwargs"],
                checked_tensor(tensors, path, f"{name}|a_sum", (*lead, d, d)),
                checked_tensor(tensors, path, f"{name}|g_sum", (*lead, k, k)),
                float(m["num_tokens"]),
                float(m["num_samples"]),
                checked_tensor(tensors, path, f"{name}|block_tokens", lead) if lead else None,
            )
        out.diagonal.update(_get_diagonal(tensors, meta, path))
        return out


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

    A blocked layer (fused experts) has a leading ``E`` axis on every tensor.
        num_samples: Samples the fit used.
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
            _check_shape(name, lg, eig)
            ref = _ref(lg)
            ct = dtype or _acc_dtype(ref)
            ev = eig.eigenvalues().to(device=ref.device, dtype=ct)
            lam = damping * float(ev.mean()) if relative else float(damping)
            denom = ev + lam
            if float(denom.min()) <= 0:
                raise ValueError(
                    f"layer {name!r}: F̂ + damping is singular (damping={damping}); use a "
                    "positive damping."
                )
            q_g = eig.q_g.to(device=ref.device, dtype=ct)
            q_a = eig.q_a.to(device=ref.device, dtype=ct)
            parts = [torch.matmul(q_g, rot / denom) @ q_a.mT for rot in _rotated(lg, q_g, q_a, ct)]
            data = torch.cat(parts).reshape(lg.batch_size, -1).to(ref.dtype)
            out[name] = Materialized(data, lg.layer_type, lg.module_kwargs)
        for name, diag in self.diagonal.items():
            lg = gradient.layers[name]
            dense = lg.materialize().data
            ct = dtype or _acc_dtype(dense)
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
        tensors, layers = {}, {}
        for name, e in self.layers.items():
            for key in ("q_a", "s_a", "q_g", "s_g"):
                tensors[f"{name}|{key}"] = getattr(e, key)
            if e.corrected is not None:
                tensors[f"{name}|corrected"] = e.corrected
            layers[name] = {
                "layer_type": e.layer_type,
                "module_kwargs": e.module_kwargs,
                "num_samples": e.num_samples,
            }
        diags = _put_diagonal(self.diagonal, tensors)
        meta = {"kind": self.kind, "layers": layers, "diagonal": diags, "skipped": self.skipped}
        meta["correction"] = self.correction
        write_bundle(path, "kronecker_factors", tensors, meta, FORMAT_VERSION)

    @classmethod
    def load(cls, path: str | os.PathLike) -> KroneckerFactors:
        """Read what :meth:`save` wrote, validating format, version, layers and shapes."""
        tensors, meta = read_bundle(path, "kronecker_factors", FORMAT_VERSION)
        kind = meta.get("kind")
        if kind not in ("kfac", "ekfac"):
            raise ValueError(f"{path}: unknown kind {kind!r} (expected 'kfac' or 'ekfac').")
        layers = {}
        for name, m in meta["layers"].items():
            lead, k, d = fit_shapes(m["layer_type"], m["module_kwargs"])
            get = lambda key, *shape, name=name, lead=lead: checked_tensor(  # noqa: E731
                tensors, path, f"{name}|{key}", (*lead, *shape)
            )
            layers[name] = LayerEigen(
                m["layer_type"],
                m["module_kwargs"],
                get("q_a", d, d),
                get("s_a", d),
                get("q_g", k, k),
                get("s_g", k),
                get("corrected", k, d) if kind == "ekfac" else None,
                float(m["num_samples"]),
            )
        diags = _get_diagonal(tensors, meta, path)
        return cls(kind, layers, diags, dict(meta["skipped"]), meta.get("correction"))


# ---- helpers ---------------------------------------------------------------------------------
def _ref(lg: LayerGradient) -> torch.Tensor:
    s = _sites(lg)[0]
    return s.g if isinstance(s, Factorized) else s.data


def _check_shape(name: str, lg: LayerGradient, eig: LayerEigen) -> None:
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


def _rotated(
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
        for site in _sites(lg.slice(idx)):
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


def _kronecker_pairs(name: str, lg: LayerGradient) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(a, g)`` pairs K-FAC accumulates; a vector layer (``exact_fisher``) is ``(v, 1)``."""
    if get_rule(lg.layer_type).exact_fisher:
        v = lg.materialize().data
        return [(v.unsqueeze(1), v.new_ones(v.shape[0], 1, 1))]
    if any(isinstance(s, Materialized) for s in _sites(lg)):
        raise ValueError(
            f"layer {name!r} ({lg.layer_type}) is materialized, so its K-FAC factors are gone. "
            "Capture with capture_style='factorized' and write the store with "
            "OffloadCallback(keep_token_factors=True), or accumulate the covariances during "
            "capture with KroneckerCovarianceCallback and pass them as fit(covariances=...); "
            "or use ProjectedFisherAttributor (each layer's exact Fisher, from any store form)."
        )
    return [(s.a, s.g) for s in _sites(lg)]
