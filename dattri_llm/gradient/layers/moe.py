"""Mixture-of-experts layers: fused expert weights, routers, and linears fed flattened tokens.

Hugging Face ``transformers`` 5.x keeps a sparse block's experts in *one* module
(``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``,
``GptOssExperts``) whose parameters are 3-D: ``gate_up_proj`` ``(E, 2I, H)`` and ``down_proj``
``(E, H, I)`` (gpt-oss: transposed, ``(E, H, 2I)`` / ``(E, I, H)``, with per-expert biases).
The module receives the block's tokens flattened to ``(B*T, H)`` rows (batch-major), the
router's top-k expert indices and weights, and for every expert ``e`` computes
``down_e(gate(gate_up_e(x_t))) * w_{t,e}`` over the tokens routed to ``e``.

Each 3-D parameter is a layer of its own, ``"<module>.gate_up_proj"`` / ``"<module>.down_proj"``
(:class:`MoEExpertsRule`, layer type ``"moe.experts"``). Its per-sample gradient is the stack of
the per-expert gradients ``M_e = sum_{t -> e} g_{t,e} a_{t,e}^T`` (matrix form ``(E*K, D)``,
``[W_e | b_e]`` per expert), kept factorised with one *token slot per routed (token, expert)
pair*:

* ``a``: ``(B, T*k, D [+1 bias column] + 1)``: the pair's input row (``x_t`` for
  ``gate_up_proj``, the gated activation ``h_{t,e}`` for ``down_proj``) followed by the expert
  index as a number (exact in every float dtype for ``E <= 256``);
* ``g``: ``(B, T*k, K)``: the gradient of the expert's linear output for that pair,
  ``w_{t,e} dL/dy_t`` for ``down_proj``, its back-propagation through ``W_down[e]`` and the
  module's own gate (``_apply_gate``) for ``gate_up_proj``.

An expert no token of a sample reached has no slot in that sample's factors: its block of the
per-sample gradient is exactly zero and costs nothing (a dropped pair, index outside
``[0, E)``, is a zero slot). Inner products match slots by expert index, so a Gram costs what a
dense linear layer with ``T*k`` tokens costs. The routing is re-derived from the module's own
inputs (``top_k_index`` / ``top_k_weights``) exactly as its eager loop does, and the
intermediate activations are recomputed from the detached inputs and weights, whatever
``experts_implementation`` ran the forward (``"eager"``, ``"grouped_mm"``, ...).

Routers (``MixtralTopKRouter``, ...) and the ``nn.Linear`` layers of a Qwen2-MoE shared expert
see the same flattened rows: :class:`TokenLinearRule` (``"moe.token_linear"``) is a linear
layer whose rows are put back into ``(B, T, .)`` with the model's batch size.

Expert modules of any other class are refused by name (never captured wrongly).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dattri_llm.gradient.layers.base import LayerRule, chunk_rows
from dattri_llm.gradient.layers.hf_classes import KNOWN_EXPERTS, MOE_EXPERTS, MOE_TOKEN_LINEAR
from dattri_llm.gradient.layers.linear import LinearRule

__all__ = [
    "MoEExpertsRule",
    "TokenLinearRule",
    "KNOWN_EXPERTS",
    "split_expert_factor",
    "expert_covariances",
]

#: Largest expert count whose index every float dtype (bfloat16 included) holds exactly.
MAX_EXPERTS = 256


def _rows_to_samples(
    x: torch.Tensor, batch: tuple[int | None, int | None], what: str
) -> torch.Tensor:
    """``(B*T, 1, W)`` flattened rows -> ``(B, T, W)`` (batch-major, as the MoE blocks flatten).

    Raises:
        RuntimeError: the batch size is unknown, or the rows are not the whole batch's tokens
            (a block called on sub-batches would otherwise give rows to the wrong samples).
    """
    b, tokens = batch
    if b is None:
        raise RuntimeError(
            f"{what} sees the batch's tokens flattened into rows, so the model's batch size is "
            "needed to give each sample its rows: call the model itself inside collect() (the "
            "manager reads the batch size from its inputs)."
        )
    n = x.shape[0] * x.shape[1]
    if x.shape[0] == b and (tokens is None or n == b * tokens):
        return x
    if n % b or (tokens is not None and n != b * tokens):
        raise RuntimeError(
            f"{what} saw {n} token rows, while the model's batch has {b} samples"
            + (f" x {tokens} tokens" if tokens is not None else "")
            + ": its rows cannot be given to samples (a block called on sub-batches, or on "
            "other tokens than the batch's, is not supported). Exclude it "
            "(HookManagerConfig(exclude=[...]))."
        )
    return x.reshape(b, n // b, *x.shape[2:])


class TokenLinearRule(LinearRule):
    """A linear map of batch-major flattened tokens ``(B*T, D)``: routers, shared experts.

    The maths is :class:`~dattri_llm.gradient.layers.linear.LinearRule`'s; only the rows are
    regrouped per sample with the model's batch size. Modules that are not ``nn.Linear``
    (routers) hold ``weight`` ``(K, D)`` and optionally ``bias`` ``(K,)``.
    """

    layer_type = MOE_TOKEN_LINEAR
    module_types = ()  # routers are matched by class name; shared-expert linears by their block

    def module_kwargs(self, module: nn.Module) -> dict:
        if isinstance(module, nn.Linear):
            return super().module_kwargs(module)
        w = getattr(module, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise NotImplementedError(
                f"{type(module).__name__} has no 2-D weight, so it is not a router the "
                "moe.token_linear rule can read."
            )
        return {
            "in_features": int(w.shape[1]),
            "out_features": int(w.shape[0]),
            "bias": isinstance(getattr(module, "bias", None), torch.Tensor),
        }

    def capture_forward(
        self,
        module: nn.Module,
        args: tuple,
        output: torch.Tensor,
        kw: dict,
        batch: tuple[int | None, int | None],
    ) -> tuple[torch.Tensor, Any]:
        a = self.capture_input(module, args, output, kw)
        return _rows_to_samples(a, batch, type(module).__name__), batch

    def context_output_grad(self, grad: torch.Tensor, kw: dict, context: Any) -> torch.Tensor:
        return _rows_to_samples(self.capture_output_grad(grad, kw), context, "moe.token_linear")


# ---- the factor layout ------------------------------------------------------------------------
def split_expert_factor(a: torch.Tensor, kw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features (B, S, D'), expert index (B, S) long)`` of an ``"moe.experts"`` ``a`` factor.

    Raises:
        ValueError: an index that is not an integer in ``[0, E)`` (a factor written in a dtype
            too narrow for the expert count, or not an expert factor at all).
    """
    ids = a[..., -1]
    e = int(kw["num_experts"])
    if ids.numel() and (
        not torch.equal(ids, ids.round()) or float(ids.min()) < 0 or float(ids.max()) >= e
    ):
        raise ValueError(
            f"moe.experts factor: the expert-index column holds values outside the integers "
            f"0..{e - 1}; the factor was stored in a dtype that cannot hold them, or is not an "
            "expert factor."
        )
    return a[..., :-1], ids.long()


