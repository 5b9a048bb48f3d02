"""Hugging Face classes recognised by their class name, so ``REGISTER_ALL`` needs no declarations.

``transformers`` is never imported here: a module is matched by ``type(module).__name__``
(plus a check of the attributes the maths reads), and the first-step coverage check
(``gradient/hooks/coverage.py``) compares the captured gradients of every matched module with
autograd's, so a class whose maths differs from its entry is reported, not captured silently.

**RMS norms.** Three forms exist in transformers 5.25 (the lists below were built by comparing
every ``*RMSNorm`` class's source with these three; ``experiments/hf_norm_classes.py`` redoes
that comparison for another transformers version):

- ``"llama"``: ``weight * (x / rms(x)).to(input_dtype)``, eps in ``variance_epsilon``;
- ``"olmo2"``: ``(weight * x / rms(x)).to(input_dtype)`` (the product in float32);
- ``"gemma"``: ``((1 + weight) * x / rms(x)).type_as(x)`` (product in float32), eps in ``eps``.

The gradient of ``(1 + w) * x_hat`` with respect to ``w`` is that of ``w * x_hat``, so all three
are captured by ``nn.RMSNorm``'s rule (``a = x_hat``); they differ only in where the product is
rounded to a half dtype (round-off). A ``bias`` tensor on the module is read as ``+ b``.

**Scaled embeddings** (Gemma's, BART's, ...): ``nn.Embedding`` subclasses returning
``embedding(ids) * embed_scale``; ``nn.Embedding``'s rule scales the output gradient back.

**Mixture-of-experts** (transformers 5.x): fused expert modules (:data:`KNOWN_EXPERTS`, found by
their layout: :func:`looks_like_experts`), routers (:data:`KNOWN_ROUTERS`) and the linears a
known sparse block feeds flat tokens (:func:`flat_token_layer_types`). Their rules live in
``moe.py``, imported only when a model has such a layer.

The explicit route (``HookManagerConfig(layer_types=..., module_kwargs=...)``) wins over this
registry; :func:`register_hf_norm` adds a class of one of the known forms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "HFNormForm",
    "HF_NORM_FORMS",
    "hf_norm_classes",
    "hf_norm_form",
    "register_hf_norm",
    "embedding_output_scale",
    "MOE_EXPERTS",
    "MOE_TOKEN_LINEAR",
    "KNOWN_EXPERTS",
    "KNOWN_ROUTERS",
    "looks_like_experts",
    "flat_token_layer_types",
]

#: Layer types of the mixture-of-experts rules (``moe.py``): a fused expert module, and a linear
#: map of the flattened tokens (a router, a shared expert's linears).
MOE_EXPERTS = "moe.experts"
MOE_TOKEN_LINEAR = "moe.token_linear"


@dataclass(frozen=True)
class HFNormForm:
    """How a known RMS norm class computes ``y`` from ``x``.

    Attributes:
        name: ``"llama"``, ``"olmo2"`` or ``"gemma"`` (see the module docstring).
        offset: The weight multiplies as ``(offset + weight)``: ``0.0`` or Gemma's ``1.0``.
        eps_attr: The attribute holding eps (``"variance_epsilon"`` or ``"eps"``).
        product_in_float32: The weight multiplies before the cast back to the input dtype.
    """

    name: str
    offset: float
    eps_attr: str
    product_in_float32: bool


#: The known forms, by name.
HF_NORM_FORMS: dict[str, HFNormForm] = {
    "llama": HFNormForm("llama", 0.0, "variance_epsilon", False),
    "olmo2": HFNormForm("olmo2", 0.0, "variance_epsilon", True),
    "gemma": HFNormForm("gemma", 1.0, "eps", True),
}

# Class-name stems (``<stem>RMSNorm``) whose source in transformers 5.24 is exactly the form's.
_LLAMA_CLASSES = """
    AXK1 AXK2 Aimv2 Apertus1p5Text Apertus Arcee AriaText BailingHybrid Bamba BitNet Blt
    Chameleon Clvp Cohere2Moe Cosmos3EdgeText Csm Cwm DeepseekOcr2Text
    DeepseekOcr2Vision DeepseekV2 DeepseekV32 DeepseekV3 Deimv2 Dia DiffLlama Doge Dots1
    Dots3Note Emu3 Ernie4_5 Ernie4_5_Moe Ernie4_5_VLMoe EuroBert Evolla Exaone4
    Exaone4_5_ ExaoneMoe FalconH1 FalconMamba Glm4MoeLite Glm4Moe Glm4 Glm4vMoe
    Glm4vMoeText Glm4v Glm5Next Glm5NextText GlmImage GlmMoeDsa GlmOcr Glm
    Granite4VisionText GraniteDoclingText GraniteMoeHybrid GraniteMoe GraniteMoeSWA
    GraniteMoeShared Granite GraniteSWA HYV3 HYV4 HYV4VL HiggsAudioV2 HunYuanDenseV1
    HunYuanMoEV1 HunYuanVL HyperCLOVAX Idefics2 Idefics3 Inkling InternVLVision Jamba
    JetMoe KimiLinear Kolibri1 Kolibri1_1 Laguna Lfm2Moe Lfm2 Lfm3 Lfm3VlVision LightOnOcr Llama
    LongcatFlash Mamba2 Mamba Mellum MiMoV2Flash MiniCPM3 MiniCPM5Moe MiniMaxM2 MiniMax Ministral3
    Ministral Mistral3 Mistral4 MistralLarge4 Mistral Mixtral MllamaText Molmo2
    MuseGlimmerAssistant NeuCodec Olmoe Ovis2 PaddleOCR PeAudioEncoder
    PeAudioVideoEncoder PeVideoEncoder Phi3 Phi4Multimodal Pixtral QianfanOCRVision
    Qwen2Moe Qwen2 Qwen2VL Qwen2_5Omni Qwen2_5_VL Qwen3Moe Qwen3OmniMoeCode2Wav
    Qwen3OmniMoe Qwen3OmniMoeText Qwen3OmniMoeThinkerText Qwen3 Qwen3VLMoeText
    Qwen3VLText Sapiens2 SeedOss SmolLM3 SolarOpen TimesFm2_5 TimesFm UltraVBert
    Ultrabert UnlimitedOcrText VibeVoiceAcousticTokenizer VibeVoiceAsr VibeVoice
    VoxtralRealtime Xcodec2 Youtu Zamba2 Zamba Zaya
