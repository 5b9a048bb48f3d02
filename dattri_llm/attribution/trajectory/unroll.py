"""Linearised optimizer steps: how removing a sample perturbs the rest of a training run.

A training step ``k`` maps the optimizer state ``x_k`` (parameters and moments) to ``x_{k+1}``.
Removing a sample ``z`` of step ``t`` (weight 1 -> 0 in the batch loss as trained) changes the
consumed batch gradient by ``-s_z`` (its captured share) and, to first order, every later step
carries the perturbation through the step's Jacobian. All vectors are dense rows over the
captured coordinates (layers concatenated in a fixed order), so every map is elementwise except
the curvature term.

Per step (torch's exact semantics; ``c`` the optimizer's update count):

* the consumed gradient ``g = clip · (G + ...)``: its perturbation is
  ``δg = A δθ + p`` with ``A = κ_c (I − u uᵀ) Ĥ + λ_c I`` — ``Ĥ = κ Σ_j ŝ_j ŝ_jᵀ`` the curvature
  of the batch loss (by default its empirical Fisher, ``ŝ`` the per-sample shares,
  ``κ = B`` for a mean loss and 1 for a sum), ``κ_c`` the clip factor and ``u`` the unit batch
  gradient when norm clipping was active (1 and no projection otherwise), ``λ_c`` a coupled
  weight decay — and ``p = −κ_c (I − u uᵀ) s_z`` the removal's direct push at its own step;
* Adam / AdamW: ``δm = β₁δm + (1−β₁)δg``, ``δv = β₂δv + 2(1−β₂) g ⊙ δg`` (AMSGrad:
  ``δv_max`` follows ``δv`` where ``v`` set the maximum), and
  ``δθ' = (1 − ηλ_d) δθ − η (D δm / (1−β₁ᶜ) − S δv̂ / (1−β₂ᶜ))`` with ``D = 1/(√v̂+ε)``,
  ``S = m̂ / (2√v̂ (√v̂+ε)²)`` (0 where ``v̂ = 0``);
* SGD: ``δb = μ δb + (1−d) δg`` (``δb = δg`` at the buffer's first step),
  ``δθ' = δθ − η (δb, or δg + μ δb with Nesterov, or δg without momentum)``.

Two equivalent evaluations (tested equal): :func:`forward_sweep` carries every sample's
perturbation forward (memory ∝ samples; gives DVEmb's data value embeddings), and
:func:`adjoint_sweep` carries each query's adjoint backward (memory ∝ queries, matrix-free).

Adam's update is bounded per coordinate but its derivative is not where ``v`` is young (the
first update of a fresh optimizer is ``≈ sign(g)``). ``AdamStep(exact_push=True)`` takes a
removal's own step exactly (torch's update recomputed without the sample) and
``AdamStep(nonlinear=True)`` also carries earlier perturbations through the exact update (the
gradient change ``A δθ`` stays linear); nonlinear steps must open the run, and the adjoint
sweep evaluates them forward (:func:`adjoint_sweep`).
The score of an occurrence is ``q_Tᵀ δθ_T`` of its removal: positive when removing the sample
would raise the query's loss, i.e. the sample helped (the library's sign).

A sweep whose numbers stop being finite is refused (:class:`FloatingPointError`), never
returned: when the linearised steps amplify perturbations (a run whose derivative grows
exponentially backward, e.g. the true Hessian of a from-scratch run at a large learning rate)
the adjoint can pass the compute dtype's range (float32: 3.4e38) within the run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "Curvature",
    "LinearStep",
    "SGDStep",
    "AdamStep",
    "StepPushes",
    "forward_sweep",
    "adjoint_sweep",
]

State = dict[str, torch.Tensor]


@dataclass
class Curvature:
    """``A x = κ_c (I − u uᵀ) Ĥ x + λ_c x`` with ``Ĥ = κ Σ_j w_j ŝ_j ŝ_jᵀ``.

    Attributes:
        vectors: ``(M, P)`` the curvature vectors ``ŝ_j`` (``None``: no curvature term).
        kappa: ``κ`` (the batch size for a mean loss, 1 for a sum).
        weights: ``(M,)`` per-vector weights ``w_j`` (e.g. ``1/n`` for ``n`` sampled labels).
        clip: ``κ_c`` (1 without active clipping).
        unit: ``u`` ``(P,)`` when clipping is active.
        coupled_decay: ``λ_c`` per coordinate ``(P,)`` or ``None``.
        operator: ``H x`` for rows ``x`` — the batch loss's Hessian applied directly (e.g.
            :class:`~dattri_llm.attribution.trajectory.curvature.ExactHessian`); replaces
            ``vectors``.
    """

    vectors: torch.Tensor | None
    kappa: float = 1.0
    weights: torch.Tensor | None = None
    clip: float = 1.0
    unit: torch.Tensor | None = None
    coupled_decay: torch.Tensor | None = None
    operator: Callable[[torch.Tensor], torch.Tensor] | None = None

    def _hessian(self, x: torch.Tensor) -> torch.Tensor:
        if self.operator is not None:
            return self.operator(x)
        if self.vectors is None:
            return torch.zeros_like(x)
        proj = x @ self.vectors.T  # (R, M)
        if self.weights is not None:
            proj = proj * self.weights
        return self.kappa * (proj @ self.vectors)

    def _deflate(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit is None:
            return x
        return x - (x @ self.unit)[:, None] * self.unit

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``A x`` for rows ``x`` ``(R, P)``."""
        out = self.clip * self._deflate(self._hessian(x))
        return out if self.coupled_decay is None else out + self.coupled_decay * x

    def apply_transpose(self, y: torch.Tensor) -> torch.Tensor:
        """``Aᵀ y`` for rows ``y`` ``(R, P)``."""
        out = self.clip * self._hessian(self._deflate(y))
        return out if self.coupled_decay is None else out + self.coupled_decay * y

    def push(self, s: torch.Tensor) -> torch.Tensor:
        """The removal's direct gradient change ``p = −κ_c (I − u uᵀ) s`` for rows ``s``."""
        return -self.clip * self._deflate(s)

    def push_scores(self, gamma: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``⟨γ_r, p(s_n)⟩`` as an ``(N, R)`` matrix."""
        return -self.clip * (self._deflate(s) @ gamma.T)


class LinearStep:
    """One step's linear map on state perturbations, and its transpose."""

    components: tuple[str, ...] = ("theta",)
    #: carries incoming perturbations through a map that is not linear (see ``AdamStep``)
    nonlinear: bool = False

    def __init__(self, curvature: Curvature) -> None:
        self.curvature = curvature

    def update(self, state: State, dg: torch.Tensor) -> State:
        """The state after the step from the incoming state and the gradient change ``δg``."""
        raise NotImplementedError

    def update_adjoint(self, adj: State) -> tuple[State, torch.Tensor]:
        """Transpose of :meth:`update`: adjoints of the incoming state and of ``δg``."""
        raise NotImplementedError

    def forward(self, state: State) -> State:
        """Carry incoming perturbations through the step (``δg = A δθ``)."""
        return self.update(state, self.curvature.apply(state["theta"]))

    def push(self, s: torch.Tensor) -> State:
        """The state perturbation after this step from removing samples ``s`` ``(N, P)``."""
        zero = {c: torch.zeros_like(s) for c in self.components}
        return self.update(zero, self.curvature.push(s))

    def push_scores(self, adj: State, gamma: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``(N, R)`` scores of removing rows ``s`` at this step: ``⟨γ_r, p(s_n)⟩``.

        ``adj`` is the adjoint of the state after the step (used by pushes that are not linear
        in ``δg``), ``gamma`` the adjoint of ``δg`` from :meth:`adjoint`.
        """
        return self.curvature.push_scores(gamma, s)

    def adjoint(self, adj: State) -> tuple[State, torch.Tensor]:
        """Adjoints of the incoming state (curvature included) and of ``δg``."""
        prev, gamma = self.update_adjoint(adj)
        prev["theta"] = prev["theta"] + self.curvature.apply_transpose(gamma)
        return prev, gamma


class SGDStep(LinearStep):
    """``torch.optim.SGD``'s update linearised (momentum, dampening, Nesterov)."""

    def __init__(
        self,
        curvature: Curvature,
        lr: torch.Tensor,
        momentum: torch.Tensor | None = None,
        dampening: torch.Tensor | None = None,
        nesterov: torch.Tensor | None = None,
        first_buffer: bool = False,
    ) -> None:
        super().__init__(curvature)
        self.lr = lr
        self.momentum = momentum if momentum is not None and bool((momentum != 0).any()) else None
        self.dampening = dampening
        self.nesterov = nesterov
        self.first_buffer = first_buffer
        self.components = ("theta", "b") if self.momentum is not None else ("theta",)

    def _b_gain(self) -> torch.Tensor | float:
        return 1.0 if self.first_buffer else 1 - self.dampening

    def update(self, state: State, dg: torch.Tensor) -> State:
        """``δθ' = δθ − η·direction`` with the momentum buffer's perturbation."""
        if self.momentum is None:
            return {"theta": state["theta"] - self.lr * dg}
        mu = self.momentum
        b = (0 if self.first_buffer else mu * state["b"]) + self._b_gain() * dg
        direction = torch.where(self.nesterov > 0, dg + mu * b, b)
        direction = torch.where(mu != 0, direction, dg)
        return {"theta": state["theta"] - self.lr * direction, "b": torch.where(mu != 0, b, 0)}

    def update_adjoint(self, adj: State) -> tuple[State, torch.Tensor]:
        """Transpose of :meth:`update`."""
        lt = adj["theta"]
        if self.momentum is None:
            return {"theta": lt.clone()}, -self.lr * lt
        mu = self.momentum
        nest = self.nesterov > 0
        on = mu != 0
        # δθ' = δθ − η·dir; dir = b (or δg + μb); b = μ b_prev + gain δg
        adj_dir = -self.lr * lt
        adj_b = torch.where(on, adj["b"] + torch.where(nest, mu * adj_dir, adj_dir), 0)
        gamma = self._b_gain() * adj_b + torch.where(on & nest, adj_dir, 0)
        gamma = gamma + torch.where(on, 0, adj_dir)
        prev_b = torch.zeros_like(adj_b) if self.first_buffer else mu * adj_b
        return {"theta": lt.clone(), "b": prev_b}, gamma


class AdamStep(LinearStep):
    """``torch.optim.Adam`` / ``AdamW``'s update linearised around the recorded moments.

    Args:
        curvature: The step's ``A`` and push.
        lr, beta1, beta2, eps, count: Per-coordinate ``(P,)`` hyper-parameters and update count.
        decoupled_decay: ``λ_d`` per coordinate (AdamW; zeros for Adam).
        grad: The consumed gradient ``g`` ``(P,)`` (recovered from the moments).
        exp_avg: ``m`` after the update; ``exp_avg_sq``: ``v`` after it.
        max_exp_avg_sq: ``v_max`` after the update (AMSGrad) and ``vmax_pre`` before it.
        exact_push: Take the removal's own step exactly instead of linearised (see
            :meth:`exact_update`). Not with AMSGrad.
        nonlinear: Also carry earlier removals through this step's exact update
            (:meth:`forward`); the steps so marked must be the first of the run (see
            :func:`adjoint_sweep`). Implies ``exact_push``.
    """

    def __init__(
        self,
        curvature: Curvature,
        lr: torch.Tensor,
        beta1: torch.Tensor,
        beta2: torch.Tensor,
        eps: torch.Tensor,
        count: torch.Tensor,
        decoupled_decay: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        max_exp_avg_sq: torch.Tensor | None = None,
        max_exp_avg_sq_pre: torch.Tensor | None = None,
        exact_push: bool = False,
        nonlinear: bool = False,
    ) -> None:
        super().__init__(curvature)
        if (exact_push or nonlinear) and max_exp_avg_sq is not None:
            raise ValueError("AdamStep: the exact update is not modelled with AMSGrad.")
        self.exact = exact_push or nonlinear
        self.nonlinear = nonlinear
        self.lr, self.beta1, self.beta2 = lr, beta1, beta2
        self.decay = 1 - lr * decoupled_decay
        self.grad = grad
        self.amsgrad = max_exp_avg_sq is not None
        self.components = ("theta", "m", "v", "vmax") if self.amsgrad else ("theta", "m", "v")
        bc1 = 1 - beta1**count
        bc2 = 1 - beta2**count
        v_used = max_exp_avg_sq if self.amsgrad else exp_avg_sq
        v_hat = v_used / bc2
        root = v_hat.sqrt()
        denom = root + eps
        m_hat = exp_avg / bc1
        self.d_m = lr / (bc1 * denom)  # ∂θ'/∂m = −d_m
        safe = torch.where(root > 0, root, torch.ones_like(root))
        s = torch.where(root > 0, m_hat / (2 * safe * denom * denom), torch.zeros_like(root))
        self.d_v = lr * s / bc2  # ∂θ'/∂v_used = +d_v
        if self.amsgrad:
            assert max_exp_avg_sq_pre is not None
            self.branch = (exp_avg_sq >= max_exp_avg_sq_pre).to(exp_avg_sq.dtype)
        if self.exact:
            self.bc1, self.bc2, self.eps = bc1, bc2, eps
            self.m_hat, self.root, self.v = m_hat, root, exp_avg_sq

    def exact_update(self, state: State, dg: torch.Tensor) -> State:
        """The state change after this step, without linearising the optimizer's update.

        ``state`` is the incoming perturbation ``(δθ, δm, δv)`` and ``dg`` the change of the
        consumed gradient. Torch's update from the perturbed pre-step state gives
        ``δm' = β₁δm + (1−β₁) dg``, ``δv' = β₂δv + (1−β₂)(2g + dg) ⊙ dg`` and
        ``δθ' = (1 − ηλ_d) δθ − η (m̂'/(√v̂'+ε) − m̂/(√v̂+ε))``, the last evaluated as
        ``−η (δm̂ (r+ε) − m̂ δr) / ((r'+ε)(r+ε))`` with ``δr = δv̂ / (r' + r)`` (no cancellation
        for small changes; its limit is the linearised :meth:`update`). Adam's update is
        bounded per coordinate, its derivative is not (``ε/(|g|+ε)²`` at the first update,
        where ``v̂ = g²``), so a sample that dominates coordinates of a young ``v`` moves the
        run far less than the derivative says; this map is exact there.
        """
        dm = self.beta1 * state["m"] + (1 - self.beta1) * dg
        dv = self.beta2 * state["v"] + (1 - self.beta2) * (2 * self.grad + dg) * dg
        dv_hat = dv / self.bc2
        root_new = (self.v / self.bc2 + dv_hat).clamp_min(0).sqrt()
        both = root_new + self.root
        d_root = torch.where(both > 0, dv_hat / torch.where(both > 0, both, 1.0), 0.0)
        num = dm / self.bc1 * (self.root + self.eps) - self.m_hat * d_root
        step = self.lr * num / ((root_new + self.eps) * (self.root + self.eps))
        return {"theta": self.decay * state["theta"] - step, "m": dm, "v": dv}

    def exact_push(self, s: torch.Tensor) -> State:
        """The state change after this step from removing rows ``s``, not linearised.

        :meth:`exact_update` of the removal's gradient change from an unperturbed state.
        """
        zero = {c: torch.zeros_like(s) for c in self.components}
        return self.exact_update(zero, self.curvature.push(s))

    def forward(self, state: State) -> State:
        """Carry incoming perturbations through the step.

        Linearised, or through the exact update (``nonlinear``) with the gradient change
        ``A δθ`` still linear.
        """
        if self.nonlinear:
            return self.exact_update(state, self.curvature.apply(state["theta"]))
        return super().forward(state)

    def push(self, s: torch.Tensor) -> State:
        """The state perturbation after this step from removing rows ``s`` ``(N, P)``."""
        return self.exact_push(s) if self.exact else super().push(s)

    def push_scores(self, adj: State, gamma: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """``(N, R)`` scores of removing rows ``s`` here (exact push: ``Σ_c ⟨adj_c, δc⟩``)."""
        if not self.exact:
            return super().push_scores(adj, gamma, s)
        d = self.exact_push(s)
        return sum(d[c] @ adj[c].T for c in ("theta", "m", "v"))

    def update(self, state: State, dg: torch.Tensor) -> State:
        """Moments and parameters after the step, linearised."""
        m = self.beta1 * state["m"] + (1 - self.beta1) * dg
        v = self.beta2 * state["v"] + 2 * (1 - self.beta2) * self.grad * dg
        out = {"m": m, "v": v}
        used = v
        if self.amsgrad:
            used = self.branch * v + (1 - self.branch) * state["vmax"]
            out["vmax"] = used
        out["theta"] = self.decay * state["theta"] - self.d_m * m + self.d_v * used
        return out

    def update_adjoint(self, adj: State) -> tuple[State, torch.Tensor]:
        """Transpose of :meth:`update`."""
        lt = adj["theta"]
        adj_m = adj["m"] - self.d_m * lt
        adj_used = self.d_v * lt
        prev: State = {"theta": self.decay * lt}
        if self.amsgrad:
            adj_vmax = adj["vmax"] + adj_used
            adj_v = adj["v"] + self.branch * adj_vmax
            prev["vmax"] = (1 - self.branch) * adj_vmax
        else:
            adj_v = adj["v"] + adj_used
        gamma = (1 - self.beta1) * adj_m + 2 * (1 - self.beta2) * self.grad * adj_v
        prev["m"] = self.beta1 * adj_m
        prev["v"] = self.beta2 * adj_v
        return prev, gamma


@dataclass
class StepPushes:
    """The samples removed at one step: their shares ``(N, P)`` and identities."""

    step: int
    shares: torch.Tensor
    hashes: list[str] = field(default_factory=list)


def _zeros(components: Iterable[str], rows: int, like: torch.Tensor) -> State:
    return {c: like.new_zeros(rows, like.shape[-1]) for c in components}


def _align(state: State, components: Sequence[str], like: torch.Tensor) -> State:
    """Give a state the components a step expects (missing ones are zero perturbations)."""
    return {c: state[c] if c in state else torch.zeros_like(like) for c in components}


def _check_finite(values: torch.Tensor, at: str, sweep: str) -> None:
    """Refuse non-finite scores / perturbations (see the module docstring).

    Raises:
        FloatingPointError: naming the step, the dtype and the ways out.
    """
    if bool(torch.isfinite(values).all()):
        return
    big = values[torch.isfinite(values)].abs()
    largest = f"{float(big.max()):.3g}" if big.numel() else "none"
    raise FloatingPointError(
        f"{sweep}: non-finite values (inf/NaN) {at} in {values.dtype} (largest finite "
        f"magnitude {largest}). Either the inputs (captured gradients, queries, optimizer "
        "record) hold non-finite values, or the linearised training steps amplify "
        "perturbations past the dtype's range: the run's first-order influence is then "
        "astronomically large and holds only for vanishingly small removals. Pass "
        "compute_dtype=torch.float64 to compute it anyway, or use a curvature that does not "
        "amplify (the default empirical Fisher, or none)."
    )


def _carry(
    steps: Sequence[int],
    load: Callable[[int], tuple[LinearStep, StepPushes]],
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda x: x,
    keep: Callable[[StepPushes], StepPushes] | None = None,
) -> tuple[State, list[str], list[int], LinearStep]:
    """Every removal's state perturbation after the last of ``steps``.

    Returns the state (rows in step order), each row's identity and step, and the last step's
    map.
    """
    state: State | None = None
    hashes: list[str] = []
    rows: list[int] = []
    op = None
    linear_seen = False
    for step in progress(steps):
        op, pushes = load(step)
        if op.nonlinear and linear_seen:
            raise ValueError(
                f"step {step} carries perturbations nonlinearly after a linearised step; the "
                "nonlinear steps must be the first of the run."
            )
        linear_seen = linear_seen or not op.nonlinear
        if keep is not None:
            pushes = keep(pushes)
        if state is not None:
            state = op.forward(_align(state, op.components, state["theta"]))
        new = op.push(pushes.shares)
        state = new if state is None else {c: torch.cat([state[c], new[c]]) for c in new}
        hashes += list(pushes.hashes)
        rows += [pushes.step] * pushes.shares.shape[0]
    if state is None or op is None:
        raise ValueError("the trajectory holds no steps.")
    return state, hashes, rows, op


def forward_sweep(
    steps: Sequence[int],
    load: Callable[[int], tuple[LinearStep, StepPushes]],
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda x: x,
    keep: Callable[[StepPushes], StepPushes] | None = None,
) -> tuple[torch.Tensor, list[str], list[int]]:
    """Carry every removal forward to the end of the run.

    Args:
        steps: The steps in training order.
        load: ``step -> (LinearStep, StepPushes)``.
        progress: Wraps the steps (a progress bar).
        keep: Selects the removals to carry (e.g. this rank's samples); every row is
            independent of the others, so a subset gives exactly those rows.

    Returns:
        ``(E, hashes, steps)``: ``E`` ``(N_occ, P)`` the final parameter perturbations
        ``δθ_T`` of removing each occurrence (DVEmb's data value embeddings, for SGD), in
        step order, with each row's sample identity and step.
    """
    state, hashes, rows, _ = _carry(steps, load, progress, keep)
    _check_finite(state["theta"], f"by step {rows[-1]} (the end of the run)", "forward sweep")
    return state["theta"], hashes, rows


def adjoint_sweep(
    steps: Sequence[int],
    load: Callable[[int], tuple[LinearStep, StepPushes]],
    queries: torch.Tensor,
    progress: Callable[[Iterable[int]], Iterable[int]] = lambda x: x,
) -> tuple[torch.Tensor, list[str], list[int]]:
    """Carry the queries' adjoints backward; score each occurrence at its own step.

    Steps whose map is ``nonlinear`` (the first steps of the run; see ``AdamStep``) cannot be
    transposed: the sweep stops at the last of them, carries those steps' removals *forward*
    through them (:func:`forward_sweep`'s recursion) and scores each against the adjoint of the
    state after that step.

    Args:
        steps: The steps in training order.
        load: ``step -> (LinearStep, StepPushes)``.
        queries: ``(R, P)`` the query gradients at the end of the run.
        progress: Wraps the steps (a progress bar).

    Returns:
        ``(scores (N_occ, R), hashes, steps)`` in step order.
    """
    adj: State = {"theta": queries}
    out: list[tuple[torch.Tensor, list[str], list[int]]] = []  # (scores, hashes, steps)
    order = list(steps)
    prefix: list[int] = []
    for i, step in enumerate(progress(list(reversed(order)))):
        op, pushes = load(step)
        if op.nonlinear:
            prefix = order[: len(order) - i]
            break
        adj = _align(adj, op.components, queries)
        prev, gamma = op.adjoint(adj)
        scores = op.push_scores(adj, gamma, pushes.shares)
        _check_finite(scores, f"at step {step}", "adjoint sweep")
        out.append((scores, list(pushes.hashes), [pushes.step] * scores.shape[0]))
        adj = prev
    out.reverse()
    if prefix:
        state, hashes, rows, last = _carry(prefix, load)
        adj = _align(adj, last.components, queries)
        scores = sum(state[c] @ adj[c].T for c in last.components)
        _check_finite(scores, f"by step {prefix[-1]} (the exactly taken steps)", "adjoint sweep")
        out.insert(0, (scores, hashes, rows))
    if not out:
        raise ValueError("the trajectory holds no steps.")
    scores = torch.cat([s for s, _, _ in out])
    hashes = [h for _, hs, _ in out for h in hs]
    rows = [st for _, _, sts in out for st in sts]
    return scores, hashes, rows
