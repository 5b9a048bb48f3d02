"""Scoring under ``torch.distributed``: split the train side across ranks, merge exactly.

Under an initialised process group (torchrun; ``gloo`` on CPUs, ``nccl`` on GPUs) the score
loop of every attributor built on :class:`~dattri_llm.attribution.base.BaseAttributor` works on
this rank's share of the train side and merges:

* **Split.** A store's records (:mod:`dattri_llm.attribution.engine.units`) are grouped so that
  every row of one sample lands on one rank (records sharing a sample identity are in one group: a
  sample's agnostic score is then complete on that rank, which keeps ``top_k`` exact), and the
  groups are spread over the ranks by rows (largest first onto the least loaded rank). When one
  group would hold more than a fair share (e.g. epochs reshuffling the same samples), the split
  falls back to rows: every rank reads every record and keeps the rows of the samples it owns.
  Every rank reads the whole test side. A live ``attribute`` gives each rank a contiguous slice
  of the train dataset.
* **Fit.** Methods that fit something over the train side (K-FAC / EK-FAC covariances and
  eigenvalues) fit on each rank's share with their collective (all-reduced) fit, which equals
  the fit on all the data; every rank must then hold records of every checkpoint (checked).
* **Merge.** Full matrices are gathered to rank 0 and put back in store order (rank 0 returns
  the full :class:`~dattri_llm.attribution.score.AttributionScore`; the other ranks return the
  scores of their own rows). ``top_k`` states are all-gathered and merged (the global top-k of
  disjoint sets is the top-k of their top-k): every rank returns the same result. Nothing is
  pickled: identities travel as JSON bytes in tensors.

What every rank must read: the train store's index (every partition's ``index.jsonl``) and the
shard files of its own records, and the whole test store. Before scoring, the ranks compare a
digest of the train records they see and check that their own shard files are readable; a rank
that sees another store, or cannot read its part, stops every rank with an error naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dattri_llm.attribution.engine.units import RecordSource, Unit, unit_digest
from dattri_llm.utils.distributed import (
    get_rank,
    get_world_size,
    is_distributed,
    settle_collectives_at_exit,
)
from dattri_llm.utils.grouping import linked_groups

__all__ = [
    "active",
    "split_units",
    "check_shares",
    "all_gather_bytes",
    "gather_full",
    "merge_top_k_states",
    "live_slice",
]

#: A group holding more than this times a fair share of rows triggers the row split.
_UNBALANCED = 1.5


def active(args: Any) -> bool:
    """Whether scoring is split: a group of more than one rank and ``args.distributed_scoring``."""
    return is_distributed() and get_world_size() > 1 and bool(args.distributed_scoring)


def join(args: Any, where: str) -> None:
    """Wait until every rank has entered the same scoring call, or fail naming the fix.

    A split call is collective: a rank that calls it alone (e.g. rank 0 scoring while the
    others wait at a barrier) would otherwise wait forever in the first collective.
    """
    from datetime import timedelta

    n = _CALLS[0] = _CALLS[0] + 1
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a private API: without it, no early check
        return
    rank, world = get_rank(), get_world_size()
    store.set(f"dattri_llm/scoring/{n}/{rank}", where)
    keys = [f"dattri_llm/scoring/{n}/{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=float(args.distributed_timeout_s)))
    except Exception:  # noqa: BLE001 - the store's timeout error type varies
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RuntimeError(
            f"{where} was called under a torch.distributed group of {world} ranks, which "
            f"splits the train side across all of them, but rank(s) {missing} did not join "
            f"within {args.distributed_timeout_s} s. Call it on every rank, or pass "
            "AttributionArguments(distributed_scoring=False) to score in this process alone."
        ) from None


_CALLS = [0]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` (as uint8 tensors; no pickle)."""
    device = _comm_device()
    n = torch.tensor([len(payload)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(n) for _ in range(get_world_size())]
    dist.all_gather(sizes, n)
    most = int(max(int(s) for s in sizes))
    buf = torch.zeros(most, dtype=torch.uint8, device=device)
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(out, buf)
    settle_collectives_at_exit()
    return [bytes(o[: int(s)].cpu().numpy().tobytes()) for o, s in zip(out, sizes)]


def all_gather_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's CPU tensor (any shapes; through safetensors bytes)."""
    from safetensors.torch import load, save

    blobs = all_gather_bytes(save({"t": t.contiguous()}))
    return [load(b)["t"] for b in blobs]


def owner(h: str, world: int) -> int:
    """The rank that owns a sample identity (a stable hash, the same on every rank)."""
    import hashlib

    return int.from_bytes(hashlib.sha1(h.encode()).digest()[:8], "big") % world


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``."""
    return [json.loads(b.decode()) for b in all_gather_bytes(json.dumps(obj).encode())]


# ---- the split ----
def _groups(units: Sequence[Unit]) -> list[list[int]]:
    """Units joined when they share a sample identity, in store order."""
    return linked_groups([u.hashes for u in units])


def split_units(source: RecordSource, rank: int, world: int) -> tuple[RecordSource, str]:
    """This rank's share of a store's records, and how it was split (``"records"``/``"rows"``).

    Deterministic: every rank computes the same plan from the same index.
    """
    units = source.units
    total = sum(u.num_rows for u in units)
    groups = _groups(units)
    fair = total / world if world else total
    sizes = [sum(units[i].num_rows for i in g) for g in groups]
    if world > 1 and groups and max(sizes) > _UNBALANCED * max(fair, 1.0):
        return _split_rows(source, rank, world), "rows"
    load = [0] * world
    mine: list[int] = []
    order = sorted(range(len(groups)), key=lambda g: (-sizes[g], groups[g][0]))
    for g in order:
        r = min(range(world), key=lambda x: (load[x], x))
        load[r] += sizes[g]
        if r == rank:
            mine += groups[g]
    return source.subset([units[i] for i in sorted(mine)]), "records"


def _split_rows(source: RecordSource, rank: int, world: int) -> RecordSource:
    """Each sample to one rank (balanced by rows); every record, only this rank's rows."""
    count: dict[str, int] = {}
    for u in source.units:
        for h in u.hashes:
            count[h] = count.get(h, 0) + 1
    load = [0] * world
    owner: dict[str, int] = {}
    for h in sorted(count, key=lambda x: -count[x]):  # stable: ties keep first-seen order
        r = min(range(world), key=lambda x: (load[x], x))
        owner[h] = r
        load[r] += count[h]
    out = []
    for u in source.units:
        rows = [i for i, h in enumerate(u.hashes) if owner[h] == rank]
        if not rows:
            continue
        base = u.rows if u.rows is not None else list(range(len(u.hashes)))
        out.append(
            Unit(
                u.index, [u.hashes[i] for i in rows], u.step, u.checkpoint, [base[i] for i in rows]
            )
        )
    return source.subset(out)


def check_shares(full: RecordSource, mine: RecordSource, collective_fit: bool) -> None:
    """Every rank sees the same store and can read its share (errors raised on every rank)."""
    problems: list[str] = []
    records = full.store.records()
    for u in mine.units:
        path = records[u.index].path
        if not os.access(path, os.R_OK):
            problems.append(f"cannot read its train shard {path}")
            break
    if collective_fit:
        missing = sorted(set(full.all_checkpoints) - {u.checkpoint for u in mine.units})
        if missing:
            problems.append(
                f"holds no train record of checkpoint(s) {missing}: the collective K-FAC / "
                "EK-FAC fit needs every checkpoint on every rank (use fewer ranks, or more "
                "records per checkpoint)"
            )
    seen = all_gather_json({"digest": unit_digest(full), "problems": problems})
    lines = []
    if len({s["digest"] for s in seen}) > 1:
        groups: dict[str, list[int]] = {}
        for r, s in enumerate(seen):
            groups.setdefault(s["digest"], []).append(r)
        lines.append(
            f"the ranks see different train stores at {full.store.save_dir} (ranks grouped by "
            f"what they see: {sorted(groups.values())}); every rank must read the same store "
            "index (a shared filesystem, or an identical copy on each node)"
        )
    lines += [f"rank {r} {p}" for r, s in enumerate(seen) for p in s["problems"]]
    if lines:
        raise RuntimeError("distributed scoring cannot start: " + "; ".join(lines) + ".")


def live_slice(n: int, rank: int, world: int) -> range:
    """This rank's contiguous slice of ``n`` live train samples."""
    per, extra = divmod(n, world)
    start = rank * per + min(rank, extra)
    return range(start, start + per + (1 if rank < extra else 0))


# ---- the merge ----
def row_keys(source: RecordSource) -> list[list[int]]:
    """``[record index, row]`` of each row a source yields, in order (the store-order key)."""
    out = []
    for u in source.units:
        rows = u.rows if u.rows is not None else range(len(u.hashes))
        out += [[u.index, int(r)] for r in rows]
    return out


def gather_full(
    scores: torch.Tensor, meta: dict[str, Any], keys: list[list[int]] | None
) -> tuple[torch.Tensor, dict[str, Any]] | None:
    """Gather every rank's score rows on rank 0, in store order (``None`` on other ranks).

    ``meta`` holds ``hashes``, ``steps``, ``checkpoints`` (one per row); ``keys`` the rows'
    store-order keys (``None``: ranks' rows are concatenated in rank order, for live slices).
    """
    device = _comm_device()
    infos = all_gather_json(
        {"rows": int(scores.shape[0]), "cols": int(scores.shape[1]), "dtype": str(scores.dtype)}
    )
    rows = [i["rows"] for i in infos]
    most = max(rows)
    dtype = scores.dtype
    for i in infos:
        dtype = torch.promote_types(dtype, getattr(torch, i["dtype"].split(".")[-1]))
    m = max(i["cols"] for i in infos)
    buf = torch.zeros(most, m, dtype=dtype, device=device)
    buf[: scores.shape[0], : scores.shape[1]] = scores.to(device, dtype)
    payload = dict(meta, keys=keys)
    metas = all_gather_json(payload)
    rank = get_rank()
    if rank == 0:
        parts = [torch.zeros_like(buf) for _ in rows]
        dist.gather(buf, gather_list=parts, dst=0)
    else:
        dist.gather(buf, dst=0)
        return None
    mats = [p[:r].cpu() for p, r in zip(parts, rows)]
    full = torch.cat(mats)
    merged: dict[str, Any] = {
        k: [x for mt in metas for x in mt[k]] for k in ("hashes", "steps", "checkpoints")
    }
    if all(mt["keys"] is not None for mt in metas):
        flat = [tuple(k) for mt in metas for k in mt["keys"]]
        order = sorted(range(len(flat)), key=lambda i: flat[i])
        idx = torch.as_tensor(order, dtype=torch.long)
        full = full.index_select(0, idx)
        merged = {k: [v[i] for i in order] for k, v in merged.items()}
    return full, merged


def merge_top_k_states(state: tuple[dict, dict], counts: dict[str, int], duplicates: str) -> Any:
    """All-gather the ranks' top-k states and merge them (every rank gets the same sink)."""
    from safetensors.torch import load, save

    from dattri_llm.attribution.engine.sinks import merge_top_k

    tensors, meta = state
    blobs = all_gather_bytes(save({k: v.contiguous() for k, v in tensors.items()}))
    metas = all_gather_json(meta)
    return merge_top_k([(load(b), mt) for b, mt in zip(blobs, metas)], counts, duplicates)
