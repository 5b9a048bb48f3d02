"""``GradientIndex``: nearest-neighbour search over a projected gradient store (FAISS).

Build once over a train store whose layers are fixed-size vectors (a projected capture), then
answer "which training samples are the top proponents / opponents of these queries?" without a
pass over the store::

    index = GradientIndex.build("train_grads", "train_grads.index", metric="cosine")
    scores = GradientIndex.open("train_grads.index").search("query_grads", k=10)
    scores.top_k(10)          # as after TracInAttributor(...).attribute_from_cache(top_k=10)

A score is an inner product of per-sample vectors (the layers joined in the store's order):
``metric="dot"`` is TracIn / Grad-Dot, ``"cosine"`` is Grad-Cos (every row divided by its norm
over the indexed layers). A sample's rows at several steps or checkpoints are summed at build
time (each weighted by ``checkpoint_weights``), so an exact (``flat``) search gives the very
scores and ranking of ``TracInAttributor(...).attribute_from_cache(train, test, top_k=k)``,
to float32 round-off. ``ivf`` and ``hnsw`` are approximate (``kinds`` documents their
parameters; ``docs/benchmarks/index.md`` measures recall and speed).

Partitions: a store written by several ranks gets one FAISS index per partition (each sample
in the partition of its first row, its vector summing all its rows), and a search merges the
partitions' top-k exactly. The build streams the store (``block_rows``; memory: the index plus
one block, see ``builder``). Under ``torchrun`` build and search split by partition across
the ranks (every rank calls them; see ``distributed``).

The proponents are a search for the largest inner products with the query ``q``, the
opponents one for the largest with ``-q``; the result holds both, like the top-k sink of the
score engine (:class:`~dattri_llm.attribution.engine.sinks.TopKSink`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dattri_llm.attribution.index import distributed as dd
from dattri_llm.attribution.index import kinds
from dattri_llm.attribution.index.builder import (
    PartBuilder,
    check_block_rows,
    part_params,
    weights_of,
    write_parts,
)
from dattri_llm.attribution.index.format import (
    INDEX_FORMAT_NAME,
    INDEX_FORMAT_VERSION,
    META_NAME,
    IndexFormatError,
    StaleIndexError,
    fingerprint_difference,
    read_index_meta,
    store_fingerprint,
    write_json,
)
from dattri_llm.attribution.index.part_search import open_rerank_file, search_part
from dattri_llm.attribution.index.vectors import (
    BLOCK_ROWS,
    check_finite_vectors,
    check_vector_schema,
    plan_parts,
    query_vectors,
    train_parts,
    unit_rows,
)
from dattri_llm.attribution.ranking import check_top_k, clamp_top_k, rank
from dattri_llm.attribution.score import AttributionScore, check_repeats
from dattri_llm.gradient.gradient import Gradient, Materialized
from dattri_llm.utils.progress import progress_bar

__all__ = ["GradientIndex"]

Preconditioner = torch.Tensor | Callable[[torch.Tensor], torch.Tensor]


def _open_store(store: Any) -> Any:
    from dattri_llm.gradient.sources import DiskGradientSource, store_reading
    from dattri_llm.gradient.store import GradientStorageManager

    reading = store_reading(store)
    if reading is not None:
        return reading.store
    if isinstance(store, GradientStorageManager):
        return store
    return DiskGradientSource(store).store  # its checks: exists, is a store, holds records


def _source_selection(
    source: Any, layers: Sequence[str] | None, checkpoints: Sequence[int] | None
) -> tuple[Sequence[str] | None, Sequence[int] | None]:
    """The layers and checkpoint labels to index: a source over a store brings its own.

    ``build(DiskGradientSource(store, checkpoints=[0]))`` indexes what an attributor reading
    that source scores; the store alone would give every label summed, another score. A build
    argument that names another selection than the source's is refused, never one of the two
    silently dropped.

    Raises:
        ValueError: ``layers`` or ``checkpoints`` differs from the source's.
    """
    from dattri_llm.gradient.sources import store_reading

    reading = store_reading(source)
    if reading is None:
        return layers, checkpoints
    if layers is None:
        layers = reading.layers
    elif reading.layers is not None and list(layers) != list(reading.layers):
        raise ValueError(
            f"layers={list(layers)} but the train source reads layers {list(reading.layers)}; "
            "give the selection once (on the source or to build)."
        )
    if checkpoints is None:
        checkpoints = None if reading.checkpoints is None else sorted(reading.checkpoints)
    elif reading.checkpoints is not None and {int(c) for c in checkpoints} != reading.checkpoints:
        raise ValueError(
            f"checkpoints={sorted(checkpoints)} but the train source reads checkpoints "
            f"{sorted(reading.checkpoints)}; give the selection once (on the source or to build)."
        )
    return layers, checkpoints


class GradientIndex:
    """A FAISS index over a projected gradient store (see the module docstring).

    Build it with :meth:`build`, reopen it with :meth:`open`, query it with :meth:`search`.

    Attributes:
        directory: The index directory.
        meta: Its ``index.json`` (metric, kind, params, layers, dims, parts, store fingerprint).
        store: The train ``GradientStorageManager`` it was built from (checked unchanged).

    Example:
        An exact (flat) cosine index finds the top samples Grad-Cos finds (needs the ``index``
        extra):

        >>> import tempfile, torch
        >>> from dattri_llm import (AttributionArguments, GradientIndex, GradientStorageManager,
        ...                         HookManager, HookManagerConfig, OffloadCallback,
        ...                         ProjectionConfig, TracInAttributor)
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 8))
        >>> config = HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=32))  # a vector
        >>> def capture(x):  # one store of per-sample gradients, each a 32-number vector
        ...     store = GradientStorageManager(tempfile.mkdtemp())
        ...     hm = HookManager(model, config, callbacks=[OffloadCallback(file_manager=store)])
        ...     with hm.collect(deregister_on_exit=True):
        ...         model(x).pow(2).sum().backward()
        ...     store.close()
        ...     return store.save_dir
        >>> train, test = capture(torch.randn(50, 16)), capture(torch.randn(3, 16))
        >>> index = GradientIndex.build(train, tempfile.mkdtemp(), metric="cosine")  # exact: flat
        >>> found = index.search(test, k=5)  # an AttributionScore holding each query's top 5
        >>> args = AttributionArguments(output_dir=tempfile.mkdtemp())
        >>> grad_cos = TracInAttributor(args, normalized_grad=True)
        >>> exact = grad_cos.attribute_from_cache(train, test, top_k=5)
        >>> found.top_k(5).proponent_hashes == exact.top_k(5).proponent_hashes
        True
    """

    def __init__(
        self,
        directory: Path,
        meta: dict[str, Any],
        store: Any,
        parts: list,
        rerank: list[np.ndarray | None] | None = None,
    ) -> None:
        self.directory = directory
        self.meta = meta
        self.store = store
        self._parts = parts  # [(faiss index, hashes, steps, checkpoints)]
        # per part: its memory-mapped re-rank file (ivf with PQ), else None
        self._rerank = rerank if rerank is not None else [None] * len(parts)

    # ---- properties ------------------------------------------------------------------------
    @property
    def metric(self) -> str:
        """``"dot"`` or ``"cosine"``."""
        return self.meta["metric"]

    @property
    def repeats(self) -> str:
        """How a sample's rows under one checkpoint label were combined (``build(repeats=)``).

        An index written before the option summed them.
        """
        return self.meta.get("repeats", "sum")

    @property
    def kind(self) -> str:
        """The built kind: ``"flat"``, ``"ivf"`` or ``"hnsw"``."""
        return self.meta["kind"]

    @property
    def params(self) -> dict[str, Any]:
        """The kind's parameters (defaults filled in)."""
        return dict(self.meta["params"])

    @property
    def expected_recall(self) -> float | None:
        """The recall@10 measured at build (``ivf``), ``1.0`` for ``flat``, else ``None``.

        For ``ivf``: the lowest over the partitions of the recall@10 (proponents and
        opponents, the lower) of held-out train vectors searched with the build's ``nprobe``
        against their exact top-10 (:mod:`~dattri_llm.attribution.index.calibrate`; each
        part's record is its ``meta["parts"][i]["calibration"]``). Test queries from
        another distribution usually reach less (``docs/benchmarks/index.md``). ``None``
        for ``hnsw`` and for indexes built before the measurement existed.
        """
        if self.kind == "flat":
            return 1.0
        return self.meta.get("expected_recall")

    @property
    def layers(self) -> list[str]:
        """The indexed layers, in vector order."""
        return list(self.meta["layers"])

    @property
    def dim(self) -> int:
        """Numbers per vector."""
        return int(self.meta["dim"])

    @property
    def num_samples(self) -> int:
        """Indexed train samples (one vector each)."""
        return sum(len(p[1]) for p in self._parts)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        recall = self.expected_recall
        return (
            f"GradientIndex({str(self.directory)!r}, samples={self.num_samples}, "
            f"metric={self.metric!r}, kind={self.kind!r}, dim={self.dim}, parts={len(self._parts)}"
            + ("" if recall is None else f", expected_recall={recall:.3f}")
            + ")"
        )

    # ---- build -----------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        train_store: Any,
        index_dir: str | os.PathLike,
        metric: str = "dot",
        kind: str = "auto",
        *,
        layers: Sequence[str] | None = None,
        checkpoints: Sequence[int] | None = None,
        checkpoint_weights: Sequence[float] | Mapping[int, float] | None = None,
        overwrite: bool = False,
        show_progress: bool | None = None,
        block_rows: int = BLOCK_ROWS,
        repeats: str | None = None,
        **params: Any,
    ) -> GradientIndex:
        """Build an index over a projected train store and write it to ``index_dir``.

        Args:
            train_store: The train gradient store (a directory, ``GradientStorageManager`` or
                ``DiskGradientSource``, whose ``layers`` and ``checkpoints`` are then the
                build's); every indexed layer must be stored as one vector per
                sample (a projected capture), else :class:`NotVectorError` says why and how.
            index_dir: Where to write the index (created; beside the store, or inside it).
            metric: ``"dot"`` (TracIn / Grad-Dot inner products) or ``"cosine"`` (Grad-Cos).
            kind: ``"auto"`` (exact ``flat`` for small stores, see
                :data:`~dattri_llm.attribution.index.kinds.AUTO_FLAT_MAX`; above it IVF-PQ
                with exact re-ranking, :func:`~dattri_llm.attribution.index.kinds.auto_ivf_params`,
                its ``nprobe`` chosen at build to reach ``target_recall``, recall@10 0.95 on
                held-out train vectors, reported as :attr:`expected_recall`), ``"flat"``,
                ``"ivf"`` or ``"hnsw"``.
            layers: Index only these layers (default: all, in the store's order).
            checkpoints: Index only records with these checkpoint labels (default: all).
            checkpoint_weights: TracIn's ``w_c`` per checkpoint label (a sequence or mapping).
            overwrite: Replace an existing index in ``index_dir``.
            show_progress: A progress bar over the store's rows (``None``: only on a terminal).
            block_rows: Rows per block read from the store and per block added to FAISS.
                The build streams: its peak memory is about the index itself (a ``flat``
                index *is* the vectors: ``n * D * 4`` bytes), plus for ``ivf`` the training
                sample (``train_size * D * 4`` bytes), plus one block (about
                ``block_rows * D * 12`` bytes) and the samples' ids; see
                :mod:`dattri_llm.attribution.index.builder`. Any value gives the same index;
                one beyond the store's rows is clamped to them.
            repeats: How a sample's rows under one checkpoint label combine (a loop captured
                over several epochs under one label), as the attributors' ``repeats=``:
                ``"sum"`` or ``"mean"``; default ``"mean"`` for ``"cosine"`` (Grad-Cos's
                default, so a score stays a cosine per label) and ``"sum"`` for ``"dot"``.
                Checkpoint labels are always summed.
            **params: The kind's parameters (``nlist``, ``nprobe``, ``train_size``, ``seed``,
                ``pq_m``, ``pq_bits``, ``rerank``, ``target_recall`` (choose ``nprobe`` at
                build: the smallest power of two, or ``nlist``, whose measured recall@10
                reaches it; warns when even ``nlist`` does not), ``calibration_queries``
                (held-out vectors it is measured on, 128) for ``ivf``; ``M``, ``efConstruction``,
                ``efSearch`` for ``hnsw``; see :mod:`dattri_llm.attribution.index.kinds`).

        Returns:
            The opened index.

        Raises:
            ValueError: an unknown metric or kind, a parameter the kind does not take, an
                ``index_dir`` that already holds an index (pass ``overwrite=True``), or
                ``layers`` / ``checkpoints`` other than a ``DiskGradientSource``'s own.
            NotVectorError: a layer stored factorized.
        """
        faiss = kinds.import_faiss()
        if metric not in kinds.METRICS:
            raise ValueError(f"metric must be one of {kinds.METRICS}, got {metric!r}.")
        if kind not in kinds.KINDS:
            raise ValueError(f"kind must be one of {kinds.KINDS}, got {kind!r}.")
        block_rows = check_block_rows(block_rows)
        if repeats is None:
            repeats = "mean" if metric == "cosine" else "sum"
        repeats = check_repeats(repeats, "GradientIndex.build(repeats=)")
        layers, checkpoints = _source_selection(train_store, layers, checkpoints)
        store = _open_store(train_store)
        directory = Path(index_dir)
        if (directory / META_NAME).exists() and not overwrite:
            raise ValueError(
                f"index_dir {directory} already holds an index; pass overwrite=True to replace "
                "it, or choose another directory."
            )
        layers = store.check_layers(layers) or store.layer_names
        wanted = store.check_checkpoints(checkpoints)
        where = f"store {store.save_dir}"
        check_vector_schema(store.schema, layers, where)
        weight, saved_weights = weights_of(checkpoint_weights)
        fingerprint = store_fingerprint(store)
        facts = store.capture_facts(layers)
        started = time.perf_counter()
        rows = unit_rows(store, wanted)
        plan = plan_parts(rows)
        n_total = sum(plan[2].values())
        # buffers of block_rows rows are allocated: more than the store's rows is all of them
        block_rows = min(block_rows, max(1, sum(len(r.hashes) for _, _, r in rows)))
        first = store.load_record(rows[0][0] if rows else 0, layers=layers).gradient
        dims = [int(first.layers[n].materialize().data[0].numel()) for n in layers]
        dim = sum(dims)
        del first
        built_kind, full = kinds.resolve(kind, n_total, dim, params)
        if directory.exists() and overwrite and (not dd.active() or dd.get_rank() == 0):
            (directory / META_NAME).unlink(missing_ok=True)  # first: no half-valid index
            for p in directory.glob("part_*"):
                p.unlink()
        directory.mkdir(parents=True, exist_ok=True)
        dd.barrier()  # under torch.distributed: rank 0 cleared, partition i % world is ours
        number = {rel: i for i, rel in enumerate(plan[2])}
        ours = {rel for rel, i in number.items() if i in dd.mine(len(number))}
        builders = {
            rel: PartBuilder(
                built_kind,
                dim,
                part_params(built_kind, full, plan[2][rel]),
                plan[2][rel],
                block_rows,
                directory / f".part_{number[rel]}.vectors.tmp",
            )
            for rel in number
            if rel in ours
        }
        if len(ours) < len(number):
            rows = dd.rows_to_read(rows, plan[0], ours)
        bar = progress_bar(
            show_progress, total=store.num_samples, desc="reading the store", unit="row"
        )
        try:
            last = 0
            stream = train_parts(
                store, layers, metric, wanted, weight,
                rows=rows, plan=plan, parts=builders, block_rows=block_rows,
                repeats=repeats,
            )  # fmt: skip
            for _, done, _, _ in stream:
                if bar is not None:
                    bar.update(done - last)
                last = done
            del rows, plan, stream
            read_s = time.perf_counter() - started
            entries, opened, rerank = write_parts(builders, number, directory)
            calibrate_s = sum(pb.calibration_seconds for pb in builders.values())
        finally:
            if bar is not None:
                bar.close()
            for pb in builders.values():
                pb.close()
        entries = dd.gather_entries(entries)
        recalls = [e["calibration"]["recall"] for e in entries if "calibration" in e]
        if built_kind == "ivf" and full.get("target_recall") is not None and entries:
            # the parts' nprobe were calibrated: the index's is the largest (the one that
            # reaches the target in every part); each part searches with its own
            full = {**full, "nprobe": max(int(e["params"]["nprobe"]) for e in entries)}
        meta = {
            "format": INDEX_FORMAT_NAME,
            "version": INDEX_FORMAT_VERSION,
            "metric": metric,
            "kind": built_kind,
            "requested_kind": kind,
            "params": full,
            "layers": list(layers),
            "dims": dims,
            "dim": dim,
            "num_samples": n_total,
            "checkpoints": sorted(wanted) if wanted is not None else None,
            "checkpoint_weights": saved_weights,
            "repeats": repeats,
            "capture_fingerprint": facts.fingerprint,
            "store": {
                "path": os.path.relpath(os.path.abspath(store.save_dir), directory.absolute()),
                "absolute_path": os.path.abspath(store.save_dir),
                "fingerprint": fingerprint,
            },
            "parts": entries,
            "expected_recall": min(recalls) if recalls else None,
            "build_seconds": {
                "read": read_s,
                "calibrate": calibrate_s,  # this rank's parts
                "total": time.perf_counter() - started,
            },
            "faiss_version": getattr(faiss, "__version__", "unknown"),
        }
        if not dd.active():
            write_json(directory / META_NAME, meta)
            return cls(directory, meta, store, opened, rerank)
        if dd.get_rank() == 0:
            write_json(directory / META_NAME, meta)
        dd.barrier()
        return cls.open(directory, store)

    # ---- open ------------------------------------------------------------------------------
    @classmethod
    def open(cls, index_dir: str | os.PathLike, store: Any = None) -> GradientIndex:
        """Open an index written by :meth:`build`, refusing one whose store changed.

        Args:
            index_dir: The index directory.
            store: The train store, when it moved since the build (default: the path
                recorded at build time, relative to the index first, then absolute).

        Raises:
            IndexFormatError: not an index (or an interrupted build), or a damaged one.
            FileNotFoundError: the store is not where the index recorded it.
            StaleIndexError: the store changed since the build (naming the file); rebuild.
        """
        faiss = kinds.import_faiss()
        directory = Path(index_dir)
        meta = read_index_meta(directory)
        recorded = meta["store"]
        if store is None:
            candidates = [directory / recorded["path"], Path(recorded["absolute_path"])]
            found = next((c for c in candidates if c.is_dir()), None)
            if found is None:
                raise FileNotFoundError(
                    f"the train store of the index {directory} is not at {candidates[0]} nor "
                    f"{candidates[1]}; pass its new location: GradientIndex.open(index_dir, "
                    "store=...)."
                )
            store = found
        store = _open_store(store)
        now = store_fingerprint(store)
        diff = fingerprint_difference(recorded["fingerprint"], now, Path(store.save_dir))
        if diff is not None:
            raise StaleIndexError(
                f"the train store {store.save_dir} changed since the index {directory} was "
                f"built: {diff}. Its scores would not be the store's; rebuild it with "
                f"GradientIndex.build(train_store, {str(directory)!r}, overwrite=True) (or "
                "dattri-llm index build --overwrite)."
            )
        facts = store.capture_facts(meta["layers"])
        if facts.fingerprint != meta["capture_fingerprint"]:
            raise StaleIndexError(
                f"the capture settings of {store.save_dir} differ from the ones the index "
                f"{directory} was built over; rebuild it."
            )
        parts, rerank = [], []
        for entry in meta["parts"]:
            faiss_path = directory / entry["faiss"]
            samples_path = directory / entry["samples_file"]
            for p in (faiss_path, samples_path):
                if not p.is_file():
                    raise IndexFormatError(f"{p} is missing from the index; rebuild it.")
            samples = json.loads(samples_path.read_text(encoding="utf-8"))
            index = faiss.read_index(os.fspath(faiss_path))
            if index.ntotal != len(samples["hashes"]) or index.ntotal != entry["samples"]:
                raise IndexFormatError(
                    f"{faiss_path} holds {index.ntotal} vectors but {samples_path} lists "
                    f"{len(samples['hashes'])} samples (index.json: {entry['samples']}); the "
                    "index is damaged: rebuild it."
                )
            kinds.set_search_params(index, meta["kind"], entry["params"])
            parts.append((index, samples["hashes"], samples["steps"], samples["checkpoints"]))
            name = entry.get("rerank_file")
            rerank.append(
                None
                if name is None
                else open_rerank_file(directory / name, index.ntotal, meta["dim"])
            )
        return cls(directory, meta, store, parts, rerank)

    def remove(self) -> None:
        """Delete the index directory's files (the store is untouched)."""
        shutil.rmtree(self.directory)

    # ---- search ----------------------------------------------------------------------------
    def search(
        self,
        test: Any,
        k: int = 10,
        *,
        nprobe: int | None = None,
        ef_search: int | None = None,
        rerank: int | None = None,
        preconditioner: Preconditioner | None = None,
        check_compatible: bool = True,
        output_dir: str | None = None,
    ) -> AttributionScore:
        """The top-``k`` proponents and opponents of every query, as an ``AttributionScore``.

        Args:
            test: The queries: a test gradient store (directory, ``GradientStorageManager``,
                ``DiskGradientSource``, whose ``checkpoints=`` is kept) or any gradient source
                of the indexed layers, with one checkpoint label. An index over one checkpoint
                reads only that checkpoint's records of a store holding several. Factorized
                query layers are materialized.
            k: Proponents and opponents per query; beyond the indexed samples it is clamped
                to their number. The index holds only finite vectors (a non-finite train
                vector is refused at build, a non-finite query here, naming the sample).
            nprobe: ``ivf``: lists visited per query (default: the build's).
            ef_search: ``hnsw``: the search's candidate list (default: the build's).
            rerank: ``ivf`` with PQ: re-rank ``rerank * k`` candidates exactly.
            preconditioner: Folded into the query side: a ``(D, D)`` matrix ``P`` (queries
                become ``q @ P``; for a symmetric ``P`` the score is ``q^T P g``, e.g. a
                projected inverse Fisher), a callable mapping the ``(M, D)`` float64
                queries to ``(M, D)``, or a fitted K-FAC / EK-FAC / projected-Fisher inverse
                applied layer by layer: the attributor itself, fitted here as
                ``attribute_from_cache(train, test, layers=<indexed>, checkpoints=[c],
                top_k=k)`` would be (its held fit reused only under the same key), so an
                exact search equals that call for every option of the attributor
                (``normalized_grad=True`` is refused); or
                ``attributor.preconditioner(damping=..., checkpoint=c)`` (a
                ``FisherPreconditioner`` of the indexed layers and checkpoint). A fitted
                inverse is refused for a ``"cosine"`` index, an index over several
                checkpoints or one built with ``checkpoint_weights`` (naming the option).
                A matrix or callable is applied after the Grad-Cos normalization. Default:
                identity.
            check_compatible: Refuse a test capture incompatible with the train store
                (layers, projection style / size / seed), as the attributors do.
            output_dir: The result's default ``save`` directory.

        Returns:
            An :class:`AttributionScore` with ``top_k_kept=k``: one row per kept train
            sample, ``NaN`` where a score was not kept; ``top_k(k' <= k)`` and ``query`` of
            kept entries work as after ``attribute_from_cache(..., top_k=k)``.
        """
        k = check_top_k(k, "k")
        if k is None:
            raise ValueError("k must be a positive int.")
        k = clamp_top_k(k, self.num_samples)  # beyond the indexed samples: every one
        source, where = self._test_source(test)
        if check_compatible:
            self._check_test(source)
        hashes, queries = query_vectors(source, self.layers, self.metric, where)
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"the {where} gives {queries.shape[1]} numbers per sample over the indexed "
                f"layers, the index holds {self.dim}; was it captured with another projection?"
            )
        queries = _precondition(queries, self._layerwise(preconditioner, source), self.dim)
        q = np.ascontiguousarray(queries.to(torch.float32).numpy())
        check_finite_vectors(q, hashes, "query")
        overrides = {"nprobe": nprobe, "efSearch": ef_search, "rerank": rerank}
        top, bottom = self._merged(q, k, overrides)
        return self._result(top, bottom, hashes, k, output_dir)

    def checkpoint_labels(self) -> list[int]:
        """The checkpoint labels of the indexed records (each sample's rows summed over them)."""
        wanted = self.meta.get("checkpoints")
        return sorted(wanted) if wanted is not None else self.store.available_checkpoints()

    def _fitted(self, p: Any, queries: Any) -> Any:
        """A fitted Fisher inverse for this index: ``p`` checked, or an attributor's fit.

        The search equals the attributor's ``top_k`` only where every option of both agrees;
        anything else is refused, naming the option and a remedy.
        """
        attributor = callable(getattr(p, "index_preconditioner", None))
        if not attributor and not callable(getattr(p, "precondition_gradient", None)):
            return p  # a matrix or a callable: folded in as it is
        what = f"{type(p).__name__} preconditioner"
        if self.metric != "dot":
            raise ValueError(
                f"the index {self.directory} was built with metric={self.metric!r} (unit train "
                f"vectors), and a fitted {what} scores raw train gradients: build the index "
                "with GradientIndex.build(train_store, index_dir, metric='dot')."
            )
        labels = self.checkpoint_labels()
        if len(labels) != 1:
            raise ValueError(
                f"the index {self.directory} sums each sample's vectors over checkpoints "
                f"{labels}, and a fitted {what} has one Fisher per checkpoint: build one index "
                "per checkpoint (GradientIndex.build(train_store, index_dir, checkpoints=[c])) "
                "and search each."
            )
        (c,) = labels
        weight = weights_of(self.meta.get("checkpoint_weights"))[0](c)
        if weight != 1.0:
            raise ValueError(
                f"the index {self.directory} was built with checkpoint_weights (weight {weight} "
                f"at checkpoint {c}), which a fitted {what} does not apply: build the index "
                "without checkpoint_weights."
            )
        if attributor:
            every = self.layers == list(self.store.layer_names)
            return p.index_preconditioner(self.store, None if every else self.layers, c, queries)
        if p.checkpoint is not None and p.checkpoint != c:
            raise ValueError(
                f"the preconditioner is the fit of checkpoint {p.checkpoint}, the index "
                f"{self.directory} covers checkpoint {c}: pass attributor.preconditioner("
                f"checkpoint={c}) (a fit of checkpoint {c}), or the fitted attributor itself."
            )
        return p

    def _layerwise(self, p: Any, queries: Any) -> Any:
        """A fitted per-layer preconditioner as a callable on the joined ``(M, D)`` queries."""
        p = self._fitted(p, queries)
        if not callable(getattr(p, "precondition_gradient", None)):
            return p
        if sorted(p.layer_names) != sorted(self.layers):
            raise ValueError(
                f"the preconditioner covers layers {sorted(p.layer_names)} but the index holds "
                f"{sorted(self.layers)}; build the index over the fitted layers "
                "(GradientIndex.build(..., layers=[...])) or fit over the indexed ones."
            )
        facts = self.store.capture_facts(self.layers).layers
        dims = [int(d) for d in self.meta["dims"]]

        def apply(q: torch.Tensor) -> torch.Tensor:
            parts = dict(zip(self.layers, torch.split(q, dims, dim=1)))
            grad = Gradient(
                {
                    n: Materialized(x, facts[n].layer_type, dict(facts[n].module_kwargs))
                    for n, x in parts.items()
                }
            )
            out = p.precondition_gradient(grad).layers
            return torch.cat(
                [out[n].materialize().data.reshape(len(q), -1) for n in self.layers], 1
            )

        return apply

    def _test_source(self, test: Any) -> tuple[Any, str]:
        from dattri_llm.gradient.sources import DiskGradientSource, store_reading
        from dattri_llm.gradient.store import GradientStorageManager

        if isinstance(test, (str, os.PathLike, GradientStorageManager)):
            test = DiskGradientSource(test, layers=self.layers)
        reading = store_reading(test)
        if reading is None:
            return test, "test source"
        given = None if reading.checkpoints is None else sorted(reading.checkpoints)
        wanted, labels = given, self.checkpoint_labels()
        held = reading.store.available_checkpoints()
        if given is None and len(labels) == 1 and len(held) > 1 and labels[0] in held:
            wanted = labels  # an index of one checkpoint pairs with that checkpoint's queries
        if reading.layers is None or list(reading.layers) != self.layers or wanted != given:
            # the selection the caller made (checkpoints, dtype) is kept
            test = DiskGradientSource(
                reading.store, layers=self.layers, dtype=reading.dtype, checkpoints=wanted
            )
        return test, f"test store {reading.store.save_dir}"

    def _check_test(self, source: Any) -> None:
        from dattri_llm.gradient.compat import check_compatible, facts_of

        train = self.store.capture_facts(self.layers)
        if hasattr(source, "capture_facts"):
            test = source.capture_facts()
        else:
            block = next(iter(source), None)
            if block is None:
                raise ValueError("the test source yielded no gradients.")
            test = facts_of(block.gradient.select_layers(self.layers), block.metadata, "test")
        check_compatible(train, test)

    def _merged(self, q: np.ndarray, k: int, overrides: dict[str, Any]) -> tuple[tuple, tuple]:
        """Per query, the ``k`` largest and the ``k`` smallest inner products over every part.

        Returns:
            ``((top values, global ids), (bottom values, global ids))``, each ``(M, <= k)``.
        """
        found: dict[bool, tuple[list, list]] = {True: ([], []), False: ([], [])}
        offset = 0
        ours = dd.mine(len(self._parts))  # under torch.distributed: partitions i % world
        for i, ((index, hashes, _, _), entry) in enumerate(zip(self._parts, self.meta["parts"])):
            n = len(hashes)
            if n and i in ours:
                params = {**entry["params"], **{a: b for a, b in overrides.items() if b}}
                runs = search_part(index, self.kind, params, self._rerank[i], q, min(k, n))
                for largest, d, i in runs:
                    missing = i < 0  # an approximate search found fewer than k
                    found[largest][0].append(d)
                    found[largest][1].append(
                        torch.where(missing, torch.full_like(i, -1), i + offset)
                    )
            offset += n
        out = []
        for largest in (True, False):
            empty = torch.zeros(len(q), 0, dtype=torch.float32)
            vals = torch.cat([empty, *found[largest][0]], 1)
            ids = torch.cat([empty.long(), *found[largest][1]], 1)
            v, pos = rank(vals, k, largest)
            out.append(dd.merge_ranks(v, ids.gather(1, pos), k, largest))
        return out[0], out[1]

    def _result(
        self,
        top: tuple[torch.Tensor, torch.Tensor],
        bottom: tuple[torch.Tensor, torch.Tensor],
        test_hashes: list[str],
        k: int,
        output_dir: str | None,
    ) -> AttributionScore:
        """The kept scores as the top-k sink represents them (one row per kept sample)."""
        all_hashes, all_steps, all_ckpts = [], [], []
        for _, hashes, steps, ckpts in self._parts:
            all_hashes += hashes
            all_steps += steps
            all_ckpts += ckpts
        used = torch.cat([top[1].flatten(), bottom[1].flatten()])
        used = torch.unique(used[used >= 0])
        row_of = torch.full((len(all_hashes) + 1,), -1, dtype=torch.long)
        row_of[used] = torch.arange(used.numel())
        m = len(test_hashes)
        mat = torch.full((used.numel(), m), float("nan"), dtype=torch.float32)
        for vals, ids in (top, bottom):
            ok = (ids >= 0) & torch.isfinite(vals)
            cols = torch.arange(m).unsqueeze(1).expand_as(ids)
            mat[row_of[ids[ok]], cols[ok]] = vals[ok]
        keep = used.tolist()
        return AttributionScore(
            mat,
            [all_hashes[i] for i in keep],
            [all_steps[i] for i in keep],
            test_hashes,
            output_dir=output_dir,
            train_checkpoints=[all_ckpts[i] for i in keep],
            top_k_kept=k,
            num_train=len(all_hashes),
            repeats=self.repeats,
        )


def _precondition(queries: torch.Tensor, p: Preconditioner | None, dim: int) -> torch.Tensor:
    if p is None:
        return queries
    if callable(p) and not isinstance(p, torch.Tensor):
        out = p(queries)
    else:
        p = torch.as_tensor(p)
        if tuple(p.shape) != (dim, dim):
            raise ValueError(
                f"preconditioner must be a ({dim}, {dim}) matrix over the indexed vectors, got "
                f"shape {tuple(p.shape)}; or pass a callable on the (M, {dim}) queries."
            )
        out = queries @ p.to(queries.dtype)
    if tuple(out.shape) != tuple(queries.shape):
        raise ValueError(
            f"the preconditioner returned shape {tuple(out.shape)} for queries of shape "
            f"{tuple(queries.shape)}; it must keep the shape."
        )
    return out.to(torch.float64)
