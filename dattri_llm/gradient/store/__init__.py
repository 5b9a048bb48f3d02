"""The on-disk gradient store: safetensors shards, a JSONL index, crash safety, rank merge.

``GradientStorageManager`` is the entry point; the format is specified in
``docs/STORE_FORMAT.md`` (name :data:`FORMAT_NAME`, version :data:`FORMAT_VERSION`).
"""

from __future__ import annotations

from dattri_llm.gradient.store.finite import NonFiniteGradientError
from dattri_llm.gradient.store.format import FORMAT_NAME, FORMAT_VERSION, StoreFormatError
from dattri_llm.gradient.store.lookup import SampleLocation
from dattri_llm.gradient.store.manager import GradientStorageManager, RecordInfo
from dattri_llm.gradient.store.repair import RepairReport

__all__ = [
    "GradientStorageManager",
    "RecordInfo",
    "SampleLocation",
    "RepairReport",
    "StoreFormatError",
    "NonFiniteGradientError",
    "FORMAT_NAME",
    "FORMAT_VERSION",
]
