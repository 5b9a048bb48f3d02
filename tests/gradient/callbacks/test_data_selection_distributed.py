"""Online data selection under several ranks without a DDP wrapper is refused.

With DDP (wrapped before or after the HookManager) selection is supported and checked against
one process in ``test_data_selection_ddp.py``. Without it, nothing tells the callback how
``param.grad`` is reduced across ranks, so the step is refused, with the manager built before or
after ``init_process_group``. The step runs on the unwrapped model: a rank that raises inside a
DDP backward would leave the other rank's all-reduce waiting (the test would hang, not fail).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    REGISTER_ALL,
    CaptureCallback,
    DataSelectionCallback,
    HookManager,
    HookManagerConfig,
)
from tests.helpers.distributed import init_group, run_ranks

pytestmark = pytest.mark.distributed

WORLD = 2


def _make() -> tuple[nn.Module, DataSelectionCallback]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref_model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    ref_model.load_state_dict(model.state_dict())
    cap = CaptureCallback()
    hm = HookManager(ref_model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    with hm.collect(deregister_on_exit=True):
        ref_model(torch.randn(2, 3)).sum().backward()
    return model, DataSelectionCallback(reference=cap.record.gradient, drop_fraction=0.5)


def _worker(rank: int, world: int, workdir: str, wrap_after: bool) -> None:
    model, selection = _make()
    config = HookManagerConfig(linear_io=REGISTER_ALL)
    if wrap_after:  # the manager is built on the plain model before the process group
        hm = HookManager(model, config, callbacks=[selection])
    init_group(rank, world, workdir)
    if not wrap_after:
        hm = HookManager(model, config, callbacks=[selection])
    with hm.collect(deregister_on_exit=True):
        model(torch.randn(4, 3)).sum().backward()


@pytest.mark.parametrize("wrap_after", [True, False])
def test_selection_under_two_ranks_is_refused(tmp_path, wrap_after) -> None:
    outcomes = run_ranks(_worker, WORLD, tmp_path, wrap_after)
    for outcome in outcomes:  # each rank's own outcome: every rank refuses, none fails to join
        assert outcome.kind == "error" and outcome.error == "RuntimeError", outcome.describe()
        assert "DataSelectionCallback runs under torch.distributed with 2 ranks" in outcome.message
        assert "single process" in outcome.message
