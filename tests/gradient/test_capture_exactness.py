"""Capture exactness regressions.

Every case compares the captured per-sample gradients with one backward pass per sample, per
parameter (through ``HookManager.layer_parameters``) and through the routed inner products.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dattri_llm.gradient.hooks.coverage as coverage
import dattri_llm.gradient.hooks.manager as manager
from dattri_llm import REGISTER_ALL, CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Shared, ops
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err

STYLES = ("factorized", "materialized", "auto")


def sq_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return (out * torch.linspace(-1.0, 1.0, out.shape[-1], dtype=out.dtype)).sum() + (out**2).sum()


def capture(model: nn.Module, batches: list[torch.Tensor], loss=sq_loss, **cfg):
    """``(records, manager, warnings)`` of a capture over ``batches``."""
    manager._WARNED.clear()
    coverage._WARNED_UNCAPTURED.clear()
    cb = CaptureCallback(keep_all=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm = HookManager(model, config=HookManagerConfig(**cfg), callbacks=[cb])
        with hm.collect():
            for x in batches:
                loss(model, x).backward()
    hm.remove()
    ours = [str(w.message) for w in caught if "dattri_llm" in w.filename or "tests" in w.filename]
    return cb.records, hm, ours


def assert_exact(model, batches, loss=sq_loss, tol=1e-10, **cfg) -> list:
    """Captured per-parameter gradients and Grams equal the one-sample reference; returns
    the library's warnings (the caller decides which are expected)."""
    for style in STYLES:
        recs, hm, warned = capture(model, batches, loss, capture_style=style, **cfg)
        refs = [per_sample_loop_grads(model, loss, x) for x in batches]
        assert len(recs) == len(batches)
        for rec, ref in zip(recs, refs):
            got = captured_by_parameter(hm, rec.gradient, model)
            assert set(got) == set(ref), (style, sorted(got), sorted(ref))
            for name, value in ref.items():
                assert (
                    rel_err(got[name], value) < tol
                    if value.abs().max() > 0
                    else (got[name].abs().max() == 0)
                ), (style, name)
        flat = [torch.cat([r[n].reshape(r[n].shape[0], -1) for n in sorted(r)], 1) for r in refs]
        g1, g2 = recs[0].gradient, recs[-1].gradient
        for mode in ("auto", "factorized", "materialized"):
            assert rel_err(ops.cross_dot(g1, g2, mode=mode), flat[0] @ flat[-1].T) < tol, mode
            assert rel_err(ops.grad_norm_sq(g1, mode=mode), flat[0].pow(2).sum(1)) < tol, mode
    return warned


# ---- 1. in-place ops on a hooked layer's output that is a view -------------------------------
class AddInPlace(nn.Module):
    """``out = fc(x); out += x`` (a residual added in place to a view output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out += x
        return self.head(out)


class SlicedLinear(nn.Module):
    """Relabelled as nn.Linear; its output is a partial view of a wider product."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = torch.cat([self.weight, self.weight.detach()], 0)
        bias = torch.cat([self.bias, self.bias.detach()])
        return nn.functional.linear(x, wide, bias)[..., :4]


def _inplace_models() -> dict[str, tuple[nn.Module, tuple[int, ...], dict]]:
    from transformers.pytorch_utils import Conv1D

    return {
        "linear_relu": (
            nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)),
            (3, 5, 3),
            {},
        ),
        "conv1d_hf": (
            nn.Sequential(Conv1D(4, 3), nn.ReLU(inplace=True), Conv1D(2, 4)),
            (3, 5, 3),
            {},
        ),
        "instance_norm": (
            nn.Sequential(
                nn.InstanceNorm1d(3, affine=True), nn.ReLU(inplace=True), nn.Linear(4, 2)
            ),
            (3, 3, 4),
            {},
        ),
        "add_inplace": (AddInPlace(), (2, 4, 3), {}),
        "sliced_view": (
            nn.Sequential(SlicedLinear(), nn.ReLU(inplace=True), nn.Linear(4, 2)),
            (3, 5, 3),
            {
                "layer_types": {"0": "nn.Linear"},
                "module_kwargs": {"0": {"in_features": 3, "out_features": 4, "bias": True}},
            },
        ),
    }


