"""Capture facts, and whether train and test gradients can be scored against each other.

Two gradients can be scored against each other only if they live in the same space: the same
layers, each of the same type with the same hyper-parameters (``module_kwargs``: shapes,
``eps``, convolution geometry, ...), and for a capture-time projection the same style, size,
seed and projector (a projected layer's ``layer_type`` is ``"projected.<style>"`` and its
``module_kwargs`` hold the projection and the source layer). A store records these facts in
every shard header (``docs/STORE_FORMAT.md``); :class:`CaptureFacts` is what they amount to for
one block, one source or one store, and :func:`check_compatible` refuses a difference with an
error that names it.

How a layer was captured (factors or dense) never matters, and neither do the dtype or the
record metadata (e.g. a preconditioned LESS train capture scored against a raw test capture),
except TrackStar's capture-time second-moment correction, which both sides must carry alike
(:mod:`dattri_llm.gradient.optim.second_moment`). The rest is recorded in the facts for
attributors that need to decide
(:meth:`BaseAttributor.check_compatible <dattri_llm.attribution.base.BaseAttributor>`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from dattri_llm.gradient.gradient import Gradient, Shared

__all__ = [
    "LayerFacts",
    "CaptureFacts",
    "IncompatibleGradientsError",
    "facts_of",
    "compare_facts",
    "check_compatible",
    "check_same_capture",
]


class IncompatibleGradientsError(ValueError):
    """Train and test gradients (or two parts of one store) were captured incompatibly."""


@dataclass(frozen=True)
class LayerFacts:
    """What identifies one captured layer's gradient space.

    Attributes:
        layer_type: The layer rule (``"nn.Linear"``, ``"projected.logra"``, ...); a tied
            parameter reports its first site.
        module_kwargs: Its hyper-parameters (for a projected layer: the projection and the
            source layer's type and hyper-parameters).
        site_names: The sites of a tied parameter captured as separate sites, else ``None``.
    """

    layer_type: str
    module_kwargs: Mapping[str, Any]
    site_names: tuple[str, ...] | None = None

    def describe(self) -> str:
        """A short human-readable description (projection settings spelled out)."""
        kw = self.module_kwargs
        if self.layer_type.startswith("projected."):
            style = self.layer_type.split(".", 1)[1]
            parts = [f"{k} {kw[k]}" for k in ("proj_dim", "seed", "proj_type", "nnz") if k in kw]
            return f"{kw.get('source_layer_type', '?')} projected ({style}: {', '.join(parts)})"
        return f"{self.layer_type} (no projection)"


@dataclass(frozen=True)
class CaptureFacts:
    """The facts of one capture: per layer :class:`LayerFacts`, plus what is only recorded.

    Attributes:
        layers: ``{layer name: LayerFacts}``, in capture order.
        dtype: The floating dtype of the gradients (``"float32"``, ...), recorded only.
        metadata: The record metadata of the first block (e.g. a LESS capture's
            preconditioning), recorded only.
        source: Where the facts come from (a store directory, ``"train source"``, ...).
    """

    layers: Mapping[str, LayerFacts]
    dtype: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit digest of :attr:`layers` (equal facts, equal fingerprints)."""
        blob = json.dumps(
            {
                n: [f.layer_type, dict(f.module_kwargs), f.site_names]
                for n, f in self.layers.items()
            },
            sort_keys=True,
            default=repr,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def facts_of(
    gradient: Gradient, metadata: Mapping[str, Any] | None = None, source: str = ""
) -> CaptureFacts:
    """The :class:`CaptureFacts` of one captured :class:`Gradient`."""
    layers = {}
    for name, lg in gradient.layers.items():
        lead = lg.sites[0] if isinstance(lg, Shared) else lg
        sites = tuple(lg.site_names) if isinstance(lg, Shared) else None
        layers[name] = LayerFacts(lead.layer_type, dict(lead.module_kwargs), sites)
    dtype = str(gradient.dtype).removeprefix("torch.") if gradient.layers else None
    return CaptureFacts(layers, dtype, dict(metadata or {}), source)


def _kwargs_diff(a: Mapping, b: Mapping, ignore: Collection[str]) -> list[str]:
    keys = [k for k in dict.fromkeys([*a, *b]) if k not in ignore]
    return [
        f"{k}: {a.get(k, '<absent>')!r} vs {b.get(k, '<absent>')!r}"
        for k in keys
        if a.get(k) != b.get(k)
    ]


def compare_facts(
    first: CaptureFacts,
    second: CaptureFacts,
    ignore: Collection[str] = (),
    names: tuple[str, str] = ("train", "test"),
) -> list[str]:
    """The differences between two captures' layers, one sentence each (``[]``: compatible).

    Args:
        first: The facts of one capture.
        second: The facts of the other.
        ignore: What not to compare: ``"layer_type"``, ``"module_kwargs"``, ``"site_names"``,
            or single ``module_kwargs`` keys (e.g. ``"eps"``).
        names: How to call the two sides in the sentences.
    """
    a, b = names
    out = []
    only_a = [n for n in first.layers if n not in second.layers]
    only_b = [n for n in second.layers if n not in first.layers]
    if only_a or only_b:
        out.append(
            f"layers only in {a}: {only_a}; only in {b}: {only_b} (score a common subset with "
            "layers=[...], or capture both with the same hook config)"
        )
    for name, fa in first.layers.items():
        fb = second.layers.get(name)
        if fb is None:
            continue
        if "layer_type" not in ignore and fa.layer_type != fb.layer_type:
            out.append(f"layer {name!r} is {fa.describe()} in {a} but {fb.describe()} in {b}")
            continue
        if "module_kwargs" not in ignore:
            diff = _kwargs_diff(fa.module_kwargs, fb.module_kwargs, ignore)
            if diff:
                what = (
                    "projection / layer settings"
                    if fa.layer_type.startswith("projected.")
                    else "shapes / hyper-parameters"
                )
                out.append(
                    f"layer {name!r} ({fa.layer_type}) has different {what} in {a} and {b}: "
                    + "; ".join(diff[:4])
                    + ("; ..." if len(diff) > 4 else "")
                )
        if (
            "site_names" not in ignore
            and fa.site_names is not None
            and fb.site_names is not None
            and fa.site_names != fb.site_names
        ):
            out.append(
                f"tied layer {name!r} has sites {list(fa.site_names)} in {a} but "
                f"{list(fb.site_names)} in {b}"
            )
    return out


def check_compatible(train: CaptureFacts, test: CaptureFacts, ignore: Collection[str] = ()) -> None:
    """Refuse train and test gradients that do not live in the same space.

    Compares layer names, layer types (projected or not) and ``module_kwargs`` (shapes,
    hyper-parameters, projection style / size / seed), and whether the record metadata carry
    the capture-time second-moment correction (TrackStar's, which must be on both sides:
    :func:`~dattri_llm.gradient.optim.second_moment.check_same_correction`, a ``ValueError``);
    the dtype and the rest of the metadata (e.g. LESS's preconditioned train side against raw
    queries) are not compared.

    Args:
        train: Facts of the train capture.
        test: Facts of the test capture.
        ignore: See :func:`compare_facts`.

    Raises:
        IncompatibleGradientsError: naming both sources and every difference.
    """
    diffs = compare_facts(train, test, ignore)
    if not diffs:
        # imported here: capturing and storing never needs the optimizer correction's module
        from dattri_llm.gradient.optim.second_moment import check_same_correction

        check_same_correction(
            train.metadata,
            test.metadata,
            f"the train gradients ({train.source or 'train'})",
            f"the test gradients ({test.source or 'test'})",
            strict=False,  # a store's checkpoints may each carry their own v
        )
    if diffs:
        raise IncompatibleGradientsError(
            f"the train gradients ({train.source or 'train'}) and the test gradients "
            f"({test.source or 'test'}) were captured incompatibly and cannot be scored "
            "against each other:\n  - "
            + "\n  - ".join(diffs)
            + "\nCapture both from the same model with the same HookManagerConfig (layers, "
            "layer_types / module_kwargs, projection style, proj_dim and seed)."
        )


def check_same_capture(
    first: CaptureFacts, gradient: Gradient, source: str, where: str = "a later block"
) -> None:
    """Refuse a gradient captured differently from the first one of the same source.

    Raises:
        IncompatibleGradientsError: naming the source and every difference.
    """
    facts = facts_of(gradient)
    if facts.layers == first.layers:
        return
    diffs = compare_facts(first, facts, names=("its first block", where))
    if diffs:
        raise IncompatibleGradientsError(
            f"the {source} mixes incompatible captures:\n  - "
            + "\n  - ".join(diffs)
            + "\nWrite each capture to its own store."
        )
