"""Embedding tables: ``a`` is the index tensor ``(B, T)``, ``g`` the output gradient ``(B, T, D)``.

The per-sample gradient ``sum_t e_{idx_t} g_t^T`` has the vocabulary as rows, so inner products
are computed from index matches, ``sum_{t,s} [idx_t = idx'_s] <g_t, g'_s>``, and the
``(V, D)`` gradient is never formed for dots.
"""

from __future__ import annotations

import torch
from torch import nn

from dattri_llm.gradient.layers.base import LayerRule, chunk_rows
from dattri_llm.gradient.layers.hf_classes import embedding_output_scale

__all__ = ["EmbeddingRule"]


class EmbeddingRule(LayerRule):
    """``nn.Embedding`` (``padding_idx`` rows get no gradient, as in PyTorch).

    A Hugging Face scaled embedding (Gemma's ``embedding(ids) * embed_scale``, recognised by
    class name in :mod:`~dattri_llm.gradient.layers.hf_classes`) records ``output_scale`` in its
    kwargs, and its output gradient is multiplied by it (the table's own gradient).
    """

    layer_type = "nn.Embedding"
    module_types = (nn.Embedding,)
    broadcasts_batch = True  # position ids are often one row shared by the batch
    projection_styles = ("logra", "dense", "mask", "sparse")
    a_pad_value = 0

    def module_kwargs(self, module: nn.Module) -> dict:
        if getattr(module, "scale_grad_by_freq", False):
            raise NotImplementedError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by batch frequencies, so "
                "per-sample gradients are not defined; disable it or exclude the layer."
            )
        kw = {
            "num_embeddings": int(module.num_embeddings),
            "embedding_dim": int(module.embedding_dim),
            "padding_idx": None if module.padding_idx is None else int(module.padding_idx),
        }
        scale = embedding_output_scale(module)
        if scale is not None and scale != 1.0:
            kw["output_scale"] = scale
        return kw

    def param_names(self, kw: dict) -> list[str]:
        return ["weight"]

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return int(kw["num_embeddings"]), int(kw["embedding_dim"])

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        idx = args[0].detach()
        return idx.reshape(idx.shape[0], -1) if idx.dim() > 1 else idx.reshape(1, -1)

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        d = int(kw["embedding_dim"])
        g = grad.reshape(grad.shape[0], -1, d) if grad.dim() > 2 else grad.reshape(1, -1, d)
        scale = kw.get("output_scale")
        return g if scale is None else g * scale

    def finalize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        """Zero the output gradient at ``padding_idx`` positions (PyTorch gives them none)."""
        pad = kw.get("padding_idx")
        if pad is None:
            return g
        return g.masked_fill((a == pad).unsqueeze(-1), 0)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        v, d = self.matrix_shape(kw)
        return {"weight": dense.reshape(dense.shape[0], v, d)}

    def zero_factors(
        self, b: int, kw: dict, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.zeros(b, 1, dtype=torch.long, device=device)
        return idx, torch.zeros(b, 1, int(kw["embedding_dim"]), dtype=dtype, device=device)

    def materialize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        v, d = self.matrix_shape(kw)
        b = a.shape[0]
        out = g.new_zeros(b, v, d)
        out.scatter_add_(1, a.long().unsqueeze(-1).expand(-1, -1, d), g)
        return out.reshape(b, v * d)

    def materialize_per_token(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        v, d = self.matrix_shape(kw)
        b, t = a.shape
        out = g.new_zeros(b, t, v, d)
        out.scatter_(2, a.long().reshape(b, t, 1, 1).expand(-1, -1, 1, d), g.unsqueeze(2))
        return out.reshape(b, t, v * d)

    def gram_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        b2, s = a2.shape
        d = g1.shape[-1]
        g2f = g2.reshape(b2 * s, d)
        i2 = a2.reshape(1, 1, b2 * s)

        def block(rows: slice) -> torch.Tensor:
            i1, y = a1[rows], g1[rows]
            b, t = i1.shape
            gg = (y.reshape(b * t, d) @ g2f.T).reshape(b, t, b2 * s)
            match = i1.unsqueeze(-1) == i2
            return (gg * match).reshape(b, t, b2, s).sum(-1)

        return chunk_rows(a1, b2 * s, block)

    def dense_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        v, d = self.matrix_shape(kw)
        w2 = dense2.reshape(-1, v, d)
        rows = w2[:, a1.long()]  # (B2, B1, T, D)
        return torch.einsum("jbtd,btd->btj", rows, g1)

    def dense_cross(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """``(B1, B2)``: each left sample's gradient on the rows its indices hit, times those rows.

        Equal to summing :meth:`dense_per_token` over tokens, but the dense side is read once
        per distinct index of the left block (``index_select`` of whole rows) instead of once
        per token and per right sample through an advanced-index gather: GPT-2 4x512 (vocab
        1000), 8 train x 32 test rows of 64 tokens, 33 -> 9 ms.
        """
        v, d = self.matrix_shape(kw)
        b1 = a1.shape[0]
        ids, where = torch.unique(a1.long(), return_inverse=True)
        hit = g1.new_zeros(b1, ids.numel(), d)
        hit.scatter_add_(1, where.reshape(b1, -1, 1).expand(-1, -1, d), g1.reshape(b1, -1, d))
        rows = dense2.reshape(-1, v, d).index_select(1, ids)
        return hit.reshape(b1, -1) @ rows.reshape(rows.shape[0], -1).T

    def norm_sq(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        gg = torch.bmm(g, g.transpose(1, 2))
        match = a.unsqueeze(-1) == a.unsqueeze(-2)
        return (gg * match).sum((1, 2))

    def prefer_materialized_gram(self, b1: int, b2: int, s1: int, s2: int, kw: dict) -> bool:
        v, d = self.matrix_shape(kw)
        factorized = b1 * b2 * s1 * s2 * (d + 1)
        materialized = (b1 * s1 + b2 * s2) * d + b1 * b2 * v * d
        return materialized < factorized

    def prefer_materialized_against_dense(self, b1: int, b2: int, s: int, kw: dict) -> bool:
        # the per-token route gathers D numbers per token; materialising scatters V x D
        v, _ = self.matrix_shape(kw)
        return v * b2 < s * b2

    def prefer_materialized_norm(self, s: int, kw: dict) -> bool:
        v, d = self.matrix_shape(kw)
        return v * d < s * s * (d + 1)

    def prefer_materialized_capture(self, s: int, kw: dict) -> bool:
        v, d = self.matrix_shape(kw)
        return v * d < s * (d + 1)