@pytest.mark.parametrize(
    "case", ["linear_relu", "conv1d_hf", "instance_norm", "add_inplace", "sliced_view"]
)
def test_inplace_op_on_a_view_output_is_captured_exactly(case: str) -> None:
    torch.manual_seed(0)
    model, shape, cfg = _inplace_models()[case]
    model = model.double()
    batches = [torch.randn(*shape, dtype=torch.float64) for _ in range(2)]
    assert assert_exact(model, batches, **cfg) == []


def test_issue_minimal_case_layer_0_is_not_zero() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).double()
    recs, _, _ = capture(model, [torch.randn(3, 5, 3, dtype=torch.float64)])
    assert float(recs[0].gradient.layers["0"].materialize().data.abs().max()) > 0


# ---- 2. a hooked layer without gradient in a step --------------------------------------------
class Idle(nn.Module):
    """A norm that is not called, called with its output unused, or inside a reentrant
    checkpoint whose input has no grad."""

    def __init__(self, norm: nn.Module, how: str) -> None:
        super().__init__()
        self.norm, self.how = norm, how
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "unused":
            self.norm(x)
        elif self.how == "checkpoint":
            x = checkpoint(self.norm, x, use_reentrant=True)
        return self.fc(x)


@pytest.mark.parametrize("how", ["not_called", "unused", "checkpoint"])
@pytest.mark.parametrize(
    "norm",
    ["layer_norm", "rms_norm", "group_norm", "instance_norm", "layer_norm_no_bias"],
)
def test_layer_without_gradient_is_an_exact_zero(norm: str, how: str) -> None:
    torch.manual_seed(0)
    layer = {
        "layer_norm": lambda: nn.LayerNorm(4),
        "layer_norm_no_bias": lambda: nn.LayerNorm(4, bias=False),
        "rms_norm": lambda: nn.RMSNorm(4),
        "group_norm": lambda: nn.GroupNorm(1, 3),
        "instance_norm": lambda: nn.InstanceNorm1d(3, affine=True),
    }[norm]()
    model = Idle(layer, how).double()
    batches = [torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*requires_grad=True.*")  # torch, checkpoint
        warned = assert_exact(model, batches)
    assert warned == []
    recs, _, _ = capture(model, batches[:1])
    assert float(recs[0].gradient.layers["norm"].materialize().data.abs().max()) == 0.0


# ---- 3. tied weights whose sites carry biases -----------------------------------------------
class TiedLinears(nn.Module):
    def __init__(self, b1: bool, b2: bool) -> None:
        super().__init__()
        self.f1 = nn.Linear(3, 3, bias=b1)
        self.f2 = nn.Linear(3, 3, bias=b2)
        self.f2.weight = self.f1.weight
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.f2(torch.tanh(self.f1(x))))


class MLMHead(nn.Module):
    """BERT-style: the decoder ``nn.Linear(bias=True)`` is tied to the word embeddings."""

    def __init__(self, vocab: int = 11, dim: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.decoder = nn.Linear(dim, vocab, bias=True)
        self.decoder.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(torch.tanh(self.emb(ids))))


def ce_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids.roll(1, 1).reshape(-1), reduction="sum"
    )


