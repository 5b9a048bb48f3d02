"""The K-FAC covariances: the running sums ``A``, ``G`` (and diagonal Fishers) of a fit.

What is accumulated (which layers, which tokens, which scale) is defined in the conventions of
:mod:`dattri_llm.gradient.kronecker`. Here: which layers K-FAC reads and the shapes of their fit
(:func:`is_kronecker_layer`, :func:`fit_shapes`), the accumulator
(:class:`KroneckerCovariances`: per-sample gradients or raw factors in, all-reduced over ranks
once), and the files of the Kronecker family. Every Kronecker object is written as one bundle,
two files in a directory: ``<stem>.safetensors`` (tensors keyed ``"<layer>|<name>"``) and
``<stem>.json`` (``format``, ``version`` and the object's metadata); reading checks the format
name, the version and each tensor's presence and shape. :mod:`.factors` writes its fits with
the same functions.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, LayerGradient, Materialized, Shared
from dattri_llm.gradient.layers import get_rule
from dattri_llm.utils.distributed import all_reduce_sum, get_rank, get_world_size
from dattri_llm.utils.files import atomic_write

__all__ = [
    "FORMAT_VERSION",
    "NonKronecker",
    "TokenCount",
    "LayerCovariance",
    "DiagonalFisher",
    "KroneckerCovariances",
    "is_kronecker_layer",
    "fit_shapes",
]

#: Version of the on-disk format of covariances and factors.
FORMAT_VERSION = 1

NonKronecker = Literal["skip", "diagonal"]
TokenCount = Literal["gradient", "all"]


# ---- what K-FAC reads of a layer ---------------------------------------------------------------
def layer_sites(lg: LayerGradient) -> list[Factorized | Materialized]:
    """The sites of a layer: a tied group's (:class:`Shared`), else the layer itself."""
    return list(lg.sites) if isinstance(lg, Shared) else [lg]


def is_kronecker_layer(lg: LayerGradient) -> bool:
    """Whether K-FAC applies: every site has a ``kronecker`` rule and one matrix shape."""
    try:
        rules = [(get_rule(s.layer_type), s.module_kwargs) for s in layer_sites(lg)]
    except ValueError:  # e.g. "param_grad", which has no rule
        return False
    if not all(r.kronecker for r, _ in rules):
        return False
    return len({tuple(r.matrix_shape(kw)) for r, kw in rules}) == 1


def check_fit_options(non_kronecker: object, tokens: object) -> None:
    """Refuse a ``non_kronecker`` or ``tokens`` option that is not one of its values."""
    if non_kronecker not in ("skip", "diagonal"):
        raise ValueError(f"non_kronecker must be 'skip' or 'diagonal', got {non_kronecker!r}.")
    if tokens not in ("gradient", "all"):
        raise ValueError(f"tokens must be 'gradient' or 'all', got {tokens!r}.")


def fit_shapes(layer_type: str, kw: dict) -> tuple[tuple[int, ...], int, int]:
    """``(leading block axis, K, D)`` of one layer's fit: ``((), K, D)`` or ``((E,), K/E, D)``."""
    rule = get_rule(layer_type)
    k, d = rule.matrix_shape(kw)
    blocks = rule.kronecker_blocks(kw)
    return ((blocks,) if blocks > 1 else ()), k // blocks, d


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """GEMM dtype: the input's, raised to at least float32 (never lowered)."""
    return torch.promote_types(t.dtype, torch.float32)


def _token_mask(g: torch.Tensor, a: torch.Tensor, tokens: TokenCount) -> torch.Tensor:
    if tokens == "all":
        return torch.ones(g.shape[:2], dtype=torch.bool, device=g.device)
    return (g != 0).any(-1) & (a != 0).any(-1)  # g a^T = 0 when either factor is


