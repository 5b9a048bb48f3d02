"""Coverage: is every trainable parameter captured, and do the captures add up to autograd's?

Hooks see a parameter only through its module's forward. A weight also used *outside* the
module (a functional tie such as ``F.linear(h, wte.weight)``, a fused LM head reading
``lm_head.weight``) gets gradient the hooks never see, and the captured per-sample gradients
silently miss that share; a module that does not compute what its layer type says (an
``nn.Linear`` subclass with its own forward) gives wrong ones. The check runs once per manager,
on the first captured step, for every captured parameter (weights, biases, norm parameters):
in the parameter's gradient hook (which receives the whole gradient of this backward pass),
the captured per-sample gradients of every site of that parameter are summed over the batch
(one contraction per site, ``batch_sum``) and compared with it.

At construction, :func:`uncaptured_warning` names the trainable parameters no hook captures,
and :func:`capture_coverage` counts them (``HookManager.coverage()``, logged at the first step,
recorded in a store's ``meta.json`` by ``OffloadCallback``).

The trainable set can change after construction (peft's ``set_adapter``, a module swapped
in, ``requires_grad`` toggled). :class:`TrainableWatch` looks for parameters that became
trainable since, on every captured forward, so the manager can hook them and report each
step in which they receive a gradient no capture hook saw (:func:`late_message`); a backward
through the model that captures nothing is reported as well (:func:`nothing_captured_message`).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.gradient import Factorized, Materialized

__all__ = [
    "CaptureCoverage",
    "TrainableWatch",
    "batch_param_gradient",
    "capture_coverage",
    "bypass_message",
    "coverage_gap",
    "coverage_message",
    "late_message",
    "nothing_captured_message",
    "site_coverage_gap",
    "term_magnitude",
    "tolerance",
    "uncaptured_warning",
]

_HALF = (torch.float16, torch.bfloat16)

#: One site of a parameter: ``(items, rule, module_kwargs, parameter name)``.
Site = tuple[Sequence[Any], Any, dict, str]


def batch_param_gradient(
    items: Sequence[Any], rule: Any, kwargs: dict, pname: str = "weight"
) -> torch.Tensor | None:
    """Sum over samples (and calls) of one site's captured gradients, as parameter ``pname``.

    Args:
        items: The site's buffered :class:`Factorized` / :class:`Materialized` items.
        rule: The site's layer rule.
        kwargs: The site's module kwargs.
        pname: The parameter (``"weight"``, ``"bias"``).

    Returns:
        The batch-summed gradient, or ``None`` for items the check cannot sum.
    """
    total = None
    for item in items:
        if not isinstance(item, (Factorized, Materialized)):
            return None
        part = rule.unflatten(item.batch_sum().data, kwargs).get(pname)
        if part is None:
            return None
        part = part[0].to(torch.float64)
        total = part if total is None else total + part
    return total


def term_magnitude(item: Any) -> float:
    """Largest summed magnitude of a raw capture's terms, over all the layer's parameters.

    The factors are replaced by their absolute values: the scale of the round-off the sum
    over samples and tokens can carry. A normalised input (``rule.unit_scale_input``) counts at
    least 1: a norm over an input constant along its normalised axes has ``x_hat = 0`` up to
    round-off, so its weight's gradient is round-off that ``|x_hat|`` does not measure.
    """
    if isinstance(item, Factorized):
        terms = item.apply(torch.abs)
        if item.rule.unit_scale_input:
            terms = Factorized(terms.a.clamp_min(1.0), terms.g, item.layer_type, item.module_kwargs)
        return float(terms.batch_sum().data.abs().max())
    return float(item.data.abs().sum(0).max())


def coverage_gap(captured: torch.Tensor, autograd: torch.Tensor, magnitude: float = 0.0) -> float:
    """Relative difference ``|captured - autograd| / |autograd|`` (max norms).

    The scale is at least ``eps ** (1/4) * magnitude`` (the size of the captured terms, over
    the layer's parameters): a gradient that cancels to round-off (a bias right before a
    normalisation, a norm weight over few tokens whose ``x_hat`` the rule recomputes) is not
    compared relative to that round-off (measured: up to ``2e-5 * magnitude`` in float32).
    """
    ref = autograd.detach().to(torch.float64)
    scale = float(ref.abs().max())
    if autograd.is_floating_point():
        scale = max(scale, magnitude * torch.finfo(autograd.dtype).eps ** 0.25)
    if scale == 0.0:
        return 0.0 if float(captured.abs().max()) == 0.0 else float("inf")
    return float((captured - ref).abs().max()) / scale


def site_coverage_gap(
    sites: Sequence[Site], grad: torch.Tensor, magnitude: float = 0.0
) -> float | None:
    """Gap between a parameter's autograd gradient and the batch sum over all its sites' items.

    Args:
        sites: ``(items, rule, module_kwargs, parameter name)`` of every site of the parameter.
        grad: The parameter's gradient of this backward pass.
        magnitude: Size of the captured terms (:func:`term_magnitude`), see :func:`coverage_gap`.

    Returns:
        The relative gap, or ``None`` when the two cannot be compared (sparse, sharded, an
        item type or layout the check does not sum).
    """
    if grad.is_sparse or type(grad).__name__ == "DTensor":  # FSDP2 shard: not comparable
        return None
    total = None
    for items, rule, kwargs, pname in sites:
        part = batch_param_gradient(items, rule, kwargs, pname)
        if part is None or tuple(part.shape) != tuple(grad.shape):
            return None
        total = part if total is None else total + part
    return None if total is None else coverage_gap(total, grad, magnitude)


def tolerance(sites: Sequence[Site], grad: torch.Tensor) -> float:
    """Allowed gap: round-off of the least precise dtype involved.

    A missing share (a functional tie) is typically tens of percent; the allowance covers what
    the rules recompute (a norm's ``x_hat`` over few elements amplifies float32 round-off to
    ~1e-3) and half types, which sum far less exactly.
    """
    dtypes = {grad.dtype}
    for items, *_ in sites:
        for item in items:
            dtypes.add(item.g.dtype if isinstance(item, Factorized) else item.data.dtype)
    if dtypes & set(_HALF):
        return 5e-2
    return 1e-2 if torch.float32 in dtypes else 1e-6


def coverage_message(
    sites: Sequence[tuple[Any, str]],
    buffers: Mapping[str, list],
    grad: torch.Tensor,
    magnitudes: Mapping[str, float] | None = None,
) -> str | None:
    """The warning for a parameter if its captured gradients miss part of ``grad``.

    Args:
        sites: ``(LayerSpec, parameter name)`` of every hooked site of the parameter.
        buffers: The step's buffered items that make up ``grad``, ``{layer: [(order, item)]}``
            (those of the backward pass, or nested reentrant pass, ``grad`` comes from).
        grad: The parameter's gradient of this backward pass.
        magnitudes: ``{layer: term_magnitude}`` of the raw captures (round-off scale).

    Returns:
        The message, or ``None`` when the gradients agree or cannot be compared.
    """
    parts = [
        ([item for _, item in buffers[s.name]], s.rule, s.module_kwargs, pname)
        for s, pname in sites
        if s.name in buffers
    ]
    magnitude = max((magnitudes or {}).get(s.name, 0.0) for s, _ in sites)
    gap = site_coverage_gap(parts, grad, magnitude) if parts else None  # none ran: bypass
    if gap is None or gap <= tolerance(parts, grad):
        return None
    name, pname = sites[0][0].name, sites[0][1]
    names = [s.name for s, _ in sites]
    return (
        f"layer {name!r}: the captured per-sample gradients sum to a {pname} gradient that "
        f"differs from autograd's by {gap:.1%} (relative, first step): the {pname} is also "
        f"used outside the hooked module(s) {names}, e.g. a functional tie such as "
        "F.linear(h, wte.weight), so that share is missing from the captured gradients; or "
        f"the module does not compute what its layer type ({sites[0][0].rule.layer_type}) "
        "assumes (a subclass with its own forward). Call the module instead, or exclude the "
        f"layer (HookManagerConfig(exclude=[{name!r}])); check_coverage=False silences this."
    )


def only_reaches(node: Any, leaves: Mapping[int, str]) -> list[str]:
    """The layers of ``leaves`` that the autograd graph feeding ``node`` reaches.

    Args:
        node: An autograd node (a reentrant checkpoint's backward).
        leaves: ``{id(tensor): layer name}`` of tensors made to require grad by the manager.

    Returns:
        Their names, or ``[]`` when the graph also reaches any other tensor that requires grad
        (a trainable parameter, an input): then ``node``'s inputs need a gradient anyway.
    """
    found: list[str] = []
    seen: set[Any] = set()
    stack = [f for f, _ in node.next_functions]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf that requires grad
        if variable is not None:
            if id(variable) not in leaves:
                return []
            found.append(leaves[id(variable)])
            continue
        stack.extend(f for f, _ in fn.next_functions)
    return sorted(set(found))


def frozen_checkpoint_message(name: str, frozen: Sequence[str]) -> str:
    """The warning for a reentrant checkpoint whose inputs require grad only through ``frozen``.

    ``frozen``: the frozen layers whose outputs include_frozen made require grad.
    """
    return (
        f"layer {name!r} is recomputed by a reentrant checkpoint (use_reentrant=True) whose "
        f"inputs require grad only because include_frozen made the output of the frozen "
        f"layer(s) {list(frozen)} require it. Without the manager, torch's reentrant checkpoint "
        "gives the parameters inside no gradient when its inputs need none; with it, they get "
        "the checkpointed call's share, in the captured per-sample gradients and in their "
        "`.grad` (the captured gradients are those of the model with those layers trainable). "
        "Checkpoint with use_reentrant=False (for transformers models, "
        "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})), "
        "or capture without include_frozen."
    )


def bypass_message(entries: Sequence[Any]) -> str:
    """The warning for one layer whose parameters got a gradient while none of their sites ran.

    Args:
        entries: The layer's ``ParamSites`` (see ``hooks/sharing.py``) that got a gradient.
    """
    names = [s.name for s, _ in entries[0].sites]
    name = names[0]
    pnames = " and ".join(e.sites[0][1] for e in entries)
    tied = f" (tied with {names[1:]})" if len(names) > 1 else ""
    return (
        f"layer {name!r}{tied}: its {pnames} received a gradient in this backward pass but its "
        "forward never ran, so the parameter was used outside the module (e.g. TRL's fused LM "
        "head computes logits from lm_head.weight directly; nn.MultiheadAttention uses "
        "out_proj.weight without calling out_proj). Hooks cannot see that use: its per-sample "
        "gradient is recorded as zero. Exclude it "
        f"(HookManagerConfig(exclude=[{name!r}])) or make the model call the module."
    )


_WARNED_UNCAPTURED: set[str] = set()


def _listed(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def uncaptured_warning(
    modules: Mapping[str, nn.Module], specs: Sequence[Any], register_all: bool, skip: set[str]
) -> None:
    """Name every trainable parameter the hooks will not capture (construction time, once).

    Two cases: a hooked module's own parameter that its layer type does not cover (an
    ``nn.Linear`` subclass with an extra parameter; warned whatever the selection), and, under
    ``REGISTER_ALL``, any other trainable parameter of the model (a module no rule covers, a
    parameter registered on the root module).

    Args:
        modules: ``{canonical module name: module}`` of the model (the root as ``""``).
        specs: The resolved ``LayerSpec`` list.
        register_all: The selection is ``REGISTER_ALL`` (or the default).
        skip: Module names the user excluded, or that were left out with a warning already.
    """
    captured: set[int] = set()
    for spec in specs:
        if spec.hook_type == "param_grad":
            captured.update(id(p) for p in spec.module.parameters(recurse=False))
            continue
        for pname in spec.rule.param_names(spec.module_kwargs):
            p = getattr(spec.module, pname, None)
            if isinstance(p, torch.Tensor):
                captured.add(id(p))
    hooked = {s.name: s for s in specs}
    seen: set[int] = set()
    in_hooked: dict[str, list[str]] = {}
    elsewhere: list[str] = []
    for mname, module in modules.items():
        if mname in skip:
            continue
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in captured or id(p) in seen:
                continue
            seen.add(id(p))
            if mname in hooked:
                in_hooked.setdefault(mname, []).append(pname)
            elif register_all:
                where = "the root module" if not mname else "a"
                elsewhere.append(
                    f"{mname + '.' if mname else ''}{pname} ({where} {type(module).__name__})"
                )
    for mname, pnames in in_hooked.items():
        spec = hooked[mname]
        _warn_once(
            f"extra:{mname}:{pnames}",
            f"layer {mname!r} is hooked as {spec.rule.layer_type}, but its trainable "
            f"parameter(s) {pnames} are not part of that layer type's gradient, so they are "
            "not captured (and if they change how the module uses its weight, the weight's "
            "captured gradient is wrong as well: the first-step coverage check warns then). "
            f"Exclude the layer (HookManagerConfig(exclude=[{mname!r}])) or hook it with "
            "param_grad (batch size 1), or freeze those parameters.",
        )
    if elsewhere:
        _warn_once(
            "elsewhere:" + ",".join(elsewhere),
            f"REGISTER_ALL captures no per-sample gradient for these trainable parameters: "
            f"{_listed(elsewhere)}. No layer rule covers them. Declare their modules with "
            "layer_types + module_kwargs (e.g. 'nn.RMSNorm' for an RMSNorm class), hook them "
            "with param_grad, or freeze them; otherwise attribution ignores them.",
        )


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED_UNCAPTURED:
        _WARNED_UNCAPTURED.add(key)
        warnings.warn(message, UserWarning, stacklevel=5)


_LOG = logging.getLogger("dattri_llm.capture")


@dataclass(frozen=True)
class CaptureCoverage:
    """What share of a model's trainable parameters a :class:`~dattri_llm.HookManager` captures.

    Counts are parameter entries (scalars); a parameter shared by several modules (tied
    weights) counts once. ``HookManager.coverage()`` returns one.

    Attributes:
        captured: Trainable entries whose per-sample gradient is captured.
        total: Trainable entries of the model.
        left_out: Names (``model.named_parameters()``) of the trainable parameters not captured.
    """

    captured: int
    total: int
    left_out: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        """``captured / total`` (``1.0`` for a model without trainable parameters)."""
        return self.captured / self.total if self.total else 1.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``captured``, ``total``, ``fraction`` and ``left_out``."""
        return {
            "captured": self.captured,
            "total": self.total,
            "fraction": round(self.fraction, 6),
            "left_out": list(self.left_out),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaptureCoverage:
        """The inverse of :meth:`to_dict` (a store's ``meta.json`` entry)."""
        return cls(int(d["captured"]), int(d["total"]), tuple(d.get("left_out", ())))

    def __str__(self) -> str:
        text = (
            f"{self.fraction:.1%} of the trainable parameters ({self.captured:,} of {self.total:,})"
        )
        return text + (f"; left out: {_listed(list(self.left_out))}" if self.left_out else "")


def capture_coverage(
    model: nn.Module, layers: Sequence[Any], param_ids: Iterable[int]
) -> CaptureCoverage:
    """Count the trainable parameters a manager's hooks capture.

    Args:
        model: The hooked model.
        layers: The manager's ``LayerSpec`` list (``param_grad`` layers capture every
            trainable parameter of their module).
        param_ids: ``id()`` of every parameter the ``linear_io`` layers capture.
    """
    captured = set(param_ids)
    for spec in layers:
        if spec.hook_type == "param_grad":
            captured.update(id(p) for p in spec.module.parameters(recurse=False))
    n_captured = total = 0
    left_out: list[str] = []
    for name, p in model.named_parameters():  # each parameter once, tied ones too
        if not p.requires_grad:
            continue
        total += p.numel()
        if id(p) in captured:
            n_captured += p.numel()
        else:
            left_out.append(name)
    return CaptureCoverage(n_captured, total, tuple(left_out))


def log_coverage(coverage: CaptureCoverage) -> None:
    """The one log line of a manager's first captured step (logger ``dattri_llm.capture``)."""
    _LOG.info("HookManager captures %s", coverage)


class TrainableWatch:
    """The trainable parameters a manager was built for, and those that became trainable since.

    A parameter is known by identity or by its slot (module, attribute name) when that slot
    held a trainable parameter at construction: FSDP2 swaps a module's sharded parameters for
    unsharded ones around each forward, the same parameter under another object. A module
    swapped in is a new slot; a parameter unfrozen since is a slot that was frozen. Both are
    held weakly (a freed object must not lend its ``id`` to a new one).

    Args:
        model: The hooked model.
        known: Parameters the manager accounts for beyond the trainable ones (frozen
            parameters it captures, ``include_frozen``).
    """

    def __init__(self, model: nn.Module, known: Iterable[torch.Tensor] = ()) -> None:
        self.model = model
        self._known: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._slots: dict[tuple[int, str], weakref.ref] = {}
        for module, pname, p in _trainable(model):
            self._remember(module, pname, p)
        for p in known:
            self._known[id(p)] = p

    def _remember(self, module: nn.Module, pname: str, p: torch.Tensor) -> None:
        self._known[id(p)] = p
        self._slots[(id(module), pname)] = weakref.ref(module)

    def _is_known(self, module: nn.Module, pname: str, p: torch.Tensor) -> bool:
        if id(p) in self._known:
            return True
        ref = self._slots.get((id(module), pname))
        return ref is not None and ref() is module

    def new_trainable(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` of each trainable parameter unknown at construction.

        One walk over the modules' own parameter dicts (names are built only when one is
        found); each one found is known from then on, so it is returned once.
        """
        known = self._known
        for module, pname, p in _trainable(self.model):
            if id(p) not in known and not self._is_known(module, pname, p):
                break
        else:
            return []
        found = []
        for mname, module in self.model.named_modules():
            for pname, p in module._parameters.items():
                if p is None or not p.requires_grad or self._is_known(module, pname, p):
                    continue
                self._remember(module, pname, p)
                found.append((f"{mname}.{pname}" if mname else pname, p))
        return found


def _trainable(model: nn.Module) -> Iterable[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, parameter)`` of each trainable parameter, by a plain walk of the tree.

    ``model.parameters()`` builds every name on the way (some 2x slower on a small GPT-2), and
    this runs on every forward.
    """
    stack = [model]
    while stack:
        module = stack.pop()
        for pname, p in module._parameters.items():
            if p is not None and p.requires_grad:
                yield module, pname, p
        stack.extend(m for m in module._modules.values() if m is not None)


def late_message(names: Sequence[str], captured: bool) -> str:
    """The warning for a step whose gradient reached parameters no capture hook covers.

    Args:
        names: The parameters (``model.named_parameters()`` names) that became trainable after
            the manager was built and received a gradient in this step.
        captured: Whether the step captured anything else (a record was written).
    """
    outcome = (
        "the step's record leaves their per-sample gradients out"
        if captured
        else "nothing else was captured, so no record was written for this step"
    )
    return (
        f"trainable parameters {_listed(list(names))} received a gradient in this backward "
        "pass, but they became trainable after the HookManager was built (e.g. peft's "
        "set_adapter switched the active adapter, a module was replaced, or requires_grad was "
        f"turned on), so no hook captures them: {outcome}. Build the HookManager after the "
        "model's trainable parameters are final (hm.remove(); HookManager(model, config)), "
        "or freeze those parameters."
    )


def nothing_captured_message(layers: Sequence[str]) -> str:
    """The warning for a backward through the model that captured nothing.

    Args:
        layers: The manager's hooked layers.
    """
    return (
        "a backward pass went through the model's output but captured nothing: none of the "
        f"hooked layers ({_listed(list(layers), 5)}) received a gradient, so no record was "
        "written for this step. Their parameters were frozen or replaced after the "
        "HookManager was built, or the loss does not depend on them. Build the HookManager "
        "after the model's trainable parameters are final (hm.remove(); "
        "HookManager(model, config)), or select the layers that train."
    )
