"""``CaptureCallback``: keep the most recent record (or all of them) in memory."""

from __future__ import annotations

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.gradient import GradientRecord

__all__ = ["CaptureCallback"]


class CaptureCallback(HookCallback):
    """Keep the last captured record in ``self.record`` (and every record if ``keep_all``).

    Args:
        keep_all: Also append every record to ``self.records``.
    """

    def __init__(self, keep_all: bool = False) -> None:
        self.keep_all = keep_all
        self.record: GradientRecord | None = None
        self.records: list[GradientRecord] = []

    def on_step_end(self, record: GradientRecord) -> None:
        self.record = record
        if self.keep_all:
            self.records.append(record)

    def pop(self) -> GradientRecord:
        """Return the last record and forget it.

        Raises:
            RuntimeError: when no step was captured since the last ``pop``.
        """
        if self.record is None:
            raise RuntimeError(
                "no step was captured: did the loss reach the hooked layers and was .backward() "
                "called inside manager.collect()?"
            )
        rec, self.record = self.record, None
        return rec