def _kronecker_pairs(name: str, lg: LayerGradient) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``(a, g)`` pairs K-FAC accumulates; a vector layer (``exact_fisher``) is ``(v, 1)``."""
    if get_rule(lg.layer_type).exact_fisher:
        v = lg.materialize().data
        return [(v.unsqueeze(1), v.new_ones(v.shape[0], 1, 1))]
    if any(isinstance(s, Materialized) for s in layer_sites(lg)):
        raise ValueError(
            f"layer {name!r} ({lg.layer_type}) is materialized, so its K-FAC factors are gone, "
            "and no covariances recorded at capture cover this record. Capture with "
            "capture_style='factorized' into a store written by OffloadCallback (its compact "
            "store records the covariances; OffloadCallback(keep_token_factors=True) keeps the "
            "factors), or accumulate the covariances during capture with "
            "KroneckerCovarianceCallback and pass them as fit(covariances=...); or use "
            "ProjectedFisherAttributor (each layer's exact Fisher, from any store form)."
        )
    return [(s.a, s.g) for s in layer_sites(lg)]


# ---- the fit's inputs: gradient items, progress, ranks -----------------------------------------
def as_gradient(item: object) -> Gradient:
    """The :class:`Gradient` of a fit's item (a Gradient, GradientRecord or GradientBlock)."""
    if isinstance(item, Gradient):
        return item
    grad = getattr(item, "gradient", None)
    if isinstance(grad, Gradient):
        return grad
    raise TypeError(f"expected a Gradient, GradientRecord or GradientBlock, got {type(item)}")


def fit_progress(items: Iterable, desc: str, enabled: bool | None) -> Iterable:
    """``items`` behind a progress bar on rank 0 (``None``: only on a terminal), bare elsewhere."""
    from dattri_llm.utils.progress import progress

    return items if get_rank() != 0 else progress(items, enabled, desc=desc)


def check_same_layers(names: list[str], device: torch.device | None = None) -> None:
    """Fail loudly when ranks accumulated different layer sets (all-reduce would misalign)."""
    code = float(zlib.crc32("\n".join(names).encode()))
    t = all_reduce_sum(torch.tensor([code, code * code], dtype=torch.float64, device=device))
    w = get_world_size()
    if t[0] != code * w or t[1] != code * code * w:
        raise RuntimeError(
            "ranks accumulated different layer sets; every rank must capture the "
            "same layers before the Kronecker all-reduce."
        )


def sum_counts(device: torch.device, *counts: float) -> list[float]:
    """``counts`` summed over ranks (float64, so large counts stay exact)."""
    return all_reduce_sum(torch.tensor(counts, dtype=torch.float64, device=device)).tolist()


# ---- the accumulator ---------------------------------------------------------------------------
@dataclass
class LayerCovariance:
    """Running sums of one layer (see the package docstring for the conventions).

    Attributes:
        layer_type: The layer's rule name.
        module_kwargs: Its hyper-parameters.
        a_sum: ``sum_{n,t} a a^T`` over counted tokens, ``(D, D)``.
        g_sum: ``sum_{n,t} g g^T``, ``(K, K)``.
        num_tokens: Counted token positions ``N_tok``.
        num_samples: Samples ``N``.
        block_tokens: Counted slots per block ``(E,)`` of a blocked layer (fused experts;
            ``a_sum`` / ``g_sum`` then have a leading ``E`` axis), else ``None``.
    """

    layer_type: str
    module_kwargs: dict
    a_sum: torch.Tensor
    g_sum: torch.Tensor
    num_tokens: float = 0.0
    num_samples: float = 0.0
    block_tokens: torch.Tensor | None = None

    def a_mean(self) -> torch.Tensor:
        """``A``: ``a_sum`` over the counted tokens (per block; an empty block stays zero)."""
        if self.block_tokens is None:
            return self.a_sum / self.num_tokens
        return self.a_sum / self.block_tokens.clamp_min(1.0).to(self.a_sum)[:, None, None]


@dataclass
class DiagonalFisher:
    """Exact diagonal empirical Fisher of a non-Kronecker layer: ``sum_n m_n^2`` and ``N``."""

    layer_type: str
    module_kwargs: dict
    sq_sum: torch.Tensor
    num_samples: float = 0.0


