"""Two gloo ranks capture a compact store: its per-rank Kronecker statistics merge exactly.

Each rank writes its share of the data into ``rank_N/`` with ``OffloadCallback``'s defaults
(dense layers, statistics recorded per partition) and into a factor-keeping store. K-FAC /
EK-FAC over the compact store must score as over the factor store, both when one process reads
the merged store and when the two ranks score it together (the train records split across
them, the fit collective). Float64; tolerance ``1e-10``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dattri_llm import (
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    KFACAttributor,
    OffloadCallback,
)
from dattri_llm.utils.distributed import barrier
from tests.helpers.distributed import B, loss_fn, make
from tests.helpers.reference import rel_err as rel
from tests.helpers.store import args

pytestmark = pytest.mark.distributed

WORLD = 2
CLASSES = {"kfac": KFACAttributor, "ekfac": EKFACAttributor}


def _offload(model, ids, path, **offload) -> None:
    store = GradientStorageManager(path)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store, **offload)])
    with hm.collect(deregister_on_exit=True):
        for i in range(0, len(ids), B):
            model.zero_grad(set_to_none=True)
            loss_fn(model, {"input_ids": ids[i : i + B]}).backward()
    store.close()


def _fit_and_score(cls, root: str, train: str) -> tuple[torch.Tensor, float]:
    """The scores and the number of samples the fit of layer ``fc`` counted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the embedding and LayerNorm are skipped
        att = cls(args(Path(root)), damping=1e-3)
        got = att.attribute_from_cache(os.path.join(root, train), os.path.join(root, "test"))
    return got.scores, att.factors[0].layers["fc"].num_samples


def _worker(rank: int, root: str, init_file: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model, ids = make()
        mine = ids[rank::WORLD]
        _offload(model, mine, os.path.join(root, "compact"))
        _offload(model, mine, os.path.join(root, "factors"), keep_token_factors=True)
        barrier()
        from safetensors.torch import save_file

        out = {}
        for kind, cls in CLASSES.items():
            out[kind], counted = _fit_and_score(cls, root, "compact")
            out[f"{kind}_samples"] = torch.tensor(counted)  # each sample once, not per rank
        if rank == 0:
            save_file(out, os.path.join(root, "split_scores.safetensors"))
        barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_statistics_merge_exactly(tmp_path):
    root = str(tmp_path)
    old = torch.get_default_dtype()  # make() sets float64 as the default: restored at the end
    try:
        model, ids = make()
        _offload(model, ids[:3], os.path.join(root, "test"))
        mp.spawn(_worker, args=(root, str(tmp_path / "pg_init")), nprocs=WORLD, join=True)
        compact = GradientStorageManager(tmp_path / "compact")
        assert compact.ranks == [0, 1]
        assert all(
            (tmp_path / "compact" / f"rank_{r}" / "kronecker_statistics.safetensors").exists()
            for r in (0, 1)
        )
        kinds = {
            type(lg).__name__ for b in compact.iter_blocks() for lg in b.gradient.layers.values()
        }
        assert "Materialized" in kinds
        stats = compact.kronecker_statistics()
        assert len(stats.covered) == len(compact)
        assert stats.covariances[0].layers["fc"].num_samples == len(ids)
        from safetensors.torch import load_file

        split = load_file(str(tmp_path / "split_scores.safetensors"))
        for kind, cls in CLASSES.items():
            want, _ = _fit_and_score(cls, root, "factors")
            got, counted = _fit_and_score(cls, root, "compact")
            assert rel(got, want) <= 1e-10, kind
            assert rel(split[kind], want) <= 1e-10, kind
            assert counted == float(split[f"{kind}_samples"]) == len(ids)
    finally:
        torch.set_default_dtype(old)
