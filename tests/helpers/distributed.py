"""Multi-process tests: running ranks with each rank's outcome collected, and the small model
two gloo ranks capture (the distributed-store and FSDP tests)."""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

N, T, B = 8, 5, 2  # samples, tokens, per-rank batch size


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 6)
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.out = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def make():
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    model = Net()
    ids = torch.randint(0, 17, (N, T), generator=torch.Generator().manual_seed(1))
    return model, ids


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["input_ids"]) ** 2).sum()


# ---- running ranks: each rank's outcome collected, whatever the timing -------------------------
@dataclass(frozen=True)
class RankOutcome:
    """What one rank did: ``kind`` is ``"ok"``, ``"error"`` (the rank raised), ``"init_failed"``
    (the process group could not be formed, after retries) or ``"died"`` (no outcome written:
    the process was killed or exited early)."""

    rank: int
    kind: str
    error: str = ""
    message: str = ""
    traceback: str = ""

    def describe(self) -> str:
        return f"rank {self.rank}: {self.kind} {self.error}: {self.message}\n{self.traceback}"


class InitFailed(RuntimeError):
    """The process group could not be formed (a rendezvous failure, not the code under test)."""


def init_group(rank: int, world: int, workdir: str, attempts: int = 3, timeout_s: float = 120):
    """Form the gloo group through files under ``workdir``, retrying a failed rendezvous.

    A loaded machine can fail gloo's connectFullMesh on one rank; the ranks then agree, through
    one marker file per rank and attempt, whether every rank got a group, and retry on a fresh
    rendezvous file if any did not. Raises :class:`InitFailed` after ``attempts``.
    """
    last = ""
    for attempt in range(attempts):
        try:
            dist.init_process_group(
                "gloo",
                init_method=f"file://{os.path.join(workdir, f'pg_init.{attempt}')}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
            ok = True
        except Exception as e:  # noqa: BLE001 - a rendezvous failure, reported below
            ok, last = False, f"{type(e).__name__}: {e}"
        mark = Path(workdir, f"pg_attempt.{attempt}.rank{rank}")
        # written whole, then renamed: a peer never reads a created but still empty marker (it
        # would take it for a failure while this rank goes on, and the ranks would part ways)
        tmp = mark.with_name(mark.name + ".tmp")
        tmp.write_text("ok" if ok else last)
        os.replace(tmp, mark)
        marks = [Path(workdir, f"pg_attempt.{attempt}.rank{r}") for r in range(world)]
        # a rank whose peer gave up waits out its own init timeout before it can mark
        deadline = time.monotonic() + 2 * timeout_s + 30
        while not all(m.exists() for m in marks):
            if time.monotonic() > deadline:
                raise InitFailed(f"rank {rank}: other ranks never reported attempt {attempt}")
            time.sleep(0.05)
        reports = [m.read_text() for m in marks]  # read once: every rank judges the same texts
        if all(r == "ok" for r in reports):
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        last = last or next(r for r in reports if r != "ok")
    raise InitFailed(f"process group not formed after {attempts} attempts: {last}")


def _rank_main(rank: int, fn: Callable, world: int, workdir: str, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    outcome = {"kind": "ok"}
    try:
        fn(rank, world, workdir, *args)
    except BaseException as e:  # noqa: BLE001 - every outcome is written, then judged
        outcome = {
            "kind": "init_failed" if isinstance(e, InitFailed) else "error",
            "error": type(e).__name__,
            "message": str(e),
            "traceback": traceback.format_exc(),
        }
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(workdir, f"outcome.rank{rank}.json").write_text(json.dumps(outcome))


def run_ranks(fn: Callable, world: int, workdir: str | Path, *args: Any) -> list[RankOutcome]:
    """Run ``fn(rank, world, workdir, *args)`` in ``world`` processes; every rank's outcome.

    ``fn`` forms its group with :func:`init_group` (where it chooses: some tests build things
    first). Each rank writes its own outcome, so a test asserts on the rank it expects to
    raise, never on whichever failure ``mp.spawn`` happened to see first.
    """
    workdir = str(workdir)
    os.makedirs(workdir, exist_ok=True)
    ctx = mp.spawn(_rank_main, args=(fn, world, workdir, args), nprocs=world, join=False)
    died = ""
    try:
        while not ctx.join():
            pass
    except Exception as e:  # noqa: BLE001 - a killed rank (its outcome file is missing)
        died = str(e)
    outcomes = []
    for rank in range(world):
        path = Path(workdir, f"outcome.rank{rank}.json")
        if path.exists():
            outcomes.append(RankOutcome(rank, **json.loads(path.read_text())))
        else:
            outcomes.append(RankOutcome(rank, "died", message=died or "wrote no outcome"))
    return outcomes


def expect_ok(outcomes: list[RankOutcome]) -> None:
    """Every rank finished; otherwise fail with every rank's own outcome."""
    bad = [o for o in outcomes if o.kind != "ok"]
    assert not bad, "\n".join(o.describe() for o in bad)
