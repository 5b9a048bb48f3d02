"""The records of ``tests/data/store_v2/``: a store written by the version-2 writer.

The directory was produced once by dattri_llm's version-2 code with :func:`write_v2_fixture`
(``python -m tests.gradient.store.format_fixture``) and is committed as it was written, so
that the tests check the current reader against bytes an older writer produced. The records
are deterministic, so the tests rebuild them here and compare exactly.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    Materialized,
    Shared,
)

FIXTURE = Path(__file__).resolve().parents[2] / "data" / "store_v2"

#: ``(record, extra, storage)`` per record, in write order.
Written = tuple[GradientRecord, dict | None, dict | None]


def _hash(i: int) -> str:
    return hashlib.sha256(f"fixture sample {i}".encode()).hexdigest()


def _exact(gen: torch.Generator, *shape: int) -> torch.Tensor:
    # multiples of 1/8 in [-2, 2): exact in bfloat16, so a bf16 round trip is lossless
    return (torch.randint(-16, 16, shape, generator=gen) / 8).to(torch.float32)


def fixture_records() -> list[Written]:
    """The fixture's records: factor, dense and tied layers, metadata, extra and storage."""
    gen = torch.Generator().manual_seed(0)
    kw_lin = {"in_features": 3, "out_features": 2, "bias": False, "_k": 2, "_d": 3}
    kw_emb = {"num_embeddings": 5, "embedding_dim": 3, "padding_idx": None, "_k": 5, "_d": 3}
    kw_norm = {
        "normalized_shape": torch.Size([2]),
        "eps": 1e-5,
        "dims": (0, 1),
        "dtype": torch.float64,
    }
    out: list[Written] = []
    for step, n in ((0, 2), (1, 1)):
        tied = Shared(
            [
                Factorized(
                    torch.randint(0, 5, (n, 4), generator=gen),
                    _exact(gen, n, 4, 5),
                    "nn.Embedding",
                    kw_emb,
                ),
                Factorized(_exact(gen, n, 4, 3), _exact(gen, n, 4, 5), "nn.Linear", kw_lin),
            ],
            ["emb", "head"],
        )
        layers = {
            "emb": tied,
            "fc": Factorized(_exact(gen, n, 4, 3), _exact(gen, n, 4, 2), "nn.Linear", kw_lin),
            "norm": Materialized(
                torch.randn(n, 4, generator=gen, dtype=torch.float64), "nn.LayerNorm", kw_norm
            ),
        }
        hashes = [_hash(10 * step + i) for i in range(n)]
        record = GradientRecord(step, hashes, Gradient(layers), 0, {"loss_reduction": "sum"})
        out.append((record, None, None))
    # a compact bf16 record with another schema (fc stored dense) and writer metadata
    dense = Materialized(_exact(gen, 2, 6), "nn.Linear", kw_lin)
    layers = {"fc": dense, "norm": Materialized(_exact(gen, 2, 4), "nn.LayerNorm", kw_norm)}
    record = GradientRecord(2, ["batch-a", "batch-b"], Gradient(layers), 1)
    storage = {
        "dtype": "bfloat16",
        "capture_dtype": "float32",
        "layers": {"fc": "dense", "norm": "captured dense"},
    }
    out.append((record, {"members": ["x", "y"]}, storage))
    return out


def stored_form(written: Written) -> Gradient:
    """The record's gradient as the store holds it (``storage["dtype"]`` applied)."""
    record, _, storage = written
    if storage is None:
        return record.gradient
    dtype = getattr(torch, storage["dtype"])
    return Gradient(
        {
            name: Materialized(lg.data.to(dtype), lg.layer_type, lg.module_kwargs)
            for name, lg in record.gradient.layers.items()
        }
    )


def write_v2_fixture(directory: Path) -> None:
    """Write the fixture store (run with the version-2 writer to regenerate it)."""
    from dattri_llm.gradient.store import GradientStorageManager

    store = GradientStorageManager(directory, async_write=False, fsync=False)
    for record, extra, storage in fixture_records():
        if storage is not None:  # the store holds what OffloadCallback would: the cast tensors
            record = GradientRecord(
                record.step,
                record.hashes,
                stored_form((record, extra, storage)),
                record.checkpoint,
                record.metadata,
            )
        store.write(record, extra=extra, storage=storage)
    store.close()


if __name__ == "__main__":
    write_v2_fixture(FIXTURE)
