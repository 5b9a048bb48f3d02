"""Layer rules: one file per layer family, and the registry that maps modules to rules.

Adding a layer type means adding one file with a :class:`LayerRule` subclass and one
``register_rule`` line below.
"""

from __future__ import annotations

from torch import nn

from dattri_llm.gradient.layers.base import LayerRule, OuterProductRule
from dattri_llm.gradient.layers.conv import ConvRule
from dattri_llm.gradient.layers.conv_transpose import ConvTransposeRule
from dattri_llm.gradient.layers.embedding import EmbeddingRule
from dattri_llm.gradient.layers.hf_classes import hf_norm_form
from dattri_llm.gradient.layers.linear import HFConv1DRule, LinearRule
from dattri_llm.gradient.layers.moe import (
    KNOWN_ROUTERS,
    MoEExpertsRule,
    TokenLinearRule,
    looks_like_experts,
)
from dattri_llm.gradient.layers.norm import (
    GroupNormRule,
    InstanceNormRule,
    LayerNormRule,
    RMSNormRule,
)
from dattri_llm.gradient.layers.projected import (
    ProjectedDenseRule,
    ProjectedMaskRule,
    ProjectedOuterProductRule,
    ProjectedSparseRule,
    ProjectedVectorRule,
)

__all__ = [
    "LayerRule",
    "OuterProductRule",
    "register_rule",
    "get_rule",
    "rule_for_module",
    "supported_layer_types",
]

_RULES: dict[str, LayerRule] = {}
_ALIASES: dict[str, str] = {}


def register_rule(rule: LayerRule, aliases: tuple[str, ...] = ()) -> LayerRule:
    """Register a rule under its ``layer_type`` and any alias names."""
    _RULES[rule.layer_type] = rule
    for alias in aliases:
        _ALIASES[alias] = rule.layer_type
    return rule


register_rule(LinearRule(), ("Linear", "linear"))
register_rule(HFConv1DRule(), ("Conv1D",))
register_rule(ConvRule(), ("nn.Conv1d", "nn.Conv2d", "nn.Conv3d"))
register_rule(
    ConvTransposeRule(), ("nn.ConvTranspose1d", "nn.ConvTranspose2d", "nn.ConvTranspose3d")
)
register_rule(EmbeddingRule(), ("Embedding",))
register_rule(LayerNormRule(), ("LayerNorm",))
register_rule(RMSNormRule(), ("RMSNorm",))
register_rule(GroupNormRule(), ("GroupNorm",))
register_rule(InstanceNormRule(), ("nn.InstanceNorm1d", "nn.InstanceNorm2d", "nn.InstanceNorm3d"))
register_rule(MoEExpertsRule())
register_rule(TokenLinearRule())
register_rule(ProjectedOuterProductRule())
register_rule(ProjectedDenseRule())
register_rule(ProjectedMaskRule())
register_rule(ProjectedSparseRule())
register_rule(ProjectedVectorRule())  # any layer read as a vector (ProjectedFisherAttributor)


def supported_layer_types() -> list[str]:
    """Every layer type name (and alias) accepted by ``layer_types``."""
    return sorted(set(_RULES) | set(_ALIASES))


def get_rule(layer_type: str) -> LayerRule:
    """The rule registered for a layer type name (or alias).

    Raises:
        ValueError: naming the unknown type and listing the supported ones.
    """
    key = _ALIASES.get(layer_type, layer_type)
    if key not in _RULES:
        raise ValueError(
            f"unsupported layer type {layer_type!r}; supported types: "
            f"{', '.join(supported_layer_types())}."
        )
    return _RULES[key]


def rule_for_module(module: nn.Module) -> LayerRule | None:
    """The rule that recognises ``module`` by its class, or ``None``.

    Besides the torch classes, Hugging Face's ``Conv1D`` and the RMS norm classes of
    :mod:`~dattri_llm.gradient.layers.hf_classes` are recognised by name.
    """
    cls = type(module)
    if cls.__module__.startswith("transformers"):
        if cls.__name__ == "Conv1D":
            return _RULES[HFConv1DRule.layer_type]
        if cls.__name__ in KNOWN_ROUTERS:
            return _RULES[TokenLinearRule.layer_type]
    if hf_norm_form(module) is not None:
        return _RULES[RMSNormRule.layer_type]
    if looks_like_experts(module):  # an unknown layout is refused by name in module_kwargs
        return _RULES[MoEExpertsRule.layer_type]
    for rule in _RULES.values():
        if rule.module_types and isinstance(module, rule.module_types):
            return rule
    return None
