"""Layer rules: one file per layer family, and the registry that maps modules to rules.

Adding a layer type means adding one file with a :class:`LayerRule` subclass and one
``register_rule`` line below. The mixture-of-experts rules are registered lazily
(``register_lazy_rule``): ``moe.py`` is imported the first time a model has such a layer (or a
config names its type), so capturing a model without one never loads it.
"""

from __future__ import annotations

import importlib

from torch import nn

from dattri_llm.gradient.layers.base import LayerRule, OuterProductRule
from dattri_llm.gradient.layers.conv import ConvRule
from dattri_llm.gradient.layers.conv_transpose import ConvTransposeRule
from dattri_llm.gradient.layers.embedding import EmbeddingRule
from dattri_llm.gradient.layers.hf_classes import (
    KNOWN_ROUTERS,
    MOE_EXPERTS,
    MOE_TOKEN_LINEAR,
    hf_norm_form,
    looks_like_experts,
)
from dattri_llm.gradient.layers.linear import HFConv1DRule, LinearRule
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
    "register_lazy_rule",
    "get_rule",
    "rule_for_module",
    "supported_layer_types",
]

_RULES: dict[str, LayerRule] = {}
_ALIASES: dict[str, str] = {}
#: ``{layer type: (module, class name)}`` of the rules registered on first use.
_LAZY: dict[str, tuple[str, str]] = {}


def register_rule(rule: LayerRule, aliases: tuple[str, ...] = ()) -> LayerRule:
    """Register a rule under its ``layer_type`` and any alias names."""
    _RULES[rule.layer_type] = rule
    for alias in aliases:
        _ALIASES[alias] = rule.layer_type
    return rule


def register_lazy_rule(layer_type: str, module: str, class_name: str) -> None:
    """Register ``module.class_name()`` under ``layer_type``, importing it on first use."""
    _LAZY[layer_type] = (module, class_name)


def _rule(layer_type: str) -> LayerRule:
    """The registered rule of a layer type, importing a lazily registered one."""
    if layer_type not in _RULES and layer_type in _LAZY:
        module, class_name = _LAZY[layer_type]
        register_rule(getattr(importlib.import_module(module), class_name)())
    return _RULES[layer_type]


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
register_lazy_rule(MOE_EXPERTS, "dattri_llm.gradient.layers.moe", "MoEExpertsRule")
register_lazy_rule(MOE_TOKEN_LINEAR, "dattri_llm.gradient.layers.moe", "TokenLinearRule")
register_rule(ProjectedOuterProductRule())
register_rule(ProjectedDenseRule())
register_rule(ProjectedMaskRule())
register_rule(ProjectedSparseRule())
register_rule(ProjectedVectorRule())  # any layer read as a vector (ProjectedFisherAttributor)


def supported_layer_types() -> list[str]:
    """Every layer type name (and alias) accepted by ``layer_types``."""
    return sorted(set(_RULES) | set(_LAZY) | set(_ALIASES))


def get_rule(layer_type: str) -> LayerRule:
    """The rule registered for a layer type name (or alias).

    Raises:
        ValueError: naming the unknown type and listing the supported ones.
    """
    key = _ALIASES.get(layer_type, layer_type)
    if key not in _RULES and key not in _LAZY:
        raise ValueError(
            f"unsupported layer type {layer_type!r}; supported types: "
            f"{', '.join(supported_layer_types())}."
        )
    return _rule(key)


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
            return _rule(MOE_TOKEN_LINEAR)
    if hf_norm_form(module) is not None:
        return _RULES[RMSNormRule.layer_type]
    if looks_like_experts(module):  # an unknown layout is refused by name in module_kwargs
        return _rule(MOE_EXPERTS)
    for rule in _RULES.values():
        if rule.module_types and isinstance(module, rule.module_types):
            return rule
    return None
