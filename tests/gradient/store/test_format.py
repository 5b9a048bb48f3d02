"""The shard layout: layer tables written once per partition, and stores of older versions."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dattri_llm.gradient.gradient import Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError
from dattri_llm.gradient.store.format import SHARD_METADATA_KEY, TABLE_DIR, file_crc32
from tests.gradient.store.format_fixture import FIXTURE, fixture_records, stored_form
from tests.gradient.store.test_integrity import edit_line
from tests.helpers.store import assert_same_gradient


def _copy_fixture(tmp_path):
    root = tmp_path / "v2"
    shutil.copytree(FIXTURE, root)
    return root


def _capture_form(written):
    """What a reader returns: the stored tensors cast back to the capture dtype."""
    record, _, storage = written
    if storage is None:
        return record.gradient
    return stored_form(written).to(dtype=getattr(torch, storage["capture_dtype"]))


def test_a_version_2_store_reads_identically(tmp_path):
    store = GradientStorageManager(_copy_fixture(tmp_path))
    expected = fixture_records()
    assert len(store) == len(expected)
    assert store.verify_all() == len(expected)
    for i, written in enumerate(expected):
        record = store.load_record(i)
        assert record.step == written[0].step and record.hashes == written[0].hashes
        assert record.metadata == dict(written[0].metadata)
        assert_same_gradient(record.gradient, _capture_form(written))
    assert store.layer_names == ["emb", "fc", "norm"]
    assert store.shard_header(2)["storage"]["layers"] == {"fc": "dense", "norm": "captured dense"}
    assert store.load_record(2, dtype=torch.bfloat16).gradient.layers["fc"].data.dtype == (
        torch.bfloat16
    )


# ---- version 3: layer tables -----------------------------------------------------------------
def _wide_record(step: int, n: int, layers: int = 40, width: int = 256) -> GradientRecord:
    gen = torch.Generator().manual_seed(step)
    source = {"in_features": 576, "out_features": 1536, "bias": False}
    kw = {"proj_dim": width, "seed": 0, "source_layer_type": "nn.Linear"}
    kw["source_module_kwargs"] = source
    grads = {
        f"model.layers.{i}.mlp.up_proj": Materialized(
            torch.randn(n, width, generator=gen), "projected.sparse", kw
        )
        for i in range(layers)
    }
    hashes = [hashlib.sha256(f"{step}-{i}".encode()).hexdigest() for i in range(n)]
    return GradientRecord(step, hashes, Gradient(grads), 0, {"loss_reduction": "sum"})


def _raw_header(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()[SHARD_METADATA_KEY])


def test_the_layer_schema_is_written_once_per_partition(tmp_path):
    store = GradientStorageManager(tmp_path / "s", async_write=False)
    records = [_wide_record(step, n) for step, n in ((0, 1), (1, 1), (2, 3))]
    choices = {name: "captured dense" for name in records[0].gradient.layers}
    for r in records:
        store.write(r, storage={"dtype": "float32", "capture_dtype": "float32", "layers": choices})
    store.close()
    tables = sorted((tmp_path / "s" / TABLE_DIR).iterdir())
    assert len(tables) == 2  # one schema, one set of storage choices, for three records
    for info in GradientStorageManager(tmp_path / "s").records():
        raw = _raw_header(info.path)
        # what varies stays in the record; the per-layer part is a 16-hex-digit reference
        assert isinstance(raw["layers"], str) and isinstance(raw["storage"]["layers"], str)
        text = json.dumps(raw)
        assert len(text) < 300 + 70 * len(info.hashes), text  # 40 layers inline: ~9 KB
        assert "up_proj" not in text
    reader = GradientStorageManager(tmp_path / "s")
    for i, r in enumerate(records):
        got = reader.load_record(i)
        assert got.hashes == r.hashes and got.metadata == dict(r.metadata)
        assert_same_gradient(got.gradient, r.gradient)
    header = reader.shard_header(0)
    assert header["layers"] == json.loads(tables[0].read_text()) or header["layers"] == (
        json.loads(tables[1].read_text())
    )
    assert header["storage"]["layers"] == choices
    assert reader.verify_all() == 3
    assert json.loads((tmp_path / "s" / "meta.json").read_text())["version"] == 3


def test_a_small_record_is_stored_at_its_numbers_size(tmp_path):
    """Batch 1: the shard is the numbers plus a header that does not grow with the layers."""
    store = GradientStorageManager(tmp_path / "s", async_write=False)
    for step in range(4):
        store.write(_wide_record(step, 1))
    store.close()
    numbers = 40 * 256 * 4
    for info in GradientStorageManager(tmp_path / "s").records():
        assert info.path.stat().st_size <= 1.1 * numbers, info.path.stat().st_size


def test_appending_to_a_version_2_store_keeps_it_version_2(tmp_path):
    """Older dattri_llm keeps reading a store this one appended to: its headers stay inline."""
    root = _copy_fixture(tmp_path)
    store = GradientStorageManager(root, mode="append", async_write=False)
    extra = _wide_record(7, 2, layers=3, width=8)
    store.write(extra)
    store.close()
    assert json.loads((root / "meta.json").read_text())["version"] == 2
    assert not (root / TABLE_DIR).exists()
    new = GradientStorageManager(root).records()[-1].path
    assert isinstance(_raw_header(new)["layers"], list)
    reader = GradientStorageManager(root)
    assert reader.verify_all() == 4
    for i, written in enumerate(fixture_records()):
        assert_same_gradient(reader.load_record(i).gradient, _capture_form(written))
    assert_same_gradient(reader.load_record(3).gradient, extra.gradient)


def test_a_store_mixing_versions_reads_partition_by_partition(tmp_path):
    root = _copy_fixture(tmp_path)  # the root partition: version 2
    other = tmp_path / "v3"
    store = GradientStorageManager(other, async_write=False)
    extra = _wide_record(9, 2, layers=3, width=8)
    store.write(extra)
    store.close()
    shutil.copytree(other, root / "rank_1")
    meta = json.loads((root / "rank_1" / "meta.json").read_text())
    (root / "rank_1" / "meta.json").write_text(json.dumps({**meta, "rank": 1}))
    reader = GradientStorageManager(root)
    assert reader.verify_all() == 4
    for i, written in enumerate(fixture_records()):
        assert_same_gradient(reader.load_record(i).gradient, _capture_form(written))
    assert_same_gradient(reader.load_record(3).gradient, extra.gradient)


def _v3_store(tmp_path) -> tuple[Path, list[GradientRecord]]:
    root = tmp_path / "s"
    store = GradientStorageManager(root, async_write=False)
    records = [_wide_record(step, 2, layers=3, width=8) for step in range(3)]
    for r in records:
        store.write(r)
    store.close()
    return root, records


def _all(root: Path) -> list:
    return list(GradientStorageManager(root).iter_blocks())


def test_a_damaged_layer_table_is_refused_naming_it(tmp_path):
    root, _ = _v3_store(tmp_path)
    (table,) = (root / TABLE_DIR).iterdir()
    good = table.read_bytes()
    table.write_bytes(good.replace(b"up_proj", b"dn_proj"))
    with pytest.raises(StoreFormatError, match=rf"layer table .*{table.name} is corrupted"):
        _all(root)
    table.unlink()
    with pytest.raises(
        StoreFormatError, match=rf"refers to the layer table .*{table.name}.*missing"
    ):
        _all(root)
    # repair cannot rebuild a table from the shards: it refuses instead of quarantining them
    with pytest.raises(StoreFormatError, match=rf"{table.name}.*missing"):
        GradientStorageManager.repair(root)
    assert len(list((root / "shards").iterdir())) == 3
    table.write_bytes(good)  # the fix the message gives: restore the file
    assert len(_all(root)) == 3 and GradientStorageManager(root).verify_all() == 3


def test_a_writer_rewrites_a_damaged_table_it_refers_to(tmp_path):
    root, records = _v3_store(tmp_path)
    (table,) = (root / TABLE_DIR).iterdir()
    table.write_bytes(b"[]")
    store = GradientStorageManager(root, mode="append", async_write=False)
    more = _wide_record(5, 1, layers=3, width=8)
    store.write(more)
    store.close()
    blocks = _all(root)
    for block, r in zip(blocks, [*records, more], strict=True):
        assert_same_gradient(block.gradient, r.gradient)


def test_a_table_header_reference_is_checked(tmp_path):
    root, _ = _v3_store(tmp_path)
    shard = root / "shards" / "000000001.safetensors"
    tensors = load_file(str(shard))
    header = _raw_header(shard)
    header["layers"] = "../../meta"
    save_file(tensors, str(shard), metadata={SHARD_METADATA_KEY: json.dumps(header)})
    edit_line(root, 1, bytes=shard.stat().st_size, crc32=file_crc32(shard))
    with pytest.raises(StoreFormatError, match=rf"{shard.name} .*corrupted header: table digest"):
        _all(root)


def test_overwrite_and_a_killed_writer_leave_no_stale_tables(tmp_path):
    root, _ = _v3_store(tmp_path)
    (root / TABLE_DIR / ".0123456789abcdef.json.tmp").write_bytes(b"[")  # killed mid-write
    store = GradientStorageManager(root, mode="overwrite", async_write=False)
    other = _wide_record(0, 1, layers=2, width=8)
    store.write(other)
    store.close()
    (table,) = (root / TABLE_DIR).iterdir()  # the old schema's table went with its records
    assert json.loads(table.read_text()) == GradientStorageManager(root).schema
    assert_same_gradient(_all(root)[0].gradient, other.gradient)