@pytest.mark.parametrize("biases", [(False, True), (True, False), (True, True)])
def test_tied_linears_keep_each_bias_its_own(biases: tuple[bool, bool]) -> None:
    torch.manual_seed(0)
    model = TiedLinears(*biases).double()
    batches = [torch.randn(3, 2, 3, dtype=torch.float64), torch.randn(2, 2, 3, dtype=torch.float64)]
    assert assert_exact(model, batches) == []
    recs, hm, _ = capture(model, batches)
    layers = recs[0].gradient.layers
    assert isinstance(layers["f1"], Shared) and layers["f1"].site_names == ["f1", "f2"]
    own = [f"f{i + 1}.bias" for i, b in enumerate(biases) if b]
    assert [n for n in layers if n.endswith(".bias")] == own
    assert all(hm.layer_parameters()[n] == {"bias": getattr(model, n[:2]).bias} for n in own)


def test_embedding_tied_to_a_biased_head_is_exact() -> None:
    torch.manual_seed(0)
    model = MLMHead().double()
    batches = [torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (2, 4))]
    assert assert_exact(model, batches, loss=ce_loss) == []
    recs, _, _ = capture(model, batches[:1], loss=ce_loss)
    assert list(recs[0].gradient.layers) == ["emb", "norm", "decoder.bias"]
    # per-token attribution still works across the tied sites
    g = recs[0].gradient.select_layers(["emb"])
    per_tok = ops.cross_dot_per_token(g, g)
    assert rel_err(per_tok.sum(1), ops.cross_dot(g, g)) < 1e-10


# ---- 4. frozen parameters inside a partly trainable layer ------------------------------------
def _partly_frozen(which: str) -> nn.Module:
    model = nn.Sequential(
        nn.Linear(3, 4),
        nn.Tanh(),
        nn.LayerNorm(4),
        nn.Conv1d(5, 2, 2),
        nn.Flatten(),
        nn.Linear(6, 2),
    )
    frozen = {
        "bitfit": ["0.weight", "2.weight", "3.weight", "5.weight"],
        "bias_frozen": ["0.bias", "2.bias", "3.bias", "5.bias"],
    }[which]
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model.double()


@pytest.mark.parametrize("which", ["bitfit", "bias_frozen"])
def test_only_trainable_parameters_are_captured(which: str) -> None:
    torch.manual_seed(0)
    model = _partly_frozen(which)
    batches = [torch.randn(3, 5, 3, dtype=torch.float64) for _ in range(2)]
    assert assert_exact(model, batches) == []  # the reference holds trainable parameters only
    recs, hm, _ = capture(model, batches[:1])
    for layer, params in hm.layer_parameters().items():
        assert params and all(p.requires_grad for p in params.values()), layer
    width = 4 if which == "bitfit" else 4 * 3  # bias alone, or weight alone
    assert recs[0].gradient.layers["0"].materialize().data.shape == (3, width)


def test_include_frozen_captures_frozen_parameters_too() -> None:
    torch.manual_seed(0)
    model = _partly_frozen("bitfit")
    recs, hm, _ = capture(model, [torch.randn(3, 5, 3, dtype=torch.float64)], include_frozen=True)
    assert set(hm.layer_parameters()["0"]) == {"weight", "bias"}
    assert recs[0].gradient.layers["0"].materialize().data.shape == (3, 4 * 4)


def test_fully_frozen_selected_layer_is_refused_or_left_out_by_name() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"layer '0': none of its parameters.*include_frozen"):
        HookManager(model, config=HookManagerConfig(hook_types={"0": "linear_io"}))
    coverage._WARNED_UNCAPTURED.clear()
    with pytest.warns(UserWarning, match=r"layer '0': none of its parameters.*left out"):
        hm = HookManager(model, config=HookManagerConfig(linear_io=["0|1"]))
    assert hm.layer_names == ["1"]
    hm.remove()


