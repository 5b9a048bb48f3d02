"""Online data selection under DDP equals one process selecting on the global batch.

Two gloo ranks train a tiny model under ``DistributedDataParallel`` with a
:class:`DataSelectionCallback` (DDP wrapped before and after the HookManager is built; Grad-Dot
and Grad-Cos; ``drop_fraction`` and ``threshold``; with and without ``renormalize``; a
``no_sync()`` micro-pass then a reducing one per optimizer step). Each rank writes its
``.grad`` at every optimizer step, its final parameters and its selection history to its own
JSON file; the parent checks them against

* one process running the same callback on the global batch (both ranks' rows, rank after rank)
  with the global mean loss: same dropped samples, same scores, same parameters;
* a brute-force gradient: a plain backward of the loss over the kept rows only (no hooks), with
  the rows the ranks dropped.
"""

from __future__ import annotations

import json
import os
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dattri_llm import (
    REGISTER_ALL,
    CaptureCallback,
    DataSelectionCallback,
    HookManager,
    HookManagerConfig,
    hash_batch,
)

pytestmark = pytest.mark.distributed

WORLD, B, STEPS, PASSES = 2, 3, 2, 2  # ranks, rows per rank and pass, optimizer steps, passes
LR = 0.3

#: name -> (wrap DDP after building the manager, score, drop_fraction, threshold, renormalize)
CASES = {
    "before-dot-fraction": (False, "dot", 0.5, None, False),
    "after-dot-fraction": (True, "dot", 0.34, None, True),
    "before-cos-fraction": (False, "cosine", 0.5, None, True),
    "after-cos-fraction": (True, "cosine", 0.5, None, False),
    "before-dot-threshold": (False, "dot", None, 0.0, True),
    "after-dot-threshold": (True, "dot", None, 0.0, False),
    "before-cos-threshold": (False, "cosine", None, 0.0, False),
    # every sample scores below: only the best of the global batch is kept (one rank keeps none)
    "after-cos-threshold-all": (True, "cosine", None, 2.0, True),
}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))


def _rows(step: int, micro: int) -> dict[str, torch.Tensor]:
    """The global batch of one pass: ``WORLD * B`` rows, rank r holds rows ``r*B:(r+1)*B``."""
    gen = torch.Generator().manual_seed(100 * step + micro)
    return {
        "x": torch.randn(WORLD * B, 3, generator=gen, dtype=torch.float64),
        "y": torch.randn(WORLD * B, 2, generator=gen, dtype=torch.float64),
    }


def _row_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).sum(1)


