"""``HookManagerConfig``: which layers to hook, how, and how to interpret them."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.hooks.coverage import uncaptured_warning
from dattri_llm.gradient.layers import LayerRule, get_rule, rule_for_module
from dattri_llm.gradient.layers.hf_classes import flat_token_layer_types
from dattri_llm.utils.names import close_candidates

__all__ = ["REGISTER_ALL", "HookManagerConfig", "LayerSpec", "as_config", "resolve_layers"]


class _RegisterAll:
    """Sentinel: select every eligible layer."""

    _instance: _RegisterAll | None = None

    def __new__(cls) -> _RegisterAll:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "REGISTER_ALL"


#: Select every eligible layer (a supported type with trainable parameters).
REGISTER_ALL = _RegisterAll()

Selector = Any  # REGISTER_ALL | Sequence[str] (regexes matched against full module names)


@dataclass
class HookManagerConfig:
    """What the :class:`~dattri_llm.HookManager` hooks and how.

    Attributes:
        linear_io: Layers captured as per-sample factors (input activations and output
            gradients): ``REGISTER_ALL`` or a list of regexes matched against full module names.
        param_grad: Layers captured from their parameters' ``.grad`` (one gradient per
            backward, so per-sample only with batch size 1). Same selector syntax.
        hook_types: Exact module names mapped to ``"linear_io"`` or ``"param_grad"``;
            combined with the selectors.
        layer_types: Relabel a module as a registered layer type (e.g. ``"nn.RMSNorm"`` for
            Hugging Face ``LlamaRMSNorm``). Relabelling never selects a layer.
        module_kwargs: Per-module hyper-parameters overriding what is read off the module
            (builders in :mod:`dattri_llm.utils.module`).
        capture_style: ``"factorized"`` keeps factors, ``"materialized"`` contracts them in the
            backward hook, ``"auto"`` picks the smaller per layer and micro-batch.
        projection: Optional capture-time random projection: one
            :class:`~dattri_llm.gradient.ops.projection.ProjectionConfig` for every hooked layer,
            or ``{layer-name regex: ProjectionConfig | None}`` (full match, first match wins;
            ``None`` or no match keeps the layer exact). Styles ``"logra"`` (factors projected
            separately, stays factorised), ``"dense"``, ``"mask"`` and ``"sparse"`` (a
            ``(B, proj_dim)`` vector); norm layers accept ``"dense"`` / ``"mask"`` /
            ``"sparse"`` only. One config for every layer applies to each in the nearest form
            it takes (a norm under ``"logra"``: exact up to ``proj_dim`` parameters, else
            ``"dense"``; see :func:`~dattri_llm.gradient.ops.projection.nearest_projection`);
            a style a layer does not take, asked of it in the dict form, is refused.
        hash_keys: Input fields hashed to identify samples (default: ``input_ids`` when the
            model receives it, else every tensor input with the batch's leading size).
        sample_id_key: Read sample ids from this model input instead of hashing.
        exclude: Regexes of module names never hooked (applied after selection).
        shared_parameters: ``"sum"`` (default) treats modules that share a weight (tied
            embeddings) as one parameter whose gradient is the sum over sites, with exact
            cross terms; ``"separate"`` keeps each site as its own block.
        check_coverage: On the first captured step, check that each captured parameter's
            per-sample gradients (weights, biases, norm parameters) sum to the gradient
            autograd computes for it, and warn once per layer where they do not (the weight is
            also used outside its module, e.g. a functional tie ``F.linear(h, wte.weight)``, or
            the module does not compute what its layer type says). Costs two extra
            contractions per layer (the sum and its round-off scale), once.
        include_frozen: Also capture parameters that do not require grad. By default only
            trainable parameters belong to the per-sample gradient: a layer whose weight is
            frozen and whose bias trains (BitFit) contributes its bias alone, and a layer with
            nothing trainable is not captured. With ``True``, hooked layers contribute every
            parameter their type covers, frozen or not (the gradient with respect to frozen
            weights, e.g. to attribute through a frozen backbone), and ``REGISTER_ALL``
            selects every supported layer with parameters.

    With no selector and no ``hook_types`` at all, every eligible layer is captured
    (``linear_io=REGISTER_ALL``). Selector patterns and ``exclude`` patterns that match no
    module are errors.

    Tied parameters (``shared_parameters="sum"``): a weight shared by several modules is one
    parameter, recorded once under its first module's name (a :class:`Shared` layer summing
    the sites); a module's own parameter next to the shared one (the bias of a tied
    ``nn.Linear`` head) is a layer of its own named ``"<module>.<parameter>"``, e.g.
    ``"lm_head.bias"``.
    """

    linear_io: Selector | None = None
    param_grad: Selector | None = None
    hook_types: dict[str, str] = field(default_factory=dict)
    layer_types: dict[str, str] = field(default_factory=dict)
    module_kwargs: dict[str, dict] = field(default_factory=dict)
    capture_style: str = "factorized"
    projection: Any = None
    hash_keys: Sequence[str] | None = None
    sample_id_key: str | None = None
    exclude: Sequence[str] = ()
    shared_parameters: str = "sum"
    check_coverage: bool = True
    include_frozen: bool = False

    def __post_init__(self) -> None:
        for name in ("linear_io", "param_grad"):
            sel = getattr(self, name)
            if isinstance(sel, str):
                setattr(self, name, [sel])
            if sel is not None and sel is not REGISTER_ALL:
                _check_patterns(name, getattr(self, name))
        if isinstance(self.exclude, str):
            self.exclude = [self.exclude]
        _check_patterns("exclude", self.exclude)
        for name in ("hook_types", "layer_types", "module_kwargs"):
            if not isinstance(getattr(self, name), Mapping):
                raise TypeError(
                    f"HookManagerConfig.{name} must be a dict keyed by module name, got "
                    f"{type(getattr(self, name)).__name__}."
                )
        for name in ("check_coverage", "include_frozen"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"HookManagerConfig.{name} must be True or False, got {getattr(self, name)!r}."
                )
        if self.projection is not None:
            from dattri_llm.gradient.ops.projection import resolve_projection

            resolve_projection(self.projection, None)  # types only; patterns are checked per model
        if self.capture_style not in ("factorized", "materialized", "auto"):
            raise ValueError(
                "capture_style must be 'factorized', 'materialized' or 'auto', got "
                f"{self.capture_style!r}"
            )
        if self.shared_parameters not in ("sum", "separate"):
            raise ValueError(
                f"shared_parameters must be 'sum' or 'separate', got {self.shared_parameters!r}"
            )
        for name, kind in self.hook_types.items():
            if kind not in ("linear_io", "param_grad"):
                raise ValueError(
                    f"hook_types[{name!r}] must be 'linear_io' or 'param_grad', got {kind!r}"
                )


def as_config(config: Any) -> HookManagerConfig:
    """``config`` itself, a default config for ``None``; anything else is a clear TypeError."""
    if config is None:
        return HookManagerConfig()
    if isinstance(config, HookManagerConfig):
        return config
    hint = (
        "HookManagerConfig(**your_dict)"
        if isinstance(config, Mapping)
        else "HookManagerConfig(linear_io=REGISTER_ALL)"
    )
    raise TypeError(
        f"HookManager(config=...) must be a HookManagerConfig, got {type(config).__name__} "
        f"{config!r}. Build one: config={hint} (from dattri_llm import HookManagerConfig, "
        "REGISTER_ALL)."
    )


def _check_patterns(name: str, patterns: Any) -> None:
    """Selector / exclude patterns: a sequence of regex strings (``REGISTER_ALL`` aside)."""
    ok = isinstance(patterns, Sequence) and all(isinstance(p, str) for p in patterns)
    if not ok:
        hint = " (use REGISTER_ALL to select every eligible layer)" if name != "exclude" else ""
        raise TypeError(
            f"HookManagerConfig.{name} must be a list of module-name regexes{hint}, got "
            f"{patterns!r}."
        )
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            hint = (
                "; to select every eligible layer use REGISTER_ALL "
                "(from dattri_llm import REGISTER_ALL)"
                if name != "exclude"
                else ""
            )
            raise ValueError(
                f"HookManagerConfig.{name} pattern {pattern!r} is not a valid regular "
                f"expression ({err}){hint}."
            ) from None


@dataclass
class LayerSpec:
    """One resolved layer: module, rule, hook type and hyper-parameters."""

    name: str
    module: nn.Module
    hook_type: str
    rule: LayerRule | None
    module_kwargs: dict


_WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def canonical_name(name: str, data_parallel: bool = False) -> str:
    """Module name without the segments DDP / FSDP / checkpoint / compile wrappers insert.

    Layer names are then the same whether a model is captured wrapped or not, so stores
    written under DDP score against stores written on a single device.

    Args:
        name: A name from ``model.named_modules()``.
        data_parallel: The model is a ``DistributedDataParallel`` / ``DataParallel`` wrapper,
            whose ``module.`` prefix is dropped.
    """
    # anywhere in the path, also last (FSDP1 wraps a leaf: ``fc._fsdp_wrapped_module`` is fc)
    name = ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)
    if data_parallel:
        name = "" if name == "module" else name.removeprefix("module.")
    return name


def is_data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is a (Distributed)DataParallel wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return isinstance(model, (DataParallel, DistributedDataParallel))


def _candidates(name: str, names: Sequence[str]) -> str:
    return ", ".join(close_candidates(name, names))


def _trainable(module: nn.Module, include_frozen: bool = False) -> bool:
    params = list(module.parameters(recurse=False))
    return bool(params) and (include_frozen or any(p.requires_grad for p in params))


#: Selector strings users write when they mean "every layer".
_ALL_WORDS = frozenset({"all", "ALL", "All", "*", "__all__", "register_all", "REGISTER_ALL"})


def _select(
    selector: Selector | None, names: Sequence[str], eligible: set[str], kind: str
) -> list[str]:
    if selector is None:
        return []
    if selector is REGISTER_ALL:
        return [n for n in names if n in eligible]
    chosen: list[str] = []
    for pattern in selector:
        rx = re.compile(pattern)
        hits = [n for n in names if rx.fullmatch(n)]
        if not hits:
            hint = (
                f" To select every eligible layer, pass {kind}=REGISTER_ALL "
                "(from dattri_llm import REGISTER_ALL)."
                if pattern in _ALL_WORDS
                else ""
            )
            raise ValueError(
                f"{kind} pattern {pattern!r} matches no module (patterns are regexes "
                f"full-matched against module names). Close candidates: "
                f"{_candidates(pattern, names)}.{hint}"
            )
        chosen += [n for n in hits if n not in chosen]
    return chosen


def _check_exclude(patterns: Sequence[str], names: Sequence[str]) -> list[re.Pattern]:
    """Compile ``exclude``; a pattern that matches no module is a (likely misspelt) error."""
    compiled = [re.compile(p) for p in patterns]
    unused = [p for p, rx in zip(patterns, compiled) if not any(rx.fullmatch(n) for n in names)]
    if unused:
        raise ValueError(
            f"HookManagerConfig.exclude patterns {unused} match no module (patterns are regexes "
            f"full-matched against module names), so they exclude nothing. Close candidates: "
            f"{_candidates(unused[0], names)}. Fix or remove them."
        )
    return compiled


def _check_fsdp_flat_parameters(model: nn.Module) -> None:
    """Refuse FSDP1 units wrapped with ``use_orig_params=False``.

    They hide their layers' parameters in flat buffers, so the layers such a unit owns
    directly would silently drop out of the capture.
    """
    for name, module in model.named_modules():
        if type(module).__name__ == "FullyShardedDataParallel" and not getattr(
            module, "_use_orig_params", True
        ):
            raise ValueError(
                f"model: the FSDP unit {name or '<root>'!r} was wrapped with "
                "use_orig_params=False, which flattens its parameters so the layers it owns "
                "cannot be hooked. Wrap with FullyShardedDataParallel(..., "
                "use_orig_params=True) or use FSDP2 (torch.distributed.fsdp.fully_shard)."
            )


def resolve_layers(model: nn.Module, config: HookManagerConfig) -> list[LayerSpec]:
    """Resolve a config against a model into the ordered list of layers to hook.

    Raises:
        ValueError: unknown module names (with close candidates), unsupported layer types
            (with the supported ones), or a selection that is empty.
    """
    _check_fsdp_flat_parameters(model)
    dp = is_data_parallel(model)
    modules = {canonical_name(n, dp): m for n, m in model.named_modules()}
    names = [n for n in modules if n]
    for key, mapping in (
        ("hook_types", config.hook_types),
        ("layer_types", config.layer_types),
        ("module_kwargs", config.module_kwargs),
    ):
        for n in mapping:
            if n not in modules:
                raise ValueError(
                    f"{key} names module {n!r}, which the model does not have. Close "
                    f"candidates: {_candidates(n, names)}"
                )

    implied = flat_token_layer_types(modules)  # linears a known MoE block feeds flat tokens

    def rule_of(name: str) -> LayerRule | None:
        if name in config.layer_types:
            return get_rule(config.layer_types[name])
        if name in implied:
            return get_rule(implied[name])
        return rule_for_module(modules[name])

    frozen_ok = config.include_frozen
    eligible = {n for n in names if rule_of(n) is not None and _trainable(modules[n], frozen_ok)}
    kinds: dict[str, str] = {}
    nothing_given = config.linear_io is None and config.param_grad is None and not config.hook_types
    linear_sel = REGISTER_ALL if nothing_given else config.linear_io
    for n in _select(linear_sel, names, eligible, "linear_io"):
        kinds[n] = "linear_io"
    params_all = {n for n in names if _trainable(modules[n], frozen_ok)}
    for n in _select(config.param_grad, names, params_all, "param_grad"):
        kinds[n] = "param_grad"
    kinds.update(config.hook_types)
    excluded = _check_exclude(config.exclude, names)
    specs = []
    left_out: set[str] = set()  # selected modules left out with a warning of their own
    for n in names:
        if n not in kinds or any(rx.fullmatch(n) for rx in excluded):
            continue
        kind = kinds[n]
        module = modules[n]
        if kind == "param_grad":
            specs.append(LayerSpec(n, module, kind, None, {}))
            continue
        rule = rule_of(n)
        if rule is None:
            from dattri_llm.gradient.layers import supported_layer_types

            raise ValueError(
                f"module {n!r} of type {type(module).__name__} has no layer rule. Supported "
                f"types: {', '.join(supported_layer_types())}. Declare what it is with "
                f"layer_types={{{n!r}: ...}} (plus module_kwargs), or hook it with param_grad."
            )
        try:
            kw = rule.module_kwargs(module)
        except (AttributeError, TypeError):
            if n not in config.layer_types:
                raise
            kw = {}  # a relabelled module: its hyper-parameters come from module_kwargs
        except (NotImplementedError, ValueError) as err:
            if linear_sel is not REGISTER_ALL or n in config.hook_types:
                raise ValueError(f"layer {n!r}: {err}") from None
            # REGISTER_ALL means every *eligible* layer: an unsupported configuration of a
            # known type (grouped conv, ...) is left out, loudly, instead of failing the run
            warnings.warn(f"REGISTER_ALL leaves out layer {n!r}: {err}", UserWarning, stacklevel=3)
            left_out.add(n)
            continue
        kw = {**kw, **dict(config.module_kwargs.get(n, {}))}
        how = "all" if linear_sel is REGISTER_ALL else "regex"
        how = "exact" if n in config.hook_types else how
        for suffix, sub_kw in rule.sublayers(kw):  # one layer per parameter of fused experts
            sub = f"{n}.{suffix}" if suffix else n
            sub_kw = _trainable_kwargs(rule, sub_kw, module, sub, config, how)
            if sub_kw is None:
                if how != "all":
                    left_out.add(n)  # warned about by name already
                continue
            _finalize_kwargs(rule, sub_kw, sub)
            specs.append(LayerSpec(sub, module, kind, rule, sub_kw))
    if not specs:
        raise ValueError(_empty_selection_message(model, eligible))
    register_all = linear_sel is REGISTER_ALL
    skip = left_out | {n for n in names if any(rx.fullmatch(n) for rx in excluded)}
    uncaptured_warning(modules, specs, register_all=register_all, skip=skip)
    return specs


def _trainable_kwargs(
    rule: LayerRule,
    kw: dict,
    module: nn.Module,
    name: str,
    config: HookManagerConfig,
    how: str,
) -> dict | None:
    """``kw`` restricted to the parameters that require grad (unless ``include_frozen``).

    Returns ``None`` for a layer whose covered parameters are all frozen, which is then left
    out: silently under REGISTER_ALL (its other trainable parameters, if any, are named by the
    uncaptured-parameter warning), with a warning when a selector pattern picked it; an exact
    ``hook_types`` entry (``how="exact"``) raises.
    """
    names = rule.param_names(kw)
    if config.include_frozen:
        return kw
    keep = [
        p
        for p in names
        if not isinstance(getattr(module, p, None), torch.Tensor)  # declared by module_kwargs
        or getattr(module, p).requires_grad
    ]
    if keep == names:
        return kw
    if not keep:
        message = (
            f"layer {name!r}: none of its parameters {names} require grad, so it has no "
            "gradient to capture. Unfreeze them (requires_grad_(True)), leave the layer out of "
            "the selection, or set HookManagerConfig(include_frozen=True) to capture the "
            "gradient with respect to frozen parameters."
        )
        if how == "exact":
            raise ValueError(message)
        if how == "all":
            return None
        warnings.warn(f"{message} It is left out.", UserWarning, stacklevel=4)
        return None
    try:
        return rule.restrict_params(kw, keep)
    except ValueError as err:
        raise ValueError(
            f"layer {name!r}: only {keep} of its parameters require grad, but {err} Unfreeze "
            "the others, or set HookManagerConfig(include_frozen=True)."
        ) from None


def _empty_selection_message(model: nn.Module, eligible: set[str]) -> str:
    params = list(model.parameters())
    if params and not any(p.requires_grad for p in params):
        why = (
            "none of the model's parameters require grad (the model is frozen), so there is "
            "no gradient to capture. Unfreeze what should be attributed (e.g. "
            "model.requires_grad_(True)), or set HookManagerConfig(include_frozen=True) to "
            "capture the gradient with respect to frozen parameters"
        )
    elif rule_for_module(model) is not None:
        why = (
            f"the model itself is one {type(model).__name__}, and layers are hooked by their "
            "name inside the model: wrap it (nn.Sequential(model))"
        )
    elif not eligible:
        from dattri_llm.gradient.layers import supported_layer_types

        why = (
            "no module of a supported layer type has trainable parameters (supported: "
            f"{', '.join(supported_layer_types())}); declare custom layers with layer_types "
            "+ module_kwargs or hook them with param_grad"
        )
    else:
        why = f"eligible layers: {_candidates('', sorted(eligible))}"
    return f"the hook selection is empty: no module of the model matched; {why}."


def _finalize_kwargs(rule: LayerRule, kw: dict, name: str) -> None:
    """Add derived entries and check the kwargs are enough for the rule."""
    try:
        k, d = rule.matrix_shape(kw)
        kw["_k"], kw["_d"] = k, d
    except KeyError as e:
        raise ValueError(
            f"module_kwargs for {name!r} ({rule.layer_type}) lack {e.args[0]!r}; build them with "
            "the helpers in dattri_llm.utils.module."
        ) from None
