"""Capture-time random projection of per-sample gradients (``HookManagerConfig(projection=...)``).

Four styles, chosen per layer with :class:`ProjectionConfig`:

* ``"logra"``: each factor is projected with its own seeded matrix, so a linear / convolution /
  embedding layer stays factorised in a small space and its per-sample gradient is never formed
  (LoGra). For a layer whose per-sample gradient has matrix form ``M`` ``(K, D)`` (the weight's
  shape, bias as a last column; ``(V, E)`` for embeddings) the captured gradient is
  ``R^T M C`` ``(proj_dim_out, proj_dim_in)``: ``C`` ``(D, proj_dim_in)`` projects the column
  (activation) side, ``R`` ``(K, proj_dim_out)`` the row (output-gradient) side. ``proj_dim`` is
  the size of the projected gradient ``proj_dim_out * proj_dim_in``: by default both sides get
  ``sqrt(proj_dim)`` (a perfect square is required), or pass ``proj_dim_in`` / ``proj_dim_out``
  explicitly. The activation side of linear / convolution layers is projected already in the
  forward hook, so the raw activation is never kept.
* ``"dense"``: the per-sample gradient is materialised and projected with one ``(K*D, proj_dim)``
  matrix (TRAK-style) -> a ``(B, proj_dim)`` vector.
* ``"mask"``: ``proj_dim`` seeded coordinates of the row-major flattened matrix form, gathered
  straight from the factors (exact entries, no dense gradient formed) -> ``(B, proj_dim)``. A
  layer with fewer than ``proj_dim`` entries keeps all of them.
* ``"sparse"``: a seeded sparse JL transform (each matrix-form entry hashed to ``nnz`` signed
  buckets) -> ``(B, proj_dim)``, from the factors where cheaper, with only ``nnz * (K + D)``
  cached hash entries per layer shape (see :mod:`dattri_llm.gradient.ops.sparse_projection`).

Random matrices are dattri's (``dattri.func.projection.BasicProjector``, the ``attribution``
extra; ``proj_type`` ``"normal"`` (default) or ``"rademacher"``), scaled by
``1 / sqrt(proj_dim)`` as dattri does, so ``features @ matrix`` equals dattri's
``random_project(features, ...)`` for float32 features. They are always generated on the CPU in
float32 from the seed and cast / moved once per ``(shape, dim, seed, dtype, device)``, then cached:
the same seed gives the same projection on every device, in capture and in later scoring, and
nothing is regenerated per step. The mask draws its coordinates exactly as dattri's
``random_mask`` (``randperm`` of a generator seeded with ``seed``) and needs no extra. The row
matrix uses ``seed + 1`` and the column matrix ``seed`` (dattri offsets its blocks by multiples
of 1000, so the streams never coincide).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dattri_llm.gradient.gradient import Factorized, Gradient, LayerGradient, Materialized, Shared
from dattri_llm.gradient.layers import LayerRule, get_rule
from dattri_llm.gradient.layers.projected import (
    gather_entries,
    logra_project_factors,
    logra_project_input,
    logra_projects_input_in_forward,
    logra_split,
    logra_supported,
)
from dattri_llm.gradient.ops.sparse_projection import (
    check_nnz,
    clear_sparse_cache,
    sketch_item,
    sparse_cache_info,
    sparse_hashes,
)

__all__ = [
    "ProjectionConfig",
    "CaptureProjection",
    "projection_matrix",
    "mask_indices",
    "LayerProjection",
    "layer_projection",
    "nearest_projection",
    "NEAREST_STYLES",
    "resolve_projection",
    "project_gradient",
    "clear_projection_cache",
    "projection_cache_info",
]

STYLES = ("logra", "dense", "mask", "sparse")
PROJ_TYPES = ("normal", "rademacher")
_OPTIONS = {
    "logra": ("proj_dim_in", "proj_dim_out", "proj_type"),
    "dense": ("proj_type",),
    "mask": (),
    "sparse": ("nnz",),
}
_EXTRA_HINT = 'pip install "dattri_llm[attribution]"'


class ProjectionConfig:
    """One capture-time projection: style, size, seed and projector options.

    Args:
        style: ``"logra"``, ``"dense"``, ``"mask"`` or ``"sparse"``.
        proj_dim: Size of each layer's projected gradient (``logra``: ``proj_dim_out *
            proj_dim_in``; may be omitted when both are given).
        seed: Seed of the random matrices / mask; the same seed reproduces them anywhere.
        **projector_options: ``proj_type`` (``"normal"`` or ``"rademacher"``; logra, dense) and
            ``proj_dim_in`` / ``proj_dim_out`` (logra: column / activation side and row /
            output-gradient side), ``nnz`` (sparse: nonzeros per input coordinate, default
            :data:`~dattri_llm.gradient.ops.sparse_projection.DEFAULT_NNZ` = 1; more lowers the
            variance of the structured sketch at proportionally more hashing cost).
    """

    def __init__(
        self, style: str, proj_dim: int | None = None, seed: int = 0, **projector_options: Any
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"ProjectionConfig(style=) must be one of {STYLES}, got {style!r}")
        unknown = sorted(set(projector_options) - set(_OPTIONS[style]))
        if unknown:
            raise ValueError(
                f"ProjectionConfig(style={style!r}) got unknown projector options {unknown}; "
                f"accepted: {list(_OPTIONS[style]) or 'none'}."
            )
        proj_type = projector_options.get("proj_type", "normal")
        if proj_type not in PROJ_TYPES:
            raise ValueError(
                f"ProjectionConfig(proj_type=) must be one of {PROJ_TYPES} (the projectors dattri "
                f"offers on every device), got {proj_type!r}"
            )
        self.style = style
        self.seed = int(seed)
        self.projector_options = dict(projector_options)
        if style == "logra":
            d_in, d_out = logra_split(proj_dim, self.projector_options)
            self.projector_options.update(proj_dim_in=d_in, proj_dim_out=d_out)
            proj_dim = d_in * d_out
        if not isinstance(proj_dim, int) or isinstance(proj_dim, bool) or proj_dim < 1:
            raise ValueError(
                f"ProjectionConfig(proj_dim=) must be a positive int, got {proj_dim!r}"
            )
        self.proj_dim = int(proj_dim)
        if style == "sparse":
            self.projector_options["nnz"] = check_nnz(projector_options.get("nnz"), proj_dim)

    @property
    def proj_type(self) -> str:
        """Random matrix distribution (``"normal"`` or ``"rademacher"``)."""
        return self.projector_options.get("proj_type", "normal")

    @property
    def needs_dattri(self) -> bool:
        """Whether the style draws its matrices from dattri's projectors."""
        return self.style in ("logra", "dense")

    def to_dict(self) -> dict:
        """A JSON-able description (``ProjectionConfig(**d)`` rebuilds it)."""
        return {
            "style": self.style,
            "proj_dim": self.proj_dim,
            "seed": self.seed,
            **self.projector_options,
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProjectionConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.to_dict().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"ProjectionConfig({args})"


# ---- random matrices (cached) ---------------------------------------------------------------
_CACHE: dict[tuple, torch.Tensor] = {}
_STATS = {"generated": 0}


def _require_dattri() -> Any:
    try:
        from dattri.func import projection as dattri_projection
    except ImportError as e:
        raise ImportError(
            "capture-time 'logra' / 'dense' projection draws its random matrices from dattri's "
            f"projectors; install the attribution extra: {_EXTRA_HINT} (the 'mask' style needs "
            "no extra)."
        ) from e
    return dattri_projection


def _generate(feature_dim: int, proj_dim: int, seed: int, proj_type: str) -> torch.Tensor:
    """The explicit ``(feature_dim, proj_dim)`` matrix of dattri's CPU ``BasicProjector``."""
    dp = _require_dattri()
    cpu = torch.device("cpu")
    proj = dp.BasicProjector(
        feature_dim=feature_dim,
        proj_dim=proj_dim,
        seed=seed,
        proj_type=dp.ProjectionType(proj_type),
        device=cpu,
        dtype=torch.float32,
    )
    _STATS["generated"] += 1
    try:
        out = torch.empty(feature_dim, proj_dim, dtype=torch.float32)
        for i in range(proj.num_blocks):
            if i:
                proj._gen_randomness_dense(proj.generator_states[i])
            st, ed = i * proj.block_size, min((i + 1) * proj.block_size, proj_dim)
            out[:, st:ed] = proj.proj_matrix[:, : ed - st]
        return out.div_(proj_dim**0.5)
    except AttributeError:  # pragma: no cover - a dattri without the block internals
        rows = max(1, (1 << 22) // max(1, feature_dim))
        parts = [
            proj.project(torch.eye(feature_dim)[i : i + rows], 0)
            for i in range(0, feature_dim, rows)
        ]
        return torch.cat(parts)


def projection_matrix(
    feature_dim: int,
    proj_dim: int,
    seed: int = 0,
    proj_type: str = "normal",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The dattri random projection matrix ``(feature_dim, proj_dim)`` for ``seed`` (cached).

    ``x @ projection_matrix(x.shape[1], k, s)`` equals dattri's
    ``random_project(x, ..., proj_dim=k, proj_seed=s, proj_type=...)`` on the CPU for float32
    ``x``. Generated once in float32 on the CPU, then cast and moved (also cached).
    """
    device = torch.device(device)
    base_key = (
        "matrix",
        int(feature_dim),
        int(proj_dim),
        int(seed),
        proj_type,
        torch.float32,
        torch.device("cpu"),
    )
    base = _CACHE.get(base_key)
    if base is None:
        base = _CACHE[base_key] = _generate(int(feature_dim), int(proj_dim), int(seed), proj_type)
    key = (*base_key[:5], dtype, device)
    out = _CACHE.get(key)
    if out is None:
        out = _CACHE[key] = base.to(dtype=dtype, device=device)
    return out


def mask_indices(
    numel: int, proj_dim: int, seed: int = 0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``min(proj_dim, numel)`` sorted coordinates of a length-``numel`` vector (cached).

    Drawn as dattri's ``random_mask`` does on the CPU: ``randperm(numel)[:proj_dim]`` with a
    generator seeded by ``seed``.
    """
    device = torch.device(device)
    base_key = ("mask", int(numel), int(proj_dim), int(seed), torch.device("cpu"))
    base = _CACHE.get(base_key)
    if base is None:
        if proj_dim >= numel:
            base = torch.arange(numel)
        else:
            gen = torch.Generator().manual_seed(int(seed))
            base = torch.randperm(int(numel), generator=gen)[: int(proj_dim)].sort()[0]
        _STATS["generated"] += 1
        _CACHE[base_key] = base
    key = (*base_key[:4], device)
    out = _CACHE.get(key)
    if out is None:
        out = _CACHE[key] = base.to(device)
    return out


def clear_projection_cache() -> None:
    """Drop every cached matrix, mask and hash (they are regenerated identically on demand)."""
    _CACHE.clear()
    clear_sparse_cache()


def projection_cache_info() -> dict[str, int]:
    """``{"entries", "generated", "bytes"}``: cached tensors, drawn since start-up, their size."""
    sparse = sparse_cache_info()
    nbytes = sum(t.numel() * t.element_size() for t in _CACHE.values())
    return {
        "entries": len(_CACHE) + sparse["entries"],
        "generated": _STATS["generated"] + sparse["generated"],
        "bytes": nbytes + sparse["bytes"],
    }


# ---- one layer ---------------------------------------------------------------------------------
class LayerProjection:
    """The projection of one layer: its matrices and the three capture stages.

    Args:
        config: The layer's projection.
        rule: The source layer's rule.
        module_kwargs: The source layer's hyper-parameters (with ``_k`` / ``_d``).
        name: Layer name (for errors).
    """

    def __init__(
        self, config: ProjectionConfig, rule: LayerRule, module_kwargs: dict, name: str = ""
    ) -> None:
        if config.style not in rule.projection_styles or (
            config.style == "logra" and not logra_supported(rule)
        ):
            allowed = accepted_styles(rule)
            raise ValueError(
                f"layer {name!r} ({rule.layer_type}) does not accept the {config.style!r} "
                f"projection; it accepts {allowed or 'none'}. Map it to another "
                f"ProjectionConfig or to None with a dict: projection={{{name!r}: None, ...}}."
            )
        if config.needs_dattri:
            _require_dattri()
        self.config, self.rule, self.name = config, rule, name
        self.source_kwargs = dict(module_kwargs)
        self.shape = tuple(int(v) for v in rule.matrix_shape(module_kwargs))
        k, d = self.shape
        opts = config.projector_options
        meta = {
            "seed": config.seed,
            "source_layer_type": rule.layer_type,
            "source_module_kwargs": self.source_kwargs,
        }
        if config.style == "logra":
            dk, da = int(opts["proj_dim_out"]), int(opts["proj_dim_in"])
            self.module_kwargs = {
                "_k": dk,
                "_d": da,
                "proj_dim_out": dk,
                "proj_dim_in": da,
                "proj_type": config.proj_type,
                **meta,
            }
            self.layer_type = "projected.logra"
        else:
            dim = config.proj_dim if config.style != "mask" else min(config.proj_dim, k * d)
            self.module_kwargs = {"_k": 1, "_d": dim, "proj_dim": dim, **meta}
            if config.style == "dense":
                self.module_kwargs["proj_type"] = config.proj_type
            if config.style == "sparse":
                self.module_kwargs["nnz"] = int(opts["nnz"])
            self.layer_type = f"projected.{config.style}"

    @property
    def style(self) -> str:
        """The projection style."""
        return self.config.style

    def matrices(
        self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """``{"row": R, "col": C}`` (logra), ``{"matrix": P}``, ``{"indices": idx}``, hashes."""
        c, (k, d) = self.config, self.shape
        if c.style == "sparse":
            return sparse_hashes(
                k, d, c.proj_dim, c.seed, c.projector_options["nnz"], dtype, device
            )
        if c.style == "logra":
            opts = c.projector_options
            return {
                "row": projection_matrix(
                    k, opts["proj_dim_out"], c.seed + 1, c.proj_type, dtype, device
                ),
                "col": projection_matrix(
                    d, opts["proj_dim_in"], c.seed, c.proj_type, dtype, device
                ),
            }
        if c.style == "dense":
            return {
                "matrix": projection_matrix(k * d, c.proj_dim, c.seed, c.proj_type, dtype, device)
            }
        return {"indices": mask_indices(k * d, c.proj_dim, c.seed, device)}

    # ---- stages ------------------------------------------------------------------------------
    def project_input(self, a: torch.Tensor) -> torch.Tensor:
        """Forward hook: project the activation factor (logra on outer-product layers)."""
        if self.style != "logra" or not logra_projects_input_in_forward(self.rule):
            return a
        col = self.matrices(a.dtype, a.device)["col"]
        return logra_project_input(self.rule, a, col)

    def project_factors(self, item: LayerGradient, a_projected: bool = True) -> LayerGradient:
        """Backward hook, on the complete factors: logra projects the remaining factor."""
        if self.style != "logra" or not isinstance(item, Factorized):
            return item
        m = self.matrices(item.g.dtype, item.g.device)
        a_proj = a_projected and logra_projects_input_in_forward(self.rule)
        a, g = logra_project_factors(self.rule, item.a, item.g, m["row"], m["col"], a_proj)
        return Factorized(a, g, self.layer_type, self.module_kwargs)

    def project_item(self, item: LayerGradient) -> LayerGradient:
        """After the other transforms: dense / mask turn the layer into a ``(B, dim)`` vector."""
        if self.style == "logra":
            return item
        if isinstance(item, Shared):
            raise TypeError(
                f"layer {self.name!r}: project the sites of a shared parameter one by one."
            )
        k, d = self.shape
        if self.style == "sparse":
            data = sketch_item(item, self.shape, self.config.proj_dim, self.matrices)
            return Materialized(data, self.layer_type, self.module_kwargs)
        if self.style == "mask":
            idx = self.matrices(device=_device(item))["indices"]
            if isinstance(item, Materialized):
                self._check_width(item.data)
                data = item.data[:, idx]
            else:
                data = gather_entries(item.rule, item.a, item.g, item.module_kwargs, idx)
        else:
            dense = item.materialize().data
            self._check_width(dense)
            data = dense @ self.matrices(dense.dtype, dense.device)["matrix"]
        return Materialized(data, self.layer_type, self.module_kwargs)

    def _check_width(self, data: torch.Tensor) -> None:
        k, d = self.shape
        if data.shape[1] != k * d:
            raise ValueError(
                f"layer {self.name!r}: expected a ({k}x{d}) = {k * d}-entry gradient to project, "
                f"got {data.shape[1]} entries."
            )


def _device(item: LayerGradient) -> torch.device:
    return item.g.device if isinstance(item, Factorized) else item.data.device


#: The styles tried, in order, for a layer that does not take the whole-model style: the
#: nearest random projection first (logra's factors are Gaussian, so is dense).
NEAREST_STYLES = {
    "logra": ("dense", "sparse", "mask"),
    "dense": ("sparse", "mask"),
    "sparse": ("dense", "mask"),
    "mask": ("sparse", "dense"),
}


def accepted_styles(rule: LayerRule) -> list[str]:
    """The capture-time projection styles a layer rule takes."""
    return [s for s in rule.projection_styles if s != "logra" or logra_supported(rule)]


def nearest_projection(
    config: ProjectionConfig, rule: LayerRule, module_kwargs: dict
) -> ProjectionConfig | None:
    """The form of a whole-model ``config`` that one layer takes (``None``: keep it exact).

    The rule: a layer that takes ``config.style`` gets ``config``; otherwise a layer with at
    most ``config.proj_dim`` parameters stays exact (projecting it would not shrink it); any
    other layer gets the first style of :data:`NEAREST_STYLES` it takes, with the same
    ``proj_dim``, seed and ``proj_type``. E.g. under ``ProjectionConfig("logra", 256)`` an
    RMS norm of width 4096 is projected ``dense`` to 256 and one of width 64 stays exact.
    A layer that takes no style at all keeps ``config`` (and is refused by name).
    """
    allowed = accepted_styles(rule)
    if config.style in allowed:
        return config
    k, d = (int(v) for v in rule.matrix_shape(module_kwargs))
    if k * d <= config.proj_dim:
        return None
    for style in NEAREST_STYLES[config.style]:
        if style in allowed:
            opts = {"proj_type": config.proj_type} if style == "dense" else {}
            return ProjectionConfig(style, config.proj_dim, config.seed, **opts)
    return config


def layer_projection(
    config: ProjectionConfig, layer_type: str, module_kwargs: dict, name: str = ""
) -> LayerProjection:
    """The :class:`LayerProjection` of a layer of ``layer_type`` (matrices included).

    For a projected layer read back from a capture or a store, pass its
    ``source_layer_type`` / ``source_module_kwargs`` and the config rebuilt from its
    ``module_kwargs`` to get the very matrices the capture used.
    """
    rule = get_rule(layer_type)
    kw = dict(module_kwargs)
    if "_k" not in kw or "_d" not in kw:
        kw["_k"], kw["_d"] = rule.matrix_shape(kw)
    return LayerProjection(config, rule, kw, name)


# ---- per-layer resolution -----------------------------------------------------------------------
def resolve_projection(
    projection: Any, names: Sequence[str] | None
) -> dict[str, ProjectionConfig | None]:
    """Map each layer name to its projection config (``None``: keep the layer exact).

    One config applies to all layers; with a dict the first full-matching regex wins and
    unmatched layers stay exact. With ``names=None`` only the types (and regexes) are checked.

    Raises:
        TypeError / ValueError: a wrong type, or a dict pattern that matches no layer.
    """
    if isinstance(projection, ProjectionConfig):
        return {n: projection for n in names or ()}
    if not isinstance(projection, Mapping):
        raise TypeError(
            "HookManagerConfig(projection=) takes a ProjectionConfig or a dict {layer-name regex: "
            f"ProjectionConfig | None}}, got {type(projection).__name__}"
        )
    rules = []
    for pattern, cfg in projection.items():
        if cfg is not None and not isinstance(cfg, ProjectionConfig):
            raise TypeError(
                f"projection[{pattern!r}] must be a ProjectionConfig or None, got "
                f"{type(cfg).__name__}"
            )
        rules.append((pattern, re.compile(pattern), cfg))
    if names is None:
        return {}
    out: dict[str, ProjectionConfig | None] = {}
    used: set[str] = set()
    for n in names:
        out[n] = None
        for pattern, rx, cfg in rules:
            if rx.fullmatch(n):
                out[n] = cfg
                used.add(pattern)
                break
    unused = [p for p, _, _ in rules if p not in used]
    if unused:
        raise ValueError(
            f"projection patterns {unused} match no hooked layer (patterns are "
            f"full-matched, first match wins); hooked layers: {list(names)}"
        )
    return out


class CaptureProjection:
    """The projection a :class:`~dattri_llm.HookManager` applies, resolved per hooked layer.

    Args:
        projection: ``HookManagerConfig.projection``.
        layers: The manager's resolved ``LayerSpec`` list.
        shared_groups: ``{lead: [site names]}`` of tied parameters (their sites must be
            projected identically so their sum stays meaningful).
    """

    def __init__(
        self,
        projection: Any,
        layers: Sequence[Any],
        shared_groups: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        configs = resolve_projection(projection, [s.name for s in layers])
        whole = isinstance(projection, ProjectionConfig)
        self.layers: dict[str, LayerProjection | None] = {}
        for spec in layers:
            cfg = configs[spec.name]
            if whole and spec.hook_type == "linear_io":  # the form this layer takes
                cfg = nearest_projection(cfg, spec.rule, spec.module_kwargs)
            if cfg is not None and spec.hook_type != "linear_io":
                raise ValueError(
                    f"layer {spec.name!r} is hooked with {spec.hook_type}, which capture-time "
                    f"projection does not support; keep it exact with projection={{"
                    f"{spec.name!r}: None, ...}} or hook it with linear_io."
                )
            self.layers[spec.name] = (
                None
                if cfg is None
                else LayerProjection(cfg, spec.rule, spec.module_kwargs, spec.name)
            )
        for members in (shared_groups or {}).values():
            sig = {
                m: (
                    None
                    if self.layers.get(m) is None
                    else (self.layers[m].config, self.layers[m].shape)
                )
                for m in members
            }
            if len(set(sig.values())) > 1:
                raise ValueError(
                    f"layers {list(members)} share one parameter, so they need the same "
                    f"projection and matrix shape; got {sig}. Give them one config (or None)."
                )

    def __getitem__(self, name: str) -> LayerProjection | None:
        return self.layers.get(name)

    def project_input(self, spec: Any, a: torch.Tensor) -> torch.Tensor:
        """Forward-hook stage (see :meth:`LayerProjection.project_input`)."""
        lp = self.layers.get(spec.name)
        return a if lp is None else lp.project_input(a)

    def project_factors(self, spec: Any, item: LayerGradient) -> LayerGradient:
        """Backward-hook stage on the complete factors."""
        lp = self.layers.get(spec.name)
        return item if lp is None else lp.project_factors(item)

    def project_item(self, spec: Any, item: LayerGradient) -> LayerGradient:
        """Last backward-hook stage (dense / mask)."""
        lp = self.layers.get(spec.name)
        return item if lp is None else lp.project_item(item)


def project_gradient(gradient: Gradient, projection: Any) -> Gradient:
    """Project an exact capture after the fact, as ``HookManagerConfig(projection=)`` would.

    Layers already projected (``projected.*``) are left as they are.
    """
    configs = resolve_projection(projection, gradient.layer_names)
    whole = isinstance(projection, ProjectionConfig)

    def one(name: str, lg: Factorized | Materialized, cfg: ProjectionConfig) -> LayerGradient:
        lp = layer_projection(cfg, lg.layer_type, lg.module_kwargs, name)
        return lp.project_item(lp.project_factors(lg, a_projected=False))

    layers: dict[str, LayerGradient] = {}
    for name, lg in gradient.layers.items():
        cfg = configs[name]
        if whole and cfg is not None and not lg.layer_type.startswith("projected."):
            src = lg.sites[0] if isinstance(lg, Shared) else lg
            rule = get_rule(src.layer_type)  # as a capture with this config would project it
            kw = dict(src.module_kwargs)
            if "_k" not in kw or "_d" not in kw:
                kw["_k"], kw["_d"] = rule.matrix_shape(kw)
            cfg = nearest_projection(cfg, rule, kw)
        if cfg is None or lg.layer_type.startswith("projected."):
            layers[name] = lg
        elif isinstance(lg, Shared):
            sites = [one(name, s, cfg) for s in lg.sites]
            if all(isinstance(s, Materialized) for s in sites):
                layers[name] = Materialized(
                    sum(s.data for s in sites), sites[0].layer_type, sites[0].module_kwargs
                )
            else:
                layers[name] = Shared(sites, list(lg.site_names))
        else:
            layers[name] = one(name, lg, cfg)
    return Gradient(layers)
