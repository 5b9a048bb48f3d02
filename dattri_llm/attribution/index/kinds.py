"""The FAISS index kinds a :class:`~dattri_llm.attribution.index.GradientIndex` builds.

Every kind uses FAISS's inner-product metric (``METRIC_INNER_PRODUCT``): ``"dot"`` indexes the
raw vectors (TracIn / Grad-Dot), ``"cosine"`` the unit vectors (Grad-Cos).

=========  ============================================  =========================================
kind       FAISS index                                   parameters (defaults)
=========  ============================================  =========================================
``flat``   ``IndexFlatIP``: exact, brute force           none
``ivf``    ``IndexIVFFlat`` (``IndexIVFPQ`` with         ``nlist`` (``4·sqrt(n)``, at most
           ``pq_m``) over an inner-product coarse        ``n / 39``), ``nprobe`` (``nlist / 32``,
           quantizer; with ``pq_m``, the PQ short        at least 8), ``train_size``
           list of ``rerank·k`` candidates is            (``min(n, 64·nlist)``
           re-ranked with exact inner products read      vectors, sampled with ``seed``),
           from the part's memory-mapped re-rank         ``pq_m`` (``None``: no PQ; must divide
           file (``part_search``)                        the dimension), ``pq_bits`` (8),
                                                         ``rerank`` (4)
``hnsw``   ``IndexHNSWFlat`` (graph over the exact       ``M`` (32), ``efConstruction`` (80),
           vectors)                                      ``efSearch`` (64)
=========  ============================================  =========================================

``kind="auto"`` is ``flat`` while ``n·D <= AUTO_FLAT_MAX`` (2.5e8 numbers, 1 GB of float32:
about 12 ms per query in a batch of 100 on one core; 4.9 ms measured at 1e5 x 1024, see
``docs/benchmarks/index.md``), and above it ``ivf`` with :func:`auto_ivf_params` (IVF-PQ,
4-bit fast scan, exact re-ranking from the re-rank file): its memory is the PQ codes (256 B
per vector at D = 2048) where ``hnsw`` and IVF-Flat hold every vector. Its ``nprobe`` is not
a fixed fraction of ``nlist`` (how many lists a query must visit depends on the data): the
build measures recall@10 on held-out queries and keeps the smallest ``nprobe`` (a power of
two, or ``nlist``) that reaches ``target_recall`` (0.95;
:mod:`~dattri_llm.attribution.index.calibrate`), and the index reports the recall it
measured (``GradientIndex.expected_recall``).
``ivf`` also takes ``target_recall`` (default ``None``: the given ``nprobe``, measured only)
and ``calibration_queries`` (128).
``pq_bits=4`` always builds FAISS's fast-scan layout (``IndexIVFPQFastScan``: the same codes,
scanned with SIMD), which wants an even ``pq_m``.
``nprobe`` and ``efSearch`` can also be given to each search.

faiss is imported here, lazily (``pip install "dattri_llm[index]"``); nothing else of the
library needs it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = [
    "KINDS",
    "METRICS",
    "AUTO_FLAT_MAX",
    "AUTO_TARGET_RECALL",
    "import_faiss",
    "resolve",
    "resolve_kind",
    "resolve_params",
    "auto_ivf_params",
    "make_index",
    "empty_index",
    "training_rows",
    "flat_storage",
    "train_index",
    "set_search_params",
]

KINDS = ("auto", "flat", "ivf", "hnsw")
METRICS = ("dot", "cosine")
#: ``kind="auto"`` builds an exact flat index up to this many numbers (``n * D``).
AUTO_FLAT_MAX = 250_000_000
#: The recall@10 (on held-out queries) a ``kind="auto"`` IVF build calibrates ``nprobe`` to.
AUTO_TARGET_RECALL = 0.95

_PARAMS = {
    "flat": (),
    "ivf": (
        "nlist",
        "nprobe",
        "train_size",
        "seed",
        "pq_m",
        "pq_bits",
        "rerank",
        "target_recall",
        "calibration_queries",
    ),
    "hnsw": ("M", "efConstruction", "efSearch"),
}


def import_faiss() -> Any:
    """``import faiss``, or an error that says how to install it."""
    try:
        import faiss
    except ImportError as e:  # pragma: no cover - exercised only without faiss
        raise ImportError(
            "GradientIndex needs FAISS: pip install 'dattri_llm[index]' (or pip install "
            f"faiss-cpu). ({e})"
        ) from None
    return faiss


def resolve_kind(kind: str, n: int, dim: int) -> str:
    """The concrete kind of ``kind`` for ``n`` vectors of ``dim`` numbers.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    if kind == "auto":
        return "flat" if n * dim <= AUTO_FLAT_MAX else "ivf"
    return kind


