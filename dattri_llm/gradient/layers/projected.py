"""Layers captured with a capture-time random projection, and the layer maths projection needs.

Every layer's per-sample gradient has a *matrix form* ``M`` of shape ``(K, D)`` (the weight's
shape, bias folded in as a last column; ``(V, E)`` for an embedding). The projection styles are:

* ``"logra"``: ``R^T M C`` with a *row* matrix ``R`` ``(K, k)`` and a *column* matrix ``C``
  ``(D, d)``. For an outer-product layer (``M = sum_t g_t a_t^T``) that is
  ``sum_t (R^T g_t)(C^T a_t)^T``: the layer stays factorised with factors ``a C`` ``(B, T, d)``
  and ``g R`` ``(B, T, k)`` and the per-sample gradient is never formed. For an embedding
  (``M = sum_t e_{idx_t} g_t^T``, rows = vocabulary) the row factor is ``R[idx]`` (rows of the
  projection matrix picked by the indices) and the column factor ``g C``. Both become
  :class:`ProjectedOuterProductRule` layers (``"projected.logra"``) with matrix form ``(k, d)``,
  so a tied embedding / LM head (same ``(V, E)`` form, same matrices) still sums exactly.
* ``"dense"`` / ``"mask"`` / ``"sparse"``: a vector ``(B, proj_dim)``
  (:class:`ProjectedVectorRule`): ``vec(M) @ P``, ``proj_dim`` exact entries of ``vec(M)``
  (row-major) gathered from the factors by :func:`gather_entries`, or a sparse JL sketch
  (``dattri_llm.gradient.ops.sparse_projection``; :func:`factor_sides` says which factor is the
  row side of an outer-product layer).

Projected layers carry JSON-able ``module_kwargs`` (the projection's seed and sizes and the source
layer's type and hyper-parameters), never the matrices: the same seed regenerates them.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.layers.base import LayerRule, OuterProductRule
from dattri_llm.gradient.layers.embedding import EmbeddingRule
from dattri_llm.gradient.layers.norm import _ElementwiseAffineRule

__all__ = [
    "ProjectedOuterProductRule",
    "ProjectedVectorRule",
    "ProjectedDenseRule",
    "ProjectedMaskRule",
    "ProjectedSparseRule",
    "logra_supported",
    "logra_projects_input_in_forward",
    "logra_project_input",
    "logra_project_factors",
    "logra_split",
    "gather_entries",
    "factor_sides",
]


class _NotAModule:
    """Projected rules interpret stored factors only; they never read a module."""

    def module_kwargs(self, module: nn.Module) -> dict:
        raise TypeError(
            f"layer type {self.layer_type!r} describes a projected capture, not a module; "
            "hook the layer with its own type and set HookManagerConfig(projection=...)."
        )

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        return self.module_kwargs(module)  # raises

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        raise TypeError(f"layer type {self.layer_type!r} cannot be hooked directly.")


class ProjectedOuterProductRule(_NotAModule, OuterProductRule):
    """A ``"logra"`` projected layer: factors ``(B, T, d)`` (column side) and ``(B, T, k)``.

    ``module_kwargs``: ``_k``/``_d`` = ``(k, d)``, ``proj_dim_out``/``proj_dim_in``, ``seed``,
    ``proj_type``, ``source_layer_type`` and ``source_module_kwargs``. K-FAC on these factors is
    K-FAC in the projected space (as in LoGra).
    """

    layer_type = "projected.logra"
    module_types = ()
    projection_styles = ()

    def param_names(self, kw: dict) -> list[str]:
        return ["projected"]

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        k, d = self.matrix_shape(kw)
        return {"projected": dense.reshape(dense.shape[0], k, d)}


class ProjectedVectorRule(_NotAModule, LayerRule):
    """A projected per-sample gradient stored as a vector ``(B, proj_dim)``.

    Its matrix form is ``(1, proj_dim)``; it is only ever materialised. K-FAC / EK-FAC fit its
    exact Fisher ``(1/N) sum_n v_n v_n^T`` (``proj_dim x proj_dim``): the matrix form is one
    row, so the Kronecker form ``G ⊗ A`` with ``G = 1`` and ``A`` the Fisher is exact.
    """

    layer_type = "projected.vector"
    module_types = ()
    projection_styles = ()
    kronecker = True
    exact_fisher = True

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return 1, int(kw["_d"])

    def param_names(self, kw: dict) -> list[str]:
        return ["projected"]

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        return {"projected": dense}


class ProjectedDenseRule(ProjectedVectorRule):
    """``"dense"``: ``vec(M) @ P`` with one seeded Gaussian / Rademacher matrix (TRAK-style)."""

    layer_type = "projected.dense"


class ProjectedMaskRule(ProjectedVectorRule):
    """``"mask"``: ``proj_dim`` seeded entries of ``vec(M)``, exact values."""

    layer_type = "projected.mask"


class ProjectedSparseRule(ProjectedVectorRule):
    """``"sparse"``: a seeded sparse JL transform of ``vec(M)`` (``nnz`` buckets per entry)."""

    layer_type = "projected.sparse"


# ---- logra: which factor is the row / column side of each layer family ------------------------
def logra_supported(rule: LayerRule) -> bool:
    """Whether the ``"logra"`` factor projection is implemented for the rule's layers."""
    return "logra" in rule.projection_styles and (
        isinstance(rule, (OuterProductRule, EmbeddingRule)) or _is_experts(rule)
    )


