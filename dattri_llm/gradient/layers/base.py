"""The layer-rule protocol and the shared maths of outer-product ("linear-like") layers.

A layer rule turns what hooks see — the layer's input (``a``) and the gradient of its output
(``g``) — into per-sample gradients, inner products, norms and per-token shares. Every rule
works on plain tensors with a leading batch axis and a token axis:

* ``a``: ``(B, T, D)`` (an integer ``(B, T)`` index tensor for embeddings),
* ``g``: ``(B, T, K)``,
* the materialised per-sample gradient: ``(B, P)``, the layer's *matrix form* flattened
  row-major. For outer-product layers the matrix form is ``(K, D)`` with the bias folded in
  as a last column of ``a`` (a column of ones), i.e. ``[W | b]``; :meth:`LayerRule.unflatten`
  maps it back to the parameters' own shapes.

The matrix form holds exactly the parameters :meth:`LayerRule.param_names` lists: the flags
``module_kwargs["weight"]`` / ``["bias"]`` say which are captured (a frozen weight, or the bias
of a tied layer captured on its own, is left out; :meth:`LayerRule.restrict_params`).

Every rule must be *exact*: the factorised and the materialised routes return the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = ["LayerRule", "OuterProductRule", "chunk_rows", "GRAM_CHUNK_ELEMENTS"]

#: Upper bound on the elements of the (B1, T, B2, S) intermediate of a factorised Gram.
GRAM_CHUNK_ELEMENTS = 1 << 25


class LayerRule:
    """How one family of layers turns factors into per-sample gradients and inner products.

    Subclasses set ``layer_type`` (the name used in configs, the store and errors) and
    ``module_types`` (classes recognised automatically), and implement the methods below.
    ``kronecker`` says whether K-FAC / EK-FAC may precondition the layer; ``exact_fisher`` that
    the layer is one short vector per sample (matrix form ``(1, P)``, always materialised), for
    which K-FAC / EK-FAC fit the exact ``P x P`` Fisher; ``projection_styles`` lists the
    capture-time projection styles it accepts.
    """

    layer_type: ClassVar[str] = ""
    module_types: ClassVar[tuple[type, ...]] = ()
    kronecker: ClassVar[bool] = False
    exact_fisher: ClassVar[bool] = False
    projection_styles: ClassVar[tuple[str, ...]] = ("logra", "dense", "mask", "sparse")
    #: Fill value for padding the token axis of ``a`` (zero contributions).
    a_pad_value: ClassVar[float] = 0.0
    #: Whether an un-batched call (input and output of batch 1 in a batch of ``B``, e.g. GPT-2's
    #: position ids) may be expanded to ``B`` rows at capture, so each sample gets its own output
    #: gradient instead of the batch sum.
    broadcasts_batch: ClassVar[bool] = False
    #: Whether ``a`` is a normalised input (a norm's ``x_hat``), of unit scale by construction:
    #: where it vanishes (an input constant over the normalised axes) the layer's gradient is
    #: round-off of that unit scale, not of ``a``'s own value (see ``hooks/coverage.py``).
    unit_scale_input: ClassVar[bool] = False

    # ---- capture -------------------------------------------------------------------------
    def module_kwargs(self, module: nn.Module) -> dict:
        """Read the hyper-parameters the rule needs off a module."""
        raise NotImplementedError

    def param_names(self, kw: dict) -> list[str]:
        """Names of the module's parameters covered by the rule, in matrix-form order."""
        names = ["weight"] if kw.get("weight", True) else []
        return names + (["bias"] if kw.get("bias") else [])

    def restrict_params(self, kw: dict, keep: Sequence[str]) -> dict:
        """``kw`` with the parameters not in ``keep`` left out of the matrix form.

        Raises:
            ValueError: the rule cannot leave those parameters out, or none would be left.
        """
        names = self.param_names(kw)
        out = dict(kw)
        for name in names:
            if name not in keep:
                out[name] = False
        left = self.param_names(out)
        if not left or left != [n for n in names if n in keep]:
            raise ValueError(
                f"{self.layer_type} cannot capture only the parameters {list(keep)} of {names}."
            )
        return out

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """Turn the forward's inputs into the ``a`` factor ``(B, T, D)``."""
        raise NotImplementedError

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        """Turn the gradient of the module output into the ``g`` factor ``(B, T, K)``."""
        raise NotImplementedError

    def capture_forward(
        self,
        module: nn.Module,
        args: tuple,
        output: torch.Tensor,
        kw: dict,
        batch: tuple[int | None, int | None],
    ) -> tuple[torch.Tensor, Any]:
        """The forward hook's ``(a, context)``; ``context`` reaches :meth:`context_output_grad`.

        Layers whose output gradient alone does not give ``g`` (fused experts: routing, the
        rows of each sample) carry what the backward needs in ``context``. ``batch`` is the
        model's ``(batch size, tokens per sample)``, each ``None`` when unknown.
        """
        return self.capture_input(module, args, output, kw), None

    def context_output_grad(self, grad: torch.Tensor, kw: dict, context: Any) -> torch.Tensor:
        """The ``g`` factor from the output gradient and the forward's ``context``."""
        return self.capture_output_grad(grad, kw)

    def sublayers(self, kw: dict) -> list[tuple[str, dict]]:
        """``[(name suffix, kwargs)]``: the layers one module is captured as (default: itself).

        A module whose parameters see different inputs (a fused expert module's
        ``gate_up_proj`` and ``down_proj``) becomes one layer per parameter,
        ``"<module>.<suffix>"``.
        """
        return [("", kw)]

    # ---- shapes ----------------------------------------------------------------------------
    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        """``(K, D)`` of the matrix form (``P = K * D``)."""
        raise NotImplementedError

    def kronecker_blocks(self, kw: dict) -> int:
        """Diagonal blocks of the K-FAC Fisher: ``1`` (one ``G ⊗ A``) unless overridden.

        A layer whose matrix form stacks ``E`` independent matrices (fused experts) returns
        ``E`` and implements :meth:`kronecker_sums`; K-FAC is then block-diagonal,
        ``blockdiag_e(G_e ⊗ A_e)``, each block ``(K / E, D)``.
        """
        return 1

    def kronecker_sums(
        self, a: torch.Tensor, g: torch.Tensor, kw: dict, tokens: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-block ``(sum a a^T (E, D, D), sum g g^T (E, K/E, K/E), counted tokens (E,))``.

        Only for rules with :meth:`kronecker_blocks` ``> 1``; ``tokens`` is ``"gradient"`` or
        ``"all"`` as in :mod:`dattri_llm.gradient.kronecker`.
        """
        raise NotImplementedError(f"{self.layer_type} has one Kronecker block.")

    def kronecker_rotate(
        self, a: torch.Tensor, g: torch.Tensor, q_a: torch.Tensor, q_g: torch.Tensor, kw: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors whose :meth:`materialize` is ``Q_{G_e}^T M_e Q_{A_e}`` for every block ``e``.

        Only for rules with :meth:`kronecker_blocks` ``> 1`` (``q_a`` ``(E, D, D)``, ``q_g``
        ``(E, K/E, K/E)``): EK-FAC rotates each slot's factors instead of the dense gradient.
        """
        raise NotImplementedError(f"{self.layer_type} has one Kronecker block.")

    def num_params(self, kw: dict) -> int:
        """Length ``P`` of the materialised per-sample gradient."""
        k, d = self.matrix_shape(kw)
        return k * d

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        """Map ``(B, P)`` matrix-form gradients to ``{param name: (B, *param.shape)}``."""
        raise NotImplementedError

    def matrix_positions(self, kw: dict) -> dict[str, torch.Tensor]:
        """Where each parameter entry sits in the flattened matrix form.

        Returns:
            ``{param name: LongTensor of param.shape}`` with values in ``[0, P)``: entry
            ``idx`` of the parameter is coordinate ``positions[name][idx]`` of the per-sample
            gradient. Derived from :meth:`unflatten` (a pure re-indexing), so per-parameter
            tensors (optimizer moments, parameter values) can be laid out exactly like the
            materialised gradient with :meth:`flatten_parameters`.
        """
        n = self.num_params(kw)
        return {k: v[0] for k, v in self.unflatten(torch.arange(n).unsqueeze(0), kw).items()}

    def flatten_parameters(
        self, tensors: dict[str, torch.Tensor], kw: dict, positions: dict | None = None
    ) -> torch.Tensor:
        """Lay out per-parameter tensors ``{name: param-shaped}`` as the ``(P,)`` matrix form."""
        positions = positions if positions is not None else self.matrix_positions(kw)
        first = next(iter(tensors.values()))
        out = first.new_zeros(self.num_params(kw))
        for name, pos in positions.items():
            out[pos.reshape(-1)] = tensors[name].reshape(-1).to(out.dtype)
        return out

    def zero_factors(
        self, b: int, kw: dict, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors ``(a, g)`` of an exactly zero per-sample gradient (a layer without gradient).

        One token: ``a`` ``(B, 1, D)`` and ``g`` ``(B, 1, K)`` for outer-product layers.
        """
        k, d = self.matrix_shape(kw)
        z = torch.zeros((), dtype=dtype, device=device)
        return z.new_zeros(b, 1, d), z.new_zeros(b, 1, k)

    # ---- maths -----------------------------------------------------------------------------
    def materialize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        """Dense per-sample gradient ``(B, P)``."""
        raise NotImplementedError

    def materialize_per_token(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        """Per-token shares of the dense gradient ``(B, T, P)`` (they sum to ``materialize``)."""
        raise NotImplementedError

    def gram(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """Factorised ("ghost") inner products ``(B1, B2)`` of two captures of the layer."""
        return self.gram_per_token(a1, g1, a2, g2, kw).sum(1)

    def gram_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """Factorised per-token contributions ``(B1, T1, B2)`` of the left capture."""
        raise NotImplementedError

    def dense_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """Per-token contributions ``(B1, T1, B2)`` of a factorised left side against dense."""
        per_tok = self.materialize_per_token(a1, g1, kw)
        return torch.einsum("btp,jp->btj", per_tok, dense2)

    def dense_cross(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """Inner products ``(B1, B2)`` of a factorised left side against dense rows.

        The per-token contributions summed over tokens; a rule overrides it when the sum has
        a cheaper exact form.
        """
        return self.dense_per_token(a1, g1, dense2, kw).sum(1)

    def norm_sq(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        """Squared norms ``(B,)`` of the per-sample gradients, factorised."""
        rows = [
            self.gram(a[i : i + 1], g[i : i + 1], a[i : i + 1], g[i : i + 1], kw)
            for i in range(a.shape[0])
        ]
        return torch.cat([r.reshape(1) for r in rows]) if rows else a.new_zeros(0)

    # ---- cost model ------------------------------------------------------------------------
    def prefer_materialized_gram(self, b1: int, b2: int, s1: int, s2: int, kw: dict) -> bool:
        """Whether materialise-then-GEMM is cheaper than the factorised Gram."""
        return True

    def prefer_materialized_norm(self, s: int, kw: dict) -> bool:
        """Whether materialising is cheaper than the factorised norm."""
        return True

    def prefer_materialized_against_dense(self, b1: int, b2: int, s: int, kw: dict) -> bool:
        """Against a dense right side: materialise the left or contract per token.

        Materialising costs ``B1 S P + B1 B2 P`` flops, the per-token route ``B1 S B2 P``.
        """
        return b1 * s + b1 * b2 <= b1 * s * b2

    def prefer_materialized_capture(self, s: int, kw: dict) -> bool:
        """Whether the dense per-sample gradient is smaller than the factors."""
        return True

    # ---- token axis ------------------------------------------------------------------------
    def pad_tokens(self, x: torch.Tensor, length: int, is_a: bool) -> torch.Tensor:
        """Pad the token axis (dim 1) of a factor to ``length`` with zero contributions."""
        extra = length - x.shape[1]
        if extra <= 0:
            return x
        pad_shape = (x.shape[0], extra, *x.shape[2:])
        fill = self.a_pad_value if is_a else 0
        return torch.cat([x, x.new_full(pad_shape, fill)], dim=1)

    def concat_tokens(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """Join several calls of the module along the token axis (their gradients add)."""
        return torch.cat(list(parts), dim=1)


class OuterProductRule(LayerRule):
    """Layers whose per-sample weight gradient is ``sum_t g_t a_t^T`` (linear, conv, ...).

    ``a`` carries the bias as a trailing column of ones when the layer has a bias, so the matrix
    form is ``[W | b]`` of shape ``(K, D)``. Without the weight (``kw["weight"]`` false: a
    frozen weight, or a tied layer's own bias) ``a`` is that column alone: ``(K, 1)``.

    Subclasses implement :meth:`input_features` (the weight's columns) and :meth:`num_features`.
    """

    kronecker = True

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return kw["_k"], kw["_d"]

    def num_features(self, kw: dict) -> int:
        """Columns of the weight's matrix form (``D`` without the bias column)."""
        raise NotImplementedError

    def matrix_columns(self, kw: dict) -> int:
        """Columns of the matrix form: the weight's (when captured) plus the bias column."""
        weight = self.num_features(kw) if kw.get("weight", True) else 0
        return weight + int(bool(kw.get("bias")))

    def input_features(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        """The weight's ``a`` factor ``(B, T, D)`` (receptive fields, inputs), no bias column."""
        raise NotImplementedError

    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        if not kw.get("weight", True):  # the bias alone: a column of ones per output token
            tokens = self.capture_output_grad(output.detach(), kw)
            return tokens.new_ones(*tokens.shape[:2], 1)
        return self.with_bias_column(
            self.input_features(module, args, output, kw), bool(kw.get("bias"))
        )

    def split_matrix(self, m: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        """``{"weight": (B, K, D), "bias": (B, K)}`` (captured ones only) of ``(B, K, cols)``."""
        out = {}
        if kw.get("weight", True):
            out["weight"] = m[..., : self.num_features(kw)]
        if kw.get("bias"):
            out["bias"] = m[..., -1]
        return out

    @staticmethod
    def with_bias_column(a: torch.Tensor, bias: bool) -> torch.Tensor:
        """Append the column of ones that folds the bias into the matrix form."""
        if not bias:
            return a
        return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)

    def materialize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        return torch.bmm(g.transpose(1, 2), a).reshape(a.shape[0], -1)

    def materialize_per_token(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        b, t = a.shape[:2]
        return (g.unsqueeze(-1) * a.unsqueeze(-2)).reshape(b, t, -1)

    def gram_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        b2, s = a2.shape[:2]
        a2f = a2.reshape(b2 * s, -1)
        g2f = g2.reshape(b2 * s, -1)

        def block(rows: slice) -> torch.Tensor:
            x, y = a1[rows], g1[rows]
            b, t = x.shape[:2]
            aa = x.reshape(b * t, -1) @ a2f.T
            gg = y.reshape(b * t, -1) @ g2f.T
            return (aa * gg).reshape(b, t, b2, s).sum(-1)

        return chunk_rows(a1, b2 * s, block)

    def gram(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        return self.gram_per_token(a1, g1, a2, g2, kw).sum(1)

    def dense_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        b1, t = a1.shape[:2]
        k, d = g1.shape[-1], a1.shape[-1]
        b2 = dense2.shape[0]
        w2 = dense2.reshape(b2 * k, d)

        def block(rows: slice) -> torch.Tensor:
            x, y = a1[rows], g1[rows]
            b = x.shape[0]
            wa = (x.reshape(b * t, d) @ w2.T).reshape(b, t, b2, k)
            return (wa * y.unsqueeze(2)).sum(-1)

        return chunk_rows(a1, b2 * k, block)

    def norm_sq(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        aa = torch.bmm(a, a.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        return (aa * gg).sum((1, 2))

    def prefer_materialized_gram(self, b1: int, b2: int, s1: int, s2: int, kw: dict) -> bool:
        from dattri_llm.gradient.ops.routing import materialized_gram_cheaper

        k, d = self.matrix_shape(kw)
        return materialized_gram_cheaper(b1, b2, s1, s2, k, d)

    def prefer_materialized_norm(self, s: int, kw: dict) -> bool:
        from dattri_llm.gradient.ops.routing import maybe_use_materialized_norm

        k, d = self.matrix_shape(kw)
        return maybe_use_materialized_norm(s, k, d)

    def prefer_materialized_capture(self, s: int, kw: dict) -> bool:
        from dattri_llm.gradient.ops.routing import should_materialize

        k, d = self.matrix_shape(kw)
        return should_materialize(s, k, d)


def chunk_rows(left: torch.Tensor, right_width: int, block: Any) -> torch.Tensor:
    """Run ``block`` over row chunks of ``left`` so ``rows * T * right_width`` stays bounded."""
    rows = left.shape[0]
    per_row = max(1, left.shape[1] * right_width)
    step = max(1, GRAM_CHUNK_ELEMENTS // per_row)
    if step >= rows:
        return block(slice(None))
    return torch.cat([block(slice(i, i + step)) for i in range(0, rows, step)])
