"""The CRC-32 of a shard is checked once per process and file: a second store object over the
same files does not re-read them for the checksum, a shard replaced by another file (or whose
index line expects another CRC-32) is checked again, and ``verify_all`` checks everything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError
from dattri_llm.gradient.store import shard as shard_module
from dattri_llm.gradient.store.verified import VerifiedShards
from tests.helpers.store import write_store


@pytest.fixture
def counted(monkeypatch):
    """Count the whole-file CRC-32 reads of ``open_shard``."""
    calls: list[Path] = []
    real = shard_module.file_crc32

    def counting(path: Path) -> int:
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(shard_module, "file_crc32", counting)
    VerifiedShards().clear()
    yield calls
    VerifiedShards().clear()


def read_all(path: Path) -> None:
    store = GradientStorageManager(path)
    for i in range(len(store)):
        store.load_record(i)


def shard_files(path: Path) -> list[Path]:
    return sorted((path / "shards").glob("*.safetensors"))


def test_a_second_store_object_does_not_recheck(tmp_path, counted):
    write_store(tmp_path / "s")
    read_all(tmp_path / "s")
    assert len(counted) == 4  # every shard checked once
    read_all(tmp_path / "s")
    assert len(counted) == 4  # not again: same files, same expected CRC-32
    assert GradientStorageManager(tmp_path / "s").verify_all() == 4
    assert len(counted) == 8  # verify_all checks every shard


def test_a_replaced_shard_is_checked_again_and_refused(tmp_path, counted):
    write_store(tmp_path / "s")
    read_all(tmp_path / "s")
    victim = shard_files(tmp_path / "s")[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, another content
    tmp = victim.with_name(".replacement")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, victim)  # another file (inode) under the same name
    with pytest.raises(StoreFormatError, match=f"shard {victim} is corrupted: its CRC-32"):
        read_all(tmp_path / "s")


def test_vector_reader_shares_the_registry(tmp_path, monkeypatch):
    """The contiguous-block reader of projected stores checks a shard once per process too."""
    import zlib

    from dattri_llm.gradient.store import vector_reader
    from tests.helpers.index import train_vectors, write

    write(tmp_path / "v", train_vectors(40), batch=8)
    VerifiedShards().clear()
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(zlib, name)

        @staticmethod
        def crc32(data, value=0):
            calls.append(1)
            return zlib.crc32(data, value)

    monkeypatch.setattr(vector_reader, "zlib", Counting())

    def read() -> None:
        store = GradientStorageManager(tmp_path / "v")
        records = range(len(store))
        layers = vector_reader.store_vector_layers(store, records, store.layer_names)
        reader = vector_reader.VectorBlockReader(store, layers, None, 64)
        list(reader.blocks(records))

    read()
    first = len(calls)
    assert first >= 5  # 5 shards, header and data of each
    read()
    assert len(calls) == first
    VerifiedShards().clear()
