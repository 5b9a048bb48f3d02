"""OffloadCallback (per-sample, per-batch, interval, accumulation) and DiskGradientSource."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dattri_llm import (
    CaptureCallback,
    DiskGradientSource,
    GradientSource,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
)
from dattri_llm.gradient import ops
from dattri_llm.gradient.callbacks.offload import batch_id
from dattri_llm.gradient.store import StoreFormatError
from tests.helpers.reference import assert_same_formula, flat, per_sample_grads, rel_err


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 5)
        self.fc = nn.Linear(5, 7)
        self.ln = nn.LayerNorm(7)
        self.out = nn.Linear(7, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(torch.tanh(self.fc(self.emb(input_ids)))))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["input_ids"]) ** 2).sum()


def train(model, batches, callbacks, optimizer=None):
    hm = HookManager(model, callbacks=callbacks)
    with hm.collect(deregister_on_exit=True):
        for x in batches:
            loss_fn(model, {"input_ids": x}).backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()


def data(n_batches: int, b: int = 3, t: int = 6) -> list[torch.Tensor]:
    return [torch.randint(0, 13, (b, t)) for _ in range(n_batches)]


def test_per_sample_offload_equals_capture_and_brute_force(tmp_path, f64):
    model = Net()
    batches = data(4)
    cap = CaptureCallback(keep_all=True)
    fm = GradientStorageManager(tmp_path)
    train(
        model,
        batches,
        [cap, OffloadCallback(offload_interval=1, file_manager=fm, recording_type="per_sample")],
    )
    # flushed on context end: a fresh reader sees every record
    source = DiskGradientSource(tmp_path)
    assert isinstance(source, GradientSource) and source.rereadable
    assert len(source) == 4 and source.num_samples == 12
    for _ in range(2):  # re-readable
        blocks = list(source)
        assert [b.step for b in blocks] == [0, 1, 2, 3]
        for blk, rec in zip(blocks, cap.records, strict=True):
            assert blk.hashes == rec.hashes and blk.checkpoint == rec.checkpoint
            assert_same_formula(
                ops.cross_dot(blk.gradient, rec.gradient), ops.cross_dot(rec.gradient, rec.gradient)
            )
    ref = flat(per_sample_grads(model, loss_fn, {"input_ids": torch.cat(batches)}))
    grams = [ops.cross_dot(b1.gradient, b2.gradient) for b1 in blocks for b2 in blocks]
    gram = torch.cat([torch.cat(grams[i * 4 : (i + 1) * 4], 1) for i in range(4)])
    assert rel_err(gram, ref @ ref.T) < 1e-10
    fm.close()


def test_offload_interval_and_accumulation_steps(tmp_path):
    model = Net()
    batches = data(8)
    fm = GradientStorageManager(tmp_path / "a", async_write=False)
    cb = OffloadCallback(offload_interval=2, file_manager=fm)
    train(model, batches, [cb])
    assert [r.step for r in fm.records()] == [0, 2, 4, 6] and cb.num_written == 4
    fm2 = GradientStorageManager(tmp_path / "b")
    train(
        model,
        batches,
        [OffloadCallback(offload_interval=3, file_manager=fm2, gradient_accumulation_steps=2)],
    )
    # micro-steps 0..7 -> steps 0,0,1,1,2,2,3,3; interval 3 keeps steps 0 and 3
    assert [r.step for r in fm2.records()] == [0, 0, 3, 3]
    from dattri_llm.utils.hashing import hash_batch

    assert fm2.records()[2].hashes == hash_batch({"input_ids": batches[6]})


def test_per_batch_sums_accumulated_micro_batches(tmp_path, f64):
    model = Net()
    batches = data(5)
    fm = GradientStorageManager(tmp_path)
    train(
        model,
        batches,
        [
            OffloadCallback(
                file_manager=fm, recording_type="per_batch", gradient_accumulation_steps=2
            )
        ],
    )
    recs = fm.records()
    # 5 micro-batches, 2 per step: steps 0, 1 complete, step 2 flushed at context end
    assert [r.step for r in recs] == [0, 1, 2]
    ref = per_sample_grads(model, loss_fn, {"input_ids": torch.cat(batches)})
    from dattri_llm.utils.hashing import hash_batch

    for r, members in zip(recs, [(0, 1), (2, 3), (4,)], strict=True):
        ids = [h for m in members for h in hash_batch({"input_ids": batches[m]})]
        assert r.hashes == [batch_id(ids)]
        assert batch_id(list(reversed(ids))) == r.hashes[0]  # order-independent id
        rows = torch.cat([torch.arange(3 * m, 3 * m + 3) for m in members])
        got = fm.load_record(recs.index(r)).gradient
        assert got.batch_size == 1
        for layer, lg in got.layers.items():
            for pname, t in lg.parameters().items():
                expect = ref[f"{layer}.{pname}"][rows].sum(0, keepdim=True)
                assert rel_err(t, expect) < 1e-12, (layer, pname)
    lines = (tmp_path / "index.jsonl").read_text().splitlines()
    import json

    assert json.loads(lines[0])["extra"]["members"] == [
        h for m in (0, 1) for h in hash_batch({"input_ids": batches[m]})
    ]


def test_offload_from_a_training_loop_with_optimizer_steps(tmp_path, f64):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = data(3)
    cap = CaptureCallback(keep_all=True)
    with GradientStorageManager(tmp_path) as fm:
        train(model, batches, [cap, OffloadCallback(file_manager=fm)], optimizer=opt)
    for blk, rec in zip(
        DiskGradientSource(tmp_path, dtype=torch.float32), cap.records, strict=True
    ):
        assert blk.gradient.dtype == torch.float32
        assert blk.gradient.layers["emb"].a.dtype == torch.long
        torch.testing.assert_close(blk.gradient.flatten(), rec.gradient.flatten().float())


def test_disk_source_layer_selection_and_errors(tmp_path):
    model = Net()
    with GradientStorageManager(tmp_path / "s") as fm:
        train(model, data(2), [OffloadCallback(file_manager=fm)])
    src = DiskGradientSource(GradientStorageManager(tmp_path / "s"), layers=["fc", "out"])
    assert src.layer_names == ["fc", "out"]
    assert [b.gradient.layer_names for b in src] == [["fc", "out"]] * 2
    assert DiskGradientSource(tmp_path / "s").layer_names == ["emb", "fc", "ln", "out"]
    with pytest.raises(KeyError, match="nope"):
        DiskGradientSource(tmp_path / "s", layers=["nope"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DiskGradientSource(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreFormatError, match="not a gradient store"):
        DiskGradientSource(tmp_path / "empty")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.bin").write_bytes(b"1")
    with pytest.raises(StoreFormatError, match="not a gradient store"):
        DiskGradientSource(tmp_path / "other")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        DiskGradientSource(tmp_path / "file")


def test_bad_offload_arguments():
    with pytest.raises(ValueError, match="file_manager"):
        OffloadCallback()
    fm = GradientStorageManager("/nonexistent/never/created")
    with pytest.raises(ValueError, match="recording_type"):
        OffloadCallback(file_manager=fm, recording_type="per_token")
    with pytest.raises(ValueError, match="offload_interval"):
        OffloadCallback(offload_interval=0, file_manager=fm)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        OffloadCallback(file_manager=fm, gradient_accumulation_steps=0)


# ---- keep_token_factors names layers that exist ----------------------------------------------
def test_keep_token_factors_refuses_a_name_the_manager_does_not_capture(tmp_path):
    """``keep_token_factors=["model.fc"]`` on a layer called ``fc`` kept nothing, and the later
    token-level / K-FAC refusal told the user to pass the option they had passed."""
    from dattri_llm import GradientStorageManager, HookManager, HookManagerConfig
    from dattri_llm.gradient import Factorized, Materialized
    from tests.helpers.store import Net, V

    model = Net()
    bad = OffloadCallback(file_manager=tmp_path / "bad", keep_token_factors=["model.fc", "ln"])
    with pytest.raises(ValueError, match=r"keep_token_factors=\): \['model.fc'\]") as e:
        HookManager(model, HookManagerConfig(), callbacks=[bad])
    assert "Closest to 'model.fc': ['fc'" in str(e.value)  # the stored name, offered first
    # the name it offers is the fix: that layer keeps its token axis
    good = OffloadCallback(file_manager=tmp_path / "good", keep_token_factors=["fc"])
    hm = HookManager(model, HookManagerConfig(), callbacks=[good])
    with hm.collect():
        (model(torch.randint(0, V, (2, 12))) ** 2).sum().backward()
    hm.remove()
    (block,) = GradientStorageManager(tmp_path / "good").iter_blocks()
    assert isinstance(block.gradient.layers["fc"], Factorized)
    assert isinstance(block.gradient.layers["ln"], Materialized)
