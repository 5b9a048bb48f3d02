"""The train side as units: a store's records digested for the resume key (``engine/units.py``)."""

from __future__ import annotations

from dattri_llm import DiskGradientSource, GradientStorageManager
from dattri_llm.attribution.engine.units import unit_digest, units_of
from tests.helpers.store import toy_record


def _write(path, seed_offset: int, mode: str = "create") -> None:
    with GradientStorageManager(path, mode=mode) as store:
        for step in range(3):
            store.write(toy_record(step, seed=step + seed_offset))


def test_a_store_overwritten_in_place_gets_another_digest(tmp_path):
    """Same records, shapes and sizes, other values: a resumed call must not reuse old parts."""
    _write(tmp_path / "train", 0)
    first = units_of(DiskGradientSource(tmp_path / "train"))
    before = unit_digest(first)
    assert unit_digest(units_of(DiskGradientSource(tmp_path / "train"))) == before
    _write(tmp_path / "train", 100, mode="overwrite")
    after = units_of(DiskGradientSource(tmp_path / "train"))
    assert [(u.hashes, u.nbytes) for u in after.units] == [
        (u.hashes, u.nbytes) for u in first.units
    ]
    assert unit_digest(after) != before
