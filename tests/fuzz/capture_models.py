"""Random small architectures for differential testing of the capture core.

:func:`random_case` builds, from a seed, a small model drawn from chains, residual blocks (some
adding the skip in place), branches, module reuse, tied weights (square linears sharing a weight,
an LM head tied to the input embedding, with or without their own biases), frozen parameters
(weights, biases, whole modules), activation checkpointing (reentrant or not), a layer called under
checkpointing and again outside it (sometimes fed by a frozen Linear), in-place activations (also
on the model's input), dead branches and every supported layer type (``nn.Linear``, HF ``Conv1D``,
``nn.Conv1d/2d``, ``nn.ConvTranspose1d``, ``nn.ConvTranspose3d(output_size=)`` into a replicate-
padded ``nn.Conv3d`` and a ``LayerNorm`` over image dims, ``nn.Embedding`` with and without
``padding_idx`` and un-batched position ids, ``nn.LayerNorm`` with and without bias,
``nn.RMSNorm``, an RMS norm with a bias relabelled as ``nn.RMSNorm``, ``nn.GroupNorm``,
``nn.InstanceNorm1d``), for about 30 % of the seeds a transformers fused-expert block (Mixtral or
gpt-oss experts + router, drawn from a generator of its own), in float32 or float64; a Linear on a
sliced position table (no per-sample gradient exists) must be refused. :func:`check_case` captures
it under every capture style and compares the per-parameter per-sample gradients and the routed
inner products (every routing mode) with one backward pass per sample of the same model (compared
in float64).

Used by ``tests/fuzz/test_capture_fuzz.py`` (a fixed seed set) and ``capture_fuzz.py``
(many seeds).
"""

from __future__ import annotations

import copy
import random
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Case", "Outcome", "random_case", "check_case", "STYLES", "MODES"]

STYLES = ("factorized", "materialized", "auto")
MODES = ("auto", "factorized", "materialized")


# ---- building blocks ------------------------------------------------------------------------
class Act(nn.Module):
    """An activation; ``relu_`` works in place on the previous layer's (maybe view) output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "relu_":
            return torch.relu_(h)
        if self.kind == "gelu":
            return nn.functional.gelu(h)
        return torch.tanh(h)

    def extra_repr(self) -> str:
        return self.kind


class Chain(nn.Sequential):
    """Modules applied in order."""


class Contiguous(nn.Module):
    """``h.contiguous()``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.contiguous()


class Residual(nn.Module):
    """``body(h) + h``; with ``inplace`` the skip is added in place to the body's output."""

    def __init__(self, body: nn.Module, inplace: bool) -> None:
        super().__init__()
        self.body, self.inplace = body, inplace

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.body(h)
        if self.inplace:
            out += h
            return out
        return out + h


class Branch(nn.Module):
    """Two bodies on the same input, summed or gated."""

    def __init__(self, left: nn.Module, right: nn.Module, gate: bool) -> None:
        super().__init__()
        self.left, self.right, self.gate = left, right, gate

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate:
            return self.left(h) * torch.tanh(self.right(h))
        return self.left(h) + self.right(h)


class Reuse(nn.Module):
    """One square layer called twice (module reuse)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.tanh(self.layer(h)))


class Chunked(nn.Module):
    """A layer run once per chunk of 2 rows of the batch (memory chunking), joined by ``cat``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layer(c) for c in h.split(2)])


class Checkpointed(nn.Module):
    """The body under activation checkpointing."""

    def __init__(self, body: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.body, self.reentrant = body, reentrant

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, h, use_reentrant=self.reentrant)


class CheckpointedReuse(nn.Module):
    """One layer called under activation checkpointing and again outside it.

    ``inside_first`` orders the two calls; ``chained`` feeds one call's output to the other,
    else both see the same input and their outputs are summed.
    """

    def __init__(self, layer: nn.Module, reentrant: bool, inside_first: bool, chained: bool):
        super().__init__()
        self.layer, self.reentrant = layer, reentrant
        self.inside_first, self.chained = inside_first, chained

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        def inside(x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.layer, x, use_reentrant=self.reentrant)

        first, second = (inside, self.layer) if self.inside_first else (self.layer, inside)
        if self.chained:
            return second(first(h))
        return first(h) + second(h)


