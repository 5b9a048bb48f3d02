"""``dattri-llm inspect STORE [--verify]``: what a gradient store holds; whether it is intact."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dattri_llm.cli._common import (
    EXIT_DAMAGED,
    EXIT_ERROR,
    CommandError,
    HelpFormatter,
    UsageError,
    add_progress_flag,
    open_store,
    show_progress,
)
from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY as FINGERPRINT_KEY
from dattri_llm.utils.progress import progress as progress_over

DESCRIPTION = """Describe a gradient store: records, steps, checkpoints, ranks, samples, the
layers with their per-sample shapes and sizes, the dtype, the format version and the capture
settings recorded in it. --verify reads every shard and checks its integrity (size, CRC-32,
header), naming every damaged file; it exits with 3 when one is found."""


def add_parser(sub: Any) -> None:
    """Register the command."""
    p = sub.add_parser(
        "inspect",
        help="describe a gradient store; --verify checks every file",
        description=DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    p.add_argument("store", metavar="STORE", help="a gradient store directory")
    p.add_argument("--verify", action="store_true", help="read every shard and check its integrity")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    add_progress_flag(p)
    p.set_defaults(run=run)


def _layer_rows(gradient: Any) -> list[dict]:
    """Per layer: type, kind, per-sample shapes and bytes (from one record)."""
    from dattri_llm.gradient.gradient import Factorized, Materialized, Shared

    def shapes(lg: Any) -> str:
        if isinstance(lg, Factorized):
            return f"a {tuple(lg.a.shape[1:])}, g {tuple(lg.g.shape[1:])}"
        if isinstance(lg, Materialized):
            return f"{tuple(lg.data.shape[1:])}"
        return " + ".join(f"[{shapes(s)}]" for s in lg.sites)

    def kind(lg: Any) -> str:
        if isinstance(lg, Shared):
            return f"shared ({len(lg.sites)} sites)"
        return "factorized" if isinstance(lg, Factorized) else "materialized"

    def projection(lg: Any) -> str:
        if isinstance(lg, Shared):
            return " + ".join(dict.fromkeys(projection(s) for s in lg.sites))
        return describe_projection(lg.layer_type, lg.module_kwargs or {})

    b = max(gradient.batch_size, 1)
    return [
        {
            "name": name,
            "type": lg.layer_type,
            "kind": kind(lg),
            "shape per sample": shapes(lg),
            "projection": projection(lg),
            "bytes per sample": lg.nbytes // b,
        }
        for name, lg in gradient.layers.items()
    ]


def describe_projection(layer_type: str, kw: dict) -> str:
    """One layer's capture-time projection: style, dimensions, seed, options and source.

    E.g. ``"logra 8x8 (output side x input side) = 64, seed 0, normal; of nn.Linear 6x5"``,
    ``"sparse dim 64, nnz 2, seed 3; of nn.Linear 6x5"``; ``"none"`` for a raw layer.
    """
    if not layer_type.startswith("projected."):
        return "none"
    style = layer_type.split(".", 1)[1]
    if "proj_dim_out" in kw and "proj_dim_in" in kw:
        k, d = int(kw["proj_dim_out"]), int(kw["proj_dim_in"])
        parts = [f"{style} {k}x{d} (output side x input side) = {k * d}"]
    else:
        parts = [f"{style} dim {kw.get('proj_dim', kw.get('_d', '?'))}"]
    if "nnz" in kw:
        parts.append(f"nnz {kw['nnz']}")
    parts.append(f"seed {kw.get('seed')}")
    if "proj_type" in kw:
        parts.append(str(kw["proj_type"]))
    text = ", ".join(parts)
    source = kw.get("source_layer_type")
    if source:
        skw = kw.get("source_module_kwargs") or {}
        shape = f" {skw['_k']}x{skw['_d']}" if "_k" in skw and "_d" in skw else ""
        text += f"; of {source}{shape}"
    return text


def _settings(store: Any) -> dict:
    """The capture settings the store recorded (meta.json entries beyond format and version)."""
    from dattri_llm.gradient.store.format import read_meta

    dirs = [store.save_dir, *sorted({r.path.parent.parent for r in store.records()})]
    out: dict = {}
    for d in dict.fromkeys(Path(x) for x in dirs):
        if (d / "meta.json").is_file():
            for k, v in read_meta(d).items():
                if k not in ("format", "version", "rank", "world_size"):
                    out.setdefault(k, v)
    return out


def describe(store: Any) -> dict:
    """Everything ``inspect`` prints, as a JSON-ready dict."""
    from dattri_llm.gradient.store import StoreFormatError
    from dattri_llm.gradient.store.format import FORMAT_NAME, FORMAT_VERSION

    records = store.records()
    first = None
    for i in range(len(records)):  # the first readable record describes the layers
        try:
            first = store.load_record(i)
            break
        except (StoreFormatError, OSError):
            continue
    if first is None:
        raise StoreFormatError(
            f"no record of {store.save_dir} can be read: every shard is damaged."
        )
    paths = [r.path for r in records]
    on_disk = sum(p.stat().st_size for p in paths if p.exists())
    return {
        "store": str(store.save_dir),
        "format": f"{FORMAT_NAME} v{FORMAT_VERSION}",
        "records": len(records),
        "steps": store.available_steps(),
        "checkpoints": store.available_checkpoints(),
        "ranks": store.ranks,
        "rows": store.num_samples,
        "distinct samples": len(store.sample_hashes()),
        "dtype": str(first.gradient.dtype).replace("torch.", ""),
        "bytes on disk": on_disk,
        "capture settings": _settings(store),
        "record metadata (first readable record)": dict(first.metadata),
        "layers": _layer_rows(first.gradient),
    }


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _span(values: list[int]) -> str:
    if len(values) > 8:
        return f"{values[0]}..{values[-1]} ({len(values)} values)"
    return ", ".join(map(str, values))


def _print(d: dict) -> None:
    layers = d["layers"]
    per_sample = sum(x["bytes per sample"] for x in layers)
    lines = [
        ("store", d["store"]),
        ("format", d["format"]),
        ("records", f"{d['records']} (steps {_span(d['steps'])})"),
        ("checkpoints", _span(d["checkpoints"])),
        ("ranks", _span(d["ranks"])),
        ("samples", f"{d['rows']} rows, {d['distinct samples']} distinct"),
        ("dtype", d["dtype"]),
        ("size", f"{_size(d['bytes on disk'])} on disk, {_size(per_sample)} per sample"),
    ]
    projected = [x for x in layers if x["projection"] != "none"]
    kinds = sorted({x["projection"].split("; of ")[0] for x in projected})  # source apart
    lines.append(
        ("projection", f"{', '.join(kinds)} on {len(projected)}/{len(layers)} layers")
        if projected
        else ("projection", "none")
    )
    for k, v in {**d["capture settings"], **d["record metadata (first readable record)"]}.items():
        if k == "coverage" and isinstance(v, dict):  # written by OffloadCallback
            from dattri_llm.gradient.hooks.coverage import CaptureCoverage

            lines.append((k, str(CaptureCoverage.from_dict(v))))
        elif k != FINGERPRINT_KEY:  # one record's weights fingerprint says nothing to a reader
            lines.append((k, json.dumps(v) if not isinstance(v, str) else v))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    print(f"\nlayers ({len(layers)}; shapes per sample, from the first readable record):")
    heads = ("name", "type", "kind", "shape per sample", "projection", "bytes per sample")
    rows = [[str(x[h]) if h != "bytes per sample" else _size(x[h]) for h in heads] for x in layers]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip())
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def verify(store: Any, progress: bool | None) -> tuple[int, list[str]]:
    """Read every record; returns ``(records checked, one message per damaged file)``."""
    from dattri_llm.gradient.store import StoreFormatError

    bad: list[str] = []
    indices: Any = progress_over(range(len(store)), progress, desc="verifying", unit="record")
    for i in indices:
        try:
            store.load_record(i)
        except (StoreFormatError, OSError) as e:
            bad.append(str(e))
    return len(store), bad


def _is_store_dir(path: Path) -> bool:
    return (path / "meta.json").exists() or any(path.glob("rank_*/meta.json"))


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    from dattri_llm.gradient.store import StoreFormatError

    try:
        store = open_store(args.store, "STORE")
    except UsageError as e:
        if not _is_store_dir(Path(args.store)) or "holds no gradient records" in str(e):
            raise
        raise CommandError(  # a store whose own files are damaged
            f"{args.store}: {e}".replace("argument STORE: ", ""),
            EXIT_DAMAGED if args.verify else EXIT_ERROR,
        ) from None
    try:
        d = describe(store)
    except StoreFormatError as e:
        raise CommandError(str(e), EXIT_DAMAGED if args.verify else EXIT_ERROR) from None
    bad: list[str] = []
    if args.verify:
        d["verified records"], bad = verify(store, show_progress(args))
        d["damaged"] = bad
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        _print(d)
        if args.verify:
            state = "all intact" if not bad else f"{len(bad)} damaged"
            print(f"\nverified {d['verified records']} records: {state}")
    for msg in bad:
        print(f"dattri-llm inspect: damaged: {msg}", file=sys.stderr)
    return EXIT_DAMAGED if bad else 0
