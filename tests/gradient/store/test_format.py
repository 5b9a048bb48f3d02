"""The shard layout: layer tables written once per partition, and stores of older versions."""

from __future__ import annotations

import shutil

import torch

from dattri_llm.gradient.store import GradientStorageManager
from tests.gradient.store.format_fixture import FIXTURE, fixture_records, stored_form
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
