"""Store lifecycle: create / append / overwrite, steps that continue
after a resume, and a writer that is released when a capture ends or fails."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookCallback,
    HookManager,
    OffloadCallback,
    TracInAttributor,
)
from dattri_llm.gradient.store import StoreFormatError
from tests.helpers.store import toy_record


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.fc = nn.Linear(4, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(input_ids))


def batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (2, 5), generator=g) for _ in range(n)]


def capture(model, path, data, mode="create", checkpoint=0, stop_after=None, **offload):
    fm = GradientStorageManager(path, mode=mode)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=fm, **offload)])
    hm.checkpoint = checkpoint
    with hm.collect(deregister_on_exit=True):
        for i, x in enumerate(data):
            if stop_after is not None and i == stop_after:
                raise KeyboardInterrupt  # Ctrl-C in a notebook cell
            (model(x) ** 2).sum().backward()
    return fm


def test_rerunning_a_capture_into_a_full_store_is_refused(tmp_path):
    torch.manual_seed(0)
    model = Net()
    capture(model, tmp_path / "train", batches(2))
    capture(model, tmp_path / "test", batches(1, seed=1))
    args = AttributionArguments(output_dir=str(tmp_path / "out"))
    before = TracInAttributor(args).attribute_from_cache(tmp_path / "train", tmp_path / "test")
    with pytest.raises(FileExistsError, match="already holds 2 record.*mode='append'") as e:
        capture(model, tmp_path / "train", batches(2))
    assert "count every sample twice" in str(e.value) and "mode='overwrite'" in str(e.value)
    after = TracInAttributor(args).attribute_from_cache(tmp_path / "train", tmp_path / "test")
    assert torch.equal(before.scores, after.scores)  # nothing was written, nothing doubled


def test_overwrite_replaces_the_records(tmp_path):
    model = Net()
    capture(model, tmp_path, batches(3))
    fm = capture(model, tmp_path, batches(1, seed=5), mode="overwrite")
    store = GradientStorageManager(tmp_path)
    assert len(store) == 1 and [r.step for r in store.records()] == [0]
    assert [r.seq for r in store.records()] == [0]
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == ["000000000.safetensors"]
    assert fm.mode == "overwrite"


def test_overwrite_also_removes_stale_rank_partitions(tmp_path):
    from tests.helpers.store import write_ranks

    write_ranks(tmp_path / "s")
    with pytest.raises(FileExistsError, match="already holds 4"):
        GradientStorageManager(tmp_path / "s").write(toy_record(0))
    with GradientStorageManager(tmp_path / "s", mode="overwrite") as store:
        store.write(toy_record(0))
    store = GradientStorageManager(tmp_path / "s")
    assert len(store) == 1 and store.ranks == [0]
    assert not (tmp_path / "s" / "rank_0").exists() and not (tmp_path / "s" / "rank_1").exists()


def test_resume_after_an_interruption_continues_the_steps(tmp_path):
    model = Net()
    data = batches(5)
    with pytest.raises(KeyboardInterrupt):
        capture(model, tmp_path, data, stop_after=3)
    assert [r.step for r in GradientStorageManager(tmp_path).records()] == [0, 1, 2]
    capture(model, tmp_path, data[3:], mode="append")  # resume with a fresh HookManager
    records = GradientStorageManager(tmp_path).records()
    assert [r.step for r in records] == [0, 1, 2, 3, 4]
    # hashes at steps 3, 4 are batches 3, 4: the resumed records are the right ones
    from dattri_llm.utils.hashing import hash_batch

    assert records[3].hashes == hash_batch({"input_ids": data[3]})


def test_append_at_a_new_checkpoint_keeps_its_own_step_numbers(tmp_path):
    model = Net()
    capture(model, tmp_path, batches(2), checkpoint=0)
    capture(model, tmp_path, batches(2), mode="append", checkpoint=1)
    capture(model, tmp_path, batches(1), mode="append", checkpoint=1)
    got = [(r.checkpoint, r.step) for r in GradientStorageManager(tmp_path).records()]
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]


def test_explicit_step_offset_is_kept_and_a_collision_warns(tmp_path):
    model = Net()
    capture(model, tmp_path, batches(2), step_offset=10)
    assert [r.step for r in GradientStorageManager(tmp_path).records()] == [10, 11]
    with pytest.warns(UserWarning, match=r"step_offset=11.*step 11 .*last step already stored"):
        capture(model, tmp_path, batches(1), mode="append", step_offset=11)
    with pytest.raises(ValueError, match="step_offset"):
        OffloadCallback(file_manager=GradientStorageManager(tmp_path), step_offset=-1)


def test_one_manager_keeps_writing_across_contexts_and_hook_managers(tmp_path):
    """Records this manager wrote itself are always appended to (mode='create' included)."""
    model = Net()
    fm = GradientStorageManager(tmp_path)
    for c in (0, 1):
        hm = HookManager(model, callbacks=[OffloadCallback(file_manager=fm)])
        hm.checkpoint = c
        for x in batches(2):
            with hm.collect():
                (model(x) ** 2).sum().backward()
        hm.remove()
    got = [(r.checkpoint, r.step) for r in GradientStorageManager(tmp_path).records()]
    assert sorted(got) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_interrupted_capture_releases_the_store_and_removes_the_hooks(tmp_path):
    """A notebook cell interrupted with Ctrl-C, then run again in the same process."""
    model = Net()
    with pytest.raises(KeyboardInterrupt):
        capture(model, tmp_path, batches(4), stop_after=2)
    assert not model._forward_pre_hooks and not model.fc._forward_hooks  # hooks came down
    # the writer was released: a new manager is not told "another process is writing"
    with pytest.raises(FileExistsError, match="already holds 2"):
        capture(model, tmp_path, batches(2))
    capture(model, tmp_path, batches(2), mode="append")
    assert len(GradientStorageManager(tmp_path)) == 4
    # and another process can write it now too
    code = (
        "from dattri_llm.gradient.store import GradientStorageManager\n"
        "from tests.helpers.store import toy_record\n"
        f"GradientStorageManager({str(tmp_path)!r}, mode='append').write(toy_record(9))\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[3]  # `tests` importable from the child
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=root)


def test_a_failing_callback_does_not_leave_hooks_or_the_store_open(tmp_path):
    class Boom(HookCallback):
        def on_context_end(self) -> None:
            raise RuntimeError("boom")

    model = Net()
    fm = GradientStorageManager(tmp_path)
    hm = HookManager(model, callbacks=[Boom(), OffloadCallback(file_manager=fm)])
    with pytest.raises(RuntimeError, match="boom"):
        with hm.collect(deregister_on_exit=True):
            (model(batches(1)[0]) ** 2).sum().backward()
    assert not hm._handles and not model.fc._forward_hooks
    assert fm._writer is None  # released although the other callback failed first
    assert len(GradientStorageManager(tmp_path)) == 1


def test_a_second_writer_in_the_same_process_takes_over(tmp_path):
    first = GradientStorageManager(tmp_path)
    first.write(toy_record(0))  # never closed: an interrupted cell
    second = GradientStorageManager(tmp_path, mode="append")
    with pytest.warns(UserWarning, match="takes over"):
        second.write(toy_record(1))
    with pytest.raises(RuntimeError, match="took the partition over"):
        first.write(toy_record(2))
    first.close()
    with pytest.raises(RuntimeError, match="took the partition over"):
        first.write(toy_record(2))  # closing it does not let it ping-pong back
    second.close()
    assert [r.step for r in GradientStorageManager(tmp_path).records()] == [0, 1]


def test_create_counts_the_unflushed_records_of_an_open_writer(tmp_path):
    first = GradientStorageManager(tmp_path)
    first.write(toy_record(0))
    with pytest.raises(FileExistsError, match="already holds 1"):
        GradientStorageManager(tmp_path).write(toy_record(1))
    first.close()


def test_mode_is_checked(tmp_path):
    with pytest.raises(ValueError, match="mode must be one of"):
        GradientStorageManager(tmp_path, mode="a")


def test_reading_never_depends_on_the_mode(tmp_path):
    with GradientStorageManager(tmp_path) as store:
        store.write(toy_record(0))
    for mode in ("create", "append", "overwrite"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(GradientStorageManager(tmp_path, mode=mode)) == 1
    assert len(GradientStorageManager(tmp_path)) == 1  # opening in overwrite deleted nothing


def test_a_damaged_store_is_not_appended_to(tmp_path):
    with GradientStorageManager(tmp_path) as store:
        for s in range(3):
            store.write(toy_record(s))
    (tmp_path / "index.jsonl").write_bytes(
        b"".join((tmp_path / "index.jsonl").read_bytes().splitlines(keepends=True)[:1])
    )
    with pytest.raises(StoreFormatError, match="does not list 2"):
        GradientStorageManager(tmp_path, mode="append")
    assert len(list((tmp_path / "shards").iterdir())) == 3  # the evidence is kept


def test_reopening_after_someone_else_appended_rereads_the_index(tmp_path):
    mine = GradientStorageManager(tmp_path)
    mine.write(toy_record(0))
    mine.close()
    with GradientStorageManager(tmp_path, mode="append") as other:
        other.write(toy_record(1))
    mine.write(toy_record(2))  # reopens: must continue after the other's record
    mine.close()
    store = GradientStorageManager(tmp_path)
    assert [r.seq for r in store.records()] == [0, 1, 2] and len(mine) == 3
    assert store.verify_all() == 3
