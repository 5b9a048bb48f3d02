"""A layer called once per sub-batch of the model's batch (memory chunking) is captured per sample.

``torch.cat([self.fc(c) for c in x.split(2)])`` used to have its calls joined
along the token axis (row ``i`` of every chunk taken as one sample), and unequal chunks crashed.
The reference is one ``backward()`` per sample, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import REGISTER_ALL, CaptureCallback, HookManager, HookManagerConfig
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err

DT = torch.float64


class Chunked(nn.Module):
    """A linear layer run per chunk of the batch, a second one on the whole batch."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, dtype=DT)
        self.head = nn.Linear(4, 2, dtype=DT)
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([torch.tanh(self.fc(c)) for c in x.split(self.chunks)])
        return self.head(h)


def loss_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).sum()


@pytest.mark.parametrize(
    ("batch", "chunks", "tokens"),
    [(4, 2, False), (5, 2, False), (4, 3, True), (6, 1, True)],
)
@pytest.mark.parametrize("style", ["factorized", "materialized"])
def test_sub_batch_calls_are_joined_along_the_batch(batch, chunks, tokens, style) -> None:
    torch.manual_seed(0)
    model = Chunked(chunks)
    x = torch.randn(batch, 5, 3, dtype=DT) if tokens else torch.randn(batch, 3, dtype=DT)
    cap = CaptureCallback()
    hm = HookManager(
        model, HookManagerConfig(linear_io=REGISTER_ALL, capture_style=style), callbacks=[cap]
    )
    with hm.collect():
        loss_fn(model, x).backward()
    got = captured_by_parameter(hm, cap.record.gradient, model)
    ref = per_sample_loop_grads(model, loss_fn, x)
    assert cap.record.gradient.batch_size == batch
    for name, value in ref.items():
        assert rel_err(got[name], value) < 1e-12, name


class TwoPasses(nn.Module):
    """The layer sees the batch twice, each time in chunks: 4 calls of 2 rows for 4 samples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.fc(c) for c in x.split(2)])
        return torch.cat([self.fc(c) for c in h.split(2)])


def test_calls_that_do_not_partition_the_batch_are_refused() -> None:
    model = TwoPasses()
    hm = HookManager(
        model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[CaptureCallback()]
    )
    with pytest.raises(RuntimeError, match=r"'fc' was called 4 times.*\[2, 2, 2, 2\].*has 4"):
        with hm.collect():
            loss_fn(model, torch.randn(4, 3, dtype=DT)).backward()


def test_whole_batch_calls_still_add_up() -> None:
    """A layer applied twice to the whole batch (weight sharing) keeps the token-axis join."""

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3, dtype=DT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.tanh(self.fc(x)))

    torch.manual_seed(1)
    model = Twice()
    x = torch.randn(3, 3, dtype=DT)
    cap = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    with hm.collect():
        loss_fn(model, x).backward()
    got = captured_by_parameter(hm, cap.record.gradient, model)
    ref = per_sample_loop_grads(model, loss_fn, x)
    for name, value in ref.items():
        assert rel_err(got[name], value) < 1e-12, name
