"""``KFACAttributor`` and ``EKFACAttributor``: influence with a Kronecker-factored Fisher.

``score(z, z') = g(z')^T (F̂ + λ I)^{-1} g(z)`` per layer (block-diagonal), with ``F̂`` the
K-FAC (``G ⊗ A``) or EK-FAC (Kronecker eigenbasis, empirical eigenvalues) approximation of the
empirical Fisher ``F = (1/N) sum_n g_n g_n^T`` of the training gradients. The exact conventions
(which ``A`` and ``G``, token counting, damping, non-Kronecker layers) are in
:mod:`dattri_llm.gradient.kronecker`.

Workflow: :meth:`fit` makes a *damping-free* fit (covariances, eigenbases, and for EK-FAC the
corrected eigenvalues) from the training gradients, once per model checkpoint; every later
``attribute*`` call reuses it with any ``damping``. The preconditioner is applied once to the
(usually few) test gradients (``prepare_test``) and the result is scored against the training
gradients with the same routed inner products as TracIn, so ``attribution_granularity="token"``
works (the score is linear in the train gradient).

A fit is persisted with :meth:`KFACAttributor.save_factors` (one folder per checkpoint) and read
back by :func:`load_factors`, which also takes fits in memory; :func:`load_covariances` reads
covariances accumulated during capture (a callback, its sums or their directory).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from dattri_llm.attribution.arguments import AttributionArguments
from dattri_llm.attribution.base import BaseAttributor
from dattri_llm.attribution.engine.blocks import LiveSource
from dattri_llm.attribution.kronecker.fit_key import data_key, live_key
from dattri_llm.attribution.kronecker.mixture import (
    check_mix,
    mixed_covariances,
    mixed_eigenvalues,
    queries_by_checkpoint,
)
from dattri_llm.attribution.kronecker.preconditioner import (
    FisherPreconditioner,
    resolve_damping,
)
from dattri_llm.attribution.kronecker.recorded import recorded_pass
from dattri_llm.attribution.kronecker.second_moment import SecondMomentFisher
from dattri_llm.attribution.normalization import check_flag, dense_row_dot, unit_rows
from dattri_llm.gradient.gradient import Gradient, GradientRecord
from dattri_llm.gradient.hooks import HookManagerConfig
from dattri_llm.gradient.kronecker import (
    EigenvalueCorrection,
    KroneckerCovariances,
    KroneckerFactors,
    NonKronecker,
    TokenCount,
    eigendecompose,
)
from dattri_llm.gradient.kronecker.covariances import as_gradient, check_fit_options, fit_progress
from dattri_llm.gradient.sources import (
    GradientBlock,
    GradientSource,
    InMemoryGradientSource,
    as_source,
)

__all__ = ["KFACAttributor", "EKFACAttributor", "load_factors", "load_covariances"]


class KFACAttributor(SecondMomentFisher, BaseAttributor):
    """K-FAC influence: ``g_test^T (G ⊗ A + λ I)^{-1} g_train`` per Kronecker-eligible layer.

    ``A`` is the mean over (gradient-carrying) token positions of ``a a^T`` and ``G`` the mean
    over training samples of the per-sample sum of ``g g^T``, so ``G ⊗ A`` approximates the
    mean empirical Fisher; ``damping`` is added to its eigenvalues (absolute, or times the
    layer's mean eigenvalue with ``relative=True``), hence heavy damping tends to Grad-Dot / λ.
    The default, ``0.1 ×`` each layer's mean eigenvalue (kronfluence's heuristic), is
    scale-free: in the quality benchmark it landed within 0.04 LDS of the best swept value on
    every setting (0.00 to 0.04), where a fixed absolute ``1e-3`` lost up to 0.13 on the
    language models (docs/benchmarks/quality.md).

    Layers K-FAC does not apply to (embeddings, norms) are left out of the scores with one
    warning (``non_kronecker="skip"``) or preconditioned by their exact diagonal Fisher
    (``"diagonal"``).

    Projected stores: a ``"logra"`` layer is K-FAC / EK-FAC in the projected space (``A``, ``G``
    of the projected factors, as LoGra); fitting it from a store needs its factors
    (``OffloadCallback(keep_token_factors=True)``) or covariances from a
    ``KroneckerCovarianceCallback`` under the same projection (then a compact store scores),
    else it is refused naming both. A ``"dense"`` / ``"sparse"`` / ``"mask"`` layer is one
    vector ``v`` per sample: it gets its **exact** Fisher ``F = (1/N) sum_n v_n v_n^T``
    (``proj_dim x proj_dim``; K-FAC and EK-FAC coincide; ``non_kronecker`` does not apply), so
    the score is ``sum_l v_test^T (F_l + λ I)^{-1} v_train`` with ``λ`` as above (relative:
    times ``tr(F_l) / proj_dim``). :meth:`preconditioner` hands the damped inverse to
    ``GradientIndex.search(preconditioner=...)``.

    Example:
        ```python
        attributor = KFACAttributor(AttributionArguments(output_dir="scores"), task=task)
        score = attributor.attribute(train_set, test_set)  # 0.1 x mean eigenvalue
        score_b = attributor.attribute(train_set, test_set, damping=1e-4)  # same fit
        ```

    Args:
        args: Run options.
        task: An :class:`AttributionTask` (or a dattri task) for the live path.
        non_kronecker: ``"skip"`` or ``"diagonal"``.
        tokens: Which positions ``A`` averages over: ``"gradient"`` (those whose output
            gradient is non-zero; padding and positions outside the loss drop out) or
            ``"all"``.
        eigen_dtype: Eigendecomposition dtype (float64 by default, also for float32 models).
        mode: Routing of the inner products (``"auto"``, ``"factorized"``, ``"materialized"``).
        normalized_grad: TrackStar's unit normalization after the preconditioner, on both
            sides: with ``P = (F̂ + λI)^{-1}`` the score becomes
            ``gᵀ P q / (√(gᵀ P g) √(qᵀ P q)) = cos(P^{1/2} g, P^{1/2} q)`` (TrackStar normalizes
            ``R^{-1/2} g``), norms over all preconditioned layers. Costs one preconditioning of
            every train chunk (materialized) for its ``P``-norm.
        mix: Fit the preconditioner on a mixture of train and query gradients (TrackStar fits
            its Fisher on one): ``A``, ``G`` (and EK-FAC's eigenvalues, diagonal Fishers) are
            ``(1 − mix) ×`` the train mean ``+ mix ×`` the query mean, the query side being the
            test gradients of the call. ``0`` (default): the train gradients alone. See
            :mod:`dattri_llm.attribution.kronecker.mixture`.
        second_moment: TrackStar's ``1/√(v + ε)`` per coordinate (a ``SecondMoment``, or one per
            checkpoint), fit and scores on corrected gradients; K-FAC on vector layers only
            (EK-FAC: corrected eigenvalues). See
            :mod:`dattri_llm.attribution.kronecker.second_moment`.
        damping: ``λ``: absolute, or with ``relative=True`` a factor of each layer's mean
            eigenvalue. ``None``: the default, ``0.1 ×`` each layer's mean eigenvalue. A call
            may pass its own (``attribute*(..., damping=...)``: one fit serves every damping).
        relative: Scale ``damping`` by each layer's mean eigenvalue (``None``: only for the
            default). A call may pass its own.
        repeats: How a train sample's rows under one checkpoint label combine (several
            epochs under one label, duplicates): ``"sum"`` or ``"mean"``; ``None``: ``"mean"``
            with ``normalized_grad`` (TrackStar's cosine), else ``"sum"``.

    Attributes:
        factors: ``{checkpoint: KroneckerFactors}``, the damping-free fit (empty before
            :meth:`fit`).
    """

    kind: ClassVar[str] = "kfac"

    def __init__(
        self,
        args: AttributionArguments | None = None,
        task: Any = None,
        non_kronecker: NonKronecker = "skip",
        tokens: TokenCount = "gradient",
        eigen_dtype: torch.dtype = torch.float64,
        mode: str = "auto",
        normalized_grad: bool = False,
        mix: float = 0.0,
        second_moment: Any = None,
        damping: float | None = None,
        relative: bool | None = None,
        repeats: str | None = None,
    ) -> None:
        super().__init__(args, task, mode=mode, repeats=repeats)
        resolve_damping(damping, relative)  # refuse a bad pair now, not at the first call
        self.normalized_grad = check_flag(
            normalized_grad, f"{type(self).__name__}(normalized_grad=)"
        )
        self.mix = check_mix(mix, f"{type(self).__name__}(mix=)")
        self._init_second_moment(second_moment)
        check_fit_options(non_kronecker, tokens)
        self.non_kronecker = non_kronecker
        self.tokens = tokens
        self.eigen_dtype = eigen_dtype
        self.factors: dict[int, KroneckerFactors] = {}
        self.damping = damping
        self.relative = relative
        self._fit_key: Any = None  # what self.factors was fitted on (see fit_key)
        self._live_key: Any = None  # the key of the live call in progress
        self._unlabelled = False  # one fit given without a checkpoint label: serves every label

    # ---- fitting ---------------------------------------------------------------------------
    def fit(
        self,
        train_source: Any = None,
        covariances: Any = None,
        factors: Any = None,
        save_dir: str | os.PathLike | None = None,
        refit: bool = False,
        hook_config: HookManagerConfig | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        query_source: Any = None,
    ) -> dict[int, KroneckerFactors]:
        """Fit (or load) the damping-free factors, once per checkpoint; later calls reuse them.

        Args:
            train_source: The training gradients: a :class:`GradientSource`, a list of
                blocks / records, a gradient store (directory or ``GradientStorageManager``),
                or a dataset (streamed live with the task's model). Not needed for K-FAC when
                ``covariances`` are given, nor when ``factors`` are.
            covariances: Covariances accumulated during capture: a
                :class:`KroneckerCovarianceCallback`, its ``.covariances``, a directory its
                ``save`` wrote, or ``{checkpoint: one of those}``. Skips the covariance pass.
            factors: A saved fit (directory written by ``save_dir``/:meth:`save_factors`), a
                :class:`KroneckerFactors`, or ``{checkpoint: KroneckerFactors}``.
            save_dir: Persist the fit there (safetensors + JSON, one folder per checkpoint).
            refit: Fit again even when a fit is held. Without it, a held fit is reused only
                when everything it depends on is unchanged: the training data (a store's
                directory and content fingerprint, the layers and checkpoint labels read; the
                same live dataset, hook config and weights; the same in-memory blocks, not
                modified) and the fit's settings (class, ``non_kronecker``, ``tokens``,
                ``eigen_dtype``, ``second_moment``, ``max_dim``); any other source is fitted
                anew (:mod:`dattri_llm.attribution.kronecker.fit_key`). A fit given as
                ``factors`` (or made from covariances alone) is used for every later call.
            hook_config: Layers to capture when ``train_source`` is a dataset.
            collate_fn: Collate of the live path when ``train_source`` is a dataset.
            query_source: The query gradients (a gradient source or blocks) of a ``mix > 0``
                fit; ``attribute_from_cache`` / ``attribute_sources`` pass their test side.
                A mixed fit is made anew by every call (it depends on the queries).

        Returns:
            ``{checkpoint: KroneckerFactors}``.

        Under an initialised ``torch.distributed`` group the fit is collective: every rank
        calls it on its share of the data and the accumulators are all-reduced.
        """
        key = self._fit_key_of(train_source, hook_config)
        if self.mix > 0 and factors is None:
            if query_source is None:
                raise ValueError(
                    f"{type(self).__name__}(mix={self.mix}) fits on train and query gradients: "
                    "score with attribute_from_cache / attribute_sources (they pass the test "
                    "side), or call fit(train_source, query_source=...) first and pass the "
                    "result as factors=."
                )
            refit = True
        if factors is not None:
            self.load_factors(factors)
        elif self.factors and not refit and self._reusable(key):
            pass  # reuse: one fit serves every damping and query on the same training data
        else:
            self.factors = self._tag_fits(
                self._fit(train_source, covariances, hook_config, collate_fn, query_source)
            )
            # made from covariances alone: the user's fit, for every later call; mixed: this
            # call's queries, never reused
            pinned = train_source is None
            self._fit_key = _PINNED if pinned else key if self.mix == 0 else None
            self._unlabelled = covariances is not None and not isinstance(covariances, Mapping)
        if save_dir is not None:
            self.save_factors(save_dir)
        return self.factors

    def _fit(
        self,
        train_source: Any,
        covariances: Any,
        hook_config: Any,
        collate_fn: Any,
        query_source: Any = None,
    ) -> dict[int, KroneckerFactors]:
        source = self._as_source(train_source, hook_config, collate_fn)
        show = self.args.show_progress
        if covariances is not None:
            covs = load_covariances(covariances)
            self._check_moment_covariances(covs)
            skipped = {n: t for cov in covs.values() for n, t in cov.skipped.items()}
            if self.non_kronecker == "diagonal" and skipped:
                raise ValueError(
                    f"{type(self).__name__}(non_kronecker='diagonal') was given covariances "
                    "accumulated with non_kronecker='skip' (KroneckerCovarianceCallback's "
                    f"default): they hold no diagonal Fisher for {skipped}. Create the callback "
                    "as KroneckerCovarianceCallback(non_kronecker='diagonal'), or fit from the "
                    "training gradients without covariances=."
                )
        else:
            if source is None:
                raise ValueError(
                    f"{type(self).__name__}.fit needs the training gradients "
                    "(train_source) or covariances=... (or factors=...)."
                )
            covs = {}
            # a compact store recorded its K-FAC sums at capture: read only what they lack
            recorded = recorded_pass(source, self.non_kronecker, self.tokens)
            passing = source if recorded is None else recorded.blocks
            fit_source = self._fit_blocks(passing, "covariances")
            try:
                for block in fit_progress(fit_source, "K-FAC covariances", show):
                    c = int(getattr(block, "checkpoint", 0))
                    if c not in covs:
                        covs[c] = KroneckerCovariances(self.non_kronecker, self.tokens)
                    covs[c].update(as_gradient(block))
            except ValueError as e:
                if self.tokens == "all" and "factors are gone" in str(e):
                    raise ValueError(
                        f"{e} A store written with OffloadCallback's defaults recorded its "
                        f"covariances counting tokens='gradient'; {type(self).__name__}"
                        "(tokens='all') needs the factors. Use tokens='gradient' (the default), "
                        "or capture with KroneckerCovarianceCallback(tokens='all') and pass it "
                        "as covariances=."
                    ) from None
                raise
            if recorded is not None:
                recorded.add_to(covs, self.non_kronecker)
            if not covs:
                raise ValueError("the train source yielded no gradients: nothing to fit.")
        queries = None
        if self.mix > 0:
            queries = queries_by_checkpoint(as_source(query_source, "query"), sorted(covs))
            for c in covs:
                qcov = KroneckerCovariances(self.non_kronecker, self.tokens)
                for g in queries[c]:
                    qcov.update(self._fit_gradient(g, c, "covariances"))
                covs[c] = mixed_covariances(covs[c], qcov, self.mix)
        out = {
            c: eigendecompose(cov, dtype=self.eigen_dtype, progress=show, warn_skipped=(i == 0))
            for i, (c, cov) in enumerate(sorted(covs.items()))
        }
        if self.kind == "ekfac":
            if source is None:
                raise ValueError(
                    "EKFACAttributor.fit needs the training gradients "
                    "(train_source) for the eigenvalue correction, also when "
                    "covariances are given."
                )
            source = self._fit_blocks(source, "eigenvalues")
            if queries is None:
                return _ekfac_pass(out, source, show)
            out = {
                c: mixed_eigenvalues(
                    f,
                    (as_gradient(b) for b in source if int(getattr(b, "checkpoint", 0)) == c),
                    (self._fit_gradient(g, c, "eigenvalues") for g in queries[c]),
                    self.mix,
                )
                for c, f in out.items()
            }
        return out

    def _fit_settings(self) -> tuple:
        """The settings a fit depends on (with the training data, its reuse key)."""
        return (
            type(self).__qualname__,
            self.kind,
            self.non_kronecker,
            self.tokens,
            str(self.eigen_dtype),
            self._moment_key(),
        )

    def _fit_key_of(self, source: Any, hook_config: Any = None) -> tuple | None:
        """What a fit from ``source`` depends on (``None``: it cannot be reused)."""
        if source is None:
            return None
        if isinstance(source, LiveSource):
            data = self._live_key
        elif _looks_like_dataset(source):
            data = live_key(source, hook_config, self.task)
        else:
            data = data_key(source)
        return None if data is None else (data, self._fit_settings())

    def _reusable(self, key: tuple | None) -> bool:
        """Whether the held fit serves a call whose fit key is ``key``."""
        return self._fit_key is _PINNED or (key is not None and self._fit_key == key)

    def _as_source(
        self, train_source: Any, hook_config: Any, collate_fn: Any
    ) -> GradientSource | None:
        if train_source is None:
            return None
        if isinstance(train_source, (str, os.PathLike)) or _is_store(train_source):
            from dattri_llm.gradient.sources import DiskGradientSource

            return DiskGradientSource(train_source, device=self.device)
        if (
            isinstance(train_source, (list, tuple))
            and train_source
            and isinstance(train_source[0], (GradientBlock, GradientRecord, Gradient))
        ):
            items = [
                GradientBlock(0, x, [f"row{i}" for i in range(x.batch_size)])
                if isinstance(x, Gradient)
                else x
                for x in train_source
            ]
            return InMemoryGradientSource(items)
        if isinstance(train_source, GradientSource) or not _looks_like_dataset(train_source):
            return as_source(train_source, "train")
        return self._live_source(train_source, hook_config, collate_fn)

    def _live_source(self, dataset: Any, hook_config: Any, collate_fn: Any) -> Iterable:
        from dattri_llm.gradient.streaming import GradientStreamer

        if self.task is None:
            raise ValueError(
                f"{type(self).__name__}.fit got a dataset but no task: pass "
                "task=AttributionTask(...) to the constructor, or a gradient store."
            )
        args, task = self.args, self.task
        collate_fn = self._collate(collate_fn)

        class _Live:
            rereadable = False

            def __iter__(self) -> Any:
                for c in range(task.num_checkpoints):
                    task.load_checkpoint(c)
                    yield from GradientStreamer(
                        task.model,
                        dataset,
                        task.train_loss,
                        hook_config=hook_config,
                        batch_size=args.per_device_train_batch_size,
                        checkpoint=c,
                        collate_fn=collate_fn,
                        num_workers=args.dataloader_num_workers,
                        show_progress=args.show_progress,
                        desc=f"fit ckpt {c}",
                    )

        return _Live()

    # ---- persistence -----------------------------------------------------------------------
    def save_factors(self, path: str | os.PathLike) -> None:
        """Write the fit: ``path/checkpoint_<c>/kronecker_factors.{safetensors,json}``."""
        if not self.factors:
            raise ValueError("nothing to save: call fit(...) first.")
        for c, f in self.factors.items():
            f.save(os.path.join(path, f"checkpoint_{c}"))

    def load_factors(self, path: Any) -> dict[int, KroneckerFactors]:
        """Load a fit written by :meth:`save_factors` (validated) and use it from now on.

        Also takes what :func:`load_factors` does. A fit of one checkpoint label (a folder
        ``checkpoint_<c>/`` or ``{c: fit}``) serves that label; a single fit without a label (a
        ``KroneckerFactors``, or a folder holding ``kronecker_factors.json``) serves every label.
        """
        self.factors = load_factors(path)
        self._fit_key, self._unlabelled = _PINNED, _is_unlabelled(path)
        return self.factors

    # ---- scoring hooks ---------------------------------------------------------------------
    def _fit_for(self, checkpoint: int, strict: bool = False) -> KroneckerFactors:
        """The fit of ``checkpoint``.

        In a call, a single fit serves the test side whatever its label (it is the fit of the
        call's train side, which a single test checkpoint pairs with). ``strict`` (a
        preconditioner asked for by label): only a fit of that label, or one given without any.
        """
        if not self.factors:
            raise RuntimeError(f"{type(self).__name__} has no fit: call fit(...) first.")
        lenient = not strict or self._unlabelled
        if checkpoint in self.factors:
            fit = self.factors[checkpoint]
        elif len(self.factors) == 1 and lenient:
            fit = next(iter(self.factors.values()))
        else:
            raise ValueError(
                f"{type(self).__name__} has no Kronecker fit for checkpoint {checkpoint}; "
                f"fitted checkpoints: {sorted(self.factors)}. Fit it on that checkpoint's "
                f"training gradients: fit(DiskGradientSource(train_store, checkpoints="
                f"[{checkpoint}]), refit=True)."
            )
        if fit.kind != self.kind:
            raise ValueError(
                f"{type(self).__name__} got a {fit.kind!r} fit; expected "
                f"{self.kind!r} (load the matching factors)."
            )
        return self._check_fit_moment(fit, checkpoint)

    def prepare_test(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Apply ``(F̂ + λ I)^{-1}`` to the test gradients (once per checkpoint).

        With ``normalized_grad`` each row is then divided by its ``P``-norm ``√(qᵀ P q)``.
        """
        fit = self._fit_for(checkpoint)
        gradient = self._score_view(gradient, checkpoint, fit.layer_names)
        out = fit.precondition(gradient, *resolve_damping(self.damping, self.relative))
        if not self.normalized_grad:
            return out
        return unit_rows(out, dense_row_dot(gradient.select_layers(fit.layer_names), out))

    def prepare_train(self, gradient: Gradient, checkpoint: int) -> Gradient:
        """Keep the preconditioned layers (skipped ones do not enter the score).

        With ``normalized_grad`` each row is divided by its ``P``-norm ``√(gᵀ P g)``.
        """
        fit = self._fit_for(checkpoint)
        out = self._score_view(gradient.select_layers(fit.layer_names), checkpoint, fit.layer_names)
        if not self.normalized_grad:
            return out
        pre = fit.precondition(out, *resolve_damping(self.damping, self.relative))
        return unit_rows(out, dense_row_dot(out, pre))

    def preconditioner(
        self, damping: float | None = None, relative: bool | None = None, checkpoint: int = 0
    ) -> FisherPreconditioner:
        """The fitted ``(F̂ + λ I)^{-1}`` of one checkpoint, for another query side.

        E.g. ``GradientIndex.search(..., preconditioner=...)``: an exact (``flat``) search over
        the fitted layers ranks as ``attribute_from_cache(..., top_k=k)`` with this damping.

        Args:
            damping: ``λ``, as the constructor's (``None``: the constructor's, by default
                ``0.1 ×`` each layer's mean eigenvalue; never a call's).
            relative: Scale ``damping`` by each layer's mean eigenvalue (``None``: the
                constructor's).
            checkpoint: The checkpoint label of the fit (only a fit of that label, or a single
                fit given without a label, e.g. a ``KroneckerFactors``, serves it).

        Raises:
            ValueError: no fit of ``checkpoint``, naming the fitted labels and how to fit it.
        """
        damping, relative = resolve_damping(
            self.damping if damping is None else damping,
            self.relative if relative is None else relative,
        )
        fit = self._fit_for(checkpoint, strict=True)
        p = FisherPreconditioner(fit, damping, relative, checkpoint=checkpoint)
        return self._moment_preconditioner(p, checkpoint)

    def index_preconditioner(
        self, store: Any, layers: list[str] | None, checkpoint: int, queries: Any
    ) -> FisherPreconditioner:
        """The inverse with which an exact index search scores as this attributor does.

        What ``GradientIndex.search(..., preconditioner=attributor)`` folds into its queries:
        the fit that ``attribute_from_cache(store, queries, layers=layers,
        checkpoints=[checkpoint], top_k=k)`` makes or reuses (for ``mix > 0``, on these
        queries), damped as the constructor says.

        Args:
            store: The index's train store (a ``GradientStorageManager``).
            layers: The indexed layers (``None``: every stored layer).
            checkpoint: The one checkpoint label the index covers.
            queries: The search's query source.

        Raises:
            ValueError: ``normalized_grad=True``: every train gradient is divided by its
                ``P``-norm, which an index of raw gradients does not hold.
        """
        name = type(self).__name__
        if self.normalized_grad:
            raise ValueError(
                f"{name}(normalized_grad=True) divides every train gradient by its P-norm "
                "sqrt(g^T P g), which an index of raw gradients does not hold, so "
                "GradientIndex.search cannot give its scores. Score with "
                f"{name}(..., normalized_grad=True).attribute_from_cache(train_store, "
                "test_store, top_k=k), or search with a preconditioner of an attributor built "
                "with normalized_grad=False."
            )
        from dattri_llm.gradient.sources import DiskGradientSource

        labels = store.available_checkpoints()
        source = DiskGradientSource(
            store,
            layers=layers,
            device=self.device,
            checkpoints=None if labels == [checkpoint] else [checkpoint],
        )
        self.fit(source, query_source=queries if self.mix > 0 else None)
        return self.preconditioner(checkpoint=checkpoint)

    # ---- the call's plan --------------------------------------------------------------------
    call_options = ("damping", "relative")

    def check_option(self, name: str, value: Any, where: str) -> Any:
        """``damping`` (a number >= 0) or ``relative`` (a flag) of one call."""
        if name == "relative":
            return check_flag(value, where)
        resolve_damping(value, None)  # the number's own check
        return value

    def check_call(self, granularity: str, live: bool) -> None:
        """Refuse token granularity with a correction, and a damping pair that means nothing."""
        self._check_moment_granularity(granularity)
        resolve_damping(self.damping, self.relative)

    def fit_call(self, train: Any, test: Any, sides: Any, fit_options: dict[str, Any]) -> None:
        """Fit for one call; a ``mix > 0`` fit reads the call's test blocks too.

        A live call's fit is reused only for the same dataset, hook config and weights
        (:func:`~dattri_llm.attribution.kronecker.fit_key.live_key`).

        Raises:
            ValueError: a fit per train checkpoint but the test gradients at one checkpoint
                only (it would precondition them with one checkpoint's inverse for all).
        """
        self._live_key = None
        if sides is not None:
            self._live_key = live_key(sides.train_set, sides.hook_config, self.task)
        if self.mix > 0 and fit_options.get("factors") is None and test is not None:
            fit_options = {**fit_options, "query_source": test}
        self.fit(train, **fit_options)
        labels = {self.pairing_key(b) for b in test or ()}
        if len(labels) == 1 and len(self.factors) > 1:
            label = labels.pop()
            raise ValueError(
                f"{type(self).__name__}: the train gradients have a Fisher fit per checkpoint "
                f"{sorted(self.factors)}, the test gradients exist at checkpoint {label} "
                "only; a single test checkpoint pairs with every train checkpoint, so its "
                "gradients would be preconditioned with one checkpoint's inverse for all of "
                "them. Capture the test set at every train checkpoint "
                "(HookManager.checkpoint), or score the train checkpoint the test set was "
                "captured at: attribute_sources(DiskGradientSource(train_store, "
                f"checkpoints=[{label}]), DiskGradientSource(test_store))."
            )


class EKFACAttributor(KFACAttributor):
    """EK-FAC influence: the K-FAC eigenbasis with empirical eigenvalues.

    ``F̂ = (Q_G ⊗ Q_A) diag(Λ) (Q_G ⊗ Q_A)^T`` with ``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` from
    a second pass over the training gradients (George et al., 2018; Grosse et al., 2023).
    Everything else (damping, layers, persistence, reuse) is as for :class:`KFACAttributor`;
    covariances from a :class:`KroneckerCovarianceCallback` save the first pass.
    ``second_moment=`` (TrackStar's ``1/√(v + ε)``) keeps the uncorrected basis and fits ``Λ``
    on the corrected gradients (:mod:`dattri_llm.attribution.kronecker.second_moment`).
    """

    kind: ClassVar[str] = "ekfac"


# ---- saved fits ------------------------------------------------------------------------------
_FACTORS_JSON = "kronecker_factors.json"
_COV_JSON = "kronecker_covariances.json"


def load_factors(obj: Any) -> dict[int, KroneckerFactors]:
    """``{checkpoint: KroneckerFactors}`` from a fit, a dict of fits or a saved directory."""
    if isinstance(obj, KroneckerFactors):
        return {0: obj}
    if isinstance(obj, Mapping):
        out = {}
        for c, f in obj.items():
            if not isinstance(f, KroneckerFactors):
                raise TypeError(
                    f"factors[{c!r}] must be a KroneckerFactors, got {type(f).__name__}."
                )
            out[int(c)] = f
        return out
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        if os.path.exists(os.path.join(path, _FACTORS_JSON)):
            return {0: KroneckerFactors.load(path)}
        subs = (
            sorted(d for d in os.listdir(path) if d.startswith("checkpoint_"))
            if os.path.isdir(path)
            else []
        )
        if not subs:
            raise FileNotFoundError(
                f"{path} holds no saved Kronecker factors (expected "
                f"{_FACTORS_JSON} or checkpoint_<c>/ folders)."
            )
        return {int(d.split("_", 1)[1]): KroneckerFactors.load(os.path.join(path, d)) for d in subs}
    raise TypeError(
        f"factors must be a directory, a KroneckerFactors or a dict of them, got "
        f"{type(obj).__name__}."
    )


def load_covariances(obj: Any) -> dict[int, KroneckerCovariances]:
    """``{checkpoint: KroneckerCovariances}`` from a callback, covariances, a directory, a dict."""
    if isinstance(obj, Mapping):
        return {int(c): _one_cov(v) for c, v in obj.items()}
    return {0: _one_cov(obj)}


def _one_cov(obj: Any) -> KroneckerCovariances:
    if isinstance(obj, KroneckerCovariances):
        return obj
    cov = getattr(obj, "covariances", None)  # a KroneckerCovarianceCallback
    if isinstance(cov, KroneckerCovariances):
        return cov
    if isinstance(obj, (str, os.PathLike)):
        if not os.path.exists(os.path.join(obj, _COV_JSON)):
            raise FileNotFoundError(f"{obj} holds no saved covariances ({_COV_JSON}).")
        return KroneckerCovariances.load(obj)
    raise TypeError(
        "covariances must be a KroneckerCovarianceCallback, KroneckerCovariances, "
        f"a directory or a dict of them, got {type(obj).__name__}."
    )


# ---- helpers ---------------------------------------------------------------------------------
#: The fit key of a fit the user gave (``factors=``, or covariances alone): serves every call.
_PINNED = ("pinned",)


def _is_unlabelled(obj: Any) -> bool:
    """Whether a fit given to :func:`load_factors` carries no checkpoint label."""
    if isinstance(obj, KroneckerFactors):
        return True
    if isinstance(obj, (str, os.PathLike)):
        return os.path.exists(os.path.join(os.fspath(obj), _FACTORS_JSON))
    return False


def _ekfac_pass(
    fits: dict[int, KroneckerFactors], source: Iterable, show: bool | None
) -> dict[int, KroneckerFactors]:
    """One pass over the training gradients, each block feeding its checkpoint's correction."""
    corr = {c: EigenvalueCorrection(f) for c, f in fits.items()}
    passing = source if any(c.needs_pass for c in corr.values()) else ()  # vectors: exact
    for block in fit_progress(passing, "EK-FAC eigenvalues", show):
        c = int(getattr(block, "checkpoint", 0))
        key = c if c in corr else (next(iter(corr)) if len(corr) == 1 else None)
        if key is None:
            raise ValueError(
                f"train block at checkpoint {c} has no K-FAC fit (fitted: {sorted(corr)})."
            )
        corr[key].update(as_gradient(block))
    return {c: corr[c].result() for c in sorted(corr)}


def _is_store(obj: Any) -> bool:
    return type(obj).__name__ == "GradientStorageManager"


def _looks_like_dataset(obj: Any) -> bool:
    """A dataset of samples (not of gradient blocks): indexable, first item not a block."""
    if isinstance(obj, (str, bytes, os.PathLike)) or isinstance(obj, Mapping):
        return False
    if not hasattr(obj, "__getitem__") or not hasattr(obj, "__len__") or len(obj) == 0:
        return False
    first = obj[0]
    if isinstance(first, tuple) and 3 <= len(first) <= 5 and isinstance(first[1], Gradient):
        return False  # (step, Gradient, hashes, ...) blocks
    return not isinstance(first, (GradientBlock, GradientRecord, Gradient))
