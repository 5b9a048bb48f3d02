"""A store cannot be silently misread: duplicated, mismatched, dropped records and damaged
metadata are refused naming the file, and ``repair`` rebuilds an index."""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError
from dattri_llm.gradient.store.format import decode_schema, file_crc32
from tests.helpers.store import assert_same_gradient, toy_record, write_ranks, write_store


def lines(path: Path) -> list[bytes]:
    return (path / "index.jsonl").read_bytes().splitlines(keepends=True)


def set_lines(path: Path, new: list[bytes]) -> None:
    (path / "index.jsonl").write_bytes(b"".join(new))


def edit_line(path: Path, i: int, **fields) -> None:
    """Set fields of index line ``i`` (0-based), keeping it valid JSON."""
    ls = lines(path)
    ls[i] = json.dumps({**json.loads(ls[i]), **fields}).encode() + b"\n"
    set_lines(path, ls)


def all_blocks(path: Path) -> list:
    return list(GradientStorageManager(path).iter_blocks())


# ---- item 7: a record counted twice -------------------------------------------------------------
@pytest.mark.parametrize("where", [1, 4])  # a middle copy, a copy at the end
def test_duplicated_index_line_is_refused_naming_the_line(tmp_path, where):
    write_store(tmp_path)
    ls = lines(tmp_path)
    set_lines(tmp_path, ls[:where] + [ls[0]] + ls[where:])
    with pytest.raises(StoreFormatError, match=rf"index\.jsonl:{where + 1}: duplicated") as e:
        GradientStorageManager(tmp_path)
    assert "counted twice" in str(e.value)
    # the writer refuses it too, instead of appending after it
    with pytest.raises(StoreFormatError, match="duplicated"):
        GradientStorageManager(tmp_path, mode="append")


def test_partition_copied_under_another_rank_is_refused(tmp_path):
    write_ranks(tmp_path / "s")
    assert len(GradientStorageManager(tmp_path / "s")) == 4
    shutil.copytree(tmp_path / "s" / "rank_1", tmp_path / "s" / "rank_2")
    with pytest.raises(StoreFormatError, match=r"rank_2/meta\.json was written by rank 1") as e:
        GradientStorageManager(tmp_path / "s")
    assert "counted twice" in str(e.value)


def test_flat_partition_copied_into_rank_dir_is_refused(tmp_path):
    write_store(tmp_path / "s")
    dst = tmp_path / "s" / "rank_0"
    dst.mkdir()
    for name in ("meta.json", "index.jsonl"):
        shutil.copy(tmp_path / "s" / name, dst / name)
    shutil.copytree(tmp_path / "s" / "shards", dst / "shards")
    with pytest.raises(StoreFormatError, match="byte-identical copy") as e:
        GradientStorageManager(tmp_path / "s")
    assert "rank_0/shards/000000000.safetensors" in str(e.value)
    # two ranks that really computed the same batch can opt in
    store = GradientStorageManager(tmp_path / "s", allow_duplicate_records=True)
    assert len(store) == 8


# ---- item 8: index line vs shard header ----------------------------------------------------------
@pytest.mark.parametrize(
    "field, value",
    [
        ("checkpoint", 7),
        ("step", 9),
        ("schema", "0123456789abcdef"),
        ("metadata", {"lr": 1.0}),
        ("extra", {"members": ["x"]}),
        ("hashes", ["a", "b", "c"]),
    ],
)
def test_index_field_disagreeing_with_the_shard_header_is_refused(tmp_path, field, value):
    write_store(tmp_path)
    edit_line(tmp_path, 1, **{field: value})
    store = GradientStorageManager(tmp_path)
    victim = "000000001.safetensors"
    with pytest.raises(StoreFormatError, match=rf"{victim} does not hold the record .*{field}"):
        list(store.iter_blocks())
    with pytest.raises(StoreFormatError, match=victim):
        store.verify_all()
    # the header is authoritative (its CRC-32 matches): repair rebuilds the line from it
    (report,) = GradientStorageManager.repair(tmp_path)
    assert report.corrected == [f"shards/{victim}"] and report.records == 4
    assert len(all_blocks(tmp_path)) == 4


def test_checkpoint_label_mismatch_would_have_paired_the_wrong_test_gradients(tmp_path):
    """The issue's case: a line relabelled to another checkpoint is refused, not scored."""
    write_store(tmp_path, steps=(0, 1))  # checkpoints 0, 1
    edit_line(tmp_path, 0, checkpoint=1)
    with pytest.raises(StoreFormatError, match="checkpoint: index 1 vs shard 0"):
        all_blocks(tmp_path)


