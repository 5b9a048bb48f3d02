"""The ``"sparse"`` capture-time projection: a sparse Johnson-Lindenstrauss transform (SJLT).

**Construction.** A layer's per-sample gradient has a matrix form ``M`` ``(K, D)`` (see
:mod:`dattri_llm.gradient.layers.projected`). For ``proj_dim = m`` and ``nnz = s`` the seed draws,
for every copy ``r = 1..s``, independent uniform hashes of the rows ``h_r: [K] -> [m]`` and of the
columns ``c_r: [D] -> [m]`` and independent random signs ``sigma_r: [K] -> ±1`` and
``tau_r: [D] -> ±1``. Entry ``(i, j)`` of ``M`` is sent, in every copy, to bucket
``(h_r(i) + c_r(j)) mod m`` with weight ``sigma_r(i) tau_r(j) / sqrt(s)``::

    y_b = s^(-1/2) sum_r sum_{(i, j): h_r(i) + c_r(j) = b (mod m)} sigma_r(i) tau_r(j) M_ij

so every input coordinate has ``s`` nonzeros (``±1/sqrt(s)``) in the ``(K*D, m)`` matrix, which is
never formed: :func:`sketch_dense` adds the flattened gradient into its buckets with
``index_add_``. One copy is a TensorSketch (Pham & Pagh, KDD 2013) of the matrix form: the hash of
``(i, j)`` is the sum of a row hash and a column hash, so the sketch of one outer product
``g a^T`` is the circular convolution of the count sketches of ``g`` and ``a``. For the layers
whose matrix form is a sum of per-token outer products (linear / convolution ``sum_t g_t a_t^T``,
embeddings ``sum_t e_{idx_t} g_t^T``), :func:`sketch_factors` therefore computes the very same
``y`` from the factors, ``s^(-1/2) sum_r irfft(sum_t rfft(CS_r(g_t)) * rfft(CS_r(a_t)))``, in
``O(s T (K + D + m log m))`` per sample instead of the ``O(T K D)`` of forming ``M`` (the
factorised sketch; FactGraSS, Hu et al. 2025, likewise sketches the factors of linear layers
before combining them). Hashes are drawn on the CPU from a generator seeded with ``seed``
(``torch.randint``: row buckets, row signs, column buckets, column signs, in that order) and
cached as int32 buckets and int8 signs: ``s (K + D)`` entries per layer shape, a few KB, the same
on every device.

**Guarantee.** Signs of different rows (columns) are independent, so every product of two
different coordinates has mean zero and ``E<y(M), y(N)> = <M, N>`` over seeds: inner products
and squared norms are unbiased, as with the Gaussian ``"dense"`` matrix. The variance of one
copy is, up to the terms of the diagonal,
``(1/m) [|M|^2 |N|^2 + <M, N>^2 + |M^T N|^2 + |M N^T|^2 + tr((M^T N)^2) + tr((M N^T)^2)]``:
the first two terms are those of a fully random SJLT or a Gaussian projection of the same size;
the others come from the structure (two entries of one row collide in every row at once when
their columns do) and are at most ``|M|^2 |N|^2`` each, small when the gradients have a high
stable rank and up to 3x the dense variance for rank-one gradients. Summing ``s`` independent
copies into the same ``m`` buckets keeps the first two terms and divides the structural ones by
``s`` (cross-copy collisions are independent) at ``s`` times the hashing cost: ``nnz`` trades
capture time for variance. The default ``nnz=1`` is the cheapest (GraSS uses one nonzero too).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dattri_llm.gradient.gradient import Factorized, LayerGradient
from dattri_llm.gradient.layers import LayerRule
from dattri_llm.gradient.layers.projected import factor_sides

__all__ = [
    "DEFAULT_NNZ",
    "sparse_hashes",
    "sketch_dense",
    "sketch_factors",
    "sketch_item_factors",
    "sketch_item",
    "check_nnz",
    "factorized_sketch_cheaper",
    "clear_sparse_cache",
    "sparse_cache_info",
]

#: Nonzeros per input coordinate of the ``"sparse"`` projection unless ``nnz=`` says otherwise.
DEFAULT_NNZ = 1
#: Elements of one chunk of the flattened gradient hashed at once by :func:`sketch_dense`.
_CHUNK = 1 << 22

_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}
_STATS = {"generated": 0}


def check_nnz(nnz: Any, proj_dim: int) -> int:
    """Validate ``ProjectionConfig("sparse", nnz=)`` (``None``: :data:`DEFAULT_NNZ`)."""
    nnz = DEFAULT_NNZ if nnz is None else nnz
    if not isinstance(nnz, int) or isinstance(nnz, bool) or not 1 <= nnz <= proj_dim:
        raise ValueError(
            f"ProjectionConfig(nnz=) must be an int in [1, proj_dim={proj_dim}] (nonzeros per "
            f"input coordinate; {DEFAULT_NNZ} is the default and the cheapest), got {nnz!r}"
        )
    return int(nnz)


def sparse_hashes(
    k: int,
    d: int,
    proj_dim: int,
    seed: int = 0,
    nnz: int = DEFAULT_NNZ,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The hashes of a ``(k, d)`` matrix form for ``(proj_dim, seed, nnz)`` (cached).

    Returns:
        ``{"row": (nnz, k), "col": (nnz, d)}`` buckets (int64 on ``device``) and
        ``{"row_sign", "col_sign"}`` signs ``±1`` in ``dtype``. The CPU master copy is kept as
        int32 buckets and int8 signs.
    """
    device = torch.device(device)
    base_key = ("sparse", int(k), int(d), int(proj_dim), int(seed), int(nnz))
    base = _CACHE.get(base_key)
    if base is None:
        gen = torch.Generator().manual_seed(int(seed))
        m = int(proj_dim)
        row = torch.randint(0, m, (nnz, k), generator=gen, dtype=torch.int32)
        row_sign = torch.randint(0, 2, (nnz, k), generator=gen, dtype=torch.int8).mul_(2).sub_(1)
        col = torch.randint(0, m, (nnz, d), generator=gen, dtype=torch.int32)
        col_sign = torch.randint(0, 2, (nnz, d), generator=gen, dtype=torch.int8).mul_(2).sub_(1)
        base = {"row": row, "row_sign": row_sign, "col": col, "col_sign": col_sign}
        _CACHE[base_key] = base
        _STATS["generated"] += 1
    key = (*base_key, dtype, device)
    out = _CACHE.get(key)
    if out is None:
        out = {
            "row": base["row"].to(device=device, dtype=torch.long),
            "col": base["col"].to(device=device, dtype=torch.long),
            "row_sign": base["row_sign"].to(device=device, dtype=dtype),
            "col_sign": base["col_sign"].to(device=device, dtype=dtype),
        }
        _CACHE[key] = out
    return out


