"""``HookManager``: registers hooks, pairs forwards with backwards, completes steps.

Nothing here is layer-specific: the layer rules turn what the hooks see into factors.

How a step is captured:

1. A forward pre-hook on the model records the batch inputs (for sample hashes) and size.
2. A forward hook on each selected layer computes the ``a`` factor and registers a tensor hook
   on the layer output; the closure carries ``a``, so forwards that never see a backward
   (evaluation with grad enabled, checkpoint recomputation leftovers) leak nothing.
3. The tensor hook receives the output gradient, computes ``g`` (and materialises or projects
   it when configured) and queues an end-of-backward callback on the autograd engine.
   Capture-time projection (``config.projection``, see ``ops/projection.py``) runs in three
   stages: the activation factor in the forward hook (logra), the complete factors before the
   ``on_backward`` callbacks (logra), and the item after the ``add_transform`` maps (dense,
   mask).
4. When the (outermost) backward finishes, the layer buffers become a :class:`Gradient` and
   callbacks receive a :class:`GradientRecord`.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dattri_llm.gradient.callbacks.base import HookCallback
from dattri_llm.gradient.gradient import (
    Factorized,
    Gradient,
    GradientRecord,
    LayerGradient,
)
from dattri_llm.gradient.hooks import coverage as cov
from dattri_llm.gradient.hooks.assembly import (
    first_tensor,
    grad_target,
    merge_calls,
    output_tensors,
    param_item,
    ref_tensor,
)
from dattri_llm.gradient.hooks.config import (
    HookManagerConfig,
    LayerSpec,
    as_config,
    resolve_layers,
)
from dattri_llm.gradient.hooks.fingerprint import METADATA_KEY as FINGERPRINT_KEY
from dattri_llm.gradient.hooks.fingerprint import weights_fingerprint
from dattri_llm.gradient.hooks.inputs import batch_shape, model_inputs, sample_ids
from dattri_llm.gradient.hooks.sharing import group_shared, layer_parameters, plan_sharing

__all__ = ["HookManager"]

_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emit ``message`` as a UserWarning once per process for ``key``."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


class HookManager:
    """Capture per-sample gradients from any training loop that calls ``.backward()``.

    Example:
        Each sample's gradient from one ordinary backward of the batch; they add up to the
        batch gradient autograd computes:

        >>> import torch
        >>> from dattri_llm import CaptureCallback, HookManager
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2))  # layers are hooked by name
        >>> capture = CaptureCallback()
        >>> hm = HookManager(model, callbacks=[capture])
        >>> x = torch.randn(4, 3)
        >>> with hm.collect():
        ...     model(x).pow(2).sum().backward()  # an ordinary backward of the batch
        >>> hm.remove()
        >>> per_sample = capture.record.gradient.flatten()  # (samples, out x (in + 1)): bias last
        >>> per_sample.shape
        torch.Size([4, 8])
        >>> layer = model[0]
        >>> batch_grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], 1).flatten()
        >>> torch.allclose(per_sample.sum(0), batch_grad, atol=1e-6)  # they add up to autograd's
        True

    The hooks live on the model's modules, so ``copy.deepcopy(model)`` while they are
    registered copies them too: make copies before building the manager, or after
    :meth:`remove`. FSDP1 units need ``use_orig_params=True`` (FSDP2 works as is).

    Args:
        model: Any ``nn.Module`` (DDP / FSDP wrappers included).
        config: Which layers to hook and how; default: every supported trainable layer.
        callbacks: Receive each completed step (see :class:`HookCallback`).
        optimizer: The training optimizer (or a callable returning it, for trainers that build
            it late). With it, capture is *preconditioned* (LESS): each per-sample gradient is
            mapped to the optimizer's update direction as if that sample alone were the batch
            (see :mod:`dattri_llm.gradient.optim.precondition`; SGD, Adam and AdamW). Also
            available to callbacks as ``manager.optimizer``.
        precondition: ``False`` keeps an ``optimizer`` for callbacks only (raw capture);
            ``"second_moment"``: TrackStar's ``g/√(v + ε)`` instead, Adam's ``exp_avg_sq``
            before any projection (:mod:`dattri_llm.gradient.optim.second_moment`).
        precondition_scale: Multiplies each captured gradient before the map: ``"batch_size"``
            turns a mean loss's share ``∇ℓ/B`` into the sample's own ``∇ℓ`` (default ``1.0``).
        fixed_weights: Capture at fixed weights (query stores, a store captured after
            training): inside :meth:`collect` the backward computes the per-sample gradients
            only, not the weights' own gradients (see :meth:`fixed_weights_mode`). The same
            per-sample gradients as an ordinary capture, at less cost; ``param.requires_grad``
            and ``param.grad`` are as they were when the block ends. Not for training loops
            (the optimizer would see no gradient) nor DDP / FSDP wrappers (their reducers
            expect the weights' gradients).

    Attributes:
        step: Number of completed backward passes captured so far.
        checkpoint: Label stored with each record (set it when capturing at several model
            states, e.g. for TracIn from a cache).
    """

    def __init__(
        self,
        model: nn.Module,
        config: HookManagerConfig | None = None,
        callbacks: Sequence[HookCallback] | None = None,
        optimizer: Any = None,
        precondition: bool | str = True,
        precondition_scale: float | str = 1.0,
        fixed_weights: bool = False,
    ) -> None:
        if not isinstance(fixed_weights, bool):
            raise TypeError(
                f"HookManager(fixed_weights=) must be True or False, got {fixed_weights!r}."
            )
        self.model = model
        self.fixed_weights = fixed_weights
        self.config = as_config(config)
        self.callbacks: list[HookCallback] = list(callbacks or [])
        self.optimizer = optimizer
        specs = resolve_layers(model, self.config)
        plan = plan_sharing(model, specs, self.config.shared_parameters)
        for key, message in plan.warnings:
            warn_once(key, message)
        #: The hooked layers; a tied site's own parameter (e.g. a tied head's bias) is a layer
        #: of its own, ``"<module>.<parameter>"`` (see :mod:`~dattri_llm.gradient.hooks.sharing`).
        self.layers: list[LayerSpec] = plan.layers
        self.step = 0
        self.checkpoint = 0
        #: When True, outputs of hooked layers that do not require grad are made to (set by
        #: :meth:`fixed_weights_mode`; kept for code that freezes parameters itself).
        self.force_output_grad = False
        self._fixed_depth = 0  # nesting of fixed_weights_mode blocks
        self._frozen_before: set[int] = set()  # parameters frozen before fixed_weights_mode
        #: Outputs of frozen layers made to require grad this step (include_frozen): a
        #: reentrant checkpoint fed by them alone changes what the backward computes.
        self._forced_frozen: dict[int, str] = {}
        self._active = False
        self._handles: list[Any] = []
        self._buffers: dict[str, list[tuple[int, Any]]] = {}
        self._param_grads: dict[str, dict[str, torch.Tensor]] = {}
        self._inputs: dict[str, torch.Tensor] | None = None
        self._batch_size: int | None = None
        self._forward_order = 0
        self._queued_tasks: set[int] = set()
        self._manual_ids: list[str] | None = None
        self._transforms: list[Any] = []
        #: Hooked layers whose forward ran / captured parameters that received a gradient this
        #: step: a gradient without any of its sites' forwards means it was used outside them.
        self._forward_seen: set[str] = set()
        self._grad_seen: set[int] = set()
        self._grad_like: tuple[torch.dtype, torch.device] | None = None
        #: the last forward's (layers seen, inputs, batch size): a second backward through a
        #: retained graph (backward(retain_graph=True) twice) runs no forward of its own
        self._last_forward: tuple[set[str], Any, int | None] = (set(), None, None)
        self._partly_hooked: set[str] = plan.partly_hooked  # share with an unhooked module
        self._shared_groups: dict[str, list[str]] = plan.groups
        self._param_sites = plan.params
        self._bypassed: set[int] = set()  # captured parameters seen used outside their modules
        #: Parameters that became trainable after construction (peft's set_adapter, a module
        #: swapped in), looked for on every captured forward and hooked when found; the names
        #: of those that got a gradient this step, and whether the backward reached the model's
        #: output (a step that captures nothing is reported, never dropped in silence).
        known = [p for s in self.layers for p in s.module.parameters(recurse=False)]
        self._watch = cov.TrainableWatch(model, known)
        self._late_names: list[str] = []  # in the order found (model order)
        self._late_seen: set[str] = set()
        self._reached_output = False
        self._reported: set[str] = set()
        #: Backward passes that left trainable parameters' gradients uncaptured (parameters
        #: that became trainable after construction) or captured nothing; the first of each
        #: kind is warned about.
        self.incomplete_steps = 0
        #: The first captured step checks that captured gradients cover each parameter's:
        #: the graph task each item was captured in (a parameter's gradient hook sees the
        #: gradient of one task: a reentrant checkpoint's inner backward is a task of its own)
        #: and the size of each layer's terms (round-off scale).
        self._coverage_pending = bool(self.config.check_coverage)
        self._item_task: dict[tuple[str, int], int] = {}
        self._magnitude: dict[str, float] = {}
        #: Capture-time projection resolved per layer (``None`` without ``config.projection``).
        self.projection = None
        if self.config.projection is not None:
            from dattri_llm.gradient.ops.projection import CaptureProjection

            self.projection = CaptureProjection(
                self.config.projection, self.layers, self._shared_groups
            )
        #: The preconditioned-capture map (``None`` for raw capture).
        self.preconditioner = None
        if optimizer is not None or not isinstance(precondition, bool):
            # without an optimizer a bool asks for no map: the maps' module stays unloaded
            from dattri_llm.gradient.optim.second_moment import capture_map

            self.preconditioner = capture_map(optimizer, precondition, precondition_scale)
        if self.preconditioner is not None:
            self.preconditioner.bind(self)
        try:
            self._signature = inspect.signature(model.forward)
        except (TypeError, ValueError):  # pragma: no cover - exotic modules
            self._signature = None
        self._register()
        for cb in self.callbacks:
            cb.on_register(self)

    # ---- registration -----------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """Names of the hooked layers, in model order."""
        return [s.name for s in self.layers]

    @property
    def capturing(self) -> bool:
        """Whether capture is on (inside :meth:`collect`, not :meth:`paused`)."""
        return self._active

    @property
    def shared_groups(self) -> dict[str, list[str]]:
        """``{lead name: [site names]}`` of hooked layers sharing one weight (tied parameters)."""
        return {k: list(v) for k, v in self._shared_groups.items()}

    def layer_parameters(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{layer name: {parameter name: parameter}}`` for the layers of a captured step.

        The names are those of the layer rule's ``unflatten`` of the layer's materialised
        gradient (a tied group maps to its one shared parameter).
        """
        return layer_parameters(self.layers, self._shared_groups)

    def coverage(self) -> cov.CaptureCoverage:
        """Share of the trainable parameters captured (less any found bypassed at a step)."""
        hooked = self._param_sites.keys() - self._bypassed  # recorded as zeros
        return cov.capture_coverage(self.model, self.layers, hooked)

    def _register(self) -> None:
        self._handles.append(
            self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)
        )
        for spec in self.layers:
            if spec.hook_type == "linear_io":
                self._handles.append(spec.module.register_forward_hook(self._layer_hook(spec)))
            else:
                for pname, p in spec.module.named_parameters(recurse=False):
                    if p.requires_grad:
                        self._handles.append(p.register_hook(self._param_hook(spec, pname)))
        # one hook per captured parameter, however many sites capture it (tied weights)
        for pid, entry in self._param_sites.items():
            self._handles.append(entry.param.register_hook(self._captured_param_hook(pid)))
        self._handles.append(self.model.register_forward_hook(self._on_model_output))

    def remove(self) -> None:
        """Take every hook down (idempotent); the model is left as it was."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._active = False
        self._reset_step()
        for cb in self.callbacks:
            cb.on_remove()

    def add_transform(self, fn: Any) -> None:
        """Add a per-layer transform ``fn(spec, item) -> item`` applied in the backward hook.

        Projection and preconditioning use it.
        """
        self._transforms.append(fn)

    # ---- collection context -------------------------------------------------------------------
    @contextlib.contextmanager
    def collect(self, deregister_on_exit: bool = False) -> Iterator[HookManager]:
        """Capture while the block runs.

        When the block ends, normally or with an exception (a ``KeyboardInterrupt`` too),
        every callback's ``on_context_end`` runs (``OffloadCallback`` makes its records durable
        and releases the store) and, with ``deregister_on_exit``, the hooks come down, even if
        one of those steps fails; the first failure is then raised.

        Args:
            deregister_on_exit: Call :meth:`remove` when the block ends.
        """
        if not self._handles:
            raise RuntimeError("this HookManager was removed; create a new one to capture again.")
        self._active = True
        fixed = self.fixed_weights_mode() if self.fixed_weights else contextlib.nullcontext()
        for cb in self.callbacks:
            cb.on_context_start()
        try:
            with fixed:
                yield self
        finally:
            self._active = False
            self._reset_step()
            steps = [cb.on_context_end for cb in self.callbacks]
            _run_all(steps + ([self.remove] if deregister_on_exit else []))

    @contextlib.contextmanager
    def fixed_weights_mode(self) -> Iterator[HookManager]:
        """Inside the block, a backward computes the per-sample gradients and nothing else.

        Each parameter is made not to require grad (so autograd computes no weight gradient,
        only the output gradients the hooked layers need) and each hooked layer's output is
        made to require it; the per-sample gradients are exactly those of an ordinary
        capture. Parameters of ``param_grad`` layers, which are read from their ``.grad``,
        keep requiring grad, as do the captured parameters while the first step's coverage
        check (``HookManagerConfig.check_coverage``) is pending: that step is an ordinary one,
        so a weight used outside its module is still found. Every ``requires_grad`` flag and
        ``.grad`` is restored when the block ends, however it ends. Also works on a model
        whose parameters are all frozen (with ``HookManagerConfig(include_frozen=True)``).

        ``HookManager(fixed_weights=True)`` enters it for each :meth:`collect` block; enter
        it yourself around each batch when the model trains in between (live queries).
        """
        params = list(self.model.parameters())
        saved = [(p, p.requires_grad, p.grad) for p in params]
        keep = self._param_grad_ids()
        if self._coverage_pending:  # the first step stays ordinary: its check needs them
            keep |= set(self._param_sites)
        force = self.force_output_grad
        if not self._fixed_depth:
            self._frozen_before = {id(p) for p, flag, _ in saved if not flag}
        try:
            for p in params:
                p.grad = None  # a kept parameter's gradient must not accumulate into the user's
                if id(p) not in keep:
                    p.requires_grad_(False)
            self.force_output_grad = True
            self._fixed_depth += 1
            yield self
        finally:
            self._fixed_depth -= 1
            self.force_output_grad = force
            for p, flag, grad in saved:
                p.requires_grad_(flag)
                p.grad = grad

    def _param_grad_ids(self) -> set[int]:
        """Ids of the parameters of ``param_grad`` layers (read from ``.grad``: never frozen)."""
        return {
            id(p)
            for spec in self.layers
            if spec.hook_type == "param_grad"
            for p in spec.module.parameters(recurse=False)
        }

    def _freeze_checked(self) -> None:
        """After the coverage check, inside fixed_weights_mode: freeze the checked parameters."""
        if self._fixed_depth:
            keep = self._param_grad_ids()
            for pid, entry in self._param_sites.items():
                if pid not in keep:
                    entry.param.requires_grad_(False)

    @contextlib.contextmanager
    def paused(self) -> Iterator[HookManager]:
        """Suspend capture inside a ``collect()`` block; the previous state is restored on exit.

        For an evaluation forward/backward run by a callback in the middle of training.
        """
        active, self._active = self._active, False
        try:
            yield self
        finally:
            self._active = active

    @contextlib.contextmanager
    def raw_gradients(self) -> Iterator[HookManager]:
        """Capture raw (not preconditioned) gradients inside the block; a no-op without one."""
        if self.preconditioner is None:
            yield self
            return
        with self.preconditioner.disabled():
            yield self

    @property
    def _preconditioning(self) -> bool:
        return self.preconditioner is not None and self.preconditioner.enabled

    @property
    def transforms(self) -> tuple[Any, ...]:
        """The per-layer transforms added with :meth:`add_transform`, in order (read-only)."""
        return tuple(self._transforms)

    def set_sample_ids(self, ids: Sequence[str]) -> None:
        """Use these ids for the next captured step instead of content hashes."""
        self._manual_ids = [str(i) for i in ids]

    # ---- hooks -------------------------------------------------------------------------------
    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._active or not torch.is_grad_enabled():
            return
        # every forward: the trainable set may change between any two (one walk of the
        # module tree: about 45 µs on a 4-layer GPT-2 whose captured step takes 6.2 ms)
        for name, p in self._watch.new_trainable():
            self._late_names.append(name)
            self._handles.append(p.register_hook(self._late_param_hook(name)))
        if self._inputs is not None:
            return
        fields = model_inputs(self._signature, args, kwargs)
        self._inputs = fields
        if fields:
            key = "input_ids" if "input_ids" in fields else next(iter(fields))
            self._batch_size = int(fields[key].shape[0])

    def _on_model_output(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active or not torch.is_grad_enabled():
            return
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_reached)

    def _output_reached(self, grad: torch.Tensor) -> None:
        if self._active:
            self._reached_output = True
            self._ensure_end_callback()

    def _late_param_hook(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self._active:
                self._late_seen.add(name)
                self._ensure_end_callback()

        return hook

    def _layer_hook(self, spec: LayerSpec) -> Any:
        rule = spec.rule
        kw = spec.module_kwargs
        broadcast_ok = rule.broadcasts_batch

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            if not self._active or not torch.is_grad_enabled():
                return None
            self._forward_seen.add(spec.name)
            if (
                self._forced_frozen
                # fixed_weights_mode freezes the weights that would make the checkpoint's
                # inputs require grad, except in the first step (kept for the coverage check)
                and (not self._fixed_depth or self._coverage_pending)
                and torch._C._current_graph_task_id() != -1  # a recomputation in a backward
                # a frozen layer recomputed is captured as if trainable, as include_frozen says
                and not self._frozen(module)
            ):
                self._check_reentrant(spec.name)
            out = first_tensor(output)
            if out is None or not out.is_floating_point():
                return None
            replaced = False
            if not out.requires_grad:
                # a frozen layer first on the path (fixed weights, or frozen parameters captured
                # with include_frozen): its output becomes the leaf the gradient flows to
                if not (self.force_output_grad or self.config.include_frozen):
                    return None  # not on the autograd path
                out = out.detach().requires_grad_()
                replaced = True
                if self._frozen(module):
                    self._forced_frozen[id(out)] = spec.name
            b = self._batch_size
            if broadcast_ok and b and b > 1 and out.shape[0] == 1 and args[0].shape[0] == 1:
                # an un-batched index (GPT-2 position ids): expand so each sample gets its own
                # output gradient instead of the batch sum
                out = out.expand(b, *out.shape[1:])
                args = (args[0].expand(b, *args[0].shape[1:]),) + tuple(args[1:])
                replaced = True
            target = out
            if not replaced:
                target, new_out = grad_target(out)
                replaced = new_out is not out
                out = new_out
            batch = batch_shape(self._inputs, self._batch_size)
            a, ctx = rule.capture_forward(module, args, out, kw, batch)
            if self.projection is not None:  # logra: the raw activation is never kept
                a = self.projection.project_input(spec, a)
            order = self._forward_order
            self._forward_order += 1
            for cb in self.callbacks:
                cb.on_forward(spec.name, module, a)
            if target is out:
                out.register_hook(lambda grad: self._on_output_grad(spec, order, a, grad, ctx))
            else:  # the base of a view: its gradient, in the output's shape
                shape = out.shape
                target.register_hook(
                    lambda grad: self._on_output_grad(spec, order, a, grad.reshape(shape), ctx)
                )
            if not replaced:
                return None
            if isinstance(output, torch.Tensor):
                return out
            return (out, *output[1:]) if isinstance(output, tuple) else [out, *output[1:]]

        return hook

    def _frozen(self, module: nn.Module) -> bool:
        """Whether ``module``'s own parameters were all frozen before any fixed_weights_mode."""
        params = list(module.parameters(recurse=False))
        if self._fixed_depth:
            return all(id(p) in self._frozen_before for p in params)
        return not any(p.requires_grad for p in params)

    def _check_reentrant(self, name: str) -> None:
        """Warn if the reentrant checkpoint recomputing ``name`` needs grad only through us.

        Its inputs require grad only through frozen layers' outputs the manager made require it.
        """
        node = torch._C._current_autograd_node()  # the checkpoint's backward
        if node is None:
            return
        frozen = cov.only_reaches(node, self._forced_frozen)
        if frozen:
            warn_once(f"reentrant-frozen:{name}", cov.frozen_checkpoint_message(name, frozen))

    def _on_output_grad(
        self, spec: LayerSpec, order: int, a: torch.Tensor, grad: torch.Tensor, ctx: Any = None
    ) -> None:
        if not self._active:
            return
        rule, kw = spec.rule, spec.module_kwargs
        g = rule.context_output_grad(grad.detach(), kw, ctx)
        if hasattr(rule, "finalize"):
            g = rule.finalize(a, g, kw)
        if g.dtype != a.dtype and a.is_floating_point():
            a = a.to(g.dtype)
        item: LayerGradient = Factorized(a, g, rule.layer_type, kw)
        if self._coverage_pending and not self._transforms and self.projection is None:
            self._item_task[(spec.name, order)] = torch._C._current_graph_task_id()
            self._magnitude[spec.name] = max(
                self._magnitude.get(spec.name, 0.0), cov.term_magnitude(item)
            )
        if self.projection is not None:  # logra: project the factors, relabel the layer
            item = self.projection.project_factors(spec, item)
        for cb in self.callbacks:
            cb.on_backward(spec.name, spec.module, item.a, item.g)
        style = self.config.capture_style
        materialize = style == "materialized" or (
            style == "auto"
            and item.rule.prefer_materialized_capture(item.num_tokens, item.module_kwargs)
        )
        item = self._apply_transforms(spec, item, materialize)
        self._buffers.setdefault(spec.name, []).append((order, item))
        self._ensure_end_callback()

    def _param_hook(self, spec: LayerSpec, pname: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not self._active:
                return
            self._param_grads.setdefault(spec.name, {})[pname] = (
                self._param_grads.get(spec.name, {}).get(pname, 0) + grad.detach()
            )
            self._ensure_end_callback()

        return hook

    def _captured_param_hook(self, pid: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not self._active:
                return
            self._grad_seen.add(pid)
            self._grad_like = (grad.dtype, grad.device)
            if self._coverage_pending:
                self._check_coverage(pid, grad)
            self._ensure_end_callback()  # a step whose hooked forwards were all bypassed

        return hook

    def _check_coverage(self, pid: int, grad: torch.Tensor) -> None:
        """Warn once if the captured gradients of a parameter miss part of ``grad``."""
        if self._transforms or self.projection is not None or self._preconditioning:
            return  # the items are no longer the raw per-sample gradients
        sites = self._param_sites[pid].sites
        if self._partly_hooked & {s.name for s, _ in sites}:
            return  # shared with an unhooked module: warned about at construction
        task = torch._C._current_graph_task_id()
        buffers = {
            name: [(o, it) for o, it in items if self._item_task.get((name, o)) == task]
            for name, items in self._buffers.items()
        }
        message = cov.coverage_message(sites, buffers, grad, self._magnitude)
        if message is not None:
            warn_once(f"coverage:{sites[0][0].name}:{sites[0][1]}", message)

    def _ensure_end_callback(self) -> None:
        task = torch._C._current_graph_task_id()
        if task in self._queued_tasks:
            return
        self._queued_tasks.add(task)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._on_task_end(task))

    def _on_task_end(self, task: int) -> None:
        self._queued_tasks.discard(task)
        outer = torch._C._current_autograd_node()
        if outer is not None:
            # a nested backward (reentrant checkpointing) ended inside an enclosing one: finish
            # the step when the enclosing backward does
            outer.register_hook(lambda *_: self._ensure_end_callback())
            return
        if self._queued_tasks:
            return
        self._finish_step()

    # ---- step assembly -----------------------------------------------------------------------
    def _reset_step(self) -> None:
        self._forward_seen = set()
        self._grad_seen = set()
        self._grad_like = None
        self._late_seen = set()
        self._reached_output = False
        self._item_task = {}
        self._magnitude = {}
        self._buffers = {}
        self._param_grads = {}
        self._inputs = None
        self._batch_size = None
        self._forward_order = 0
        self._queued_tasks = set()
        self._forced_frozen = {}

    def _zero_like(
        self, spec: LayerSpec, b: int, like: tuple[torch.dtype, torch.device]
    ) -> LayerGradient:
        """An exactly zero gradient for a layer that received none in this step."""
        a, g = spec.rule.zero_factors(b, spec.module_kwargs, *like)
        if self.projection is not None:
            a = self.projection.project_input(spec, a)
        item = Factorized(a, g, spec.rule.layer_type, spec.module_kwargs)
        if self.projection is not None:
            item = self.projection.project_factors(spec, item)
        return self._apply_transforms(
            spec, item, materialize=self.config.capture_style == "materialized"
        )

    def _apply_transforms(
        self, spec: LayerSpec, item: LayerGradient, materialize: bool
    ) -> LayerGradient:
        """Materialise if asked, run the transforms, then the dense / mask projection.

        Under preconditioned capture an unmasked layer is materialised (the map needs its
        entries) and a dense projection waits until after the map (:meth:`_finish_step`).
        """
        lp = self.projection[spec.name] if self.projection is not None else None
        if self._preconditioning and (lp is None or lp.style != "mask"):
            materialize = True
        if materialize:
            item = item.materialize()
        for fn in self._transforms:
            item = fn(spec, item)
        if lp is not None and not (
            self.preconditioner is not None and self.preconditioner.defers_projection(lp)
        ):
            item = lp.project_item(item)
        return item

    def _finish_step(self) -> None:
        buffers, param_grads = self._buffers, self._param_grads
        inputs, manual = self._inputs, self._manual_ids
        forward_seen, grad_seen = self._forward_seen, self._grad_seen
        grad_like, batch_size = self._grad_like, self._batch_size
        late = [n for n in self._late_names if n in self._late_seen]
        reached = self._reached_output
        self._reset_step()
        self._manual_ids = None
        if forward_seen:
            self._last_forward = (forward_seen, inputs, batch_size)
        elif buffers:  # a backward through the graph of the last forward, run again
            forward_seen, inputs, batch_size = self._last_forward
        bypassed = [
            e
            for pid, e in self._param_sites.items()
            if pid in grad_seen and not any(s.name in forward_seen for s, _ in e.sites)
        ]
        captured = bool(buffers or param_grads or bypassed)
        if late or (reached and not captured):
            self._report_incomplete(late, captured)
        if not captured:
            return
        merged = {n: merge_calls(items, batch_size, n) for n, items in buffers.items()}
        sizes = {n: lg.batch_size for n, lg in merged.items()}
        if len(set(sizes.values())) > 1 or (
            batch_size is not None and any(v != batch_size for v in sizes.values())
        ):
            raise RuntimeError(
                f"hooked layers saw batches of {sizes} rows in one step, the model's batch has "
                f"{batch_size}. A layer fed an un-batched input (e.g. a position table sliced and "
                "passed through a Linear, then broadcast over the batch) cannot give per-sample "
                "gradients: exclude it (HookManagerConfig(exclude=[...])) or expand its input to "
                "the batch first."
            )
        b = next(iter(sizes.values())) if sizes else (batch_size or 1)
        by_layer: dict[str, list[Any]] = {}
        for entry in bypassed:
            by_layer.setdefault(entry.sites[0][0].name, []).append(entry)
        for name, entries in by_layer.items():
            warn_once(f"bypassed:{name}", cov.bypass_message(entries))
            self._bypassed.update(id(e.param) for e in entries)
        if merged and self._coverage_pending:
            self._coverage_pending = False  # checked on the first captured step only
            self._freeze_checked()
        if self.step == 0:
            cov.log_coverage(self.coverage())
        ref = ref_tensor(merged)
        like = (ref.dtype, ref.device) if ref is not None else grad_like
        layers: dict[str, LayerGradient] = {}
        for spec in self.layers:
            if spec.hook_type == "param_grad":
                item = param_item(spec, param_grads.get(spec.name), b, ref)
                if item is not None:
                    layers[spec.name] = item
                continue
            if spec.name in merged:
                layers[spec.name] = merged[spec.name]
            elif like is not None:
                layers[spec.name] = self._zero_like(spec, b, like)
        layers = group_shared(layers, self._shared_groups)
        metadata: dict[str, Any] = {}
        if self._preconditioning and layers:
            layers, metadata = self.preconditioner.apply(layers, b, self.projection)
        gradient = Gradient(layers)
        fingerprint = weights_fingerprint(self.layer_parameters())
        if fingerprint is not None:
            metadata = {**metadata, FINGERPRINT_KEY: fingerprint}
        hashes = self._hashes(inputs, manual, gradient.batch_size)
        record = GradientRecord(self.step, hashes, gradient, self.checkpoint, metadata)
        self.step += 1
        for cb in self.callbacks:
            cb.on_step_end(record)

    def _report_incomplete(self, late: list[str], captured: bool) -> None:
        """Count a step that missed trainable parameters or captured nothing; warn the first."""
        self.incomplete_steps += 1
        key = "late:" + ",".join(late) if late else "nothing"
        if key in self._reported:
            return
        self._reported.add(key)
        message = (
            cov.late_message(late, captured)
            if late
            else cov.nothing_captured_message(self.layer_names)
        )
        warnings.warn(message, UserWarning, stacklevel=2)

    def _hashes(self, inputs: dict | None, manual: list[str] | None, b: int) -> list[str]:
        ids = sample_ids(inputs, manual, b, self.config.sample_id_key, self.config.hash_keys)
        if ids is not None:
            return ids
        warn_once(
            "no-hash",
            "could not see the model's batched inputs, so samples are identified by step and "
            "row; call the model itself (or HookManager.set_sample_ids) for content hashes.",
        )
        return [f"step{self.step}:row{i}" for i in range(b)]


def _run_all(steps: list[Any]) -> None:
    """Call every step even if some fail; raise the first failure afterwards."""
    error: BaseException | None = None
    for step in steps:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            error = error or e
    if error is not None:
        raise error