# ---- item 9: records silently dropped ------------------------------------------------------------
def test_lost_middle_line_is_reported_and_repair_restores_it(tmp_path):
    records = write_store(tmp_path)
    ls = lines(tmp_path)
    set_lines(tmp_path, ls[:1] + ls[2:])
    with pytest.raises(StoreFormatError, match=r"index\.jsonl:2: expected the record with seq 1"):
        GradientStorageManager(tmp_path)
    # a writer does not destroy the evidence either
    with pytest.raises(StoreFormatError, match="seq 1"):
        GradientStorageManager(tmp_path, mode="append").write(toy_record(9))
    (report,) = GradientStorageManager.repair(tmp_path)
    assert report.reindexed == ["shards/000000001.safetensors"] and report.records == 4
    for rec, block in zip(records, all_blocks(tmp_path), strict=True):
        assert block.step == rec.step and block.hashes == rec.hashes
        assert_same_gradient(block.gradient, rec.gradient)


def test_index_truncated_at_a_line_boundary_is_reported(tmp_path):
    write_store(tmp_path)
    set_lines(tmp_path, lines(tmp_path)[:2])  # two records lost
    with pytest.raises(StoreFormatError, match="does not list 2 shard") as e:
        GradientStorageManager(tmp_path)
    assert "000000002.safetensors" in str(e.value) and "repair" in str(e.value)
    with pytest.raises(StoreFormatError, match="does not list 2 shard"):
        GradientStorageManager(tmp_path, mode="append").write(toy_record(9))
    GradientStorageManager.repair(tmp_path)
    assert [b.step for b in all_blocks(tmp_path)] == [0, 1, 2, 3]


def test_one_missing_last_line_stays_the_documented_crash_recovery(tmp_path):
    write_store(tmp_path)
    set_lines(tmp_path, lines(tmp_path)[:3])  # as a writer killed before appending its line
    with pytest.warns(UserWarning, match=r"000000003\.safetensors is not listed"):
        store = GradientStorageManager(tmp_path)
    assert len(store) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradientStorageManager(tmp_path, mode="append") as store:
            store.write(toy_record(4))  # the next writer removes the unindexed shard
    assert [b.step for b in all_blocks(tmp_path)] == [0, 1, 2, 4]


def test_orphaned_shard_of_a_rank_partition_without_index_is_reported(tmp_path):
    write_ranks(tmp_path / "s")
    (tmp_path / "s" / "rank_1" / "index.jsonl").unlink()
    with pytest.raises(StoreFormatError, match=r"rank_1/index\.jsonl does not list 2 shard"):
        GradientStorageManager(tmp_path / "s")


def test_repair_quarantines_a_corrupted_shard_and_never_indexes_it(tmp_path):
    records = write_store(tmp_path)
    victim = tmp_path / "shards" / "000000001.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in a tensor: only the CRC-32 sees it
    victim.write_bytes(bytes(data))
    set_lines(tmp_path, lines(tmp_path) + [lines(tmp_path)[0]])  # and a duplicated line
    (report,) = GradientStorageManager.repair(tmp_path)
    assert report.quarantined == [
        ("quarantine/000000001.safetensors", "its CRC-32 matches no index line")
    ]
    assert report.records == 3 and report.dropped_lines == 2
    blocks = all_blocks(tmp_path)
    assert [b.step for b in blocks] == [0, 2, 3]
    for rec, block in zip([records[0], *records[2:]], blocks, strict=True):
        assert block.hashes == rec.hashes
        assert_same_gradient(block.gradient, rec.gradient)
    assert GradientStorageManager(tmp_path).verify_all() == 3


def test_repair_refuses_while_a_writer_is_open(tmp_path):
    with GradientStorageManager(tmp_path) as store:
        store.write(toy_record(0))
        with pytest.raises(RuntimeError, match="close"):
            GradientStorageManager.repair(tmp_path)
    assert GradientStorageManager.repair(tmp_path)[0].changed is False


# ---- item 10: damaged metadata -> StoreFormatError naming the file -------------------------
@pytest.mark.parametrize(
    "content, match",
    [
        (b"\xff\xfe\x00garbage", "UTF-8"),
        (b'{"format": "dattri_llm.gradient_store", "version": 1, "rank": "zero"}', "rank"),
        (b'{"format": "dattri_llm.gradient_store", "version": 1, "rank": 1.5}', "rank"),
        (b'{"format": "dattri_llm.gradient_store", "version": 1, "world_size": "2"}', "world"),
        (b'{"format": "dattri_llm.gradient_store", "version": 1, "rank": 3}', "rank 3"),
    ],
)
def test_damaged_meta_json_is_a_store_format_error(tmp_path, content, match):
    write_store(tmp_path)
    (tmp_path / "meta.json").write_bytes(content)
    with pytest.raises(StoreFormatError, match=match) as e:
        GradientStorageManager(tmp_path)
    assert "meta.json" in str(e.value)


