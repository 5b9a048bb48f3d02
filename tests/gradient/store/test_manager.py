"""The on-disk gradient store: exact round trips, index, lookup, crash safety, corruption."""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import ops
from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    Materialized,
    Shared,
)
from dattri_llm.gradient.store import (
    FORMAT_NAME,
    FORMAT_VERSION,
    GradientStorageManager,
    StoreFormatError,
)
from dattri_llm.utils.hashing import hash_batch
from tests.helpers.reference import assert_same_formula, flat, per_sample_grads, rel_err
from tests.helpers.store import assert_same_gradient, toy_record

try:
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover - transformers missing
    Conv1D = None

V, E = 11, 6


class Tiny(nn.Module):
    """Every layer family, plus an embedding tied to the output head (a Shared layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.fc = nn.Linear(E, 8)
        self.c1d = Conv1D(8, 8) if Conv1D is not None else nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 5, 3, padding=1, stride=2)
        self.ct = nn.ConvTranspose1d(5, 4, 3, stride=2, padding=1, output_padding=1)
        self.gn = nn.GroupNorm(2, 4)
        self.proj = nn.Linear(4, E)
        self.head = nn.Linear(E, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.emb(input_ids)))
        h = self.rms(self.ln(self.c1d(h)))
        h = self.gn(self.ct(torch.tanh(self.conv(h.transpose(1, 2)))))
        return self.head(self.proj(h.transpose(1, 2)))


def loss_fn(model: nn.Module, batch: dict) -> torch.Tensor:
    return (model(batch["input_ids"]) ** 2).sum()


def capture(model: nn.Module, batches: list[torch.Tensor], style: str = "factorized"):
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, HookManagerConfig(capture_style=style), callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        for x in batches:
            loss_fn(model, {"input_ids": x}).backward()
    return cb.records


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("async_write", [True, False])
def test_round_trip_every_layer_type_is_exact(tmp_path, f64, async_write):
    model = Tiny()
    batches = [torch.randint(0, V, (4, 7)) for _ in range(2)]
    records = capture(model, batches[:1]) + capture(model, batches[1:], style="materialized")
    kinds = {type(lg).__name__ for lg in records[0].gradient.layers.values()}
    assert kinds == {"Factorized", "Shared"}
    assert {type(lg).__name__ for lg in records[1].gradient.layers.values()} == {"Materialized"}
    with GradientStorageManager(tmp_path / "s", async_write=async_write) as store:
        for r in records:
            store.write(r)
    store = GradientStorageManager(tmp_path / "s")
    assert len(store) == 2 and store.num_samples == 8
    assert store.layer_names == records[0].gradient.layer_names
    assert store.layer_types == records[0].gradient.layer_types
    expected_types = {
        "emb": "nn.Embedding",
        "fc": "nn.Linear",
        "ln": "nn.LayerNorm",
        "rms": "nn.RMSNorm",
        "conv": "nn.Conv",
        "ct": "nn.ConvTranspose",
        "gn": "nn.GroupNorm",
        "proj": "nn.Linear",
    }
    for name, typ in expected_types.items():
        assert store.layer_types[name] == typ
    if Conv1D is not None:
        assert store.layer_types["c1d"] == "transformers.Conv1D"
    shared = store.load_record(0).gradient.layers["emb"]
    assert isinstance(shared, Shared) and shared.site_names == ["emb", "head"]
    assert shared.sites[0].a.dtype == torch.long
    for rec, block in zip(records, store.iter_blocks(), strict=True):
        assert block.step == rec.step and block.hashes == rec.hashes
        assert_same_gradient(block.gradient, rec.gradient)
        for mode in ("factorized", "materialized"):
            # the stored tensors are equal (above); a Gram of them equals up to summation order
            assert_same_formula(
                ops.cross_dot(block.gradient, rec.gradient, mode=mode),
                ops.cross_dot(rec.gradient, rec.gradient, mode=mode),
            )
    # independent reference: per-sample gradients by torch.func, Gram of every parameter
    blocks = [b.gradient for b in store.iter_blocks()]
    gram = torch.cat([torch.cat([ops.cross_dot(g1, g2) for g2 in blocks], 1) for g1 in blocks])
    ref = flat(per_sample_grads(model, loss_fn, {"input_ids": torch.cat(batches)}))
    assert rel_err(gram, ref @ ref.T) < 1e-10


def test_index_dtype_tuples_and_dtype_cast(tmp_path):
    idx = torch.randint(0, 9, (2, 3), dtype=torch.int32)
    emb = Factorized(
        idx,
        torch.randn(2, 3, 4),
        "nn.Embedding",
        {
            "num_embeddings": 9,
            "embedding_dim": 4,
            "padding_idx": None,
            "extra": (1, (2, 3)),
            "shape": torch.Size([2, 2]),
            "dt": torch.bfloat16,
        },
    )
    half = Materialized(torch.randn(2, 5).to(torch.bfloat16), "nn.Linear", {"bias": False})
    rec = GradientRecord(0, ["a", "b"], Gradient({"emb": emb, "h": half}))
    with GradientStorageManager(tmp_path) as store:
        store.write(rec)
    back = GradientStorageManager(tmp_path).load_record(0).gradient
    assert_same_gradient(back, rec.gradient)
    assert back.layers["emb"].module_kwargs["extra"] == (1, (2, 3))
    assert isinstance(back.layers["emb"].module_kwargs["shape"], torch.Size)
    cast = GradientStorageManager(tmp_path).load_record(0, dtype=torch.float64).gradient
    assert cast.layers["emb"].a.dtype == torch.int32
    assert cast.layers["emb"].g.dtype == torch.float64
    assert torch.equal(cast.layers["emb"].g, emb.g.double())


def test_module_kwargs_that_are_not_json_fail_at_write(tmp_path):
    bad = Materialized(torch.randn(1, 2), "nn.Linear", {"fn": object()})
    with GradientStorageManager(tmp_path) as store:
        with pytest.raises(TypeError, match="fn"):
            store.write(GradientRecord(0, ["x"], Gradient({"l": bad})))
        with pytest.raises(ValueError, match="hashes"):
            store.write(GradientRecord(0, ["x", "y"], toy_record(0, n=1).gradient))


# ---- order, steps, lookup ---------------------------------------------------------------------
def test_store_order_steps_and_layer_selection(tmp_path):
    with GradientStorageManager(tmp_path) as store:
        for step in (5, 1, 3, 1):
            store.write(toy_record(step, hashes=[f"w{len(store)}-{i}" for i in range(3)]))
    store = GradientStorageManager(tmp_path)
    assert [r.step for r in store.records()] == [1, 1, 3, 5]
    assert [r.seq for r in store.records()] == [1, 3, 2, 0]  # step, then write order
    assert store.available_steps() == [1, 3, 5]
    assert store.available_checkpoints() == [1]
    blocks = list(store.iter_blocks(layers=["ln"]))
    assert [b.gradient.layer_names for b in blocks] == [["ln"]] * 4
    assert torch.equal(
        blocks[3].gradient.layers["ln"].data, toy_record(5).gradient.layers["ln"].data
    )
    with pytest.raises(KeyError, match="nope"):
        list(store.iter_blocks(layers=["nope"]))


def test_lookup_by_hash_and_by_inputs(tmp_path, f64):
    model = Tiny()
    x = torch.randint(0, V, (4, 7))
    y = torch.cat([x[2:], torch.randint(0, V, (2, 7))])  # rows 0,1 of y = rows 2,3 of x
    records = capture(model, [x, y])
    with GradientStorageManager(tmp_path) as store:
        for r in records:
            store.write(r)
    store = GradientStorageManager(tmp_path)
    hashes = hash_batch({"input_ids": x})
    assert hashes == records[0].hashes
    locs = store.lookup({"input_ids": x[3]})
    assert [(loc.step, loc.row) for loc in locs] == [(0, 3), (1, 1)]
    assert store.locations(hashes[3]) == locs
    assert hashes[0] in store and "nope" not in store
    assert store.lookup({"input_ids": torch.full((7,), 1)}) == []
    one = store.load_sample({"input_ids": x[3]}, step=1)
    assert_same_gradient(one, records[1].gradient.slice([1]))
    first = store.load_sample(hashes[3], layers=["fc"])
    assert_same_gradient(first, records[0].gradient.slice([3]).select_layers(["fc"]))
    steps = store.load_sample_steps({"input_ids": x[3]})
    assert [b.step for b in steps] == [0, 1] and steps[0].hashes == [hashes[3]]
    assert_same_gradient(steps[1].gradient, records[1].gradient.slice([1]))
    torch.testing.assert_close(
        ops.cross_dot(steps[1].gradient, steps[1].gradient),
        ops.cross_dot(records[1].gradient, records[1].gradient)[1:2, 1:2],
        rtol=1e-12,
        atol=0,
    )
    with pytest.raises(KeyError, match="steps"):
        store.load_sample(hashes[0], step=1)
    with pytest.raises(KeyError, match="not in the store"):
        store.load_sample_steps("nope")
    assert store.sample_hashes()[:4] == hashes


# ---- files on disk ------------------------------------------------------------------------------
def test_no_file_is_a_pickle_and_meta_is_versioned(tmp_path, f64):
    records = capture(Tiny(), [torch.randint(0, V, (3, 7))])
    with GradientStorageManager(tmp_path) as store:
        store.write(records[0])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files
    for p in files:
        head = p.read_bytes()[:8]
        assert not head.startswith(b"\x80"), p  # pickle protocol >= 2
        assert not head.startswith(b"PK\x03\x04"), p  # torch.save zip archive
        assert p.suffix in (".safetensors", ".json", ".jsonl", ".lock", ".bin"), p
        if p.suffix == ".bin":  # the binary index: fixed-width integers behind our own magic
            assert p.name in ("records.bin", "samples.bin") and head in (b"DTLREC02", b"DTLSMP02")
        if p.suffix == ".safetensors":
            n = int.from_bytes(head, "little")
            assert json.loads(p.read_bytes()[8 : 8 + n])["__metadata__"]["dattri_llm"]
        elif p.suffix in (".json", ".jsonl"):
            for line in p.read_text().splitlines():
                json.loads(line) if p.suffix == ".jsonl" else None
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["format"] == FORMAT_NAME and meta["version"] == FORMAT_VERSION


def test_bad_directories_and_versions_fail_loudly(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("hi")
    with pytest.raises(StoreFormatError, match="not a gradient store"):
        GradientStorageManager(foreign)
    with GradientStorageManager(tmp_path / "s") as store:
        store.write(toy_record(0))
    meta = tmp_path / "s" / "meta.json"
    good = meta.read_text()
    meta.write_text(json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION + 1}))
    with pytest.raises(StoreFormatError, match="version"):
        GradientStorageManager(tmp_path / "s")
    meta.write_text(json.dumps({"format": "something-else", "version": 1}))
    with pytest.raises(StoreFormatError, match="something-else"):
        GradientStorageManager(tmp_path / "s")
    meta.write_text(good)
    assert len(GradientStorageManager(tmp_path / "s")) == 1
    assert len(GradientStorageManager(tmp_path / "new")) == 0  # a new store, nothing created
    assert not (tmp_path / "new").exists()


def test_one_writer_per_partition(tmp_path):
    with GradientStorageManager(tmp_path) as a:
        a.write(toy_record(0))
        a.flush()
        code = (
            "import sys\n"
            "from dattri_llm.gradient.store import GradientStorageManager\n"
            "from dattri_llm.gradient.gradient import GradientRecord\n"
            f"s = GradientStorageManager({str(tmp_path)!r}, mode='append')\n"
            "try:\n"
            "    s.write(None)\n"
            "except RuntimeError as e:\n"
            "    print(e)\n"
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert "another process is writing" in out.stdout, out.stderr


# ---- crash safety ------------------------------------------------------------------------------
def test_torn_index_line_is_ignored_then_truncated_on_resume(tmp_path):
    with GradientStorageManager(tmp_path) as store:
        for s in range(3):
            store.write(toy_record(s))
    index = tmp_path / "index.jsonl"
    with open(index, "ab") as f:
        f.write(b'{"seq":3,"step":3,"checkp')
    with pytest.warns(UserWarning, match="torn"):
        store = GradientStorageManager(tmp_path)
    assert len(store) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradientStorageManager(tmp_path, mode="append") as store:
            store.write(toy_record(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the torn line is gone
        store = GradientStorageManager(tmp_path)
    assert [r.step for r in store.records()] == [0, 1, 2, 3]
    assert_same_gradient(store.load_record(3).gradient, toy_record(3).gradient)
    assert index.read_bytes().endswith(b"\n")


@pytest.mark.parametrize("line", [b'{"seq": 0}\n', b"not json at all\n", b"\n"])
def test_complete_but_invalid_index_line_raises_naming_the_file(tmp_path, line):
    with GradientStorageManager(tmp_path) as store:
        store.write(toy_record(0))
    with open(tmp_path / "index.jsonl", "ab") as f:
        f.write(line)
    with pytest.raises(StoreFormatError, match=r"index\.jsonl:2"):
        GradientStorageManager(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_header", "delete"])
def test_corrupted_shard_raises_naming_it(tmp_path, damage):
    with GradientStorageManager(tmp_path) as store:
        for s in range(3):
            store.write(toy_record(s))
    store = GradientStorageManager(tmp_path)
    victim = store.records()[1].path
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(bytes(data[:-17]))
    elif damage == "delete":
        victim.unlink()
    else:
        pos = len(data) - 5 if damage == "flip_data" else 20
        data[pos] ^= 0xFF
        victim.write_bytes(bytes(data))
    store.load_record(0)  # the others still read
    with pytest.raises(StoreFormatError, match=victim.name):
        store.load_record(1)
    with pytest.raises(StoreFormatError, match=victim.name):
        list(store.iter_blocks())
    with pytest.raises(StoreFormatError, match=victim.name):
        store.verify_all()


WRITER = textwrap.dedent(
    """
    import torch
    from dattri_llm.gradient.gradient import Factorized, Gradient, GradientRecord, Materialized
    from dattri_llm.gradient.store import GradientStorageManager
    store = GradientStorageManager({path!r}, mode="append", async_write={async_write})
    step = {start}
    while True:
        store.write(toy_record(step, n=64))
        step += 1
    """
)


def _run_writer(path: Path, start: int, min_records: int, async_write: bool) -> None:
    head, loop = WRITER.format(path=str(path), start=start, async_write=async_write).split(
        "store = ", 1
    )
    code = head + inspect.getsource(toy_record) + "store = " + loop
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    index = path / "index.jsonl"
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"writer died: {proc.stderr.read().decode()}")
            if index.exists() and index.read_bytes().count(b"\n") >= min_records:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("writer too slow")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("async_write", [True, False])
def test_killed_writer_leaves_a_store_that_reopens_and_resumes(tmp_path, async_write):
    _run_writer(tmp_path, 0, 5, async_write)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a torn line is possible
        store = GradientStorageManager(tmp_path)
    done = len(store)
    assert done >= 5
    assert [r.step for r in store.records()] == list(range(done))
    for i, block in enumerate(store.iter_blocks()):  # every completed record intact
        assert_same_gradient(block.gradient, toy_record(i, n=64).gradient)
    assert store.verify_all() == done
    # resume: a second writer appends after the completed records, is killed too, then a third
    _run_writer(tmp_path, done, done + 3, async_write)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradientStorageManager(tmp_path, mode="append") as store:
            n = len(store)
            store.write(toy_record(n, n=64))
    store = GradientStorageManager(tmp_path)
    assert len(store) == n + 1 >= done + 4
    assert [r.step for r in store.records()] == list(range(n + 1))
    assert [r.seq for r in store.records()] == list(range(n + 1))
    for i, block in enumerate(store.iter_blocks()):
        assert_same_gradient(block.gradient, toy_record(i, n=64).gradient)
    leftovers = [p.name for p in (tmp_path / "shards").iterdir()]
    assert sorted(leftovers) == sorted(r.path.name for r in store.records())


def test_async_writes_are_bounded_and_flushed(tmp_path):
    store = GradientStorageManager(tmp_path, async_write=True, max_pending=1)
    for s in range(4):
        store.write(toy_record(s))
        # with max_pending=1, every record but the newest is durable when write returns
        assert len(store.records()) >= s
    store.flush()
    assert len(store) == 4
    reader = GradientStorageManager(tmp_path)
    assert len(reader) == 4
    store.close()
    store.close()  # idempotent
    with pytest.raises(ValueError, match="max_pending"):
        GradientStorageManager(tmp_path / "x", max_pending=0).write(toy_record(0))


def test_a_trajectory_directory_passed_as_a_store_points_to_replay(tmp_path):
    """A TrajectorySnapshots directory where a gradient store is expected."""
    from dattri_llm import AttributionArguments, TracInAttributor, TrajectorySnapshots
    from dattri_llm.gradient.store import StoreFormatError

    TrajectorySnapshots(tmp_path / "traj").save_batch(0, {"x": torch.randn(2, 3)})
    att = TracInAttributor(AttributionArguments(use_cpu=True, show_progress=False))
    with pytest.raises(
        StoreFormatError, match=r"TrajectorySnapshots directory.*ReplayGradientSource"
    ):
        att.attribute_from_cache(tmp_path / "traj", tmp_path / "traj")
