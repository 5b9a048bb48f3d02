"""Parameters shared between hooked layers (tied weights) and which sites capture each parameter.

A parameter is one parameter wherever it is used: a weight tied between an embedding and an LM
head, or between two linear layers, has one per-sample gradient, the sum over its *sites*
(:class:`~dattri_llm.gradient.gradient.Shared`). Each site's *own* parameters stay their own:
the bias of a tied ``nn.Linear`` head is split off into a layer of its own, named
``"<module>.<parameter>"`` (``"lm_head.bias"``), which hooks the same module but captures only
that parameter. Summing ``[W | b1]`` and ``[W | b2]`` instead would add two different biases'
gradients into one column.

:func:`plan_sharing` turns the resolved layer list into the hooked specs (sites restricted to
the shared parameters, own parameters split off), the groups to sum, and, for every captured
parameter, the sites that capture it (used by the coverage check and to tell a bypassed
module from an unused site of a tied weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dattri_llm.gradient.hooks.config import (
    LayerSpec,
    _finalize_kwargs,
    canonical_name,
    is_data_parallel,
)
from dattri_llm.gradient.layer_gradient import LayerGradient, Materialized, Shared
from dattri_llm.utils.grouping import linked_groups

__all__ = ["ParamSites", "SharingPlan", "plan_sharing", "layer_parameters", "group_shared"]


@dataclass
class ParamSites:
    """One captured parameter and the hooked ``(spec, parameter name)`` sites capturing it."""

    name: str
    param: torch.Tensor
    sites: list[tuple[LayerSpec, str]] = field(default_factory=list)


@dataclass
class SharingPlan:
    """What :class:`~dattri_llm.HookManager` hooks once tied parameters are resolved.

    Attributes:
        layers: The specs to hook, in model order (own parameters of tied sites split off).
        groups: ``{lead site: [site names]}`` of parameters shared by several specs (empty with
            ``shared_parameters="separate"``).
        params: ``{id(parameter): ParamSites}`` for every captured parameter that requires grad.
        partly_hooked: Specs sharing a parameter with a trainable module that is not hooked.
        warnings: ``(key, message)`` pairs for the manager to emit once (partly hooked).
    """

    layers: list[LayerSpec]
    groups: dict[str, list[str]]
    params: dict[int, ParamSites]
    partly_hooked: set[str]
    warnings: list[tuple[str, str]] = field(default_factory=list)


def _captured(spec: LayerSpec) -> list[tuple[str, torch.Tensor]]:
    out = []
    for pname in spec.rule.param_names(spec.module_kwargs):
        p = getattr(spec.module, pname, None)
        if isinstance(p, torch.Tensor):
            out.append((pname, p))
    return out


def _restricted(spec: LayerSpec, keep: Sequence[str], name: str) -> LayerSpec:
    kw = spec.rule.restrict_params(spec.module_kwargs, keep)
    _finalize_kwargs(spec.rule, kw, spec.name)
    return dataclasses.replace(spec, name=name, module_kwargs=kw)


def _components(specs: Sequence[LayerSpec]) -> list[list[LayerSpec]]:
    """Specs linked by a shared parameter (by parameter identity)."""
    groups = linked_groups([[id(p) for _, p in _captured(spec)] for spec in specs])
    return [[specs[i] for i in g] for g in groups]


def _split_group(group: list[LayerSpec]) -> tuple[list[LayerSpec], dict[str, list[LayerSpec]]]:
    """The sites restricted to the shared parameters, and each site's own-parameter specs."""
    ids = [{id(p) for _, p in _captured(s)} for s in group]
    common = set.intersection(*ids)
    partial = set.union(*ids) - common
    for pid in partial:
        holders = [s.name for s, i in zip(group, ids) if pid in i]
        if len(holders) > 1:
            raise ValueError(
                f"layers {[s.name for s in group]} share parameters in a way that is not one "
                f"parameter used at several sites (one is shared by {holders} only). Hook the "
                "layers separately (HookManagerConfig(shared_parameters='separate') gives one "
                "block per site), or exclude some of them."
            )
    sites: list[LayerSpec] = []
    own: dict[str, list[LayerSpec]] = {}
    for spec, held in zip(group, ids):
        if held == common:
            sites.append(spec)
            continue
        pairs = _captured(spec)
        shared_names = [n for n, p in pairs if id(p) in common]
        try:
            sites.append(_restricted(spec, shared_names, spec.name))
            own[spec.name] = [
                _restricted(spec, [n], f"{spec.name}.{n}") for n, p in pairs if id(p) not in common
            ]
        except ValueError as err:
            raise ValueError(
                f"layer {spec.name!r} shares {shared_names} with {[s.name for s in group]} "
                f"and cannot capture its other parameters on their own: {err}"
            ) from None
    return sites, own