class KroneckerCovariances:
    """Accumulates K-FAC covariances (and diagonal Fishers) from per-sample gradients.

    Feed it :class:`Gradient` blocks with :meth:`update` (or raw factors with
    :meth:`update_factors`); :meth:`all_reduce` sums the accumulators over ranks (done once,
    automatically, by :func:`eigendecompose`).

    Args:
        non_kronecker: ``"skip"`` or ``"diagonal"`` for layers K-FAC does not apply to.
        tokens: ``"gradient"`` (count positions whose output gradient is non-zero) or ``"all"``.
        dtype: Accumulator dtype (float64 by default; sums of float32 GEMMs).
    """

    def __init__(
        self,
        non_kronecker: NonKronecker = "skip",
        tokens: TokenCount = "gradient",
        dtype: torch.dtype = torch.float64,
    ) -> None:
        check_fit_options(non_kronecker, tokens)
        self.non_kronecker = non_kronecker
        self.tokens = tokens
        self.dtype = dtype
        self.layers: dict[str, LayerCovariance] = {}
        self.diagonal: dict[str, DiagonalFisher] = {}
        self.skipped: dict[str, str] = {}
        self.reduced = False

    # ---- accumulation ----------------------------------------------------------------------
    def update(self, gradient: Gradient) -> None:
        """Add one block of per-sample gradients.

        Raises:
            ValueError: when an eligible layer was captured materialised (its factors are gone).
        """
        b = gradient.batch_size
        for name, lg in gradient.layers.items():
            if is_kronecker_layer(lg):
                pairs = _kronecker_pairs(name, lg)
                every = "all" if get_rule(lg.layer_type).exact_fisher else None  # F: 1/N
                self.update_factors(name, pairs, lg.layer_type, lg.module_kwargs, b, every)
            elif self.non_kronecker == "diagonal":
                self._update_diagonal(name, lg, b)
            else:
                self.skipped[name] = lg.layer_type

    def update_factors(
        self,
        name: str,
        factors: list[tuple[torch.Tensor, torch.Tensor]],
        layer_type: str,
        module_kwargs: dict,
        num_samples: int,
        tokens: TokenCount | None = None,
    ) -> None:
        """Add the ``(a, g)`` factors of one layer (several pairs: calls / tied sites).

        ``tokens`` overrides the accumulator's token counting for these factors.
        """
        lead, k, d = fit_shapes(layer_type, module_kwargs)
        cov = self.layers.get(name)
        if cov is None:
            dev = factors[0][1].device
            cov = LayerCovariance(
                layer_type,
                dict(module_kwargs),
                torch.zeros(*lead, d, d, dtype=self.dtype, device=dev),
                torch.zeros(*lead, k, k, dtype=self.dtype, device=dev),
                block_tokens=torch.zeros(*lead, dtype=torch.float64, device=dev) if lead else None,
            )
            self.layers[name] = cov
        for a, g in factors:
            if cov.block_tokens is not None:  # per-block sums: the rule knows the slot layout
                sa, sg, cnt = get_rule(layer_type).kronecker_sums(
                    a, g, module_kwargs, tokens or self.tokens
                )
                cov.a_sum += sa.to(self.dtype)
                cov.g_sum += sg.to(self.dtype)
                cov.block_tokens += cnt.to(cov.block_tokens)
                cov.num_tokens += float(cnt.sum())
                continue
            ct = acc_dtype(g)
            mask = _token_mask(g, a, tokens or self.tokens)
            af = a.to(ct).reshape(-1, a.shape[-1])
            gf = g.to(ct).reshape(-1, g.shape[-1])
            if not bool(mask.all()):
                af, gf = af[mask.reshape(-1)], gf[mask.reshape(-1)]
            cov.a_sum += (af.T @ af).to(self.dtype)
            cov.g_sum += (gf.T @ gf).to(self.dtype)
            cov.num_tokens += float(mask.sum())
        cov.num_samples += float(num_samples)

    def _update_diagonal(self, name: str, lg: LayerGradient, b: int) -> None:
        dense = lg.materialize().data
        diag = self.diagonal.get(name)
        if diag is None:
            diag = DiagonalFisher(
                lg.layer_type,
                dict(lg.module_kwargs),
                torch.zeros(dense.shape[1], dtype=self.dtype, device=dense.device),
            )
            self.diagonal[name] = diag
        diag.sq_sum += dense.to(acc_dtype(dense)).pow(2).sum(0).to(self.dtype)
        diag.num_samples += float(b)

    def accumulate(
        self, gradients: Iterable, progress: bool | None = False
    ) -> KroneckerCovariances:
        """:meth:`update` with every item of ``gradients`` (Gradients or GradientBlocks)."""
        for item in fit_progress(gradients, "K-FAC covariances", progress):
            self.update(as_gradient(item))
        return self

    # ---- distributed -----------------------------------------------------------------------
    def all_reduce(self) -> KroneckerCovariances:
        """Sum every accumulator over ranks (no-op without a process group, or if done)."""
        if self.reduced or get_world_size() == 1:
            self.reduced = True
            return self
        check_same_layers(sorted(self.layers) + ["|"] + sorted(self.diagonal), self._device())
        for name in sorted(self.layers):
            cov = self.layers[name]
            all_reduce_sum(cov.a_sum)
            all_reduce_sum(cov.g_sum)
            if cov.block_tokens is not None:
                all_reduce_sum(cov.block_tokens)
            cov.num_tokens, cov.num_samples = sum_counts(
                cov.a_sum.device, cov.num_tokens, cov.num_samples
            )
        for name in sorted(self.diagonal):
            diag = self.diagonal[name]
            all_reduce_sum(diag.sq_sum)
            (diag.num_samples,) = sum_counts(diag.sq_sum.device, diag.num_samples)
        self.reduced = True
        return self

    def _device(self) -> torch.device | None:
        for c in self.layers.values():
            return c.a_sum.device
        for dg in self.diagonal.values():
            return dg.sq_sum.device
        return None

    # ---- merging ---------------------------------------------------------------------------
    def merge(self, other: KroneckerCovariances) -> KroneckerCovariances:
        """Add ``other``'s sums and counts to this accumulator (in place; returns ``self``).

        Sums over disjoint sets of samples add up exactly to the sums over their union: this is
        how statistics recorded by several writers (ranks, capture contexts) combine.

        Raises:
            ValueError: the two hold the same layer with different types or shapes, or were
                accumulated with different token counting.
        """
        if other.tokens != self.tokens:
            raise ValueError(
                f"cannot merge covariances counted over tokens={other.tokens!r} into ones "
                f"counted over tokens={self.tokens!r}."
            )
        for name, c in other.layers.items():
            mine = self.layers.get(name)
            if mine is None:
                self.layers[name] = LayerCovariance(
                    c.layer_type,
                    dict(c.module_kwargs),
                    c.a_sum.to(self.dtype).clone(),
                    c.g_sum.to(self.dtype).clone(),
                    c.num_tokens,
                    c.num_samples,
                    None if c.block_tokens is None else c.block_tokens.clone(),
                )
                continue
            _check_same_layer(name, mine, c)
            mine.a_sum += c.a_sum.to(mine.a_sum)
            mine.g_sum += c.g_sum.to(mine.g_sum)
            if mine.block_tokens is not None:
                mine.block_tokens += c.block_tokens.to(mine.block_tokens)
            mine.num_tokens += c.num_tokens
            mine.num_samples += c.num_samples
        for name, d in other.diagonal.items():
            mine_d = self.diagonal.get(name)
            if mine_d is None:
                self.diagonal[name] = DiagonalFisher(
                    d.layer_type,
                    dict(d.module_kwargs),
                    d.sq_sum.to(self.dtype).clone(),
                    d.num_samples,
                )
                continue
            _check_same_layer(name, mine_d, d)
            mine_d.sq_sum += d.sq_sum.to(mine_d.sq_sum)
            mine_d.num_samples += d.num_samples
        self.skipped.update(other.skipped)
        return self

    # ---- files -----------------------------------------------------------------------------
    def to_bundle(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, metadata)`` as :meth:`save` writes them (tensors ``"<layer>|<field>"``)."""
        tensors: dict[str, torch.Tensor] = {}
        meta = {
            "non_kronecker": self.non_kronecker,
            "tokens": self.tokens,
            "reduced": self.reduced,
            "layers": put_layers(self.layers, tensors),
            "diagonal": put_layers(self.diagonal, tensors),
            "skipped": self.skipped,
        }
        return tensors, meta

    @classmethod
    def from_bundle(
        cls, tensors: dict[str, torch.Tensor], meta: dict, path: object
    ) -> KroneckerCovariances:
        """Rebuild what :meth:`to_bundle` gave, checking every tensor's presence and shape.

        ``path`` names the files in errors.
        """
        out = cls(meta["non_kronecker"], meta["tokens"])
        out.reduced, out.skipped = bool(meta["reduced"]), dict(meta["skipped"])
        for name, m in meta["layers"].items():
            lead, k, d = fit_shapes(m["layer_type"], m["module_kwargs"])
            shapes = {"a_sum": (d, d), "g_sum": (k, k), "block_tokens": () if lead else None}
            out.layers[name] = LayerCovariance(
                m["layer_type"],
                m["module_kwargs"],
                num_tokens=float(m["num_tokens"]),
                num_samples=float(m["num_samples"]),
                **read_layer(tensors, path, name, lead, shapes),
            )
        out.diagonal.update(get_diagonal(tensors, meta, path))
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Write ``kronecker_covariances.{safetensors,json}`` into the directory ``path``."""
        write_bundle(path, "kronecker_covariances", *self.to_bundle())

    @classmethod
    def load(cls, path: str | os.PathLike) -> KroneckerCovariances:
        """Read what :meth:`save` wrote, checking the format, version and shapes."""
        return cls.from_bundle(*read_bundle(path, "kronecker_covariances"), path)