def _is_experts(rule: LayerRule) -> bool:
    """Whether ``rule`` is the fused-expert rule (no rule is one while ``moe.py`` is unloaded)."""
    moe = sys.modules.get("dattri_llm.gradient.layers.moe")
    return moe is not None and isinstance(rule, moe.MoEExpertsRule)


def logra_projects_input_in_forward(rule: LayerRule) -> bool:
    """Whether the forward hook can project the ``a`` factor (a column-side activation).

    Embeddings keep their integer indices until the backward hook.
    """
    return isinstance(rule, OuterProductRule)


def logra_project_input(rule: LayerRule, a: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Project an outer-product layer's activation factor ``(B, T, D) -> (B, T, d)``."""
    return a @ col.to(dtype=a.dtype)


def logra_project_factors(
    rule: LayerRule,
    a: torch.Tensor,
    g: torch.Tensor,
    row: torch.Tensor,
    col: torch.Tensor,
    a_projected: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The projected factors ``(a C, g R)`` of a layer (column side first).

    Args:
        rule: The source layer's rule.
        a: Input factor (already ``a C`` when ``a_projected``; indices for embeddings).
        g: Output-gradient factor.
        row: ``R`` ``(K, k)``.
        col: ``C`` ``(D, d)``.
        a_projected: Whether the forward hook projected ``a`` already.
    """
    if isinstance(rule, EmbeddingRule):
        # M = sum_t e_{idx_t} g_t^T: rows are the vocabulary, columns the embedding features
        return g @ col.to(dtype=g.dtype), row.to(dtype=g.dtype)[a.long()]
    if isinstance(rule, OuterProductRule):
        a_p = a if a_projected else logra_project_input(rule, a, col)
        return a_p, g @ row.to(dtype=g.dtype)
    if _is_experts(rule):
        # M = [M_0; ...; M_{E-1}] stacked (E*K, D): R^T M C = sum_e R_e^T M_e C, R_e the rows of
        # R for expert e, so each slot's g meets its own expert's block of R
        return _logra_experts(a, g, row.to(dtype=g.dtype), col.to(dtype=g.dtype))
    raise ValueError(f"'logra' projection is not implemented for layer type {rule.layer_type!r}.")


def _logra_experts(
    a: torch.Tensor, g: torch.Tensor, row: torch.Tensor, col: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(feat C, g R_{e})`` of a fused-expert layer's slots (``moe.experts`` factors)."""
    from dattri_llm.gradient.layers.moe import split_expert_factor  # an expert layer: loaded

    k = g.shape[-1]
    feat, ids = split_expert_factor(a, {"num_experts": row.shape[0] // k})
    g_p = g.new_zeros(*g.shape[:2], row.shape[1])
    for e in torch.unique(ids).tolist():
        hit = ids == e
        g_p[hit] = g[hit] @ row[e * k : (e + 1) * k]
    return feat @ col, g_p


# ---- logra: how proj_dim splits between the two sides -------------------------------------------
def logra_split(proj_dim: int | None, options: Mapping[str, Any]) -> tuple[int, int]:
    """``(proj_dim_in, proj_dim_out)`` of a ``"logra"`` config (sqrt split unless given).

    Raises:
        ValueError: sizes that are not positive ints, disagree, or do not split evenly.
    """
    d_in = options.get("proj_dim_in")
    d_out = options.get("proj_dim_out")
    for name, v in (("proj_dim_in", d_in), ("proj_dim_out", d_out)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"ProjectionConfig({name}=) must be a positive int, got {v!r}")
    if d_in is not None and d_out is not None:
        if proj_dim is not None and proj_dim != d_in * d_out:
            raise ValueError(
                f"logra proj_dim={proj_dim} must equal proj_dim_in * proj_dim_out = "
                f"{d_in} * {d_out}; pass one or the other."
            )
        return d_in, d_out
    if proj_dim is None:
        raise ValueError(
            "ProjectionConfig(style='logra') needs proj_dim, or both proj_dim_in and proj_dim_out."
        )
    if d_in is not None or d_out is not None:
        side = d_in if d_in is not None else d_out
        if proj_dim % side:
            raise ValueError(f"logra proj_dim={proj_dim} is not divisible by {side}.")
        other = proj_dim // side
        return (side, other) if d_in is not None else (other, side)
    root = math.isqrt(int(proj_dim))
    if root * root != proj_dim:
        raise ValueError(
            f"logra splits proj_dim evenly between the two factors (sqrt(proj_dim) each), so "
            f"it must be a perfect square, got {proj_dim}; pass proj_dim_in= and "
            "proj_dim_out= for an uneven split."
        )
    return root, root


# ---- mask: exact entries of the matrix form, gathered from the factors ------------------------
def gather_entries(
    rule: LayerRule, a: torch.Tensor, g: torch.Tensor, kw: dict, idx: torch.Tensor
) -> torch.Tensor:
    """Entries ``idx`` of the row-major flattened per-sample matrix form ``(B, len(idx))``.

    The dense per-sample gradient is never formed for outer-product layers, embeddings and
    elementwise-affine norms; other rules materialise and index (exact either way).
    """
    _, d = rule.matrix_shape(kw)
    rows, cols = torch.div(idx, d, rounding_mode="floor"), idx % d
    if isinstance(rule, EmbeddingRule):
        match = a.long().unsqueeze(-1) == rows  # (B, T, m)
        return (g[:, :, cols] * match).sum(1)
    if isinstance(rule, OuterProductRule):
        return (g[:, :, rows] * a[:, :, cols]).sum(1)
    if isinstance(rule, _ElementwiseAffineRule):
        parts = rule._parts(a[:, :, cols], g[:, :, cols], kw)  # each (B, T, m), row r = part r
        out = torch.zeros(a.shape[0], idx.numel(), dtype=g.dtype, device=g.device)
        for r, part in enumerate(parts):
            out = torch.where(rows == r, part.sum(1), out)
        return out
    return rule.materialize(a, g, kw)[:, idx]


# ---- sparse: the two sides of a sum of per-token outer products --------------------------------
def factor_sides(
    rule: LayerRule, a: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows, cols)`` with matrix form ``M = sum_t rows_t cols_t^T``, or ``None``.

    Outer-product layers: ``(g, a)`` (``(B, T, K)``, ``(B, T, D)``); embeddings: the indices of
    the one-hot rows ``(B, T)`` and ``g``; other rules (norms) have no such form.
    """
    if isinstance(rule, EmbeddingRule):
        return a.long(), g
    if isinstance(rule, OuterProductRule):
        return g, a
    return None
