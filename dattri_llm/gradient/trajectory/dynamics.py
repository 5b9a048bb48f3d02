"""``OptimizerDynamics``: the optimizer state around every recorded update.

Recorded by :class:`~dattri_llm.OptimizerStateCallback`, in memory or in a
:class:`~dattri_llm.TrajectorySnapshots` directory (safetensors + JSON). Per step ``t`` and
captured layer, tensors laid out like the layer's captured gradient (matrix form, or the
coordinates of a ``"mask"`` projection), in the parameters' own dtype:

* Adam / AdamW: ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with AMSGrad) before the
  update and the same with a ``.post`` suffix after it; ``param`` (θ_t) when weight decay is
  coupled (it is part of the consumed gradient).
* SGD: ``momentum_buffer`` before (absent before the first momentum step) and ``.post``.

Per step the JSON metadata holds the optimizer, each parameter's hyper-parameters and update
count (``ParamHyper``) and the learning rate; the layout maps each coordinate to its parameter.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from dattri_llm.gradient.trajectory.snapshots import TrajectorySnapshots

__all__ = ["OptimizerDynamics", "StepDynamics", "MemoryTrajectory"]


class MemoryTrajectory:
    """The in-memory stand-in of :class:`TrajectorySnapshots` for dynamics (same methods)."""

    def __init__(self) -> None:
        self._dynamics: dict[int, tuple[dict[str, torch.Tensor], dict]] = {}
        self._layout: tuple[dict[str, torch.Tensor], dict] | None = None

    def save_dynamics(self, step: int, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Keep one step's dynamics."""
        if int(step) in self._dynamics:
            raise ValueError(f"dynamics of step {step} were recorded already.")
        self._dynamics[int(step)] = (dict(tensors), dict(meta))

    def save_layout(self, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
        """Keep the layout."""
        self._layout = (dict(tensors), dict(meta))

    def steps(self, kind: str = "dynamics") -> list[int]:
        """Recorded steps (``kind`` must be ``"dynamics"``)."""
        return sorted(self._dynamics) if kind == "dynamics" else []

    def has(self, kind: str, step: int) -> bool:
        """Whether a step's dynamics (or the layout, step -1) are held."""
        return (kind == "layout" and self._layout is not None) or (
            kind == "dynamics" and int(step) in self._dynamics
        )

    def meta(self, kind: str, step: int) -> dict:
        """A step's metadata (``kind="dynamics"``) or the layout's (``kind="layout"``)."""
        if kind == "layout":
            return dict(self.load_layout()[1])
        return dict(self._get(step)[1])

    def _get(self, step: int) -> tuple[dict[str, torch.Tensor], dict]:
        if int(step) not in self._dynamics:
            raise KeyError(
                f"no optimizer dynamics recorded for step {step}; recorded: {self.steps()}."
            )
        return self._dynamics[int(step)]

    def load_dynamics(self, step: int, device: str | torch.device = "cpu") -> dict:
        """A step's tensors."""
        return {k: v.to(device) for k, v in self._get(step)[0].items()}

    def load_layout(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The layout's tensors and metadata."""
        if self._layout is None:
            raise KeyError("no layout recorded (no step was captured).")
        return self._layout

    def learning_rates(self) -> dict[int, float]:
        """``{step: learning rate}`` where one learning rate applies to the step."""
        return {
            s: float(m["learning_rate"])
            for s, (_, m) in sorted(self._dynamics.items())
            if isinstance(m.get("learning_rate"), (int, float))
        }


class StepDynamics:
    """The dynamics of one update: tensors per layer and per-coordinate hyper-parameters."""

    def __init__(
        self, step: int, tensors: dict[str, torch.Tensor], meta: dict, coords: dict, names: dict
    ) -> None:
        self.step = step
        self.meta = meta
        self.kind: str = meta["kind"]
        self._tensors = tensors
        self._coords = coords
        self._names = names

    def fields(self, layer: str) -> list[str]:
        """The tensors recorded for ``layer`` (e.g. ``["exp_avg", "exp_avg.post", ...]``)."""
        prefix = f"{layer}|"
        return sorted(k[len(prefix) :] for k in self._tensors if k.startswith(prefix))

    def has(self, layer: str, field: str) -> bool:
        """Whether ``field`` (e.g. ``"max_exp_avg_sq"``, ``"param"``) was recorded."""
        return f"{layer}|{field}" in self._tensors

    def tensor(self, layer: str, field: str) -> torch.Tensor:
        """A recorded tensor of ``layer`` (``field`` e.g. ``"exp_avg"`` or ``"exp_avg.post"``)."""
        key = f"{layer}|{field}"
        if key not in self._tensors:
            raise KeyError(
                f"step {self.step}: no {field!r} recorded for layer {layer!r} "
                f"(recorded: {sorted(k for k in self._tensors if k.startswith(layer + '|'))})."
            )
        return self._tensors[key]

    def hyper(self, layer: str, field: str) -> dict[str, Any]:
        """``{parameter name: value}`` of one hyper-parameter of ``layer``'s parameters."""
        try:
            per_param = self.meta["layers"][layer]["hyper"]
        except KeyError:
            raise KeyError(f"step {self.step}: layer {layer!r} has no recorded dynamics.") from None
        return {p: h[field] for p, h in per_param.items()}

    def per_coordinate(
        self, layer: str, values: Mapping[str, Any], dtype: torch.dtype, device: Any
    ) -> torch.Tensor:
        """Spread one value per parameter over the layer's coordinates ``(P,)``."""
        names = self._names[layer]
        table = torch.tensor([float(values[n]) for n in names], dtype=dtype, device=device)
        return table[self._coords[layer].to(device=device, dtype=torch.long)]

    def hyper_vector(
        self, layer: str, field: str, dtype: torch.dtype, device: Any = "cpu"
    ) -> torch.Tensor:
        """A hyper-parameter (``"lr"``, ``"beta1"``, ...) per coordinate ``(P,)``."""
        return self.per_coordinate(layer, self.hyper(layer, field), dtype, device)

    def count_vector(self, layer: str, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
        """Adam's update count ``c`` of this step per coordinate ``(P,)``."""
        return self.per_coordinate(layer, self.meta["layers"][layer]["count"], dtype, device)


class OptimizerDynamics:
    """Optimizer moments around each recorded update, for AdamW-influence and DVEmb.

    Obtain it from :meth:`~dattri_llm.OptimizerStateCallback.dynamics`, or load a recorded
    trajectory with :meth:`load`. Pass it as ``dynamics=`` to the trajectory attributors.

    Args:
        source: A :class:`TrajectorySnapshots` (or its directory), or an in-memory record.
    """

    def __init__(self, source: TrajectorySnapshots | MemoryTrajectory | str | os.PathLike) -> None:
        if isinstance(source, (str, os.PathLike)):
            source = TrajectorySnapshots(source)
        self.source = source
        if not source.has("layout", -1):
            where = getattr(source, "root", "memory")
            raise ValueError(
                f"{where} holds no optimizer dynamics: record them with OptimizerStateCallback "
                "(and call record_post(step) after every optimizer.step())."
            )
        tensors, meta = source.load_layout()
        self.layout_meta = meta
        self._coords = {k[len("coords.") :]: v for k, v in tensors.items()}
        self._names: dict[str, list[str]] = meta["param_names"]

    @classmethod
    def load(cls, path: str | os.PathLike) -> OptimizerDynamics:
        """Open dynamics recorded into a :class:`TrajectorySnapshots` directory."""
        return cls(TrajectorySnapshots(path))

    def save(self, path: str | os.PathLike) -> OptimizerDynamics:
        """Write in-memory dynamics to a trajectory directory; returns the on-disk view."""
        target = TrajectorySnapshots(path)
        tensors, meta = self.source.load_layout()
        target.save_layout(tensors, meta)
        for s in self.steps:
            target.save_dynamics(s, self.source.load_dynamics(s), self.source.meta("dynamics", s))
        target.close()
        return OptimizerDynamics(target)

    @property
    def steps(self) -> list[int]:
        """Steps whose update was recorded (``record_post`` called), ascending."""
        return self.source.steps("dynamics")

    @property
    def layer_names(self) -> list[str]:
        """The captured layers the dynamics cover."""
        return list(self._names)

    @property
    def kind(self) -> str:
        """``"adam"`` or ``"sgd"``."""
        return str(self.layout_meta["kind"])

    @property
    def optimizer(self) -> str:
        """The optimizer's class name."""
        return str(self.layout_meta["optimizer"])

    @property
    def uncovered_parameters(self) -> list[str]:
        """Trainable parameters of the model outside the captured layers."""
        return list(self.layout_meta.get("uncovered", []))

    @property
    def masked(self) -> bool:
        """Whether some layer holds only the coordinates of a ``"mask"`` projection."""
        return bool(self.layout_meta.get("masked"))

    def num_coords(self, layer: str) -> int:
        """Coordinates recorded for ``layer``."""
        return int(self._coords[layer].numel())

    def step(self, step: int, device: str | torch.device = "cpu") -> StepDynamics:
        """The dynamics of one update."""
        if not self.source.has("dynamics", step):
            raise KeyError(
                f"no optimizer dynamics for step {step}: recorded steps are {self.steps}. Was "
                "record_post(step) called after that step's optimizer.step()?"
            )
        return StepDynamics(
            int(step),
            self.source.load_dynamics(step, device),
            self.source.meta("dynamics", step),
            self._coords,
            self._names,
        )

    def learning_rates(self) -> dict[int, float]:
        """``{step: learning rate}`` for the steps with one learning rate for every layer."""
        return self.source.learning_rates()

    def __repr__(self) -> str:
        return (
            f"OptimizerDynamics({self.optimizer}, steps={len(self.steps)}, "
            f"layers={self.layer_names})"
        )
