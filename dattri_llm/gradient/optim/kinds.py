"""What a torch optimizer holds for one parameter: its kind, hyper-parameters and state.

Only optimizers whose update the library models exactly are accepted: ``torch.optim.SGD``
(momentum, dampening, Nesterov, coupled weight decay, ``maximize``) and ``torch.optim.Adam`` /
``torch.optim.AdamW`` (coupled or decoupled weight decay, AMSGrad, ``maximize``). Anything else —
another class, or a subclass that overrides ``step`` — is refused by :func:`optimizer_kind` with
an error naming the supported ones, never approximated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union

import torch

__all__ = [
    "SUPPORTED_OPTIMIZERS",
    "OptimizerLike",
    "ParamHyper",
    "resolve_optimizer",
    "optimizer_kind",
    "param_hypers",
    "param_state",
]

#: The optimizer classes whose update is modelled exactly.
SUPPORTED_OPTIMIZERS = ("torch.optim.SGD", "torch.optim.Adam", "torch.optim.AdamW")

#: An optimizer, or a callable returning it (for trainers that build theirs late).
OptimizerLike = Union[torch.optim.Optimizer, Callable[[], Any]]  # noqa: UP007 (runtime alias)

OptimizerKind = Literal["sgd", "adam"]


@dataclass(frozen=True)
class ParamHyper:
    """The hyper-parameters one parameter's update uses (from its param group).

    Attributes:
        kind: ``"sgd"`` or ``"adam"`` (Adam and AdamW).
        optimizer: The optimizer's class name.
        lr: Learning rate.
        weight_decay: Weight decay ``λ``.
        decoupled: AdamW-style decay ``θ ← (1 − ηλ)θ`` (else ``λθ`` is added to the gradient).
        maximize: The optimizer ascends.
        beta1, beta2, eps, amsgrad: Adam's.
        momentum, dampening, nesterov: SGD's.
    """

    kind: str
    optimizer: str
    lr: float
    weight_decay: float
    decoupled: bool
    maximize: bool
    beta1: float = 0.0
    beta2: float = 0.0
    eps: float = 0.0
    amsgrad: bool = False
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (stored with recorded dynamics)."""
        return dict(self.__dict__)


def resolve_optimizer(optimizer: OptimizerLike, where: str) -> torch.optim.Optimizer:
    """The optimizer itself (calling ``optimizer`` first when it is a factory).

    Raises:
        TypeError: neither an optimizer nor a callable returning one.
    """
    opt = optimizer
    if not isinstance(opt, torch.optim.Optimizer) and callable(opt):
        opt = opt()
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"{where}: optimizer must be a torch.optim.Optimizer or a callable returning one "
            f"(for trainers that build it late), got {type(opt).__name__}."
        )
    return opt


def optimizer_kind(optimizer: torch.optim.Optimizer, where: str) -> str:
    """``"sgd"`` or ``"adam"``; anything the library cannot model exactly is refused.

    Raises:
        TypeError: naming the optimizer and the supported ones.
    """
    cls = type(optimizer)
    for base, kind in ((torch.optim.AdamW, "adam"), (torch.optim.Adam, "adam")):
        if isinstance(optimizer, base) and cls.step is base.step:
            return kind
    if isinstance(optimizer, torch.optim.SGD) and cls.step is torch.optim.SGD.step:
        return "sgd"
    raise TypeError(
        f"{where}: optimizer {cls.__module__}.{cls.__name__} is not supported: its update is "
        f"modelled exactly only for {', '.join(SUPPORTED_OPTIMIZERS)} (subclasses that keep "
        "their step()). Use one of them for the run you attribute."
    )


def _float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def param_hypers(optimizer: torch.optim.Optimizer, where: str) -> dict[int, ParamHyper]:
    """``{id(param): ParamHyper}`` for every parameter the optimizer updates."""
    kind = optimizer_kind(optimizer, where)
    name = type(optimizer).__name__
    out: dict[int, ParamHyper] = {}
    for group in optimizer.param_groups:
        wd = _float(group.get("weight_decay", 0.0))
        common = {
            "kind": kind,
            "optimizer": name,
            "lr": _float(group["lr"]),
            "weight_decay": wd,
            "maximize": bool(group.get("maximize", False)),
        }
        if kind == "adam":
            b1, b2 = group["betas"]
            hyper = ParamHyper(
                decoupled=bool(group.get("decoupled_weight_decay", False)),
                beta1=_float(b1),
                beta2=_float(b2),
                eps=_float(group["eps"]),
                amsgrad=bool(group.get("amsgrad", False)),
                **common,
            )
        else:
            hyper = ParamHyper(
                decoupled=False,
                momentum=_float(group.get("momentum", 0.0)),
                dampening=_float(group.get("dampening", 0.0)),
                nesterov=bool(group.get("nesterov", False)),
                **common,
            )
        for p in group["params"]:
            out[id(p)] = hyper
    return out


def param_state(
    optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, hyper: ParamHyper
) -> dict[str, Any]:
    """The state the coming ``optimizer.step()`` reads for ``param``, before it runs.

    Returns:
        Adam: ``{"count": c, "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}`` with ``c`` the
        optimizer's own update count of the coming step (``state["step"] + 1``) and zeros for
        a parameter not updated yet. SGD: ``{"momentum_buffer": tensor | None}`` (``None``
        before the first momentum step: the buffer then starts as the gradient).
    """
    state = optimizer.state.get(param, {})
    if hyper.kind == "adam":
        count = int(_float(state.get("step", 0))) + 1
        zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
        out: dict[str, Any] = {
            "count": count,
            "exp_avg": state.get("exp_avg", zeros),
            "exp_avg_sq": state.get("exp_avg_sq", zeros),
        }
        if hyper.amsgrad:
            out["max_exp_avg_sq"] = state.get("max_exp_avg_sq", zeros)
        return out
    return {"momentum_buffer": state.get("momentum_buffer")}