# ---- 5. trainable parameters REGISTER_ALL cannot capture are named ----------------------------
class ScaledLinear(nn.Linear):
    """An nn.Linear subclass with an extra trainable parameter."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class RootParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 2)
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) / self.temperature


def test_uncaptured_trainable_parameters_are_named() -> None:
    model = nn.Sequential(ScaledLinear(3, 4), nn.Linear(4, 2)).double()
    x = torch.randn(3, 3, dtype=torch.float64)
    _, _, warned = capture(model, [x])
    assert any("layer '0' is hooked as nn.Linear" in w and "['scale']" in w for w in warned)
    # the extra parameter changes how the weight is used: the coverage check says so
    assert any("layer '0': the captured per-sample gradients" in w for w in warned)
    _, _, warned = capture(RootParam().double(), [x])
    assert any(
        "REGISTER_ALL captures no per-sample gradient" in w and "temperature" in w for w in warned
    )
    # an explicit selection is the user's choice, but a hooked module's extras are still named
    _, _, warned = capture(model, [x], linear_io=["0"])
    assert any("['scale']" in w for w in warned)


class BiasedRMSNorm(nn.Module):
    """OLMo-style RMS norm with a bias (relabelled as nn.RMSNorm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.bias = nn.Parameter(torch.randn(dim))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight + self.bias


class DoubledBiasNorm(BiasedRMSNorm):
    """Uses its bias twice: not what nn.RMSNorm's rule reads; only the bias check can tell."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


@pytest.mark.parametrize("cls", [BiasedRMSNorm, DoubledBiasNorm])
def test_norm_bias_is_captured_and_checked(cls: type) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), cls(4), nn.Linear(4, 2)).double()
    batches = [torch.randn(3, 5, 3, dtype=torch.float64) for _ in range(2)]
    cfg = {"layer_types": {"1": "nn.RMSNorm"}}
    if cls is BiasedRMSNorm:
        assert assert_exact(model, batches, **cfg) == []
    else:
        _, _, warned = capture(model, batches, **cfg)
        assert any(
            "layer '1': the captured per-sample gradients sum to a bias" in w for w in warned
        )


def test_rms_norm_builder_declares_a_bias() -> None:
    from dattri_llm.utils.module import rms_norm_module_kwargs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), BiasedRMSNorm(4), nn.Linear(4, 2)).double()
    batches = [torch.randn(3, 5, 3, dtype=torch.float64) for _ in range(2)]
    cfg = {"layer_types": {"1": "nn.RMSNorm"}}
    kw = rms_norm_module_kwargs(4, eps=1e-5, bias=True)
    assert assert_exact(model, batches, module_kwargs={"1": kw}, **cfg) == []
    # declared without its bias: the bias is named as not captured, never silently dropped
    kw = rms_norm_module_kwargs(4, eps=1e-5)
    _, _, warned = capture(model, batches, module_kwargs={"1": kw}, **cfg)
    assert any("layer '1' is hooked as nn.RMSNorm" in w and "['bias']" in w for w in warned)


# ---- 6. bypassed-only steps and unused tied sites --------------------------------------------
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def test_only_hooked_layer_bypassed_warns_and_records() -> None:
    model = Attention().double()
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    recs, _, warned = capture(model, [x], linear_io=["attn.out_proj"])
    assert any(
        "layer 'attn.out_proj': its weight and bias received a gradient" in w for w in warned
    )
    assert len(recs) == 1 and recs[0].gradient.batch_size == 2
    assert float(recs[0].gradient.layers["attn.out_proj"].materialize().data.abs().max()) == 0


class UnusedTiedSite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.head = nn.Linear(3, 7, bias=False)
        self.head.weight = self.emb.weight
        self.fc = nn.Linear(3, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(ids))


def test_unused_site_of_a_tied_weight_is_not_a_bypass() -> None:
    torch.manual_seed(0)
    model = UnusedTiedSite().double()
    batches = [torch.randint(0, 7, (3, 4)) for _ in range(2)]
    assert assert_exact(model, batches) == []


def test_register_all_models_warn_about_nothing_when_everything_is_captured() -> None:
    torch.manual_seed(0)
    model = MLMHead().double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hm = HookManager(model, config=HookManagerConfig(linear_io=REGISTER_ALL))
    hm.remove()


def test_data_selection_is_exact_on_a_tied_head_with_a_bias() -> None:
    """DataSelectionCallback maps layers to parameters the same way: the split-off bias too."""
    import copy

    from dattri_llm import DataSelectionCallback

    torch.manual_seed(1)
    model = MLMHead().double()
    plain = copy.deepcopy(model)
    ids, ref_ids = torch.randint(0, 11, (3, 5)), torch.randint(0, 11, (2, 5))
    recs, _, _ = capture(model, [ref_ids], loss=ce_loss)
    model.zero_grad()
    sel = DataSelectionCallback(reference=recs[0].gradient, drop_fraction=0.5)
    hm = HookManager(model, callbacks=[sel])
    with hm.collect(deregister_on_exit=True):
        hm.set_sample_ids(["a", "b", "c"])
        ce_loss(model, ids).backward()
    keep = [i for i, s in enumerate("abc") if s in sel.history[0].kept_hashes]
    assert 0 < len(keep) < 3
    ce_loss(plain, ids[keep]).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-12


def test_shared_dense_sum_never_writes_into_a_sites_data():
    """A tied parameter's dense sum is formed in place only in a buffer it owns: a site that is
    already dense (its data is the store's / the caller's tensor) is left untouched."""
    from dattri_llm.gradient import Factorized, Materialized

    kw = {"in_features": 3, "out_features": 2, "bias": False}
    gen = torch.Generator().manual_seed(0)
    fac = Factorized(
        torch.randn(4, 5, 3, generator=gen, dtype=torch.float64),
        torch.randn(4, 5, 2, generator=gen, dtype=torch.float64),
        "nn.Linear",
        kw,
    )
    dense = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    kept = dense.clone()
    want = fac.materialize().data + dense
    for sites in (
        [Materialized(dense, "nn.Linear", kw), fac],
        [fac, Materialized(dense, "nn.Linear", kw)],
        [fac, fac],
    ):
        got = Shared(sites, ["a", "b"]).materialize().data
        ref = sum(s.materialize().data for s in sites)
        assert torch.equal(dense, kept)
        assert torch.allclose(got, ref, rtol=0, atol=1e-14)
    assert torch.allclose(
        Shared([fac, Materialized(dense, "nn.Linear", kw)], ["a", "b"]).materialize().data, want
    )


def test_conv_transpose_output_size_replicate_conv_and_image_layer_norm() -> None:
    """ConvTranspose3d(output_size=) -> replicate-padded Conv3d -> LayerNorm
    over the image dims. The norm removes every per-channel constant, so both biases' true
    per-sample gradients are 0; they are compared on the scale of the whole gradient (a
    relative error against a reference of pure round-off reads as a false 10 % "error")."""
    from dattri_llm import REGISTER_ALL, CaptureCallback, HookManager, HookManagerConfig
    from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ct = nn.ConvTranspose3d(2, 3, 3, stride=2)
            self.conv = nn.Conv3d(3, 2, 3, padding=1, padding_mode="replicate")
            self.ln = nn.LayerNorm([8, 8, 8])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(self.conv(self.ct(x, output_size=[8, 8, 8])))

    torch.manual_seed(0)
    model = Net().double()
    x = torch.randn(3, 2, 3, 3, 3, dtype=torch.float64)

    def loss(m: nn.Module, xx: torch.Tensor) -> torch.Tensor:
        return m(xx).sin().sum()

    cap = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    with hm.collect(deregister_on_exit=True):
        loss(model, x).backward()
    got = captured_by_parameter(hm, cap.record.gradient, model)
    ref = per_sample_loop_grads(model, loss, x)
    scale = max(float(v.abs().max()) for v in ref.values())
    assert set(got) == set(ref)
    for name, value in ref.items():
        assert float((got[name] - value).abs().max()) < 1e-12 * scale, name
    assert float(ref["ct.bias"].abs().max()) < 1e-12 * scale  # truly zero