def _check_same_layer(name: str, a: Any, b: Any) -> None:
    """Refuse to add up the sums of two different layers stored under one name."""
    same_kw = json.dumps(a.module_kwargs, sort_keys=True, default=str) == json.dumps(
        b.module_kwargs, sort_keys=True, default=str
    )  # a tuple read back from JSON is a list
    if a.layer_type != b.layer_type or not same_kw:
        raise ValueError(
            f"cannot merge the statistics of layer {name!r}: one side is {a.layer_type} "
            f"{a.module_kwargs}, the other {b.layer_type} {b.module_kwargs} (captured from "
            "different models or projections)."
        )


# ---- the files of the Kronecker family ---------------------------------------------------------
def write_bundle(path: str | os.PathLike, stem: str, tensors: dict, meta: dict) -> None:
    """Write ``<stem>.{safetensors,json}`` into the directory ``path`` (JSON last, atomically)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    meta = {"format": f"dattri_llm.{stem}", "version": FORMAT_VERSION, **meta}
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        os.path.join(path, f"{stem}.safetensors"),
    )
    atomic_write(os.path.join(path, f"{stem}.json"), json.dumps(meta, indent=1, sort_keys=True))


def read_bundle(path: str | os.PathLike, stem: str) -> tuple[dict, dict]:
    """Read a bundle written by :func:`write_bundle`, checking its format name and version."""
    from safetensors.torch import load_file

    meta_path = os.path.join(path, f"{stem}.json")
    if not os.path.exists(meta_path):
        raise FileNotFoundError(f"{meta_path} not found: {path} holds no saved {stem}.")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != f"dattri_llm.{stem}":
        raise ValueError(
            f"{meta_path}: format {meta.get('format')!r}, expected 'dattri_llm.{stem}'."
        )
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: version {meta.get('version')!r}; this dattri_llm reads "
            f"version {FORMAT_VERSION}. Refit, or use the matching dattri_llm."
        )
    return load_file(os.path.join(path, f"{stem}.safetensors")), meta


def put_layers(records: Mapping[str, Any], tensors: dict) -> dict:
    """Add the per-layer records' tensors to ``tensors``; return their other fields as JSON.

    Each record is a dataclass (:class:`LayerCovariance`, :class:`DiagonalFisher`,
    ``LayerEigen``): its tensor fields are stored as ``"<layer>|<field>"``, its other fields
    go to the metadata, and a field that is ``None`` (no block axis, a K-FAC fit's eigenvalues)
    is left out of both.
    """
    meta = {}
    for name, record in records.items():
        meta[name] = {}
        for f in fields(record):
            value = getattr(record, f.name)
            if isinstance(value, torch.Tensor):
                tensors[f"{name}|{f.name}"] = value
            elif value is not None:
                meta[name][f.name] = value
    return meta


def read_layer(
    tensors: dict, path: object, name: str, lead: tuple[int, ...], shapes: dict
) -> dict[str, torch.Tensor | None]:
    """``{field: tensor}`` of one layer, each checked to exist with ``(*lead, *shapes[field])``.

    A field whose shape is ``None`` is not stored (it reads as ``None``); errors name the bundle.
    """
    out: dict[str, torch.Tensor | None] = {}
    for key, shape in shapes.items():
        if shape is None:
            out[key] = None
            continue
        stored, full = f"{name}|{key}", (*lead, *shape)
        t = tensors.get(stored)
        if t is None:
            raise ValueError(f"{path}: tensor {stored!r} is missing; the files are incomplete.")
        if tuple(t.shape) != full:
            raise ValueError(
                f"{path}: tensor {stored!r} has shape {tuple(t.shape)}, expected {full} "
                "from its layer's metadata."
            )
        out[key] = t
    return out


def get_diagonal(tensors: dict, meta: dict, path: str | os.PathLike) -> dict:
    """The diagonal Fishers described by ``meta["diagonal"]``, validated."""
    out = {}
    for name, m in meta["diagonal"].items():
        t = tensors.get(f"{name}|sq_sum")
        if t is None or t.dim() != 1:
            raise ValueError(f"{path}: diagonal Fisher of {name!r} is missing or not 1-D.")
        out[name] = DiagonalFisher(m["layer_type"], m["module_kwargs"], t, float(m["num_samples"]))
    return out