def _per_expert(ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``[(expert, flat positions)]`` of the slots of each expert present (ascending)."""
    flat = ids.reshape(-1)
    if not flat.numel():
        return []
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat).tolist()
    parts = order.split(counts)
    return [(e, parts[e]) for e, c in enumerate(counts) if c]


def _expert_map(
    groups: list[tuple[int, torch.Tensor]], x: torch.Tensor, fn: Any, width: int
) -> torch.Tensor:
    """``out[rows] = fn(x[rows], e)`` for each expert's rows: one gather, one scatter."""
    if not groups:
        return x.new_zeros(0, width)
    order = torch.cat([rows for _, rows in groups])
    xs = x[order]
    outs, start = [], 0
    for e, rows in groups:
        outs.append(fn(xs[start : start + rows.numel()], e))
        start += rows.numel()
    out = x.new_empty(x.shape[0], width)
    out[order] = torch.cat(outs)
    return out


def expert_covariances(
    a: torch.Tensor, g: torch.Tensor, kw: dict, tokens: str = "gradient"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-expert K-FAC sums ``(A (E, D', D'), G (E, K, K), token counts (E,))``.

    ``A_e = sum a a^T`` and ``G_e = sum g g^T`` over the slots routed to expert ``e``, the
    per-expert analogue of a linear layer's K-FAC sums (each expert a linear layer of its own).
    Which slots count follows the linear layers' ``tokens`` convention: ``"gradient"`` counts the
    slots whose input row and output gradient are both non-zero (``g a^T != 0``: positions
    outside the loss and padding are left out); ``"all"`` counts every routed slot (a non-zero
    input row; pad slots and dropped pairs are all-zero rows and never count).
    """
    if tokens not in ("gradient", "all"):
        raise ValueError(f"tokens must be 'gradient' or 'all', got {tokens!r}")
    feat, ids = split_expert_factor(a, kw)
    e, d, k = int(kw["num_experts"]), feat.shape[-1], g.shape[-1]
    f2, g2 = feat.reshape(-1, d), g.reshape(-1, k)
    live = (f2 != 0).any(-1)
    if tokens == "gradient":
        live &= (g2 != 0).any(-1)
    acc = torch.promote_types(g.dtype, torch.float32)
    a_sum = f2.new_zeros(e, d, d, dtype=acc)
    g_sum = g2.new_zeros(e, k, k, dtype=acc)
    count = torch.zeros(e, dtype=acc, device=g.device)
    for ex, pos in _per_expert(ids):
        pos = pos[live[pos]]
        x, y = f2[pos].to(acc), g2[pos].to(acc)
        a_sum[ex], g_sum[ex], count[ex] = x.T @ x, y.T @ y, float(pos.numel())
    return a_sum, g_sum, count


class MoEExpertsRule(LayerRule):
    """One 3-D parameter of a fused expert module (see the module docstring for the layout).

    ``module_kwargs``: ``num_experts``, ``param`` (``"gate_up_proj"`` / ``"down_proj"``),
    ``in_features`` ``D``, ``out_features`` ``K``, ``transposed`` (weights stored ``(E, D, K)``),
    ``bias`` (a per-expert bias ``<param>_bias``), ``family`` (the module's class).
    """

    layer_type = MOE_EXPERTS
    module_types = ()  # matched by class name: transformers is never imported here
    kronecker = True  # block-diagonal over experts: kronecker_blocks / kronecker_sums
    projection_styles = ("logra", "dense", "mask", "sparse")

    # ---- reading the module ------------------------------------------------------------------
    def module_kwargs(self, module: nn.Module) -> dict:
        cls = type(module).__name__
        if cls not in KNOWN_EXPERTS or not type(module).__module__.startswith("transformers"):
            raise NotImplementedError(
                f"fused expert module {cls} follows no known layout (known: "
                f"{', '.join(sorted(KNOWN_EXPERTS))}), so its per-expert gradients cannot be "
                "derived and it is not captured. Exclude it, hook it with param_grad (batch "
                "size 1), or add its layout to dattri_llm/gradient/layers/moe.py."
            )
        if getattr(module, "has_post_expert_norm", False) or not getattr(module, "has_gate", True):
            raise NotImplementedError(f"{cls} with a post-expert norm or no gate is not supported.")
        if not callable(getattr(module, "_apply_gate", None)):
            raise NotImplementedError(
                f"{cls} has no _apply_gate (transformers older than 5.x?); it is not captured."
            )
        e = int(module.gate_up_proj.shape[0])
        if e > MAX_EXPERTS:
            raise NotImplementedError(
                f"{cls} has {e} experts; the factor layout holds expert indices up to "
                f"{MAX_EXPERTS} exactly."
            )
        t = bool(getattr(module, "is_transposed", False))
        gu, dn = module.gate_up_proj, module.down_proj
        h, k2 = (gu.shape[1], gu.shape[2]) if t else (gu.shape[2], gu.shape[1])
        i = dn.shape[1] if t else dn.shape[2]
        bias = isinstance(getattr(module, "gate_up_proj_bias", None), torch.Tensor)
        return {
            "num_experts": e,
            "family": cls,
            "transposed": t,
            "bias": bias,
            "hidden": int(h),
            "gate_up_out": int(k2),
            "intermediate": int(i),
        }

    def sublayers(self, kw: dict) -> list[tuple[str, dict]]:
        if "param" in kw:
            return [("", kw)]
        base = {k: kw[k] for k in ("num_experts", "family", "transposed", "bias")}
        h, k2, i = kw["hidden"], kw["gate_up_out"], kw["intermediate"]
        return [
            (
                "gate_up_proj",
                {**base, "param": "gate_up_proj", "in_features": h, "out_features": k2},
            ),
            ("down_proj", {**base, "param": "down_proj", "in_features": i, "out_features": h}),
        ]

    def param_names(self, kw: dict) -> list[str]:
        p = kw["param"]
        return ([p] if kw.get("weight", True) else []) + ([f"{p}_bias"] if kw.get("bias") else [])

    def restrict_params(self, kw: dict, keep: Any) -> dict:
        out = dict(kw)
        out["weight"] = kw["param"] in keep and kw.get("weight", True)
        out["bias"] = f"{kw['param']}_bias" in keep and bool(kw.get("bias"))
        if not self.param_names(out):
            raise ValueError(f"moe.experts cannot capture none of {self.param_names(kw)}.")
        return out

    # ---- shapes ------------------------------------------------------------------------------
    def _cols(self, kw: dict) -> int:
        """Columns ``D'`` of one expert's matrix form (weight columns, bias column)."""
        w = int(kw["in_features"]) if kw.get("weight", True) else 0
        return w + int(bool(kw.get("bias")))

    def matrix_shape(self, kw: dict) -> tuple[int, int]:
        return int(kw["num_experts"]) * int(kw["out_features"]), self._cols(kw)

    def kronecker_blocks(self, kw: dict) -> int:
        return int(kw["num_experts"])

    def kronecker_sums(
        self, a: torch.Tensor, g: torch.Tensor, kw: dict, tokens: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return expert_covariances(a, g, kw, tokens)

    def kronecker_rotate(
        self, a: torch.Tensor, g: torch.Tensor, q_a: torch.Tensor, q_g: torch.Tensor, kw: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feat, ids = split_expert_factor(a, kw)
        d, k = feat.shape[-1], g.shape[-1]
        f_in, g_in = feat.reshape(-1, d), g.reshape(-1, k)
        f_out, g_out = torch.zeros_like(f_in), torch.zeros_like(g_in)
        for ex, rows in _per_expert(ids):  # each slot turns into its own expert's eigenbasis
            f_out[rows] = f_in[rows] @ q_a[ex]
            g_out[rows] = g_in[rows] @ q_g[ex]
        a_out = torch.cat([f_out.reshape(feat.shape), a[..., -1:]], -1)
        return a_out, g_out.reshape(g.shape)

    def unflatten(self, dense: torch.Tensor, kw: dict) -> dict[str, torch.Tensor]:
        e, k = int(kw["num_experts"]), int(kw["out_features"])
        m = dense.reshape(dense.shape[0], e, k, self._cols(kw))
        out = {}
        if kw.get("weight", True):
            w = m[..., : int(kw["in_features"])]
            out[kw["param"]] = w.transpose(-1, -2) if kw.get("transposed") else w
        if kw.get("bias"):
            out[f"{kw['param']}_bias"] = m[..., -1]
        return out

    def zero_factors(
        self, b: int, kw: dict, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros((), dtype=dtype, device=device)
        return z.new_zeros(b, 1, self._cols(kw) + 1), z.new_zeros(b, 1, int(kw["out_features"]))

    # ---- capture -----------------------------------------------------------------------------
    def capture_input(
        self, module: nn.Module, args: tuple, output: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        raise RuntimeError("moe.experts layers are captured with capture_forward.")

    def capture_output_grad(self, grad: torch.Tensor, kw: dict) -> torch.Tensor:
        raise RuntimeError("moe.experts layers are captured with context_output_grad.")

    def _linear(self, module: nn.Module, name: str, x: torch.Tensor, e: int, kw: dict):
        w = getattr(module, name)[e].detach()
        y = x @ w if kw.get("transposed") else F.linear(x, w)
        b = getattr(module, f"{name}_bias", None)
        return y + b[e].detach() if isinstance(b, torch.Tensor) else y

    def _gate_up(
        self,
        module: nn.Module,
        args: tuple,
        x: torch.Tensor,
        tok: torch.Tensor,
        pos: torch.Tensor,
        e_all: torch.Tensor,
        kw: dict,
    ) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
        """Per-expert slot groups and the recomputed ``gate_up`` rows of one forward call.

        Both layers of a module hook the same call: the second reuses the first's result
        (same module, same input tensors at the same version), then drops it.
        """
        key = (id(module), id(args[0]), args[0]._version, id(args[1]), id(args[2]))
        cached, self._recent = getattr(self, "_recent", None), None
        if cached is not None and cached[0] == key:
            return cached[2], cached[3]
        groups = _per_expert(e_all[pos])
        width = module.gate_up_proj.shape[2 if kw["transposed"] else 1]
        gu = _expert_map(
            groups,
            x[tok[pos]],
            lambda rows, ex: self._linear(module, "gate_up_proj", rows, ex, kw),
            width,
        )
        # the objects themselves are held so that their ids cannot be reused meanwhile
        self._recent = (key, (module, *args[:3]), groups, gu)
        return groups, gu

    def capture_forward(
        self,
        module: nn.Module,
        args: tuple,
        output: torch.Tensor,
        kw: dict,
        batch: tuple[int | None, int | None],
    ) -> tuple[torch.Tensor, Any]:
        if len(args) < 3:
            raise RuntimeError(
                f"{kw['family']} was called without positional (hidden_states, top_k_index, "
                "top_k_weights), so its routing cannot be read; it is not captured."
            )
        x, idx, w = args[0].detach(), args[1].detach(), args[2].detach()
        n, top_k = x.shape[0], idx.shape[-1]
        b = _rows_to_samples(x.reshape(n, 1, -1), batch, kw["family"]).shape[0]  # checks rows
        e_all = idx.reshape(-1).long()
        valid = (e_all >= 0) & (e_all < int(kw["num_experts"]))
        tok = torch.arange(n, device=x.device).repeat_interleave(top_k)
        pos = valid.nonzero().squeeze(1)
        groups, gu = self._gate_up(module, args, x, tok, pos, e_all, kw)
        if kw["param"] == "gate_up_proj":
            feat = x[tok[pos]]
        else:
            with torch.no_grad():
                feat = module._apply_gate(gu)
        if kw.get("bias"):
            ones = feat.new_ones(feat.shape[0], 1)
            feat = torch.cat([feat, ones], -1) if kw.get("weight", True) else ones
        slots = feat.new_zeros(n * top_k, feat.shape[-1] + 1)
        slots[pos, :-1] = feat
        slots[pos, -1] = e_all[pos].to(feat.dtype)
        a = slots.reshape(b, (n // b) * top_k, -1)
        context = {
            "module": module,
            "b": b,
            "rows": tok[pos],
            "pos": pos,
            "groups": groups,
            "weight": w.reshape(-1)[pos],
            "slots": n * top_k,
            "gate_up": gu if kw["param"] == "gate_up_proj" else None,
        }
        return a, context

    def context_output_grad(self, grad: torch.Tensor, kw: dict, context: Any) -> torch.Tensor:
        c = context
        dy = grad.reshape(grad.shape[0] if grad.dim() == 2 else -1, grad.shape[-1])
        dy = dy[c["rows"]] * c["weight"].to(dy.dtype).unsqueeze(-1)  # d loss / d down output
        if kw["param"] == "gate_up_proj":
            module, transposed = c["module"], kw.get("transposed")

            def back(rows: torch.Tensor, ex: int) -> torch.Tensor:
                wd = module.down_proj[ex].detach()
                return rows @ (wd.T if transposed else wd)

            width = int(module.down_proj.shape[2 if not transposed else 1])
            dh = _expert_map(c["groups"], dy, back, width)
            with torch.enable_grad():
                gu = c["gate_up"].detach().requires_grad_(True)
                (dy,) = torch.autograd.grad(module._apply_gate(gu), gu, dh)
        out = dy.new_zeros(c["slots"], dy.shape[-1])
        out[c["pos"]] = dy
        return out.reshape(c["b"], -1, dy.shape[-1])

    # ---- maths -------------------------------------------------------------------------------
    def materialize(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        feat, ids = split_expert_factor(a, kw)
        b, s = ids.shape
        e, k, d = int(kw["num_experts"]), g.shape[-1], feat.shape[-1]
        out = g.new_zeros(b, e, k, d)
        ff, gf = feat.reshape(b * s, d), g.reshape(b * s, k)
        for ex, rows in _per_expert(ids):
            # the expert's slots of each sample, packed to the longest sample's count: one
            # (B, count, .) GEMM, no work on the other experts' slots
            sample = torch.div(rows, s, rounding_mode="floor")
            counts = torch.bincount(sample, minlength=b)
            first = torch.cumsum(counts, 0) - counts
            slot = torch.arange(rows.numel(), device=rows.device) - first[sample]
            width = int(counts.max())
            fa, ga = ff.new_zeros(b, width, d), gf.new_zeros(b, width, k)
            fa[sample, slot], ga[sample, slot] = ff[rows], gf[rows]
            out[:, ex] = torch.bmm(ga.transpose(1, 2), fa)
        return out.reshape(b, -1)

    def materialize_per_token(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        feat, ids = split_expert_factor(a, kw)
        b, t = ids.shape
        onehot = F.one_hot(ids, int(kw["num_experts"])).to(g.dtype)
        outer = g.unsqueeze(-1) * feat.unsqueeze(-2)  # (B, T, K, D')
        return (onehot[..., None, None] * outer.unsqueeze(2)).reshape(b, t, -1)

    def gram_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        f1, i1 = split_expert_factor(a1, kw)
        f2, i2 = split_expert_factor(a2, kw)
        b2, s = i2.shape
        f2f, g2f, i2f = f2.reshape(b2 * s, -1), g2.reshape(b2 * s, -1), i2.reshape(1, -1)

        def block(rows: slice) -> torch.Tensor:
            x, y, ix = f1[rows], g1[rows], i1[rows]
            b, t = ix.shape
            aa = x.reshape(b * t, -1) @ f2f.T
            gg = y.reshape(b * t, -1) @ g2f.T
            same = ix.reshape(-1, 1) == i2f
            return (aa * gg * same).reshape(b, t, b2, s).sum(-1)

        return chunk_rows(i1, b2 * s, block)

    def dense_per_token(
        self, a1: torch.Tensor, g1: torch.Tensor, dense2: torch.Tensor, kw: dict
    ) -> torch.Tensor:
        feat, ids = split_expert_factor(a1, kw)
        b1, t = ids.shape
        k, d = g1.shape[-1], feat.shape[-1]
        w2 = dense2.reshape(dense2.shape[0], int(kw["num_experts"]), k, d)
        out = g1.new_zeros(b1 * t, dense2.shape[0])
        ff, gf = feat.reshape(b1 * t, d), g1.reshape(b1 * t, k)
        for ex, rows in _per_expert(ids):
            we = w2[:, ex].reshape(-1, d)  # (B2*K, D')
            wa = (ff[rows] @ we.T).reshape(rows.numel(), -1, k)
            out[rows] = (wa * gf[rows].unsqueeze(1)).sum(-1)
        return out.reshape(b1, t, -1)

    def norm_sq(self, a: torch.Tensor, g: torch.Tensor, kw: dict) -> torch.Tensor:
        feat, ids = split_expert_factor(a, kw)
        aa = torch.bmm(feat, feat.transpose(1, 2))
        gg = torch.bmm(g, g.transpose(1, 2))
        return (aa * gg * (ids.unsqueeze(-1) == ids.unsqueeze(-2))).sum((1, 2))

    # ---- cost model: an expert block is E linear layers; forming it touches every expert ----
    def prefer_materialized_gram(self, b1: int, b2: int, s1: int, s2: int, kw: dict) -> bool:
        ek, d = self.matrix_shape(kw)
        k = int(kw["out_features"])
        return b1 * b2 * s1 * s2 * (d + k) >= (b1 * s1 + b2 * s2) * ek * d + b1 * b2 * ek * d

    def prefer_materialized_norm(self, s: int, kw: dict) -> bool:
        ek, d = self.matrix_shape(kw)
        return s * s * (d + int(kw["out_features"])) >= s * ek * d + ek * d

    def prefer_materialized_capture(self, s: int, kw: dict) -> bool:
        ek, d = self.matrix_shape(kw)
        return ek * d <= s * (d + 1 + int(kw["out_features"]))