class Volume(nn.Module):
    """``(B, T, D)`` as a ``(B, D, T, 1, 1)`` volume through ``ConvTranspose3d(output_size=)``,
    a replicate-padded ``Conv3d`` and a ``LayerNorm`` over the two trailing image dims, read
    back as ``(B, T, K)``."""

    def __init__(self, d: int, k: int, bias: bool) -> None:
        super().__init__()
        self.ct = nn.ConvTranspose3d(d, k, 3, stride=2, padding=1, bias=bias)
        self.conv = nn.Conv3d(k, k, 3, padding=1, padding_mode="replicate", bias=bias)
        self.ln = nn.LayerNorm([2, 2])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        v = h.transpose(1, 2)[..., None, None]
        v = self.ln(self.conv(self.ct(v, output_size=[2 * t, 2, 2])))
        return v[:, :, ::2, 0, 0].transpose(1, 2)


class Dead(nn.Module):
    """A layer called with its output unused, or never called at all."""

    def __init__(self, layer: nn.Module, called: bool) -> None:
        super().__init__()
        self.layer, self.called = layer, called

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.called:
            self.layer(h)
        return h


class ChannelFirst(nn.Module):
    """A channel-first layer on ``(B, T, D)``: transposed to ``(B, D, T)`` (``(B, D, 1, T)``)."""

    def __init__(self, layer: nn.Module, two_d: bool = False) -> None:
        super().__init__()
        self.layer, self.two_d = layer, two_d

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.transpose(1, 2)
        if self.two_d:
            return self.layer(x.unsqueeze(2)).squeeze(2).transpose(1, 2)
        return self.layer(x).transpose(1, 2)