def _reference_gradient():
    """The validation direction: the same rows on every rank (and in the parent)."""
    m = _net()
    gen = torch.Generator().manual_seed(7)
    val = {"x": torch.randn(4, 3, generator=gen), "y": torch.randn(4, 2, generator=gen)}
    cap = CaptureCallback()
    hm = HookManager(m, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    with hm.collect(deregister_on_exit=True):
        _row_losses(m, val).sum().backward()
    return cap.record.gradient


def _callback(case: str, reference=None) -> DataSelectionCallback:
    _, score, fraction, threshold, renormalize = CASES[case]
    return DataSelectionCallback(
        reference=_reference_gradient() if reference is None else reference,
        score=score,
        drop_fraction=fraction,
        threshold=threshold,
        renormalize=renormalize,
    )


def _sgd(hm: HookManager, run: nn.Module, model: nn.Module, rows_of) -> list[torch.Tensor]:
    """``STEPS`` SGD steps of ``PASSES`` accumulated passes; the ``.grad`` of each step.

    Under DDP every pass but the last runs in ``no_sync()`` (corrected locally, reduced later).
    """
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    with hm.collect(deregister_on_exit=True):
        for step in range(STEPS):
            opt.zero_grad()
            for micro in range(PASSES):
                last = micro == PASSES - 1
                sync = run.no_sync() if hasattr(run, "no_sync") and not last else nullcontext()
                with sync:
                    _row_losses(run, rows_of(_rows(step, micro))).mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
    return grads


def _train(case: str, out: Path) -> None:
    """One case on this rank: mean loss over the rank's rows, DDP averaging over ranks."""
    rank = dist.get_rank()
    wrap_after = CASES[case][0]
    model, selection = _net(), _callback(case)
    config = HookManagerConfig(linear_io=REGISTER_ALL)
    if wrap_after:  # the manager sees the plain model; DDP wraps it afterwards
        hm = HookManager(model, config, callbacks=[selection])
        ddp = DistributedDataParallel(model)
    else:
        ddp = DistributedDataParallel(model)
        hm = HookManager(ddp, config, callbacks=[selection])
    mine = slice(rank * B, (rank + 1) * B)
    grads = _sgd(hm, ddp, model, lambda rows: {k: v[mine] for k, v in rows.items()})
    history = [
        {"dropped": h.dropped_hashes, "scores": dict(zip(h.kept_hashes, h.kept_scores))}
        | {"dropped_scores": dict(zip(h.dropped_hashes, h.dropped_scores)), "scale": h.scale}
        for h in selection.history
    ]
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    result = {"grads": [g.tolist() for g in grads], "params": params, "history": history}
    (out / f"{case}.rank{rank}.json").write_text(json.dumps(result))


def _mismatched_references(out: Path) -> None:
    """Ranks given different reference directions are refused on every rank."""
    rank = dist.get_rank()
    model = _net()
    ref = _reference_gradient().scale(1.0 + rank)
    ddp = DistributedDataParallel(model)
    selection = _callback("before-dot-fraction", reference=ref)
    hm = HookManager(ddp, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[selection])
    message = "no error"
    rows = {k: v[rank * B : (rank + 1) * B] for k, v in _rows(0, 0).items()}
    try:
        with hm.collect(deregister_on_exit=True):
            _row_losses(ddp, rows).mean().backward()
    except RuntimeError as e:
        message = str(e)
    (out / f"mismatch.rank{rank}.txt").write_text(message)


def _worker(rank: int, out: str, init_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        for case in CASES:
            _train(case, Path(out))
        _mismatched_references(Path(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks_out(tmp_path_factory) -> Path:
    """Run every case once in one two-rank process group; each rank writes its own files."""
    out = tmp_path_factory.mktemp("selection_ddp")
    mp.spawn(_worker, args=(str(out), str(out / "pg_init")), nprocs=WORLD, join=True)
    return out


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _single_process(case: str):
    """The same callback in one process on the global batch with the global mean loss."""
    model, selection = _net(), _callback(case)
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[selection])
    grads = _sgd(hm, model, model, lambda rows: rows)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return grads, params, selection.history


def _brute_force_grads(dropped: set[str], renormalize: bool) -> list[torch.Tensor]:
    """Each step's gradient from a plain backward over the kept rows only (no hooks)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(PASSES):
            rows = _rows(step, micro)
            keep = torch.tensor([h not in dropped for h in hash_batch(rows["x"])])
            kept = {k: v[keep] for k, v in rows.items()}
            n = int(keep.sum()) if renormalize else WORLD * B  # the mean's denominator
            (_row_losses(model, kept).sum() / n).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        opt.step()
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert float((a - b).norm() / b.norm()) < 1e-12


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_selection_equals_one_process_on_the_global_batch(ranks_out, case) -> None:
    ranks = [json.loads((ranks_out / f"{case}.rank{r}.json").read_text()) for r in range(WORLD)]
    grads, params, history = _single_process(case)
    assert len(history) == STEPS * PASSES
    for r in ranks:
        assert len(r["history"]) == STEPS * PASSES
    dropped: set[str] = set()
    for i, one in enumerate(history):
        # the ranks' dropped rows together are the one process's, with the same scores
        got = [h for r in ranks for h in r["history"][i]["dropped"]]
        assert got == one.dropped_hashes
        want = dict(zip(one.kept_hashes, one.kept_scores)) | dict(
            zip(one.dropped_hashes, one.dropped_scores)
        )
        for r in ranks:
            scores = r["history"][i]["scores"] | r["history"][i]["dropped_scores"]
            for h, v in scores.items():
                assert abs(v - want[h]) <= 1e-12 * max(1.0, abs(want[h]))
            assert r["history"][i]["scale"] == pytest.approx(one.scale, rel=1e-15)
        dropped.update(got)
    assert 0 < len(dropped) < STEPS * PASSES * WORLD * B  # the case selects something
    renormalize = CASES[case][4]
    brute = _brute_force_grads(dropped, renormalize)
    for step in range(STEPS):
        _close(grads[step], brute[step])
        for r in ranks:
            _close(torch.tensor(r["grads"][step]), brute[step])
    for r in ranks:
        _close(torch.tensor(r["params"]), params)


def test_global_batch_semantics_are_exercised(ranks_out) -> None:
    """The cases reach the states only a global selection handles: one rank keeps none."""
    ranks = [
        json.loads((ranks_out / f"after-cos-threshold-all.rank{r}.json").read_text())
        for r in range(WORLD)
    ]
    for i in range(STEPS * PASSES):
        kept = [B - len(r["history"][i]["dropped"]) for r in ranks]
        assert sorted(kept) == [0, 1]  # only the global best survives


def test_ranks_with_different_references_are_refused(ranks_out) -> None:
    for rank in range(WORLD):
        message = (ranks_out / f"mismatch.rank{rank}.txt").read_text()
        assert "reference directions differ" in message
        assert "same reference" in message


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group in this process (DDP's reducer runs as under torchrun -n 1)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'pg_one'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap_after", [False, True])
def test_one_rank_ddp_keeps_the_correction(one_rank, wrap_after) -> None:
    """DDP writes its bucket copy of ``.grad`` back after the step's callbacks, also alone."""
    model, selection = _net(), _callback("before-cos-fraction")
    config = HookManagerConfig(linear_io=REGISTER_ALL)
    if wrap_after:
        hm = HookManager(model, config, callbacks=[selection])
        ddp = DistributedDataParallel(model)
    else:
        ddp = DistributedDataParallel(model)
        hm = HookManager(ddp, config, callbacks=[selection])
    rows = _rows(0, 0)
    with hm.collect(deregister_on_exit=True):
        _row_losses(ddp, rows).mean().backward()
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dropped = set(selection.history[0].dropped_hashes)
    assert len(dropped) == WORLD * B // 2
    keep = torch.tensor([h not in dropped for h in hash_batch(rows["x"])])
    plain = _net()
    _row_losses(plain, {k: v[keep] for k, v in rows.items()}).mean().backward()  # renormalized
    _close(got, torch.cat([p.grad.reshape(-1) for p in plain.parameters()]))


def test_ddp_communication_hook_is_refused(one_rank) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = _net()
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, allreduce_hook)
    hm = HookManager(
        ddp, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[_callback("before-dot-fraction")]
    )
    with pytest.raises(RuntimeError, match=r"communication hooks \['allreduce_hook'\]"):
        with hm.collect(deregister_on_exit=True):
            _row_losses(ddp, _rows(0, 0)).mean().backward()


def test_data_parallel_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="DataParallel / FSDP"):
        HookManager(
            nn.DataParallel(_net()),
            HookManagerConfig(linear_io=REGISTER_ALL),
            callbacks=[_callback("before-dot-fraction")],
        )


@pytest.mark.parametrize("shard_after", [False, True])
def test_fsdp_is_refused(one_rank, shard_after) -> None:
    """FSDP2 sharding, before the manager is built or after it (caught at the step)."""
    from torch.distributed.fsdp import fully_shard

    model = _net()
    config = HookManagerConfig(linear_io=REGISTER_ALL)
    selection = _callback("before-dot-fraction")
    if not shard_after:
        fully_shard(model)
        with pytest.raises(ValueError, match="DataParallel / FSDP"):
            HookManager(model, config, callbacks=[selection])
        return
    hm = HookManager(model, config, callbacks=[selection])
    fully_shard(model)
    with pytest.raises(RuntimeError, match="outside a DistributedDataParallel"):
        with hm.collect(deregister_on_exit=True):
            _row_losses(model, _rows(0, 0)).mean().backward()
