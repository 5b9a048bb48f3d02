"""What the score engine needs of an attributor.

A protocol, so that the engine never imports the attributor interface that is built on it
(:class:`~dattri_llm.attribution.base.BaseAttributor` implements it; so can any object with
these members).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from dattri_llm.attribution.arguments import AttributionArguments
    from dattri_llm.gradient.compat import CaptureFacts
    from dattri_llm.gradient.gradient import Gradient, GradientBlock

__all__ = ["ScoringMethod"]


class ScoringMethod(Protocol):
    """The extension points of an attribution method that the score loop calls."""

    args: AttributionArguments

    @property
    def device(self) -> torch.device:
        """Where scores are computed."""
        ...

    def check_compatible(self, train: CaptureFacts, test: CaptureFacts) -> None:
        """Refuse train and test gradients captured incompatibly."""
        ...

    def check_block(self, block: GradientBlock, side: str) -> None:
        """Validate a train or test block before use."""
        ...

    def pairing_key(self, block: GradientBlock) -> int:
        """Train and test blocks with equal keys are scored together."""
        ...

    def block_weight(self, block: GradientBlock) -> float:
        """A weight multiplying every score of a train block."""
        ...

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Map a chunk of train gradients before scoring."""
        ...

    def score_block(
        self, train_grad: Gradient, test_grad: Gradient, granularity: str
    ) -> torch.Tensor:
        """Scores of a train chunk against a test chunk."""
        ...
