"""Method names of the headline quality table (:mod:`experiments.benchmark.headline`).

Each quality benchmark names its rows its own way (``EK-FAC (damping=default)`` in the LDS
harness, ``EK-FAC`` in fact tracing; ``DVEmb (assumes SGD)`` on an AdamW run, ``DVEmb
(empirical Fisher)`` on an SGD one): :data:`METHODS` gives each method one headline name and
lists the row names that stand for it in each benchmark (``"quality"``: ``quality/run.py``,
full and quick files; ``"removal"``: ``quality/removal.py``; ``"tracing"``: ``tracing/run.py``).
A peer's rows share our names, so they are keyed ``"<source>: <name>"`` (:func:`raw_key`).
"""

from __future__ import annotations

__all__ = ["GROUND_TRUTH", "METHODS", "PEERS", "canonical_name", "pick", "raw_key"]

GROUND_TRUTH = "ground truth"
PEERS = ("dattri 0.3.0", "kronfluence")

#: One name per method, and the row names each benchmark gives it (``quality`` also covers the
#: quick file; a peer's row is ``"<source>: <name>"``). The first listed name present wins.
METHODS: list[tuple[str, dict[str, tuple[str, ...]]]] = [
    (GROUND_TRUTH, {"tracing": ("carriers (ground truth)",)}),
    (
        "ground truth padded to the same size (carriers + random)",
        {"tracing": ("carriers + random (same size)",)},
    ),
    ("Random", {"quality": ("Random",), "removal": ("Random",), "tracing": ("random",)}),
    ("TF-IDF (scikit-learn, lexical)", {"tracing": ("TF-IDF (scikit-learn)",)}),
    ("BM25 (rank-bm25, lexical)", {"tracing": ("BM25 (rank-bm25)",)}),
    ("Grad-Dot", {"quality": ("Grad-Dot",), "removal": ("Grad-Dot",), "tracing": ("Grad-Dot",)}),
    ("Grad-Cos", {"quality": ("Grad-Cos",), "removal": ("Grad-Cos",), "tracing": ("Grad-Cos",)}),
    ("Grad-Dot, dense-256 projection", {"quality": ("Grad-Dot proj dense-256",)}),
    ("Grad-Dot, logra-256 projection", {"quality": ("Grad-Dot proj logra-256",)}),
    ("Grad-Dot, mask-256 projection", {"quality": ("Grad-Dot proj mask-256",)}),
    ("Grad-Cos, sparse-1024 projection", {"tracing": ("Grad-Cos sparse-1024",)}),
    ("Grad-Cos, logra-256 projection", {"tracing": ("Grad-Cos logra-256",)}),
    (
        "Grad-Dot mask-2048 (the second-moment rows' coordinates)",
        {"quality": ("Grad-Dot mask-2048",)},
    ),
    ("Grad-Cos mask-2048", {"removal": ("Grad-Cos mask-2048",)}),
    ("Grad-Dot mask-2048 + second moment", {"quality": ("Grad-Dot mask-2048 + second moment",)}),
    (
        "Grad-Cos mask-2048 + second moment (TrackStar, R = I)",
        {
            "quality": ("Grad-Cos mask-2048 + second moment (TrackStar, R = I)",),
            "removal": ("Grad-Cos mask-2048 + second moment (TrackStar, R = I)",),
        },
    ),
    (
        "ProjectedFisher mask-2048, unit-normalized",
        {"removal": ("ProjectedFisher mask-2048 unit-normalized",)},
    ),
    (
        "ProjectedFisher mask-2048 unit + second moment (TrackStar with its R)",
        {"removal": ("ProjectedFisher mask-2048 unit + second moment (TrackStar with R)",)},
    ),
    (
        "TracIn (checkpoints, w = lr)",
        {"quality": ("TracIn (4 ckpts, w=lr)",), "removal": ("TracIn (4 ckpts, w=lr)",)},
    ),
    ("TracIn-Cos (checkpoints)", {"tracing": ("TracIn-Cos (3 ckpts)",)}),
    (
        "TracIn-Cos + second moment (checkpoints; TrackStar, R = I)",
        {"tracing": ("TracIn-Cos + second moment (3 ckpts)",)},
    ),
    (
        "ProjectedFisher unit + second moment, mask-1024 (checkpoints; TrackStar with its R)",
        {"tracing": ("TrackStar: ProjectedFisher unit + second moment, mask-1024 (3 ckpts)",)},
    ),
    (
        "EK-FAC unit + diagonal + second moment (checkpoints)",
        {"tracing": ("EK-FAC unit, diagonal + second moment (3 ckpts)",)},
    ),
    (
        "K-FAC (default damping)",
        {"quality": ("K-FAC (damping=default)",), "removal": ("K-FAC (damping=default)",)},
    ),
    (
        "EK-FAC (default damping)",
        {
            "quality": ("EK-FAC (damping=default)",),
            "removal": ("EK-FAC (damping=default)",),
            "tracing": ("EK-FAC",),
        },
    ),
    (
        "EK-FAC, unit-normalized",
        {
            "quality": ("EK-FAC unit-normalized (normalized_grad=True) (damping=default)",),
            "tracing": ("EK-FAC unit",),
        },
    ),
    ("EK-FAC + diagonal embeddings / norms", {"quality": ("EK-FAC + diagonal (damping=default)",)}),
    (
        "EK-FAC unit-normalized + diagonal embeddings / norms",
        {"tracing": ("EK-FAC unit, diagonal non-Kronecker",)},
    ),
    (
        "EK-FAC unit-normalized + diagonal embeddings / norms, summed over checkpoints",
        {"tracing": ("EK-FAC unit, diagonal non-Kronecker (3 ckpts)",)},
    ),
    (
        "EK-FAC fit on train + queries (mix=0.5)",
        {"quality": ("EK-FAC fit on train + queries (mix=0.5) (damping=default)",)},
    ),
    ("EK-FAC unit-normalized, mix=0.5", {"tracing": ("EK-FAC unit mix=0.5",)}),
    (
        "LESS (checkpoints, frozen form)",
        {
            "quality": ("LESS (4 ckpts, frozen form)",),
            "removal": ("LESS (4 ckpts, frozen form)",),
            "tracing": ("LESS (3 ckpts, frozen form)",),
        },
    ),
    (
        "DVEmb (empirical Fisher)",
        {
            "quality": ("DVEmb (empirical Fisher)", "DVEmb (assumes SGD)"),
            "removal": ("DVEmb (empirical Fisher)", "DVEmb (assumes SGD)"),
            "tracing": ("DVEmb (assumes SGD; warns on this AdamW run)",),
        },
    ),
    ("DVEmb (Monte-Carlo Fisher)", {"quality": ("DVEmb (MC Fisher)",)}),
    (
        "AdamW-influence (empirical Fisher)",
        {
            "quality": ("AdamW-influence (every step, all coordinates)", "AdamW-influence"),
            "removal": ("AdamW-influence (every step, all coordinates)", "AdamW-influence"),
            "tracing": ("AdamW-influence (every step)",),
        },
    ),
    ("AdamW-influence, mask-2048", {"quality": ("AdamW-influence mask-2048",)}),
    ("AdamW-influence, mask-256", {"quality": ("AdamW-influence mask-256",)}),
    (
        "AdamW-influence, mask-256, unit-normalized",
        {"quality": ("AdamW-influence mask-256 unit-normalized (normalized_grad=True)",)},
    ),
    (
        "AdamW-influence, `ExactHessian`",
        {
            "quality": ("AdamW-influence, exact Hessian (every step, all coordinates)",),
            "removal": ("AdamW-influence, exact Hessian (every step, all coordinates)",),
            "tracing": ("AdamW-influence, exact Hessian (every step)",),
        },
    ),
    (
        'AdamW-influence (empirical Fisher), `push="exact"`',
        {
            "removal": ("AdamW-influence + exact push (every step, all coordinates)",),
            "tracing": ("AdamW-influence + exact push (every step)",),
        },
    ),
    (
        'AdamW-influence, `ExactHessian`, `push="exact"`',
        {
            "removal": (
                "AdamW-influence, exact Hessian + exact push (every step, all coordinates)",
            ),
            "tracing": ("AdamW-influence, exact Hessian + exact push (every step)",),
        },
    ),
    (
        'AdamW-influence (empirical Fisher), `push="exact", exact_steps=2`',
        {"removal": ("AdamW-influence + exact push, exact_steps=2 (every step, all coordinates)",)},
    ),
    *[
        (
            f'AdamW-influence, `ExactHessian`, `push="exact", exact_steps={k}`',
            {
                "removal": (
                    f"AdamW-influence, exact Hessian + exact push, exact_steps={k} "
                    "(every step, all coordinates)",
                )
            },
        )
        for k in (2, 4, 16)
    ],
    (
        "reference: exact IF (explicit Hessian, float64)",
        {"quality": ("Exact IF (explicit Hessian)",), "removal": ("Exact IF (explicit Hessian)",)},
    ),
    (
        "reference: exact unrolled influence (per-step Hessians, float64)",
        {
            "quality": ("Exact unrolled influence (explicit per-step Hessians)",),
            "removal": ("Exact unrolled influence (explicit per-step Hessians)",),
        },
    ),
    (
        "peer: dattri 0.3.0 TRAK, 5 half-data models",
        {"quality": ("dattri 0.3.0: TRAK-5 (half-data models)",)},
    ),
    (
        "peer: kronfluence EK-FAC (its heuristic damping)",
        {"quality": ("kronfluence: EK-FAC (damping=heuristic 0.1 x mean eig)",)},
    ),
]


def raw_key(method: str, source: str | None = None) -> str:
    """A benchmark row's lookup key: its name, prefixed by ``"<source>: "`` for a peer."""
    return f"{source}: {method}" if source in PEERS else method


def canonical_name(bench: str, method: str, source: str | None = None) -> str | None:
    """The headline name of a benchmark's row (``None``: not a headline row).

    Args:
        bench: ``"quality"``, ``"removal"`` or ``"tracing"``.
        method: The row's name in that benchmark's JSON.
        source: The row's ``source`` (a peer's rows share names with ours).
    """
    key = raw_key(method, source)
    for name, raw in METHODS:
        if key in raw.get(bench, ()):
            return name
    return None


def pick(bench: str, rows: list[dict]) -> dict[str, dict]:
    """Headline name -> the benchmark row standing for it (the first listed name present)."""
    by_key = {raw_key(r["method"], r.get("source")): r for r in rows}
    out = {}
    for name, raw in METHODS:
        for key in raw.get(bench, ()):
            if key in by_key:
                out[name] = by_key[key]
                break
    return out
