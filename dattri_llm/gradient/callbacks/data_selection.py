"""``DataSelectionCallback``: online data selection inside the training step.

After each backward pass (``param.grad`` accumulated, optimizer step not yet taken) every
training sample of the micro-batch is scored by the alignment of its per-sample gradient with a
reference direction (Grad-Dot or Grad-Cos), and the lowest-scoring samples' contributions are
subtracted from ``param.grad``: the optimizer then steps as if they were never in the batch.

Exactness needs every trainable parameter to be covered by a hooked layer, unprojected and
untransformed per-sample gradients, and a loss that is a sum (or mean) of independent per-sample
terms (no BatchNorm, no in-batch contrastive terms). What cannot be exact is refused.

Under ``DistributedDataParallel`` the selection is over the *global* batch (every rank's samples
of the same backward pass), and the dropped samples leave the all-reduced ``param.grad``: each
rank's correction is all-reduced and averaged like DDP's own gradients, after DDP's reduction
has finished. FSDP, ``DataParallel`` and gradients reduced by other means are refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch
import torch.distributed as dist
from torch import nn

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.gradient import Factorized, Gradient, Materialized, Shared
from dattri_llm.gradient.hooks.config import is_data_parallel
from dattri_llm.gradient.ops import inner as ops
from dattri_llm.options import similarity_metric
from dattri_llm.utils.distributed import all_reduce_sum, get_world_size, settle_collectives_at_exit

if TYPE_CHECKING:
    from dattri_llm.gradient.gradient import GradientRecord
    from dattri_llm.gradient.hooks.host import CaptureHost

__all__ = ["DataSelectionCallback", "SelectionStep"]

Reference = Union[Gradient, Callable[[], Gradient]]  # noqa: UP007 (runtime alias, py3.10)


@dataclass
class SelectionStep:
    """What one step kept and dropped (``callback.history`` holds one per selecting step).

    Attributes:
        step: The record's step (the hook manager's backward-pass counter).
        kept_hashes: Sample ids of the kept rows, in batch order.
        kept_scores: Their alignment scores.
        dropped_hashes: Sample ids of the dropped rows, in batch order.
        dropped_scores: Their alignment scores.
        scale: Factor applied to the kept samples' contribution (``B / (B - k)`` with
            ``renormalize=True``, else 1).
    """

    step: int
    kept_hashes: list[str]
    kept_scores: list[float]
    dropped_hashes: list[str]
    dropped_scores: list[float]
    scale: float = 1.0


def _site_weighted_sum(site: Factorized | Materialized, w: torch.Tensor) -> torch.Tensor:
    """``sum_i w_i * grad_i`` as a dense ``(1, P)`` row, without per-sample materialisation."""
    idx = w.nonzero().flatten()
    part = Gradient({"site": site.slice(idx)}).scale(w[idx])
    return part.aggregate().layers["site"].data


def _active_ddp() -> nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` whose forward is running (``None`` outside one)."""
    getter = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)
    return getter() if getter is not None else None


def _no_ddp_error(world: int) -> RuntimeError:
    return RuntimeError(
        f"DataSelectionCallback runs under torch.distributed with {world} ranks (or FSDP), but "
        "this step's forward ran outside a DistributedDataParallel wrapper: FSDP (and gradients "
        "reduced by other means) change param.grad in ways the dropped samples cannot be removed "
        "from exactly. Wrap the model in torch.nn.parallel.DistributedDataParallel (before or "
        "after building the HookManager), or run online data selection in a single process."
    )