"""
_OLMO2_CLASSES = """
    Afmoe Beam DeepseekV4 FlexOlmo Flint GptOss Inkling2Loop Inkling2 Olmo2 Olmo3
    OlmoHybrid OpenAIPrivacyFilter
"""
_GEMMA_CLASSES = """
    Gemma2 Gemma3 Gemma MiniMaxM3VL MuseGlimmerTextCentered Qwen3Next Qwen3_5Moe Qwen3_5
    RecurrentGemma Step3p7 T5Gemma2 T5Gemma VaultGemma
"""

_NORMS: dict[str, HFNormForm] = {}
for _form, _stems in (
    ("llama", _LLAMA_CLASSES),
    ("olmo2", _OLMO2_CLASSES),
    ("gemma", _GEMMA_CLASSES),
):
    for _stem in _stems.split():
        _NORMS[f"{_stem}RMSNorm"] = HF_NORM_FORMS[_form]


def register_hf_norm(class_name: str, form: str | HFNormForm) -> None:
    """Recognise the norm class ``class_name`` under ``REGISTER_ALL`` as one of the known forms.

    Args:
        class_name: ``type(module).__name__`` of the norm class.
        form: ``"llama"``, ``"olmo2"``, ``"gemma"`` or an :class:`HFNormForm`.

    Raises:
        ValueError: ``form`` names no known form.
    """
    if isinstance(form, str):
        if form not in HF_NORM_FORMS:
            raise ValueError(
                f"register_hf_norm(form={form!r}): expected one of {sorted(HF_NORM_FORMS)} or "
                "an HFNormForm; declare a norm of another form with layer_types + module_kwargs."
            )
        form = HF_NORM_FORMS[form]
    _NORMS[class_name] = form


def hf_norm_classes() -> dict[str, HFNormForm]:
    """``{class name: form}`` of every recognised norm class (a copy)."""
    return dict(_NORMS)


def hf_norm_form(module: nn.Module) -> HFNormForm | None:
    """The form of a recognised norm module, or ``None``.

    A module is recognised when its class name is registered *and* it holds what the form
    reads: a 1-D ``weight`` parameter and a float in the form's eps attribute (a same-named
    class of another shape is left to the unknown-module warning).
    """
    form = _NORMS.get(type(module).__name__)
    if form is None:
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, form.eps_attr, None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    return form


_SCALED_EMBEDDINGS = frozenset(
    f"{stem}ScaledWordEmbedding"
    for stem in """
    Bart BigBirdPegasus BioGpt Blenderbot M2M100 MBart NllbMoe PegasusX PLBart PPFormulaNet
    SeamlessM4T SeamlessM4Tv2 TrOCR XGLM DiffusionGemmaText EmbeddingGemma2Text GemmaText
    Gemma2Text Gemma3Text Gemma3nText Gemma4Text Gemma4UnifiedText MiniCPM3 VaultGemmaText
    """.split()
)


def embedding_output_scale(module: nn.Module) -> float | None:
    """``embed_scale`` of a recognised scaled-embedding module (``None`` for any other).

    transformers 5.24's ``*ScaledWordEmbedding`` classes return ``embedding(ids) * embed_scale``
    (a float attribute, or a buffer cast to the weight's dtype, whose value this returns).
    """
    if type(module).__name__ not in _SCALED_EMBEDDINGS:
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        weight = getattr(module, "weight", None)
        dtype = weight.dtype if isinstance(weight, torch.Tensor) else scale.dtype
        if scale.is_meta:  # built on the meta device: the float the buffer is made from
            scalar = getattr(module, "scalar_embed_scale", None)
            if isinstance(scalar, bool) or not isinstance(scalar, (int, float)):
                return None
            scale = torch.tensor(float(scalar))
        return float(scale.to(dtype))
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        return float(scale)
    return None


# ---- mixture of experts ------------------------------------------------------------------------
#: Fused-expert classes whose layout and eager maths the rule knows (transformers 5.x).
KNOWN_EXPERTS = frozenset(
    {"MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts", "OlmoeExperts", "GptOssExperts"}
)
#: Router classes: a linear map of the flattened tokens (softmax / top-k applied after it).
KNOWN_ROUTERS = frozenset(
    {
        "MixtralTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3MoeTopKRouter",
        "OlmoeTopKRouter",
        "GptOssTopKRouter",
    }
)
#: Sparse blocks that call these children's ``nn.Linear`` layers on the flattened tokens.
_FLAT_CHILDREN = {"Qwen2MoeSparseMoeBlock": ("shared_expert", "shared_expert_gate")}


def looks_like_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused expert weights (3-D ``gate_up_proj`` / ``down_proj``)."""
    p = getattr(module, "down_proj", None)
    return isinstance(p, torch.Tensor) and p.dim() == 3


def flat_token_layer_types(modules: dict[str, nn.Module]) -> dict[str, str]:
    """``{module name: "moe.token_linear"}`` for linears that a known block feeds flat tokens."""
    out: dict[str, str] = {}
    for name, module in modules.items():
        children = _FLAT_CHILDREN.get(type(module).__name__)
        if children is None or not type(module).__module__.startswith("transformers"):
            continue
        for child in children:
            prefix = f"{name}.{child}" if name else child
            for sub, m in modules.items():
                if (sub == prefix or sub.startswith(prefix + ".")) and isinstance(m, nn.Linear):
                    out[sub] = MOE_TOKEN_LINEAR
    return out