def auto_ivf_params(n: int, dim: int) -> dict[str, Any]:
    """The ``ivf`` parameters ``kind="auto"`` builds with above :data:`AUTO_FLAT_MAX`.

    IVF-PQ in FAISS's 4-bit fast-scan layout with ``D / 4`` sub-quantizers (one bit per
    number: 256 B per vector at ``D = 2048``), ``sqrt(n)`` lists trained on 40 vectors per
    list (a one-core build of about 3 minutes at 1M, not the hour ``4·sqrt(n)`` lists on 64
    per list would take), and a short list of ``25·k`` re-ranked exactly from the re-rank
    file. ``nprobe`` is calibrated at build to :data:`AUTO_TARGET_RECALL` (see
    :mod:`~dattri_llm.attribution.index.calibrate`); a fixed fraction of the lists does not
    hold one recall across sizes (a sixteenth gave recall@10 0.97 on 1M real projected
    gradients, 0.85 on 200k and 0.91 on 500k; calibrated: 0.95 and 0.98 on real test queries).
    Measured recall and speed: ``docs/benchmarks/index.md``.
    """
    nlist = max(1, min(max(1, n // 39), int(math.sqrt(max(n, 1)))))
    even = [m for m in range(2, dim // 4 + 1, 2) if dim % m == 0]
    return {
        "nlist": nlist,
        "train_size": min(n, 40 * nlist),
        "pq_m": max(even) if even else None,
        "pq_bits": 4,
        "rerank": 25,
        "target_recall": AUTO_TARGET_RECALL,
    }


def resolve(kind: str, n: int, dim: int, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The concrete kind and full parameters a build of ``n`` vectors of ``dim`` uses.

    ``kind="auto"`` above :data:`AUTO_FLAT_MAX` takes :func:`auto_ivf_params` as its defaults;
    an ``nprobe`` given to it replaces the calibration (``target_recall`` then defaults to
    ``None``).

    Raises:
        ValueError: an unknown kind, a parameter the kind does not take, an invalid value.
    """
    built = resolve_kind(kind, n, dim)
    if kind == "auto" and built == "ivf":
        defaults = auto_ivf_params(n, dim)
        if "nprobe" in given:
            defaults["target_recall"] = None
        given = {**defaults, **given}
    return built, resolve_params(built, n, dim, given)


def resolve_params(kind: str, n: int, dim: int, given: dict[str, Any]) -> dict[str, Any]:
    """The full parameters of a kind for ``n`` vectors: the given ones plus the defaults.

    Raises:
        ValueError: a parameter the kind does not take, or an invalid value, naming it.
    """
    unknown = sorted(set(given) - set(_PARAMS[kind]))
    if unknown:
        takes = ", ".join(_PARAMS[kind]) or "no parameters"
        raise ValueError(f"kind={kind!r} takes {takes}; got {unknown}.")
    p = dict(given)
    if kind == "ivf":
        cap = max(1, n // 39)  # FAISS wants >= 39 training points per list
        p.setdefault("nlist", max(1, min(cap, int(4 * math.sqrt(max(n, 1))))))
        p.setdefault("nprobe", min(p["nlist"], max(8, p["nlist"] // 32)))
        p.setdefault("train_size", min(n, 64 * p["nlist"]))
        p.setdefault("seed", 0)
        p.setdefault("pq_m", None)
        p.setdefault("pq_bits", 8)
        p.setdefault("rerank", 4)
        p.setdefault("target_recall", None)
        p.setdefault("calibration_queries", 128)
        for key in ("nlist", "nprobe", "train_size", "pq_bits", "rerank", "calibration_queries"):
            _positive(key, p[key])
        _target(p["target_recall"], "nprobe" in given)
        if p["nlist"] > n:
            raise ValueError(f"nlist={p['nlist']} exceeds the {n} vectors to index; lower it.")
        if p["pq_m"] is not None:
            _positive("pq_m", p["pq_m"])
            if dim % p["pq_m"]:
                raise ValueError(
                    f"pq_m={p['pq_m']} must divide the vector dimension {dim}; pick a divisor."
                )
            if p["pq_bits"] == 4 and p["pq_m"] % 2:
                raise ValueError(
                    f"pq_m={p['pq_m']} with pq_bits=4 (FAISS's fast-scan layout, two codes per "
                    "byte) must be even; pick an even divisor of the dimension."
                )
    elif kind == "hnsw":
        p.setdefault("M", 32)
        p.setdefault("efConstruction", 80)
        p.setdefault("efSearch", 64)
        for key in ("M", "efConstruction", "efSearch"):
            _positive(key, p[key])
    return p


def _target(value: Any, nprobe_given: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(
            f"target_recall must be a recall@10 in (0, 1] (e.g. 0.95) or None, got {value!r}."
        )
    if nprobe_given:
        raise ValueError(
            "target_recall chooses nprobe at build; give one of them, not both (pass "
            "target_recall=None to keep the given nprobe)."
        )


def _positive(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive int, got {value!r}.")


def make_index(kind: str, dim: int, params: dict[str, Any], vectors: np.ndarray) -> Any:
    """Build (train and fill) a FAISS index of ``kind`` over ``vectors`` ``(n, dim)`` float32.

    All in memory (the vectors and FAISS's copy); ``GradientIndex.build`` streams instead
    (:func:`empty_index`, :func:`training_rows`, :func:`train_index`, ``index.add`` by block)
    and gets the same index.
    """
    n = int(vectors.shape[0])
    index = empty_index(kind, dim, params, n)
    if kind == "ivf":
        rows = training_rows(n, params)
        index = train_index(index, params, vectors if rows is None else vectors[rows])
    if n:
        index.add(vectors)
    set_search_params(index, kind, params)
    return index


def empty_index(kind: str, dim: int, params: dict[str, Any], n: int) -> Any:
    """An empty FAISS index of ``kind`` for ``n`` vectors (``ivf``: still to be trained)."""
    faiss = import_faiss()
    ip = faiss.METRIC_INNER_PRODUCT
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, int(params["M"]), ip)
        index.hnsw.efConstruction = int(params["efConstruction"])
        index.hnsw.efSearch = int(params["efSearch"])
        return index
    nlist = min(int(params["nlist"]), max(1, n))
    quantizer = faiss.IndexFlatIP(dim)
    if params["pq_m"] is None:
        return faiss.IndexIVFFlat(quantizer, dim, nlist, ip)
    m, bits = int(params["pq_m"]), int(params["pq_bits"])
    if bits == 4:  # FAISS's SIMD "fast scan" layout: the same 4-bit codes, scanned ~10x faster
        return faiss.IndexIVFPQFastScan(quantizer, dim, nlist, m, 4, ip)
    return faiss.IndexIVFPQ(quantizer, dim, nlist, m, bits, ip)


def flat_storage(index: Any, n: int) -> np.ndarray:
    """``(n, D)`` float32: the storage of an empty flat index, sized for ``n`` vectors.

    A writable view: fill it, then set ``index.ntotal = n`` (the index allocated once, not
    grown by ``add``).
    """
    faiss = import_faiss()
    flat = faiss.downcast_index(index)
    if flat.ntotal:
        raise ValueError("flat_storage needs an empty index.")
    nbytes = n * flat.d * 4
    flat.codes.resize(nbytes)
    if not n:
        return np.zeros((0, flat.d), np.float32)
    return faiss.rev_swig_ptr(flat.codes.data(), nbytes).view(np.float32).reshape(n, flat.d)


def training_rows(n: int, params: dict[str, Any]) -> np.ndarray | None:
    """The sorted rows (of ``n``, in id order) an ``ivf`` index trains on; ``None``: all.

    The rule: ``min(n, train_size)`` rows drawn without replacement by
    ``numpy.random.default_rng(seed)``, so the sample depends on ``n``, ``train_size`` and
    ``seed`` only (not on how the vectors were read). The sample is held in memory while
    training: ``train_size * D * 4`` bytes.
    """
    size = min(n, int(params["train_size"]))
    if size >= n:
        return None
    rng = np.random.default_rng(int(params["seed"]))
    return np.sort(rng.choice(n, size, replace=False))


def train_index(index: Any, params: dict[str, Any], sample: np.ndarray) -> Any:
    """Train an empty ``ivf`` index on ``sample``.

    With PQ, the exact re-ranking reads the part's re-rank file (``part_search``).
    """
    index.train(np.ascontiguousarray(sample, dtype=np.float32))
    return index


def set_search_params(index: Any, kind: str, params: dict[str, Any]) -> None:
    """Apply ``nprobe`` / ``efSearch`` / ``rerank`` to a built (or read) index."""
    faiss = import_faiss()
    if kind == "hnsw":
        index.hnsw.efSearch = int(params["efSearch"])
    elif kind == "ivf":
        base = faiss.downcast_index(index)
        if isinstance(base, faiss.IndexRefine):  # format 1: the vectors inside the FAISS file
            base.k_factor = float(params["rerank"])
            base = faiss.downcast_index(base.base_index)
        base.nprobe = int(params["nprobe"])