def clear_sparse_cache() -> None:
    """Drop every cached hash (they are regenerated identically on demand)."""
    _CACHE.clear()


def sparse_cache_info() -> dict[str, int]:
    """``{"entries", "generated", "bytes"}`` of the cached hashes."""
    nbytes = sum(t.numel() * t.element_size() for v in _CACHE.values() for t in v.values())
    return {"entries": len(_CACHE), "generated": _STATS["generated"], "bytes": nbytes}


def _check_hashes(h: dict[str, torch.Tensor], k: int, d: int, where: str) -> None:
    if h["row"].shape[1] != k or h["col"].shape[1] != d:
        raise ValueError(
            f"{where}: the hashes are for a ({h['row'].shape[1]}x{h['col'].shape[1]}) matrix "
            f"form, got a ({k}x{d}) one; build them with sparse_hashes(k={k}, d={d}, ...)."
        )


def sketch_dense(
    flat: torch.Tensor, shape: tuple[int, int], proj_dim: int, hashes: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The sparse projection ``(B, proj_dim)`` of flattened matrix forms ``flat`` ``(B, K*D)``.

    Row chunks of the matrix form are scattered into their buckets (``index_add_``); the
    ``(K*D, proj_dim)`` matrix is never formed.
    """
    k, d = (int(v) for v in shape)
    b = flat.shape[0]
    if flat.shape[1] != k * d:
        raise ValueError(
            f"sketch_dense: expected a ({k}x{d}) = {k * d}-entry gradient, got {flat.shape[1]}."
        )
    _check_hashes(hashes, k, d, "sketch_dense")
    x = flat.reshape(b, k, d)
    out = flat.new_zeros(b, proj_dim)
    rows = max(1, _CHUNK // max(1, b * d))
    for r in range(hashes["row"].shape[0]):
        hr, hc = hashes["row"][r], hashes["col"][r]
        sr, sc = hashes["row_sign"][r].to(flat.dtype), hashes["col_sign"][r].to(flat.dtype)
        for i in range(0, k, rows):
            sl = slice(i, i + rows)
            idx = torch.remainder(hr[sl, None] + hc[None, :], proj_dim)
            part = x[:, sl] * (sr[sl, None] * sc[None, :])
            out.index_add_(1, idx.reshape(-1), part.reshape(b, -1))
    return out.mul_(1.0 / math.sqrt(hashes["row"].shape[0]))


def _count_sketch(
    x: torch.Tensor, bucket: torch.Tensor, sign: torch.Tensor, m: int
) -> torch.Tensor:
    """``(B, T, m)``: the count sketch of the last axis of ``x`` ``(B, T, n)``."""
    b, t, n = x.shape
    out = x.new_zeros(b * t, m)
    out.scatter_add_(1, bucket.expand(b * t, n), (x * sign).reshape(b * t, n))
    return out.reshape(b, t, m)


def _one_hot_sketch(
    idx: torch.Tensor, bucket: torch.Tensor, sign: torch.Tensor, m: int
) -> torch.Tensor:
    """``(B, T, m)``: the count sketch of one-hot rows ``e_{idx}`` (embedding indices)."""
    idx = idx.long()
    out = sign.new_zeros(*idx.shape, m)
    return out.scatter_(-1, bucket[idx].unsqueeze(-1), sign[idx].unsqueeze(-1))


def sketch_factors(
    rows: torch.Tensor, cols: torch.Tensor, proj_dim: int, hashes: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The sparse projection ``(B, proj_dim)`` of ``M = sum_t rows_t cols_t^T`` from its factors.

    Args:
        rows: The row side ``(B, T, K)``, or integer indices ``(B, T)`` of one-hot rows
            (embeddings: ``M = sum_t e_{idx_t} g_t^T``).
        cols: The column side ``(B, T, D)``.
        proj_dim: The number of buckets.
        hashes: :func:`sparse_hashes` of the ``(K, D)`` matrix form.

    Equals :func:`sketch_dense` of the materialised ``M`` (exactly in exact arithmetic; the
    FFT adds round-off of the order of the dtype's epsilon). Half-precision factors are sketched
    in float32 (the CPU FFT has no half kernels) and the result cast back.
    """
    dtype = cols.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    cols = cols.to(work)
    one_hot = not rows.is_floating_point()
    if not one_hot:
        rows = rows.to(work)
    copies = hashes["row"].shape[0]
    spec = None
    for r in range(copies):
        rs, cs = hashes["row_sign"][r].to(work), hashes["col_sign"][r].to(work)
        if one_hot:
            left = _one_hot_sketch(rows, hashes["row"][r], rs, proj_dim)
        else:
            left = _count_sketch(rows, hashes["row"][r], rs, proj_dim)
        right = _count_sketch(cols, hashes["col"][r], cs, proj_dim)
        term = (torch.fft.rfft(left, dim=-1) * torch.fft.rfft(right, dim=-1)).sum(1)
        spec = term if spec is None else spec + term
    out = torch.fft.irfft(spec, n=proj_dim, dim=-1)
    return out.mul_(1.0 / math.sqrt(copies)).to(dtype)


def factorized_sketch_cheaper(
    tokens: int, shape: tuple[int, int], proj_dim: int, nnz: int = DEFAULT_NNZ
) -> bool:
    """Whether sketching the factors costs less than forming and hashing ``M`` (per sample).

    Factors: ``nnz * T * (K + D + 3 m log2 m)`` (two count sketches, two FFTs and a product per
    token and copy); dense: ``T * K * D`` to form ``M`` plus ``nnz * K * D`` to hash it.
    """
    k, d = shape
    fft = 3 * proj_dim * max(1.0, math.log2(max(2, proj_dim)))
    factors = nnz * tokens * (k + d + fft)
    return factors < tokens * k * d + nnz * k * d


def sketch_item_factors(
    rule: LayerRule,
    a: torch.Tensor,
    g: torch.Tensor,
    shape: tuple[int, int],
    proj_dim: int,
    hashes: dict[str, torch.Tensor],
) -> torch.Tensor | None:
    """The factorised sketch of a captured layer, or ``None`` when it must be materialised.

    ``None`` for rules whose matrix form is not a sum of per-token outer products, and where the
    cost model (:func:`factorized_sketch_cheaper`) prefers forming ``M``.
    """
    sides = factor_sides(rule, a, g)
    if sides is None:
        return None
    rows, cols = sides
    nnz = hashes["row"].shape[0]
    if not factorized_sketch_cheaper(cols.shape[1], shape, proj_dim, nnz):
        return None
    _check_hashes(hashes, *shape, "sketch_factors")
    return sketch_factors(rows, cols, proj_dim, hashes)


def sketch_item(
    item: LayerGradient,
    shape: tuple[int, int],
    proj_dim: int,
    hashes_for: Callable[[torch.dtype, torch.device], dict[str, torch.Tensor]],
) -> torch.Tensor:
    """The sparse projection ``(B, proj_dim)`` of one captured layer.

    From the factors where :func:`sketch_item_factors` can and it is cheaper, else of the
    materialised gradient (:func:`sketch_dense`). ``hashes_for(dtype, device)`` gives the
    layer's hashes.
    """
    if isinstance(item, Factorized):
        h = hashes_for(item.g.dtype, item.g.device)
        out = sketch_item_factors(item.rule, item.a, item.g, shape, proj_dim, h)
        if out is not None:
            return out
    dense = item.materialize().data
    return sketch_dense(dense, shape, proj_dim, hashes_for(dense.dtype, dense.device))
