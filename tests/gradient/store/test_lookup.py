"""Lookup by sample hash through the sorted array over ``samples.bin`` (SampleLocator) equals the
brute-force map of every id, on multi-partition stores with duplicates, ids sharing a key,
ids of the user's own, a journal tail, records written since opening and a version-1 store;
and it builds no Python object per sample."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from dattri_llm import GradientStorageManager
from dattri_llm.gradient import Gradient, GradientRecord, Materialized
from dattri_llm.gradient.store.binary_index import HEADER, RECORDS_FILE, SAMPLES_FILE, WIDTH
from dattri_llm.gradient.store.format import StoreFormatError, write_meta
from dattri_llm.gradient.store.writer import PartitionWriter


def digest(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


TWIN = ["ab" * 8 + digest(i)[16:] for i in range(3)]  # three ids with one 8-byte key


def record(step: int, ids: list[str]) -> GradientRecord:
    data = torch.randn(len(ids), 3)
    kw = {"_d": 3, "proj_dim": 3, "seed": 0, "source_layer_type": "nn.Linear"}
    return GradientRecord(step, ids, Gradient({"l": Materialized(data, "projected.mask", kw)}))


def ids_of(rank: int, step: int) -> list[str]:
    if step == 1:
        return [f"user-{rank}-{j}" for j in range(3)] + [digest(0)]  # not digests: the line
    ids = [digest(100 * rank + 10 * step + j) for j in range(4)]
    ids[0] = digest(7)  # in every record of both ranks: many occurrences
    ids[1] = TWIN[rank]
    if step == 3:
        ids[2] = ids[3]  # twice in one record
    return ids


def two_ranks(root: Path, steps: int = 4) -> None:
    root.mkdir()
    write_meta(root, {"layout": "ranks"})
    for r in (0, 1):
        w = PartitionWriter(root / f"rank_{r}", {"rank": r, "world_size": 2}, lambda e: None)
        for s in range(steps):
            w.write(record(s, ids_of(r, s)))
        w.close()


def brute(store: GradientStorageManager) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for pos, rec in enumerate(store.records()):
        for row, h in enumerate(rec.hashes):
            out.setdefault(h, []).append((pos, row))
    return out


def check(store: GradientStorageManager) -> None:
    want = brute(store)
    absent = [digest(999), TWIN[2], "ab" * 8 + "0" * 48, "user-9-9", digest(7).upper(), "zz" * 32]
    for h in [*want, *absent]:
        got = [(loc.record, loc.row) for loc in store.locations(h)]
        assert got == want.get(h, []), h
        assert (h in store) == (h in want)


def test_lookup_equals_the_map_of_every_id_and_builds_no_dict(tmp_path):
    two_ranks(tmp_path / "s")
    store = GradientStorageManager(tmp_path / "s")
    store.locations(digest(7))
    # digest rows only (the records at step 1 not)
    assert store.sample_locator().nbytes == 20 * 2 * 3 * 4
    check(store)
    assert len(store.locations(digest(7))) == 6 and TWIN[0] in store and TWIN[1] in store
    rec = store.locations(TWIN[1])[0]
    assert rec.rank == 1 and rec.path.parent.parent.name == "rank_1"


def test_journal_tail_and_records_written_since_opening(tmp_path):
    two_ranks(tmp_path / "s")
    part = tmp_path / "s" / "rank_1"
    size = (part / RECORDS_FILE).stat().st_size
    os.truncate(part / RECORDS_FILE, size - WIDTH)  # a writer killed between line and row
    with open(tmp_path / "s" / "rank_0" / RECORDS_FILE, "ab") as f:
        f.write(b"\x01" * (WIDTH // 2))  # and a torn row
    with pytest.warns(UserWarning, match="torn last row"):
        store = GradientStorageManager(tmp_path / "s")
    check(store)
    single = tmp_path / "one"
    with GradientStorageManager(single) as w:
        w.write(record(0, [digest(1), digest(2)]))
        w.flush()
        assert [loc.row for loc in w.locations(digest(2))] == [1]
        w.write(record(1, [digest(2), "mine"]))  # after the first lookup: the order changed
        w.flush()
        assert [loc.record for loc in w.locations(digest(2))] == [0, 1]
    check(GradientStorageManager(single))


def test_version_1_store(tmp_path):
    root = tmp_path / "v1"
    with GradientStorageManager(root) as w:
        for s in range(3):
            w.write(record(s, ids_of(0, s)))
    for name in (RECORDS_FILE, SAMPLES_FILE):
        (root / name).unlink()
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps(meta | {"version": 1}))
    store = GradientStorageManager(root)
    check(store)
    assert store.sample_locator().nbytes == 0  # all through the fallback map of the JSONL index


def test_a_damaged_samples_bin_is_named_on_lookup(tmp_path):
    two_ranks(tmp_path / "s")
    path = tmp_path / "s" / "rank_0" / SAMPLES_FILE
    data = bytearray(path.read_bytes())
    data[HEADER + 32 * 9 + 3] ^= 0x20  # an id of record 2
    path.write_bytes(bytes(data))
    store = GradientStorageManager(tmp_path / "s")
    with pytest.raises(StoreFormatError, match=r"rank_0/samples\.bin is corrupted: .*seq 2"):
        store.locations(digest(7))