def plan_sharing(model: nn.Module, specs: Sequence[LayerSpec], mode: str) -> SharingPlan:
    """Resolve tied parameters among the hooked layers.

    Args:
        model: The hooked model.
        specs: The resolved layers (``resolve_layers``).
        mode: ``HookManagerConfig.shared_parameters`` (``"sum"`` or ``"separate"``).
    """
    linear = [s for s in specs if s.hook_type == "linear_io"]
    groups: dict[str, list[str]] = {}
    replaced: dict[str, LayerSpec] = {}
    extra: dict[str, list[LayerSpec]] = {}
    if mode == "sum":
        for comp in _components(linear):
            if len(comp) < 2:
                continue
            sites, own = _split_group(comp)
            groups[sites[0].name] = [s.name for s in sites]
            replaced.update({s.name: s for s in sites})
            extra.update(own)
    layers: list[LayerSpec] = []
    for spec in specs:
        layers.append(replaced.get(spec.name, spec))
        layers += extra.get(spec.name, [])
    params: dict[int, ParamSites] = {}
    for spec in layers:
        if spec.hook_type != "linear_io":
            continue
        for pname, p in _captured(spec):
            if p.requires_grad:
                entry = params.setdefault(id(p), ParamSites(f"{spec.name}.{pname}", p))
                entry.sites.append((spec, pname))
    plan = SharingPlan(layers, groups, params, set())
    _partly_hooked(model, specs, plan)
    return plan


def _partly_hooked(model: nn.Module, specs: Sequence[LayerSpec], plan: SharingPlan) -> None:
    """Find captured parameters that a trainable, unhooked module also holds."""
    hooked = {id(s.module) for s in specs}  # a module may be several layers (fused experts)
    dp = is_data_parallel(model)
    for raw_name, module in model.named_modules():
        name = canonical_name(raw_name, dp)
        if id(module) in hooked:
            continue
        for pname, p in module.named_parameters(recurse=False):
            entry = plan.params.get(id(p))
            if entry is None or not p.requires_grad:
                continue
            for spec, _ in entry.sites:
                plan.partly_hooked.add(spec.name)
                plan.warnings.append(
                    (
                        f"shared-unhooked:{spec.name}:{name}",
                        f"layer {spec.name!r} shares its {pname} with {name!r}, which is not "
                        "hooked: its gradient covers only the hooked site(s).",
                    )
                )


def layer_parameters(
    layers: Sequence[LayerSpec], groups: dict[str, list[str]]
) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer name: {parameter name: parameter}}`` for the layers of a captured step.

    The parameter names are those of the layer rule's :meth:`unflatten` of the layer's
    materialised gradient (for a tied group: of its lead site, whose parameter it is).
    ``param_grad`` layers map their module's parameters in capture order.
    """
    by_name = {s.name: s for s in layers}
    members = {m for names in groups.values() for m in names[1:]}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for spec in layers:
        if spec.name in members:
            continue
        if spec.hook_type == "param_grad":
            out[spec.name] = {
                n: p for n, p in spec.module.named_parameters(recurse=False) if p.requires_grad
            }
            continue
        lead = by_name[groups[spec.name][0]] if spec.name in groups else spec
        out[spec.name] = {
            pname: getattr(lead.module, pname)
            for pname in lead.rule.param_names(lead.module_kwargs)
        }
    return out


def group_shared(
    layers: dict[str, LayerGradient], groups: dict[str, list[str]]
) -> dict[str, LayerGradient]:
    """One entry per tied group, under the group's name; other layers unchanged.

    The group's entry is a :class:`Shared` layer of its sites' gradients, or their sum when
    every site is dense.
    """
    if not groups:
        return layers
    out: dict[str, LayerGradient] = {}
    member_of = {m: lead for lead, ms in groups.items() for m in ms}
    for name, lg in layers.items():
        lead = member_of.get(name)
        if lead is None:
            out[name] = lg
            continue
        if name != lead:
            continue
        names = [m for m in groups[lead] if m in layers]
        sites = [layers[m] for m in names]
        if all(isinstance(s, Materialized) for s in sites):
            out[name] = Materialized(
                sum(s.data for s in sites), sites[0].layer_type, sites[0].module_kwargs
            )
        else:
            out[name] = Shared(sites, names)
    return out
