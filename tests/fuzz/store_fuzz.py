"""Randomized store-corruption differential test: damaged stores vs the clean result.

A small store (one flat partition, or two ``rank_N/`` partitions) with every layer kind
(factorized, materialized, tied sites, integer embedding indices), record metadata and
``per_batch``-style ``extra`` is written once; every case copies it, applies one random
corruption (bit flips, truncation or deletion of any file, index lines duplicated / dropped /
swapped / edited field by field, torn tails, a partition copied under another rank, a shard
copied over another, damaged ``meta.json``, stray files) and reads everything back. The
verdict of a case is one of

* ``detected``: a ``StoreFormatError`` whose message names a file or directory of the store;
* ``harmless``: every record (rank, step, checkpoint, hashes, metadata, extra and the exact
  tensor bytes) equals the clean store's;
* ``recovered``: the documented crash recovery — exactly the last record of one partition is
  missing, and a warning named the file;

anything else — another exception, or a silently different result — is a failure. Each case
then runs ``GradientStorageManager.repair`` and checks that what the repaired store reads is a
subset of the clean records (repair never fabricates or duplicates a record).

Run ``python tests/fuzz/store_fuzz.py --cases 2000``
(``tests/fuzz/test_store_fuzz.py`` runs a fixed seed set of 150 cases in the normal
suite).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    Materialized,
    Shared,
)
from dattri_llm.gradient.store import GradientStorageManager, StoreFormatError
from dattri_llm.gradient.store.format import write_meta
from dattri_llm.gradient.store.writer import PartitionWriter

__all__ = ["build_clean", "run_case", "run_cases", "snapshot"]


# ---- the clean store ---------------------------------------------------------------------------
def _record(gen: torch.Generator, step: int, ckpt: int, n: int, tag: str) -> GradientRecord:
    lin_kw = {"in_features": 4, "out_features": 3, "bias": True, "_k": 3, "_d": 5}
    emb_kw = {"num_embeddings": 7, "embedding_dim": 3, "padding_idx": None, "_k": 7, "_d": 3}
    ln_kw = {"normalized_shape": (3,), "eps": 1e-5, "weight": True, "bias": True}
    layers = {
        "lin": Factorized(
            torch.randn(n, 2, 5, generator=gen, dtype=torch.float64),
            torch.randn(n, 2, 3, generator=gen, dtype=torch.float64),
            "nn.Linear",
            lin_kw,
        ),
        "ln": Materialized(torch.randn(n, 6, generator=gen), "nn.LayerNorm", ln_kw),
        "emb": Shared(
            [
                Factorized(
                    torch.randint(0, 7, (n, 2), generator=gen),
                    torch.randn(n, 2, 3, generator=gen),
                    "nn.Embedding",
                    emb_kw,
                ),
                Factorized(
                    torch.randn(n, 2, 3, generator=gen),
                    torch.randn(n, 2, 7, generator=gen),
                    "nn.Linear",
                    {"in_features": 3, "out_features": 7, "bias": False, "_k": 7, "_d": 3},
                ),
            ],
            ["emb", "head"],
        ),
    }
    hashes = [f"{tag}-s{step}-{i}" for i in range(n)]
    meta = {"lr": 0.1 * (step + 1), "note": tag} if step % 2 else {}
    return GradientRecord(step, hashes, Gradient(layers), ckpt, meta)


def build_clean(root: Path, layout: str, seed: int = 0) -> None:
    """Write the clean store: ``layout`` is ``"flat"`` or ``"ranks"`` (two partitions)."""
    gen = torch.Generator().manual_seed(seed)
    ranks = [None] if layout == "flat" else [0, 1]
    root.mkdir(parents=True)
    if layout == "ranks":
        write_meta(root, {"layout": "ranks"})
    for r in ranks:
        directory = root if r is None else root / f"rank_{r}"
        meta = {"rank": r or 0, "world_size": 1 if r is None else 2}
        writer = PartitionWriter(directory, meta, lambda e: None, async_write=False, fsync=False)
        for i, (step, ckpt, n) in enumerate([(0, 0, 3), (1, 0, 2), (1, 1, 3), (2, 1, 1)]):
            extra = {"members": [f"m{r}-{i}-{j}" for j in range(2)]} if i == 2 else None
            writer.write(_record(gen, step, ckpt, n, f"r{r}"), extra)
        writer.close()


# ---- reading everything back -------------------------------------------------------------------
def _tensors(lg: Any) -> list[bytes]:
    leaves = lg.sites if isinstance(lg, Shared) else [lg]
    out = []
    for leaf in leaves:
        ts = [leaf.a, leaf.g] if isinstance(leaf, Factorized) else [leaf.data]
        out += [
            str(t.dtype).encode() + bytes(str(tuple(t.shape)), "ascii") + t.numpy().tobytes()
            for t in ts
        ]
    return out


def snapshot(root: Path) -> list[tuple]:
    """Every record of the store as comparable values, in store order."""
    store = GradientStorageManager(root)
    out = []
    entries = store.index_entries()  # the harness also compares the index's extra
    for (part, entry), block in zip(entries, store.iter_blocks(), strict=True):
        grad = block.gradient
        out.append(
            (
                part.rank,
                block.step,
                block.checkpoint,
                tuple(block.hashes),
                json.dumps(dict(block.metadata), sort_keys=True),
                json.dumps(entry.get("extra"), sort_keys=True),
                tuple(grad.layer_names),
                tuple(
                    (lg.layer_type if not isinstance(lg, Shared) else "shared", *_tensors(lg))
                    for lg in grad.layers.values()
                ),
            )
        )
    store.verify_all()
    return out


# ---- corruptions -------------------------------------------------------------------------------
#: The corruption kinds, bit flips and index-field edits drawn more often.
KINDS = (
    "flip flip truncate delete dup_line drop_line truncate_lines swap_lines edit_field edit_field "
    "edit_field copy_partition copy_shard meta stray torn_tail"
).split()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _indexes(root: Path) -> list[Path]:
    return sorted(root.rglob("index.jsonl"))


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _random_value(rng: random.Random) -> Any:
    return rng.choice(
        [
            rng.randint(-3, 10),
            2**33,
            rng.random(),
            True,
            None,
            "x",
            "",
            [],
            [1, 2],
            ["a", 1],
            {},
            {"k": [1]},
            "shards/000000000.safetensors",
            "../evil.safetensors",
        ]
    )


def _edit_field(rng: random.Random, root: Path) -> str:
    index = rng.choice(_indexes(root))
    lines = _lines(index)
    i = rng.randrange(len(lines))
    entry = json.loads(lines[i])
    key = rng.choice([*entry, "metadata", "extra", "unknown"])
    how = rng.choice(["random", "nudge", "delete", "hash_item", "copy_other"])
    if how == "delete":
        entry.pop(key, None)
    elif how == "nudge" and isinstance(entry.get(key), int):
        entry[key] += rng.choice([-1, 1])
    elif how == "hash_item" and entry["hashes"]:
        entry["hashes"][rng.randrange(len(entry["hashes"]))] = _random_value(rng)
        key = "hashes[i]"
    elif how == "copy_other":
        other = json.loads(rng.choice(lines))
        if key in other:
            entry[key] = other[key]
    else:
        entry[key] = _random_value(rng)
    lines[i] = json.dumps(entry, separators=(",", ":")).encode() + b"\n"
    index.write_bytes(b"".join(lines))
    return f"edit {index.relative_to(root)}:{i + 1} {key} ({how})"


def _meta(rng: random.Random, root: Path) -> str:
    meta = rng.choice(sorted(root.rglob("meta.json")))
    obj = json.loads(meta.read_text())
    choice = rng.randrange(7)
    if choice == 0:
        meta.write_bytes(b"\xff\xfe not utf-8")
    elif choice == 1:
        meta.write_text("{not json")
    elif choice == 2:
        obj["rank"] = rng.choice(["zero", 1.5, True, -1, 1, 3, [0]])
    elif choice == 3:
        obj["version"] = rng.choice([0, 2, "1", None])
    elif choice == 4:
        obj["format"] = "something.else"
    elif choice == 5:
        obj.pop(rng.choice(sorted(obj)))
    else:
        obj["world_size"] = rng.choice([0, "two", 2, 7])
    if choice >= 2:
        meta.write_text(json.dumps(obj))
    return f"meta {meta.relative_to(root)} #{choice}"


def corrupt(rng: random.Random, root: Path) -> str:
    """Apply one random corruption to the store at ``root``; returns its description."""
    kind = rng.choice(KINDS)
    if kind in ("flip", "truncate", "delete"):
        files = [p for p in _files(root) if kind == "delete" or p.stat().st_size]
        victim = rng.choice(files)
        rel = victim.relative_to(root)
        data = bytearray(victim.read_bytes())
        if kind == "flip":
            pos = rng.randrange(len(data))
            data[pos] ^= 1 << rng.randrange(8)
            victim.write_bytes(bytes(data))
            return f"flip {rel} @{pos}"
        if kind == "truncate":
            cut = rng.randrange(len(data))
            victim.write_bytes(bytes(data[:cut]))
            return f"truncate {rel} to {cut}"
        victim.unlink()
        return f"delete {rel}"
    if kind in ("dup_line", "drop_line", "truncate_lines", "swap_lines", "torn_tail"):
        index = rng.choice(_indexes(root))
        lines = _lines(index)
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        if kind == "dup_line":
            lines.insert(j, lines[i])
        elif kind == "drop_line":
            del lines[i]
        elif kind == "truncate_lines":
            lines = lines[:i]
        elif kind == "swap_lines":
            lines[i], lines[j] = lines[j], lines[i]
        else:
            lines.append(lines[i][: rng.randrange(1, len(lines[i]) - 1)])
        index.write_bytes(b"".join(lines))
        return f"{kind} {index.relative_to(root)} i={i} j={j}"
    if kind == "edit_field":
        return _edit_field(rng, root)
    if kind == "meta":
        return _meta(rng, root)
    if kind == "copy_partition":
        ranks = sorted(root.glob("rank_*"))
        if ranks:
            src = rng.choice(ranks)
            dst = root / f"rank_{rng.choice([2, 3, 1 - int(src.name[5:])])}"
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst)
        else:
            src, dst = root, root / "rank_0"
            dst.mkdir()
            for name in ("meta.json", "index.jsonl"):
                shutil.copy(root / name, dst / name)
            shutil.copytree(root / "shards", dst / "shards")
        return f"copy_partition {src.name} -> {dst.name}"
    if kind == "copy_shard":
        shards = sorted(root.rglob("*.safetensors"))
        a, b = rng.sample(shards, 2)
        shutil.copy(a, b)
        return f"copy_shard {a.relative_to(root)} over {b.relative_to(root)}"
    shards_dir = rng.choice(sorted(root.rglob("shards")))
    choice = rng.randrange(5)
    if choice == 0:
        (shards_dir / "notes.txt").write_text("hello")
    elif choice == 1:
        (shards_dir / ".hidden.tmp").write_bytes(b"partial")
    elif choice == 2:
        src = rng.choice(sorted(shards_dir.glob("*.safetensors")))
        n = len(list(shards_dir.glob("*.safetensors")))
        name = rng.choice([f"{n:09d}.safetensors", "copy.safetensors", f"{n + 3:09d}.safetensors"])
        shutil.copy(src, shards_dir / name)
    elif choice == 3:
        (root / rng.choice(["rank_07", "rank_9", "notes"])).mkdir(exist_ok=True)
    else:
        (root / "stray.txt").write_text("x")
    return f"stray #{choice} in {shards_dir.relative_to(root)}"


# ---- one case ----------------------------------------------------------------------------------
def _names_store_file(message: str, root: Path) -> bool:
    return str(root) in message


def run_case(seed: int, clean_dirs: dict[str, Path], clean: dict[str, list], work: Path) -> dict:
    """Run one case; returns ``{"seed", "what", "verdict", "detail"}`` (verdict ``"FAIL"`` on
    a failure)."""
    rng = random.Random(seed)
    layout = rng.choice(sorted(clean_dirs))
    root = work / f"case{seed}"
    shutil.copytree(clean_dirs[layout], root)
    what = corrupt(rng, root)
    result = {"seed": seed, "layout": layout, "what": what, "detail": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            got = snapshot(root)
        except StoreFormatError as e:
            ok = _names_store_file(str(e), root)
            result["verdict"] = "detected" if ok else "FAIL"
            result["detail"] = str(e)[:300]
            got = None
        except Exception as e:  # noqa: BLE001 - a deep exception is a failure
            result["verdict"] = "FAIL"
            result["detail"] = f"{type(e).__name__}: {e}"[:300]
            got = None
    if got is not None:
        warned = any(_names_store_file(str(w.message), root) for w in caught)
        if got == clean[layout]:
            result["verdict"] = "harmless"
        elif warned and _last_record_missing(clean[layout], got):
            result["verdict"] = "recovered"
        else:
            result["verdict"] = "FAIL"
            result["detail"] = f"silently different: {len(got)} vs {len(clean[layout])} records"
    if result["verdict"] != "FAIL":
        result["detail"] += _check_repair(root, clean[layout])
        if "REPAIR FAIL" in result["detail"]:
            result["verdict"] = "FAIL"
    shutil.rmtree(root, ignore_errors=True)
    return result


def _last_record_missing(clean: list[tuple], got: list[tuple]) -> bool:
    """``got`` is ``clean`` without the last-written record of one partition."""
    if len(got) != len(clean) - 1:
        return False
    for k in range(len(clean)):
        if clean[:k] + clean[k + 1 :] == got:
            rank = clean[k][0]
            # store order is by step within a partition; the last written record (seq) of the
            # clean store is its last one at the highest step of that partition
            later = [r for r in clean[k + 1 :] if r[0] == rank]
            return not later
    return False


def _check_repair(root: Path, clean: list[tuple]) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            GradientStorageManager.repair(root)
            got = snapshot(root)
        except StoreFormatError as e:
            if _names_store_file(str(e), root):
                return " | repair: refused (named)"
            return f" | REPAIR FAIL unnamed: {e}"[:300]
        except (RuntimeError, FileNotFoundError) as e:
            return f" | repair: {type(e).__name__}"
        except Exception as e:  # noqa: BLE001
            return f" | REPAIR FAIL {type(e).__name__}: {e}"[:300]
    counts = collections.Counter(clean)
    extra = collections.Counter(got) - counts
    if extra:
        return f" | REPAIR FAIL: {sum(extra.values())} record(s) not in the clean store"
    return f" | repaired: {len(got)}/{len(clean)} records"


def run_cases(seeds: range | list[int], work: Path) -> list[dict]:
    """Run the cases of ``seeds`` under the scratch directory ``work``."""
    clean_dirs = {}
    clean = {}
    for layout in ("flat", "ranks"):
        clean_dirs[layout] = work / f"clean_{layout}"
        build_clean(clean_dirs[layout], layout)
        clean[layout] = snapshot(clean_dirs[layout])
    return [run_case(s, clean_dirs, clean, work) for s in seeds]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--show", type=int, default=10, help="failures to print")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dattri_store_fuzz_") as tmp:
        results = run_cases(range(args.first_seed, args.first_seed + args.cases), Path(tmp))
    verdicts = collections.Counter(r["verdict"] for r in results)
    kinds = collections.Counter((r["what"].split()[0], r["verdict"]) for r in results)
    print(f"# store corruption fuzz: {args.cases} cases in {time.perf_counter() - t0:.1f} s")
    print(
        f"command: {' '.join(sys.argv)}; torch {torch.__version__}; OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS')}\n"
    )
    print("| verdict | cases |\n|---|---|")
    for v, n in sorted(verdicts.items()):
        print(f"| {v} | {n} |")
    print("\n| corruption | verdict | cases |\n|---|---|---|")
    for (k, v), n in sorted(kinds.items()):
        print(f"| {k} | {v} | {n} |")
    fails = [r for r in results if r["verdict"] == "FAIL"]
    for r in fails[: args.show]:
        print(f"\nFAIL seed {r['seed']} ({r['layout']}): {r['what']}\n  {r['detail']}")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