def test_damaged_rank_meta_is_a_store_format_error(tmp_path):
    write_ranks(tmp_path / "s")
    meta = tmp_path / "s" / "rank_1" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "rank": "one"}))
    with pytest.raises(StoreFormatError, match=r"rank_1/meta\.json .*'rank'"):
        GradientStorageManager(tmp_path / "s")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hashes", [1, 2, 3], "non-string"),
        ("hashes", [["a"], "b", "c"], "non-string"),
        ("metadata", [1], "'metadata' is not a JSON object"),
        ("extra", "x", "'extra' is not a JSON object"),
        ("crc32", -1, "negative"),
        ("bytes", -5, "negative"),
        ("crc32", 2**40, "not a CRC-32"),
        ("shard", "shards/000000009.safetensors", "not the file of seq"),
        ("seq", True, "'seq'"),
    ],
)
def test_damaged_index_fields_are_a_store_format_error(tmp_path, field, value, match):
    write_store(tmp_path)
    edit_line(tmp_path, 2, **{field: value})
    with pytest.raises(StoreFormatError, match=rf"index\.jsonl:3: .*{match}"):
        GradientStorageManager(tmp_path)


def _rewrite_header(shard: Path, index_dir: Path, edit) -> None:
    """Rewrite a shard with an edited header and fix its index line's size and CRC-32."""
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        # the schema inline (a copy: the table's value is cached for the process)
        header = copy.deepcopy(decode_schema(f.metadata()["dattri_llm"], shard))
    header.pop("schema")
    tensors = load_file(str(shard))
    edit(header)
    save_file(tensors, str(shard), metadata={"dattri_llm": json.dumps(header)})
    edit_line(index_dir, int(shard.stem), bytes=shard.stat().st_size, crc32=file_crc32(shard))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda h: h["layers"][0].pop("kind"), "kind"),
        (lambda h: h["layers"][0].update(module_kwargs=[1]), "module_kwargs"),
        (lambda h: h["layers"][0]["module_kwargs"].update(x={"__dtype__": "nope"}), "dtype"),
        (lambda h: h["layers"][0]["module_kwargs"].update(x={"__size__": ["a"]}), "Size"),
        (lambda h: h["layers"].append(h["layers"][0]), "twice"),
        (lambda h: h.update(hashes=[1, 2, 3]), "hashes"),
        (lambda h: h.update(step="3"), "step"),
    ],
)
def test_damaged_shard_header_is_a_store_format_error(tmp_path, edit, match):
    write_store(tmp_path)
    shard = tmp_path / "shards" / "000000002.safetensors"
    _rewrite_header(shard, tmp_path, edit)
    with pytest.raises(StoreFormatError, match=rf"{shard.name} has a corrupted header.*{match}"):
        all_blocks(tmp_path)


def test_tensors_that_do_not_fit_the_header_are_a_store_format_error(tmp_path):
    write_store(tmp_path)
    shard = tmp_path / "shards" / "000000001.safetensors"
    tensors = load_file(str(shard))
    tensors["0.a"] = tensors["0.a"][:2]  # 2 rows for 3 samples
    from safetensors import safe_open

    with safe_open(str(shard), framework="pt") as f:
        meta = f.metadata()
    save_file(tensors, str(shard), metadata=meta)
    _rewrite_header(shard, tmp_path, lambda h: None)
    with pytest.raises(
        StoreFormatError, match=r"000000001\.safetensors is corrupted: tensor '0\.a'"
    ):
        all_blocks(tmp_path)


def test_a_clean_store_reads_back_exactly(tmp_path):
    """Nothing that used to read changes: every check passes on a healthy store."""
    records = write_store(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = GradientStorageManager(tmp_path)
        assert store.verify_all() == 4
        for rec, block in zip(records, store.iter_blocks(), strict=True):
            assert_same_gradient(block.gradient, rec.gradient)
        assert GradientStorageManager.repair(tmp_path)[0].changed is False
    assert torch.equal(
        store.load_record(0).gradient.layers["ln"].data, records[0].gradient.layers["ln"].data
    )
