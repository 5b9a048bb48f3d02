"""The binary record / sample index of a version-2 partition: the same view as
the JSONL journal, torn tails, a writer killed between line and row, corrupted files named,
version-1 stores still open (and stay version 1), repair rebuilds it."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dattri_llm import GradientStorageManager
from dattri_llm.gradient import Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store.binary_index import (
    FIELDS,
    HEADER,
    RECORDS_FILE,
    SAMPLES_FILE,
    WIDTH,
    BinaryIndex,
    line_spans,
)
from dattri_llm.gradient.store.format import StoreFormatError
from dattri_llm.gradient.store.index import parse_index


def digest(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def record(step: int, ids: list[str], ckpt: int = 0, meta: dict | None = None) -> GradientRecord:
    data = torch.arange(len(ids) * 3, dtype=torch.float32).reshape(len(ids), 3) + step
    kw = {"_d": 3, "proj_dim": 3, "seed": 0, "source_layer_type": "nn.Linear"}
    grad = Gradient({"l": Materialized(data, "projected.mask", kw)})
    return GradientRecord(step, ids, grad, ckpt, meta or {})


def write(path: Path, steps: range = range(4), mode: str = "create") -> None:
    with GradientStorageManager(path, mode=mode) as store:
        for s in steps:
            # hex digests, except one record with ids of the user's own (read from the line)
            ids = (
                [f"user-{s}-{j}" for j in range(3)]
                if s == 2
                else [digest(10 * s + j) for j in range(3)]
            )
            store.write(record(s, ids, ckpt=s % 2, meta={"lr": 0.1 * s} if s % 2 else None))


def journal(path: Path) -> list[dict]:
    entries, _, _ = parse_index(path / "index.jsonl")
    return entries


def view(store: GradientStorageManager) -> list[dict]:
    return [dict(e) | {"hashes": list(e["hashes"])} for _, e in store.index_entries()]


def test_rows_and_ids_equal_the_journal(tmp_path):
    write(tmp_path)
    index = BinaryIndex(tmp_path)
    want = journal(tmp_path)
    assert index.num_records == 4 and index.num_rows == 12
    for k in ("seq", "step", "checkpoint", "n", "bytes", "crc32"):
        assert index.column(k).tolist() == [e[k] for e in want], k
    spans = line_spans((tmp_path / "index.jsonl").read_bytes())
    assert index.column("line_off").tolist() == [o for o, _ in spans]
    assert index.column("line_len").tolist() == [n for _, n in spans]
    assert index.column("row0").tolist() == [0, 3, 6, 9]
    assert index.column("ids").tolist() == [1, 1, 0, 1]  # user ids come from the line
    assert index.hashes(0) == want[0]["hashes"] and index.hashes(2) is None
    assert bytes(index.ids[3]).hex() == want[1]["hashes"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = GradientStorageManager(tmp_path)
    assert view(store) == want  # the lazy entries read as the journal's
    assert store.num_samples == 12 and store.available_checkpoints() == [0, 1]
    fresh = GradientStorageManager(tmp_path).index_entries()  # entries whose lines are not parsed
    for (_, e), w in zip(fresh, want):
        assert e["schema"] == w["schema"] and e.get("metadata") == w.get("metadata")
        assert e.get("extra") is None and "extra" not in w
        if "metadata" in w:
            assert e._line is not None  # the row sends this field to the line
        else:
            assert e._line is None  # answered from the row alone
    assert store.locations(want[3]["hashes"][1])[0].row == 1
    assert store.load_record(2).hashes == ["user-2-0", "user-2-1", "user-2-2"]


def test_torn_row_is_ignored_then_cut_by_the_writer(tmp_path):
    write(tmp_path)
    with open(tmp_path / RECORDS_FILE, "ab") as f:
        f.write(b"\x01" * (WIDTH // 2))  # a writer killed inside the row
    with pytest.warns(UserWarning, match=r"records\.bin: ignoring a torn last row"):
        store = GradientStorageManager(tmp_path)
    assert view(store) == journal(tmp_path)
    write(tmp_path, range(4, 5), mode="append")
    assert (tmp_path / RECORDS_FILE).stat().st_size == HEADER + 5 * WIDTH
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert view(GradientStorageManager(tmp_path)) == journal(tmp_path)


def test_writer_killed_between_line_and_row(tmp_path):
    write(tmp_path)
    size = (tmp_path / RECORDS_FILE).stat().st_size
    os.truncate(tmp_path / RECORDS_FILE, size - WIDTH)  # the last row never came
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = GradientStorageManager(tmp_path)  # the journal's last line is parsed instead
    assert view(store) == journal(tmp_path) and len(store) == 4
    write(tmp_path, range(4, 6), mode="append")  # the next writer appends the missing row
    index = BinaryIndex(tmp_path)
    assert index.num_records == 6
    assert index.column("step").tolist() == [e["step"] for e in journal(tmp_path)]


@pytest.mark.parametrize(
    "field, value", [("step", 99), ("n", 4), ("row0", 1), ("seq", 5), ("line_off", 3)]
)
def test_corrupted_row_is_refused_naming_records_bin(tmp_path, field, value):
    write(tmp_path)
    rows = np.memmap(tmp_path / RECORDS_FILE, dtype="<i8", mode="r+", offset=HEADER)
    rows.reshape(-1, len(FIELDS))[2, FIELDS.index(field)] = value
    rows.flush()
    del rows
    with pytest.raises(StoreFormatError, match=r"records\.bin is corrupted: row \d") as e:
        GradientStorageManager(tmp_path)
    assert "repair" in str(e.value)


def test_corrupted_and_truncated_samples_bin_are_named(tmp_path):
    write(tmp_path)
    path = tmp_path / SAMPLES_FILE
    data = bytearray(path.read_bytes())
    data[HEADER + 32 * 4 + 5] ^= 0x10  # one id byte of record 1
    path.write_bytes(bytes(data))
    store = GradientStorageManager(tmp_path)
    with pytest.raises(
        StoreFormatError, match=r"samples\.bin is corrupted: the ids of record seq 1"
    ):
        store.load_record(1)
    path.write_bytes(bytes(data[: HEADER + 32 * 7]))
    with pytest.raises(StoreFormatError, match=r"samples\.bin is corrupted: .* lists 12 sample"):
        GradientStorageManager(tmp_path)
    (tmp_path / RECORDS_FILE).write_bytes(b"garbage!" * 4)
    with pytest.raises(StoreFormatError, match=r"records\.bin is corrupted: not a records index"):
        GradientStorageManager(tmp_path)


def test_edited_journal_is_read_line_by_line(tmp_path):
    write(tmp_path)
    lines = (tmp_path / "index.jsonl").read_text().splitlines(keepends=True)
    entry = json.loads(lines[1])
    entry["metadata"] = {"lr": 0.5}
    lines[1] = json.dumps(entry, separators=(",", ":")) + "\n"
    (tmp_path / "index.jsonl").write_text("".join(lines))
    with pytest.warns(UserWarning, match="does not match .*index.jsonl"):
        store = GradientStorageManager(tmp_path)
    assert view(store) == journal(tmp_path)
    with pytest.raises(StoreFormatError, match="metadata"):  # the shard disagrees, as in v1
        store.load_record(1)


def test_version_1_store_opens_and_stays_version_1(tmp_path):
    write(tmp_path)
    want = journal(tmp_path)
    for name in (RECORDS_FILE, SAMPLES_FILE):
        (tmp_path / name).unlink()
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps(meta | {"version": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = GradientStorageManager(tmp_path)
    assert view(store) == want
    write(tmp_path, range(4, 5), mode="append")
    assert not (tmp_path / RECORDS_FILE).exists()  # an old store is appended to as it is
    assert len(GradientStorageManager(tmp_path)) == 5


def test_repair_rebuilds_the_binary_index(tmp_path):
    write(tmp_path)
    want = journal(tmp_path)
    rows = np.memmap(tmp_path / RECORDS_FILE, dtype="<i8", mode="r+", offset=HEADER)
    rows[3] += 1
    rows.flush()
    del rows
    with pytest.raises(StoreFormatError, match=r"records\.bin"):
        GradientStorageManager(tmp_path)
    report = GradientStorageManager.repair(tmp_path)[0]
    assert report.records == 4 and not report.changed  # the journal itself was fine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert view(GradientStorageManager(tmp_path)) == want
    (tmp_path / RECORDS_FILE).unlink()  # a missing index: read from the journal, rebuilt
    assert view(GradientStorageManager(tmp_path)) == want
    GradientStorageManager.repair(tmp_path)
    assert BinaryIndex(tmp_path).num_records == 4
    # a lost middle line: repair re-indexes the shard and renumbers both indexes
    lines = (tmp_path / "index.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "index.jsonl").write_text("".join(lines[:1] + lines[2:]))
    with pytest.raises(StoreFormatError):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            GradientStorageManager(tmp_path)
    GradientStorageManager.repair(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store = GradientStorageManager(tmp_path)
    assert [e["step"] for e in view(store)] == [0, 1, 2, 3]
    assert BinaryIndex(tmp_path).column("seq").tolist() == [0, 1, 2, 3]