class BiasedRMSNorm(nn.Module):
    """An RMS norm with a bias (OLMo-style), relabelled as ``nn.RMSNorm`` by the case."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(dim))
        self.bias = nn.Parameter(0.3 * torch.randn(dim))
        self.eps = 1e-6

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias


class MoEBlock(nn.Module):
    """A transformers fused-expert block (router + experts on the flattened tokens) + residual."""

    def __init__(self, d: int, family: str, experts: int, top_k: int, inter: int) -> None:
        super().__init__()
        import transformers

        if family == "gpt_oss":
            from transformers.models.gpt_oss import modeling_gpt_oss as mod

            cfg = transformers.GptOssConfig(
                hidden_size=d, intermediate_size=inter, num_local_experts=experts
            )
            cfg.num_experts_per_tok = top_k
            self.router, self.experts = mod.GptOssTopKRouter(cfg), mod.GptOssExperts(cfg)
        else:
            from transformers.models.mixtral import modeling_mixtral as mod

            cfg = transformers.MixtralConfig(
                hidden_size=d,
                intermediate_size=inter,
                num_local_experts=experts,
                num_experts_per_tok=top_k,
            )
            self.router, self.experts = mod.MixtralTopKRouter(cfg), mod.MixtralExperts(cfg)
        cfg._experts_implementation = "eager"
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        _, weights, idx = self.router(flat)
        return h + self.experts(flat, idx, weights).reshape(h.shape)


def _maybe_moe(seed: int, width: int, features: set[str]) -> nn.Module | None:
    """A fused-expert block for some seeds (own generator: other seeds' models are unchanged)."""
    rng = random.Random(~seed)
    if rng.random() >= 0.3:
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:  # pragma: no cover - the capture core runs without transformers
        return None
    family = rng.choice(["mixtral", "gpt_oss"])
    experts = rng.randint(2, 4)
    features.add(f"moe:{family}")
    return MoEBlock(width, family, experts, rng.randint(1, min(2, experts)), rng.randint(2, 4))


class Net(nn.Module):
    """Input stage (token embedding(s) or float features), a body, an output head."""

    def __init__(
        self,
        body: nn.Module,
        head: nn.Module,
        emb: nn.Embedding | None,
        pos: nn.Embedding | None,
        pos_batched: bool,
        pos_linear: nn.Linear | None = None,
        input_relu_: bool = False,
    ) -> None:
        super().__init__()
        self.emb, self.pos, self.body, self.head = emb, pos, body, head
        self.pos_batched, self.pos_linear, self.input_relu_ = pos_batched, pos_linear, input_relu_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_relu_:
            x = torch.relu_(x)  # in place on the model's (float) input
        h = self.emb(x) if self.emb is not None else x
        if self.pos is not None:
            idx = torch.arange(x.shape[1], device=x.device)[None]
            if self.pos_batched:
                idx = idx.expand(x.shape[0], -1)
            h = h + self.pos(idx)  # un-batched ids: one (1, T, D) row for the whole batch
        if self.pos_linear is not None:
            # a position table sliced (not called), through a Linear as one
            # (1, T, D) row, broadcast over the batch: refused (no per-sample gradient)
            h = h + self.pos_linear(self.pos.weight[: x.shape[1]].detach()[None])
        return self.head(self.body(h))


# ---- the generator --------------------------------------------------------------------------
@dataclass
class Case:
    """One random model and how to feed it."""

    seed: int
    model: nn.Module
    dtype: torch.dtype
    vocab: int | None  # token inputs (ids < vocab) when set, else float features
    in_dim: int
    config: dict = field(default_factory=dict)
    features: list[str] = field(default_factory=list)
    refusal: str | None = None  # a capture must raise an error containing this text

    def batch(self, rng: torch.Generator, b: int, t: int) -> torch.Tensor:
        """A random input batch of ``b`` samples and ``t`` tokens."""
        if self.vocab is not None:
            return torch.randint(0, self.vocab, (b, t), generator=rng)
        return torch.randn(b, t, self.in_dim, generator=rng, dtype=self.dtype)

    def loss(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A per-sample separable loss, summed over the batch."""
        out = model(x)
        if self.vocab is not None and out.shape[-1] == self.vocab:
            return nn.functional.cross_entropy(
                out.reshape(-1, self.vocab).float().to(out.dtype),
                x.roll(1, dims=1).reshape(-1),
                reduction="sum",
            )
        w = torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype, device=out.device)
        return (out * w).sum() + 0.5 * out.pow(2).sum()


class _Builder:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.square: dict[int, list[nn.Linear]] = {}  # for ties: square linears by width
        self.features: set[str] = set()
        self.depth = 0

    def flip(self, p: float) -> bool:
        return self.rng.random() < p

    def act(self, after_param_layer: bool) -> list[nn.Module]:
        kinds = ["tanh", "gelu"] + (["relu_", "relu_"] if after_param_layer else [])
        kind = self.rng.choice(kinds + ["none"])
        if kind == "none":
            return []
        if kind == "relu_":
            self.features.add("in-place activation")
        return [Act(kind)]

    def linear(self, d: int, k: int) -> nn.Module:
        bias = self.flip(0.7)
        if self.flip(0.2):
            from transformers.pytorch_utils import Conv1D

            self.features.add("HF Conv1D")
            return Chain(Contiguous(), Conv1D(k, d))  # Conv1D views its input: contiguous
        if d == k and self.square.get(d) and self.flip(0.35):
            layer = nn.Linear(d, k, bias=bias)
            layer.weight = self.rng.choice(self.square[d]).weight  # tied
            self.features.add("tied linears" + (" with biases" if bias else ""))
            return layer
        layer = nn.Linear(d, k, bias=bias)
        if d == k:
            self.square.setdefault(d, []).append(layer)
        return layer

    def norm(self, d: int) -> nn.Module:
        kind = self.rng.choice(["ln", "ln_nobias", "rms", "rms_bias", "group", "instance"])
        self.features.add(f"norm:{kind}")
        if kind == "ln":
            return nn.LayerNorm(d)
        if kind == "ln_nobias":
            return nn.LayerNorm(d, bias=False)
        if kind == "rms":
            return nn.RMSNorm(d)
        if kind == "rms_bias":
            return BiasedRMSNorm(d)
        if kind == "group":
            groups = self.rng.choice([g for g in range(1, d + 1) if d % g == 0])
            return ChannelFirst(nn.GroupNorm(groups, d))
        return ChannelFirst(nn.InstanceNorm1d(d, affine=True))

    def conv(self, d: int, k: int) -> nn.Module:
        kind = self.rng.choice(["conv1d", "conv2d", "convT", "convT3d"])
        bias = self.flip(0.7)
        if kind == "convT3d":
            self.features.add("convT3d(output_size) + replicate conv3d + image LayerNorm")
            return Volume(d, k, bias)
        self.features.add(kind)
        ks = self.rng.choice([1, 3])
        if kind == "conv1d":
            dil = self.rng.choice([1, 2])
            mode = self.rng.choice(["zeros", "zeros", "circular", "replicate"])
            return ChannelFirst(
                nn.Conv1d(
                    d,
                    k,
                    ks,
                    padding=dil * (ks - 1) // 2,
                    dilation=dil,
                    bias=bias,
                    padding_mode=mode,
                )
            )
        if kind == "conv2d":
            return ChannelFirst(
                nn.Conv2d(d, k, (1, ks), padding=(0, (ks - 1) // 2), bias=bias), two_d=True
            )
        return ChannelFirst(nn.ConvTranspose1d(d, k, ks, padding=(ks - 1) // 2, bias=bias))

    def layer(self, d: int) -> tuple[list[nn.Module], int]:
        """One parameterised layer (+ activation) from width ``d``; returns the new width."""
        roll = self.rng.random()
        if roll < 0.45:
            k = d if self.flip(0.5) else self.rng.randint(2, 6)
            return [self.linear(d, k), *self.act(True)], k
        if roll < 0.7:
            return [self.norm(d), *self.act(True)], d
        k = d if self.flip(0.5) else self.rng.randint(2, 6)
        return [self.conv(d, k), *self.act(True)], k

    def square_body(self, d: int, n: int) -> nn.Module:
        """A chain that keeps width ``d`` and ends with a parameterised layer."""
        mods: list[nn.Module] = []
        width = d
        for i in range(n):
            last = i == n - 1
            if last:
                use_norm = width == d and self.flip(0.3)
                mods.append(self.norm(width) if use_norm else self.linear(width, d))
                width = d
            else:
                part, width = self.layer(width)
                mods += part
        return Chain(*mods)

    def checkpointed_reuse(self, d: int) -> nn.Module:
        """A square layer called under checkpointing and outside it; sometimes fed by a frozen
        ``nn.Linear`` (its input then needs no gradient)."""
        reentrant = self.flip(0.5)
        self.features.add("checkpointed and plain call" + (" (reentrant)" if reentrant else ""))
        layer = self.norm(d) if self.flip(0.6) else self.linear(d, d)
        reuse = CheckpointedReuse(layer, reentrant, self.flip(0.5), self.flip(0.5))
        if not self.flip(0.5):
            return reuse
        self.features.add("frozen Linear into a checkpointed and plain call")
        frozen = nn.Linear(d, d, bias=self.flip(0.5)).requires_grad_(False)
        return Chain(frozen, *self.act(True), reuse)

    def block(self, d: int) -> tuple[nn.Module, int]:
        self.depth += 1
        roll = self.rng.random() if self.depth < 4 else 0.0
        if roll < 0.35:
            part, k = self.layer(d)
            return Chain(*part), k
        if roll < 0.5:
            inplace = self.flip(0.5)
            self.features.add("residual" + (" (in-place add)" if inplace else ""))
            return Residual(self.square_body(d, self.rng.randint(1, 2)), inplace), d
        if roll < 0.62:
            self.features.add("branch")
            left, right = self.square_body(d, 1), self.square_body(d, 1)
            return Branch(left, right, self.flip(0.5)), d
        if roll < 0.67:
            self.features.add("module reuse")
            return Reuse(self.linear(d, d) if self.flip(0.7) else self.norm(d)), d
        if roll < 0.72:
            self.features.add("sub-batch calls")
            return Chunked(self.linear(d, d) if self.flip(0.7) else self.norm(d)), d
        if roll < 0.8:
            reentrant = self.flip(0.5)
            self.features.add("checkpoint" + (" (reentrant)" if reentrant else ""))
            body, k = self.block(d)
            return Checkpointed(body, reentrant), k
        if roll < 0.85:
            return self.checkpointed_reuse(d), d
        self.features.add("dead layer")
        part, _ = self.layer(d)
        return Dead(part[0], called=self.flip(0.5)), d


def random_case(seed: int, dtype: torch.dtype | None = None) -> Case:
    """The random model of ``seed`` (float32 or float64 drawn too unless ``dtype`` is given)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    b = _Builder(rng)
    dtype = dtype or rng.choice([torch.float32, torch.float64])
    vocab = rng.randint(5, 9) if b.flip(0.45) else None
    d = rng.randint(2, 5)
    emb = pos = pos_linear = None
    pos_batched = input_relu_ = False
    refusal = None
    if vocab is not None:
        pad = rng.choice([None, None, 0])
        emb = nn.Embedding(vocab, d, padding_idx=pad)
        b.features.add("embedding" + (" (padding_idx)" if pad is not None else ""))
        if b.flip(0.4):
            pos_batched = b.flip(0.5)
            pos = nn.Embedding(8, d)
            b.features.add("position embedding" + ("" if pos_batched else " (un-batched ids)"))
            if b.flip(0.15):
                pos_linear = nn.Linear(d, d, bias=b.flip(0.5))
                b.features.add("Linear on a sliced position table (refused)")
                refusal = "un-batched input"
    elif b.flip(0.3):
        input_relu_ = True
        b.features.add("in-place relu_ on the model input")
    blocks = []
    width = d
    for _ in range(rng.randint(1, 4)):
        blk, width = b.block(width)
        blocks.append(blk)
    body = Chain(*blocks)
    if vocab is not None and b.flip(0.6):
        if width != d:
            body.append(b.linear(width, d))
            width = d
        head = nn.Linear(d, vocab, bias=b.flip(0.5))
        head.weight = emb.weight
        b.features.add("tied LM head" + (" with bias" if head.bias is not None else ""))
    else:
        head = nn.Linear(width, vocab if vocab is not None and b.flip(0.5) else 3, bias=b.flip(0.7))
    moe = _maybe_moe(seed, width, b.features)
    if moe is not None:
        body.append(moe)  # after the head is built: earlier torch draws are unchanged
    model = Net(body, head, emb, pos, pos_batched, pos_linear, input_relu_)
    _freeze_some(model, rng, b.features)
    model = model.to(dtype)
    config = {
        "layer_types": {
            n: "nn.RMSNorm" for n, m in model.named_modules() if isinstance(m, BiasedRMSNorm)
        }
    }
    return Case(seed, model, dtype, vocab, d, config, sorted(b.features), refusal)


def _freeze_some(model: nn.Module, rng: random.Random, features: set[str]) -> None:
    """Freeze a few weights, biases or whole modules; the head always keeps something."""
    for name, module in model.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not params or name in ("head", "pos_linear"):  # pos_linear: must stay refused
            continue
        roll = rng.random()
        if roll < 0.1:
            module.requires_grad_(False)
            features.add("frozen module")
        elif roll < 0.22 and "weight" in params and "bias" in params:
            which = rng.choice(["weight", "bias"])
            params[which].requires_grad_(False)
            features.add(f"frozen {which} (partly trainable)")
    head = model.head
    if not any(p.requires_grad for p in head.parameters()):  # keep the loss differentiable
        head.requires_grad_(True)


# ---- the check ------------------------------------------------------------------------------
@dataclass
class Outcome:
    """Largest relative errors of a case (per-parameter, inner products) and any failure."""

    seed: int
    dtype: torch.dtype
    features: list[str]
    param_err: float = 0.0
    gram_err: float = 0.0
    failures: list[str] = field(default_factory=list)


def _rel(x: torch.Tensor, y: torch.Tensor, floor: float = 0.0) -> float:
    """``max|x - y| / max(max|y|, floor)``.

    The floor keeps a parameter whose gradient cancels to round-off (a bias right before a
    normalisation) from turning round-off into a large relative error.
    """
    x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
    scale = max(float(y.abs().max()) if y.numel() else 0.0, floor)
    diff = float((x - y).abs().max()) if y.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def check_case(
    case: Case,
    tol: float | None = None,
    device: str | None = None,
    batch_sizes: tuple[int, int] = (3, 2),
) -> Outcome:
    """Capture ``case`` in every style; compare with one backward pass per sample.

    The reference runs the same model (same dtype: a float64 copy would differ where the
    dtype enters the function, e.g. ``nn.RMSNorm(eps=None)``); comparisons are in float64.
    With ``device`` the model (moved in place) and the batches live there; ``batch_sizes`` are
    the two steps' batch sizes.

    Failures: an error above ``tol`` (default ``1e-9`` in float64, ``2e-3`` in float32; five
    times that for float32 inner products), a
    trainable parameter missing from (or a frozen one present in) the capture, a warning from
    the library, or an exception; a case with a ``refusal`` fails unless every style raises an
    error containing it.
    """
    from tests.helpers.reference import per_sample_loop_grads

    tol = tol if tol is not None else (1e-9 if case.dtype == torch.float64 else 2e-3)
    out = Outcome(case.seed, case.dtype, case.features)
    gen = torch.Generator().manual_seed(case.seed)
    shapes = [
        (batch_sizes[0], random.Random(case.seed).randint(2, 5)),
        (batch_sizes[1], random.Random(-case.seed).randint(2, 5)),
    ]
    batches = [case.batch(gen, bb, t) for bb, t in shapes]
    if device is not None:
        case.model.to(device)
        batches = [x.to(device) for x in batches]
    ref_model = copy.deepcopy(case.model)
    refs = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's checkpoint warnings
            for x in batches:
                grads = per_sample_loop_grads(ref_model, case.loss, x)
                refs.append({n: v.double() for n, v in grads.items()})
    except Exception as err:  # noqa: BLE001 - a generator bug, reported by seed
        out.failures.append(f"reference: {type(err).__name__}: {err}")
        return out
    names = sorted(refs[0])
    # a model whose loss is flat in every parameter (a norm over an input constant along its
    # normalised axes, for any input) has true gradients of exactly 0 and a reference of pure
    # round-off: its errors are measured against the loss's output-gradient scale instead
    largest = max(float(r[n].abs().max()) for r in refs for n in names) if names else 0.0
    out_scale = max(_output_grad_scale(case, ref_model, x) for x in batches)
    flat_scale = out_scale if largest < 1e-9 * out_scale else 0.0
    flat = [torch.cat([r[n].reshape(r[n].shape[0], -1) for n in names], 1) for r in refs]
    for style in STYLES:
        try:
            _check_style(case, style, batches, refs, flat, names, tol, out, flat_scale)
        except Exception as err:  # noqa: BLE001 - every failure is reported by seed
            if case.refusal is None or case.refusal not in str(err):
                out.failures.append(f"{style}: {type(err).__name__}: {err}")
        else:
            if case.refusal is not None:
                out.failures.append(f"{style}: not refused (expected {case.refusal!r})")
    return out


def _output_grad_scale(case: Case, model: nn.Module, x: torch.Tensor) -> float:
    """``max |d loss / d output|`` of ``case.loss`` on ``x`` (the scale round-off comes in at)."""
    with torch.no_grad():
        output = model(x).detach().requires_grad_()
    (grad,) = torch.autograd.grad(case.loss(lambda _: output, x), output)
    return float(grad.abs().max())


def _check_style(case, style, batches, refs, flat, names, tol, out, flat_scale=0.0) -> None:
    from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
    from dattri_llm.gradient import ops
    from dattri_llm.gradient.hooks import coverage, manager
    from tests.helpers.reference import captured_by_parameter

    manager._WARNED.clear()
    coverage._WARNED_UNCAPTURED.clear()
    cb = CaptureCallback(keep_all=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookManager(
            case.model, config=HookManagerConfig(capture_style=style, **case.config), callbacks=[cb]
        )
        try:
            with hm.collect():
                for x in batches:
                    case.model.zero_grad(set_to_none=True)
                    case.loss(case.model, x).backward()
        finally:
            hm.remove()
    ours = [str(w.message) for w in caught if "dattri_llm" in (w.filename or "")]
    if ours:
        out.failures.append(f"{style}: warned: {ours[0][:300]}")
    if len(cb.records) != len(batches):
        out.failures.append(f"{style}: {len(cb.records)} records for {len(batches)} backwards")
        return
    grads = [r.gradient for r in cb.records]
    # float32: relative to the whole gradient (a cancelling parameter carries float32
    # round-off of its terms); float64: down to 1e-3 of it
    frac = 1e-3 if case.dtype == torch.float64 else 1.0
    for g, ref in zip(grads, refs):
        got = captured_by_parameter(hm, g, case.model)
        if sorted(got) != names:
            out.failures.append(
                f"{style}: captured {sorted(set(got) ^ set(names))} differ from trainable"
            )
            return
        floor = frac * max(flat_scale, *(float(r.abs().max()) for r in ref.values()))
        for n in names:
            err = _rel(got[n], ref[n], floor)
            out.param_err = max(out.param_err, err)
            if err > tol:
                out.failures.append(f"{style}: parameter {n}: relative error {err:.2e}")
    # float32 factorized inner products sum T^2 token-pair products; where a layer's token
    # terms cancel (a bias before an instance norm) their round-off reaches ~4e-3 of the result
    # (seeds 1411, 2596: exact in float64), hence 5x the per-parameter tolerance there
    gram_slack = 1.0 if case.dtype == torch.float64 else 5.0
    for mode in MODES:
        gram = ops.cross_dot(grads[0], grads[1], mode=mode)
        norms = ops.grad_norm_sq(grads[0], mode=mode)
        for what, x, y in (
            ("cross_dot", gram, flat[0] @ flat[1].T),
            ("grad_norm_sq", norms, flat[0].pow(2).sum(1)),
        ):
            # a flat model's factorized products sum T^2 cancelling token-pair terms of the
            # output-gradient scale (measured: ~1e-11 of its square)
            err = _rel(x, y, flat_scale**2)
            out.gram_err = max(out.gram_err, err)
            if err > tol * gram_slack:
                out.failures.append(f"{style}/{mode}: {what}: relative error {err:.2e}")