def _check_ddp(ddp: nn.parallel.DistributedDataParallel, model: nn.Module) -> None:
    """Refuse DDP settings under which the correction would not meet DDP's own average."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not any(m is inner for m in ddp.module.modules()):
        raise RuntimeError(
            "DataSelectionCallback: the DistributedDataParallel running this forward does not "
            "wrap the hooked model (a nested DDP?). Wrap the whole hooked model in one DDP."
        )
    hooks = [getattr(h, "__name__", type(h).__name__) for h, _ in getattr(ddp, "_comm_hooks", [])]
    ignored = getattr(ddp, "parameters_to_ignore", set())
    delayed = getattr(ddp, "_delay_all_reduce_params", [])
    if hooks or ignored or delayed:
        raise RuntimeError(
            "DataSelectionCallback under DistributedDataParallel needs DDP's plain averaging "
            "all-reduce of every parameter, since the dropped samples' contributions are removed "
            "by the same average; found "
            + "; ".join(
                part
                for part in (
                    f"communication hooks {hooks} (register_comm_hook / mixed_precision)"
                    if hooks
                    else "",
                    f"parameters DDP ignores {sorted(ignored)}" if ignored else "",
                    f"{len(delayed)} parameters with delayed all-reduce" if delayed else "",
                )
                if part
            )
            + ". Build the DDP wrapper without them."
        )


def _gather_scores(
    s: torch.Tensor, direction: tuple[float, float], world: int
) -> tuple[torch.Tensor, int]:
    """Every rank's scores, rank after rank, and where this rank's rows start.

    Each rank also sends a fingerprint of its reference direction (norm, entry sum): ranks that
    score against different directions are refused, on every rank alike.
    """
    dev = s.device
    head = torch.tensor([float(s.shape[0]), *direction], dtype=torch.float64, device=dev)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head)
    counts = [int(h[0]) for h in heads]
    prints = torch.stack([h[1:] for h in heads])
    if not torch.allclose(prints, prints[0].expand_as(prints), rtol=1e-6, atol=0.0):
        raise RuntimeError(
            "DataSelectionCallback: the ranks' reference directions differ (norm, entry sum per "
            f"rank: {prints.tolist()}); selection over the global batch scores every sample "
            "against one direction. Give every rank the same reference (the same validation "
            "samples on every rank, or gradients all-gathered before building it)."
        )
    width = max(counts)
    padded = torch.zeros(width, dtype=torch.float64, device=dev)
    padded[: s.shape[0]] = s.detach().to(torch.float64)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    settle_collectives_at_exit()
    every = torch.cat([part[:c] for part, c in zip(parts, counts)])
    return every.to(s.dtype), sum(counts[: dist.get_rank()])


class DataSelectionCallback(HookCallback):
    """Drop the training samples least aligned with a reference direction, inside the step.

    Add it to the :class:`~dattri_llm.HookManager` of a training loop; ``loss.backward()``
    then leaves in ``param.grad`` the gradient of the loss over the kept samples only, so any
    ``torch.optim`` optimizer steps as if the dropped samples were never in the batch. Each
    backward pass is selected on its own (gradient accumulation stays exact).

    Under ``torch.nn.parallel.DistributedDataParallel`` (wrapped before or after the manager is
    built) one backward pass is selected over the *global* batch, every rank's samples of that
    pass together: ``drop_fraction`` drops ``floor(drop_fraction * B)`` of all ``B`` samples,
    ``threshold`` keeps the best of them if all score below it, and ``renormalize`` uses the
    global ``B`` and ``k``. A sample's Grad-Dot score is that of its contribution to the
    averaged ``.grad`` (its rank's gradient over the world size). The reduced ``.grad`` then
    equals one process's selection on the global batch with the loss ``(1/W) sum_r loss_r``
    (the global mean loss when every rank's loss is the mean over an equal batch). Every rank
    must give the same reference (checked; a callable should run ``ddp.module``, not the DDP
    wrapper, whose reduction of the training step is still pending) and run the same number of
    backward passes (no ``Join``). Passes under ``no_sync()`` are corrected locally and reduced
    by DDP later. FSDP, ``DataParallel``, DDP communication hooks and other cross-rank
    reductions are refused.

    Args:
        reference: Direction to align with: a :class:`~dattri_llm.Gradient` (e.g. validation
            samples' per-sample gradients captured with the same hook config; their mean is
            the target) or a zero-argument callable returning one, called every
            ``refresh_interval`` steps so the target follows the model. The callable runs with
            this manager paused and the training ``.grad`` set aside, so it may run its own
            forward / backward passes. Its layers may be a subset of the hooked layers (the
            score then uses only those).
        score: ``"dot"`` (Grad-Dot) or ``"cosine"`` (Grad-Cos; alias ``"cos"``).
        drop_fraction: Drop the lowest-scoring ``floor(drop_fraction * B)`` samples of each
            micro-batch of ``B`` (never all of them; under DDP, ``B`` counts every rank's
            samples). Exclusive with ``threshold``.
        threshold: Drop the samples scoring below it (the best sample is always kept; under
            DDP, the best of the global batch).
        renormalize: For a batch-*mean* loss: rescale the kept samples' contribution by
            ``B / (B - k)`` so ``.grad`` is the mean-loss gradient of the kept samples.
        refresh_interval: Steps between calls of a callable ``reference``.
        warmup_steps: Number of first steps that select nothing (and are not logged).
        enabled: Turn selection off (``callback.enabled = False``) without removing it.

    Attributes:
        history: One :class:`SelectionStep` per selecting step.

    Example:
        ```python
        sel = DataSelectionCallback(reference=val_grad, score="cosine", drop_fraction=0.25)
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[sel])
        with hm.collect():
            for batch in loader:
                opt.zero_grad(); loss_fn(model, batch).backward(); opt.step()
        ```
    """

    def __init__(
        self,
        *,
        reference: Reference,
        score: str = "dot",
        drop_fraction: float | None = None,
        threshold: float | None = None,
        renormalize: bool = False,
        refresh_interval: int = 1,
        warmup_steps: int = 0,
        enabled: bool = True,
    ) -> None:
        if not isinstance(reference, Gradient) and not callable(reference):
            raise TypeError(
                "reference must be a Gradient or a zero-argument callable returning one, got "
                f"{type(reference).__name__}"
            )
        score = similarity_metric(score, "score")
        if (drop_fraction is None) == (threshold is None):
            raise ValueError(
                "give exactly one of drop_fraction (drop the lowest-scoring fraction of each "
                "batch) and threshold (drop samples scoring below it); got "
                f"drop_fraction={drop_fraction!r}, threshold={threshold!r}"
            )
        if drop_fraction is not None and not 0.0 <= float(drop_fraction) < 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1), got {drop_fraction!r}")
        if threshold is not None and not math.isfinite(float(threshold)):
            raise ValueError(f"threshold must be a finite number, got {threshold!r}")
        for arg, val, lo in (
            ("refresh_interval", refresh_interval, 1),
            ("warmup_steps", warmup_steps, 0),
        ):
            if not isinstance(val, int) or isinstance(val, bool) or val < lo:
                raise ValueError(f"{arg} must be an integer >= {lo}, got {val!r}")
        self.reference = reference
        self.score = score
        self.drop_fraction = drop_fraction
        self.threshold = threshold
        self.renormalize = bool(renormalize)
        self.refresh_interval = refresh_interval
        self.warmup_steps = warmup_steps
        self.enabled = enabled
        self.history: list[SelectionStep] = []
        self._direction: Gradient | None = None
        self._direction_norm: float | None = None
        self._direction_sum: float | None = None
        self._seen = 0
        # (DDP running this step's forward, whether it reduces in this backward)
        self._step_ddp: tuple[nn.parallel.DistributedDataParallel, bool] | None = None

    # ---- checks ------------------------------------------------------------------------------
    def on_register(self, manager: CaptureHost) -> None:
        """Refuse configurations under which dropping cannot be exact."""
        super().on_register(manager)
        if manager.config.projection is not None:
            raise ValueError(
                "DataSelectionCallback needs the exact per-sample gradients: a capture-time "
                "projection (HookManagerConfig.projection) cannot be subtracted from param.grad. "
                "Use a HookManager without projection for training."
            )
        pg = [s.name for s in manager.layers if s.hook_type == "param_grad"]
        if pg:
            raise ValueError(
                f"DataSelectionCallback: layers {pg} are hooked with param_grad, which gives no "
                "per-sample gradients; hook them with linear_io."
            )
        from dattri_llm.gradient.streaming import is_distributed_wrapper  # lazy: no cycle

        ddp = isinstance(manager.model, nn.parallel.DistributedDataParallel)
        if not ddp and (is_data_parallel(manager.model) or is_distributed_wrapper(manager.model)):
            raise ValueError(
                "DataSelectionCallback does not support DataParallel / FSDP models: param.grad "
                "is reduced (or sharded) during backward in ways the dropped samples cannot be "
                "removed from exactly. Use DistributedDataParallel, or a single device."
            )
        covered: set[int] = set()
        for spec in manager.layers:
            for pname in spec.rule.param_names(spec.module_kwargs):
                p = getattr(spec.module, pname, None)
                if isinstance(p, torch.Tensor):
                    covered.add(id(p))
        uncovered = [
            n
            for n, p in manager.model.named_parameters()
            if p.requires_grad and id(p) not in covered
        ]
        if uncovered:
            shown = ", ".join(uncovered[:10]) + (" ..." if len(uncovered) > 10 else "")
            raise ValueError(
                f"DataSelectionCallback: trainable parameters not covered by a hooked layer: "
                f"{shown}. Their .grad would keep the dropped samples' contribution. Hook them "
                "(HookManagerConfig(linear_io=REGISTER_ALL), or layer_types for custom norms) "
                "or freeze them (requires_grad_(False))."
            )

    # ---- reference -----------------------------------------------------------------------------
    def _refresh(self, like: Gradient) -> None:
        ref = self.reference
        if callable(ref) and not isinstance(ref, Gradient):
            ref = self._call_reference()
        if not isinstance(ref, Gradient) or ref.batch_size == 0:
            raise TypeError(
                "reference must give a non-empty Gradient, got "
                f"{type(ref).__name__ if not isinstance(ref, Gradient) else 'an empty one'}"
            )
        missing = [n for n in ref.layer_names if n not in like.layers]
        if missing:
            raise ValueError(
                f"reference has layers {missing} that the training step does not; hooked: "
                f"{like.layer_names}. Capture the reference with the same hook config."
            )
        ref = ref.to(device=like.device, dtype=like.dtype)
        direction = ref.scale(1.0 / ref.batch_size).aggregate()  # the mean, one dense row
        for n, lg in direction.layers.items():
            k, d = like.layers[n].rule.matrix_shape(like.layers[n].module_kwargs)
            if lg.data.shape[1] != k * d:
                raise ValueError(
                    f"reference layer {n!r} has {lg.data.shape[1]} gradient entries, the training "
                    f"layer {k * d}: capture the reference without projection, same hook config."
                )
        self._direction = direction
        self._direction_norm = float(ops.grad_norm_sq(direction).sqrt())
        self._direction_sum = float(sum(lg.data.sum() for lg in direction.layers.values()))

    def _call_reference(self) -> Gradient:
        """Call the reference with this manager paused and the training ``.grad`` set aside."""
        m = self.manager
        params = [p for p in m.model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        try:
            for p in params:
                p.grad = None
            # the engine runs step-end callbacks with grad disabled
            with m.paused(), torch.enable_grad():
                return self.reference()
        finally:
            for p, g in zip(params, saved):
                p.grad = g

    def scores(self, gradient: Gradient) -> torch.Tensor:
        """Alignment scores ``(B,)`` of ``gradient``'s samples with the current direction."""
        if self._direction is None:
            self._refresh(gradient)
        d = self._direction
        train = gradient.select_layers(d.layer_names)
        s = ops.cross_dot(train, d)[:, 0]
        if self.score == "cosine":
            norms = ops.grad_norm_sq(train).clamp_min(0).sqrt()
            s = s / (norms * self._direction_norm).clamp_min(torch.finfo(s.dtype).tiny)
        return s

    # ---- the step ------------------------------------------------------------------------------
    def on_forward(self, layer: str, module: nn.Module, a: torch.Tensor) -> None:
        """Note the DDP wrapper running this forward (also one added after the manager)."""
        ddp = _active_ddp()
        if ddp is not None:  # None too in a checkpoint's recomputation inside backward
            # DDP decides at forward time whether this backward all-reduces
            self._step_ddp = (ddp, bool(ddp.require_backward_grad_sync and torch.is_grad_enabled()))

    def _ddp_of_step(self) -> tuple[nn.parallel.DistributedDataParallel | None, bool]:
        """This step's DDP wrapper and whether it reduces now; refuses other multi-rank runs."""
        seen, self._step_ddp = self._step_ddp, None
        if seen is None:
            from dattri_llm.gradient.streaming import is_distributed_wrapper  # lazy: no cycle

            world = get_world_size()
            if world > 1 or is_distributed_wrapper(self.manager.model):  # fully_shard later
                raise _no_ddp_error(world)
            return None, False
        # also with one rank: DDP then still writes its bucket copy of .grad back after this
        _check_ddp(seen[0], self.manager.model)
        return seen

    def on_step_end(self, record: GradientRecord) -> None:
        """Score the step's samples and remove the dropped ones from ``param.grad``."""
        step = self._seen
        self._seen += 1
        ddp, reduces = self._ddp_of_step()
        if not self.enabled or step < self.warmup_steps:
            return
        if (self.manager is not None and self.manager.transforms) or (
            "preconditioned" in record.metadata
        ):
            raise ValueError(
                "DataSelectionCallback: the hook manager has transforms (add_transform) or "
                "preconditions the gradients (HookManager(optimizer=...)); the record no longer "
                "holds the raw per-sample gradients, so they cannot be subtracted from "
                "param.grad. Build the manager without optimizer= (or precondition=False)."
            )
        grad = record.gradient
        b = grad.batch_size
        if callable(self.reference) and not isinstance(self.reference, Gradient):
            if (step - self.warmup_steps) % self.refresh_interval == 0:
                self._direction = None
        s = self.scores(grad)
        if ddp is None:
            drop = self._select(s)
            k, total = int(drop.sum()), b
        else:
            world = get_world_size()
            if self.score == "dot":  # the contribution to DDP's average is 1/world of it
                s = s / world
            every, start = _gather_scores(s, (self._direction_norm, self._direction_sum), world)
            drop_all = self._select(every)
            drop = drop_all[start : start + b]
            k, total = int(drop_all.sum()), every.shape[0]
        scale = total / (total - k) if self.renormalize and k else 1.0
        if k:
            # weight of each sample's contribution to add to .grad: -1 removes it, and with
            # renormalize the kept ones gain (scale - 1) of theirs
            w = torch.full((b,), scale - 1.0, dtype=torch.float64, device=s.device)
            w[drop] = -1.0
            deltas = self._deltas(grad, w)
            if reduces:
                self._after_ddp(ddp, deltas)
            else:  # one process, or DDP under no_sync(): DDP reduces the local .grad later
                with torch.no_grad():
                    for p, delta in deltas:
                        if p.grad is not None:
                            p.grad.add_(delta.to(p.grad.dtype))
        keep = ~drop
        hashes = list(record.hashes)
        sl = s.tolist()
        self.history.append(
            SelectionStep(
                step=record.step,
                kept_hashes=[h for h, m in zip(hashes, keep.tolist()) if m],
                kept_scores=[v for v, m in zip(sl, keep.tolist()) if m],
                dropped_hashes=[h for h, m in zip(hashes, drop.tolist()) if m],
                dropped_scores=[v for v, m in zip(sl, drop.tolist()) if m],
                scale=scale,
            )
        )

    def _after_ddp(
        self,
        ddp: nn.parallel.DistributedDataParallel,
        deltas: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Add the ranks' averaged corrections to ``.grad`` once DDP's all-reduce has finished.

        This runs inside the backward's final callbacks. DDP queued its own finalisation (wait
        for the all-reduce, write the averaged buckets into ``.grad``) when its last bucket was
        ready, i.e. before the graph's end; a callback queued now runs after it. Every rank
        reaches this point with the same parameter list (the hooked layers, in order).
        """

        def apply() -> None:
            # DDP's reducer raises here if it has not finalised: ranks refuse alike, no hang
            check = getattr(ddp.reducer, "_check_reducer_finalized", None)
            if check is not None:
                try:
                    check()
                except RuntimeError as err:
                    raise RuntimeError(
                        "DataSelectionCallback: DistributedDataParallel had not finished its "
                        "all-reduce when the dropped samples were to be removed, so they cannot "
                        "be removed from the reduced param.grad exactly. Run online data "
                        "selection in a single process with this torch / DDP setup."
                    ) from err
            world = get_world_size()
            dtype = deltas[0][1].dtype
            flat = torch.cat([d.reshape(-1).to(dtype) for _, d in deltas])
            all_reduce_sum(flat).div_(world)  # DDP's own average: sum over ranks / world
            with torch.no_grad():
                for (p, _), part in zip(deltas, flat.split([d.numel() for _, d in deltas])):
                    if p.grad is not None:
                        p.grad.add_(part.view_as(p.grad).to(p.grad.dtype))

        if torch._C._current_graph_task_id() == -1:  # not inside a backward: DDP is done
            apply()
        else:
            torch.autograd.Variable._execution_engine.queue_callback(apply)

    def _select(self, s: torch.Tensor) -> torch.Tensor:
        """Boolean ``(B,)`` mask of the samples to drop."""
        b = s.shape[0]
        drop = torch.zeros(b, dtype=torch.bool, device=s.device)
        if self.drop_fraction is not None:
            k = min(int(math.floor(self.drop_fraction * b)), b - 1)
            drop[torch.argsort(s, stable=True)[:k]] = True
        else:
            drop = s < self.threshold
            if bool(drop.all()):
                drop[torch.argmax(s)] = False
        return drop

    def _deltas(self, grad: Gradient, w: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, sum_i w_i * grad_i of it)`` for every trainable hooked parameter, in order."""
        modules = {spec.name: spec.module for spec in self.manager.layers}
        if grad.dtype in (torch.float16, torch.bfloat16):  # sum in float32, as .grad usually is
            grad = grad.to(torch.float32)
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for name, lg in grad.layers.items():
                if isinstance(lg, Shared):
                    parts = list(zip(lg.site_names, lg.sites))
                else:
                    parts = [(name, lg)]
                for site_name, site in parts:
                    dense = _site_weighted_sum(site, w)
                    module = modules[site_name]
                    for pname, delta in site.rule.unflatten(dense, site.module_kwargs).items():
                        p = getattr(module, pname)
                        if p.requires_grad:
                            out.append((p, delta[0]))
        return out
