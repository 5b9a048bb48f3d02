"""Cross terms between two *sites* of one shared parameter (tied weights).

A parameter used by several modules (GPT-2's ``wte`` and ``lm_head``) has the sum of its sites'
gradients. Inner products of such sums need the cross terms ``<site_p(x), site_q(y)>``; they are
computed here from the factors. Same-type sites use the rule's own Gram; an embedding tied to a
bias-free linear layer has a dedicated factorised cross term; anything else materialises the
right-hand site (exact, just more memory).
"""

from __future__ import annotations

import torch

from dattri_llm.gradient.layers.base import LayerRule, OuterProductRule, chunk_rows
from dattri_llm.gradient.layers.embedding import EmbeddingRule

__all__ = ["cross_site_per_token"]


def _linear_x_embedding(
    a1: torch.Tensor, g1: torch.Tensor, idx2: torch.Tensor, ge2: torch.Tensor
) -> torch.Tensor:
    # <g1_t a1_t^T, sum_s e_{idx2_s} ge2_s^T> = sum_s g1_t[idx2_s] <a1_t, ge2_s>
    b2, s = idx2.shape
    d = a1.shape[-1]
    flat_idx = idx2.reshape(-1).long()
    ge2f = ge2.reshape(b2 * s, d)

    def block(rows: slice) -> torch.Tensor:
        x, y = a1[rows], g1[rows]
        b, t = x.shape[:2]
        picked = y[:, :, flat_idx]  # (b, t, B2*S)
        ad = (x.reshape(b * t, d) @ ge2f.T).reshape(b, t, b2 * s)
        return (picked * ad).reshape(b, t, b2, s).sum(-1)

    return chunk_rows(a1, b2 * s, block)


def _embedding_x_linear(
    idx1: torch.Tensor, ge1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor
) -> torch.Tensor:
    # <e_{idx1_t} ge1_t^T, sum_s g2_s a2_s^T> = sum_s g2_s[idx1_t] <ge1_t, a2_s>
    b2, s = a2.shape[:2]
    d = ge1.shape[-1]
    a2f = a2.reshape(b2 * s, d)
    g2f = g2.reshape(b2 * s, -1)

    def block(rows: slice) -> torch.Tensor:
        i1, y = idx1[rows], ge1[rows]
        b, t = i1.shape
        picked = g2f[:, i1.reshape(-1).long()].T.reshape(b, t, b2 * s)
        ad = (y.reshape(b * t, d) @ a2f.T).reshape(b, t, b2 * s)
        return (picked * ad).reshape(b, t, b2, s).sum(-1)

    return chunk_rows(idx1, b2 * s, block)


def cross_site_per_token(
    rule1: LayerRule,
    a1: torch.Tensor,
    g1: torch.Tensor,
    kw1: dict,
    rule2: LayerRule,
    a2: torch.Tensor,
    g2: torch.Tensor,
    kw2: dict,
) -> torch.Tensor:
    """Per-token contributions ``(B1, T1, B2)`` of site 1 (left) against site 2 (right)."""
    if type(rule1) is type(rule2):
        return rule1.gram_per_token(a1, g1, a2, g2, kw1)
    emb1, emb2 = isinstance(rule1, EmbeddingRule), isinstance(rule2, EmbeddingRule)
    if emb2 and isinstance(rule1, OuterProductRule) and not kw1.get("bias"):
        return _linear_x_embedding(a1, g1, a2, g2)
    if emb1 and isinstance(rule2, OuterProductRule) and not kw2.get("bias"):
        return _embedding_x_linear(a1, g1, a2, g2)
    if rule1.num_params(kw1) != rule2.num_params(kw2):
        raise ValueError(
            "cannot combine sites of a shared parameter with matrix forms "
            f"{rule1.matrix_shape(kw1)} ({rule1.layer_type}) and {rule2.matrix_shape(kw2)} "
            f"({rule2.layer_type})."
        )
    return rule1.dense_per_token(a1, g1, rule2.materialize(a2, g2, kw2), kw1)
