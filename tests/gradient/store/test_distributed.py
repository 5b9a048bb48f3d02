"""Two gloo ranks offload their shards of the data; the merged store equals one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dattri_llm import (
    DiskGradientSource,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
)
from dattri_llm.gradient import ops
from dattri_llm.utils.distributed import barrier, get_rank, get_world_size
from dattri_llm.utils.hashing import hash_batch
from tests.helpers.distributed import B, N, expect_ok, init_group, loss_fn, make, run_ranks
from tests.helpers.reference import flat, per_sample_grads, rel_err

pytestmark = pytest.mark.distributed

WORLD = 2


def _worker(rank: int, world: int, workdir: str, root: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_group(rank, world, workdir)
    try:
        assert get_rank() == rank and get_world_size() == WORLD
        model, ids = make()
        ddp = DistributedDataParallel(model)
        store = GradientStorageManager(root)
        hm = HookManager(ddp, callbacks=[OffloadCallback(file_manager=store)])
        mine = ids[rank::WORLD]  # this rank's shard of the data
        with hm.collect(deregister_on_exit=True):
            for i in range(0, len(mine), B):
                loss_fn(ddp, {"input_ids": mine[i : i + B]}).backward()
                ddp.zero_grad()
        store.close()
        barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_merge_into_the_single_process_store(tmp_path):
    root = tmp_path / "store"
    expect_ok(run_ranks(_worker, WORLD, tmp_path / "ranks", str(root)))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["rank_0", "rank_1"]
    old = torch.get_default_dtype()
    try:
        model, ids = make()
        store = GradientStorageManager(root)
        assert store.ranks == [0, 1]
        assert len(store) == WORLD * (N // WORLD // B)
        records = store.records()
        # store order: by rank, then step
        assert [(r.rank, r.step) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        blocks = list(DiskGradientSource(root))
        hashes = [h for b in blocks for h in b.hashes]
        order = [0, 2, 4, 6, 1, 3, 5, 7]  # rank 0 holds rows 0::2, rank 1 rows 1::2
        assert hashes == [hash_batch({"input_ids": ids})[i] for i in order]
        for i in range(N):
            assert store.lookup({"input_ids": ids[i]})[0].rank == i % WORLD
        # single-process reference: every sample's gradient by torch.func
        ref = flat(per_sample_grads(model, loss_fn, {"input_ids": ids}))[order]
        gram = torch.cat(
            [
                torch.cat([ops.cross_dot(b1.gradient, b2.gradient) for b2 in blocks], 1)
                for b1 in blocks
            ]
        )
        assert rel_err(gram, ref @ ref.T) < 1e-5
        assert rel_err(gram, ref @ ref.T) < 1e-10  # float64 throughout: in fact exact
        # ... and a single-process capture of the same data into a flat store
        single = GradientStorageManager(tmp_path / "single")
        hm = HookManager(model, callbacks=[OffloadCallback(file_manager=single)])
        with hm.collect(deregister_on_exit=True):
            loss_fn(model, {"input_ids": ids[order]}).backward()
        single.close()
        (one,) = list(DiskGradientSource(tmp_path / "single"))
        assert one.hashes == hashes
        assert rel_err(ops.cross_dot(one.gradient, one.gradient), gram) < 1e-10
        assert Path(root / "meta.json").is_file()
    finally:
        torch.set_default_dtype(old)


def _reader_beside_a_writing_rank(rank: int, world: int, workdir: str, root: str) -> None:
    import shutil
    import warnings

    from tests.helpers.store import toy_record

    init_group(rank, world, workdir)
    part = Path(root, f"rank_{rank}")
    if rank == 1:  # a record durable, then the next one renamed into place but not yet indexed
        with GradientStorageManager(root) as store:
            store.write(toy_record(0, hashes=["a", "b", "c"]))
        shutil.copy(part / "shards/000000000.safetensors", part / "shards/000000001.safetensors")
    barrier()
    if rank == 0:  # opening the store and a writer reads rank 1's partition mid-write
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with GradientStorageManager(root) as store:
                store.write(toy_record(1, hashes=["d", "e", "f"]))
            assert GradientStorageManager(root).num_samples == 6
        assert [str(w.message) for w in caught] == []
    barrier()


def test_a_rank_does_not_warn_about_the_record_another_rank_is_indexing(tmp_path):
    """Rank 1's shard without its index line is the record it is writing now, not a killed
    writer's: rank 0 reads past it silently. Read outside the run, it is a killed writer's."""
    root = tmp_path / "store"
    outcomes = run_ranks(_reader_beside_a_writing_rank, WORLD, tmp_path / "ranks", str(root))
    expect_ok(outcomes)
    with pytest.warns(UserWarning, match=r"rank_1/shards/000000001.safetensors is not listed"):
        assert GradientStorageManager(root).num_samples == 6
