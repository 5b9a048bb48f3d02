"""What the hook manager shows its plug-ins (callbacks, the preconditioner, parameter layouts).

A protocol, so that the plug-ins depend on these few members and never import
:class:`~dattri_llm.gradient.hooks.manager.HookManager`, which is built on them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dattri_llm.gradient.hooks.config import HookManagerConfig, LayerSpec
    from dattri_llm.gradient.ops.projection import CaptureProjection

__all__ = ["CaptureHost"]


class CaptureHost(Protocol):
    """The members of a :class:`~dattri_llm.HookManager` that its plug-ins may read.

    Attributes:
        model: The hooked model (possibly wrapped by DDP / FSDP).
        config: The resolved :class:`~dattri_llm.HookManagerConfig`.
        layers: The hooked layers, in capture order.
        projection: The capture-time projection, or ``None``.
    """

    model: nn.Module
    config: HookManagerConfig
    layers: list[LayerSpec]
    projection: CaptureProjection | None

    @property
    def capturing(self) -> bool:
        """Whether capture is on."""
        ...

    @property
    def shared_groups(self) -> dict[str, list[str]]:
        """``{lead name: [site names]}`` of hooked layers sharing one weight."""
        ...

    @property
    def transforms(self) -> tuple[Any, ...]:
        """The per-layer transforms added to the manager, in order."""
        ...

    def layer_parameters(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{layer name: {parameter name: parameter}}`` of the captured layers."""
        ...

    def coverage(self) -> Any:
        """The share of trainable parameters captured (a ``CaptureCoverage``)."""
        ...

    def paused(self) -> AbstractContextManager[Any]:
        """A context in which capture is off."""
        ...
