"""Kronecker-factored curvature: K-FAC / EK-FAC covariances, eigenbases and preconditioning.

Conventions (row-major matrix form, as everywhere in the library). A Kronecker-eligible layer
(``rule.kronecker``: linear, HF ``Conv1D``, convolutions via im2col) has the per-sample gradient
``M_n = sum_t g_{n,t} a_{n,t}^T`` of shape ``(K, D)``; its dense vector is ``vec(M_n)``
flattened row-major, so ``vec(g a^T) = g ⊗ a`` and ``vec(B X C^T) = (B ⊗ C) vec(X)``.

* **Fisher.** ``F = (1/N) sum_n vec(M_n) vec(M_n)^T``: the *mean* over the ``N`` training
  samples of per-sample gradient outer products (empirical Fisher), so a damping value means the
  same thing whatever the dataset size.
* **K-FAC.** ``F ≈ G ⊗ A`` (this order, because of the row-major ``vec``) with
  ``G = (1/N) sum_n sum_t g_{n,t} g_{n,t}^T`` (mean over samples of the per-sample sum over
  tokens) and ``A = (1/N_tok) sum_{n,t} a_{n,t} a_{n,t}^T`` (mean over tokens). That is the
  token-independence approximation ``F ≈ (1/N) sum_n sum_t (g g^T) ⊗ (a a^T)`` with activations
  and output gradients assumed independent: its scale grows with the tokens per sample like ``F``
  does. ``N_tok`` counts the positions that carry gradient (neither ``g`` nor ``a`` identically
  zero; a ``logra`` embedding's index side ``R[idx]`` never is), so zero padding and positions
  outside the loss (pad tokens, a causal LM's last position) are left out of ``A`` and ``G``
  just as they are absent from ``F``; ``tokens="all"`` counts every position (what
  kronfluence does without an attention mask). With one token per sample (an MLP) this is
  exactly Martens & Grosse's K-FAC. A conv layer's tokens are its output positions.
* **Eigenbasis.** ``A = Q_A diag(s_A) Q_A^T``, ``G = Q_G diag(s_G) Q_G^T`` (float64 by
  default, eigenvalues clamped at 0); K-FAC eigenvalues are ``s_G s_A^T`` (``(K, D)``).
* **EK-FAC.** Same basis, eigenvalues replaced by the empirical second moments in it:
  ``Λ = (1/N) sum_n (Q_G^T M_n Q_A)^2`` (elementwise), computed from the rotated factors
  ``(g Q_G)^T (a Q_A)`` when cheaper than rotating the dense gradient.
* **Preconditioning.** ``(F̂ + λ I)^{-1} vec(M) = vec(Q_G [(Q_G^T M Q_A) / (E + λ)] Q_A^T)`` with
  ``E`` the eigenvalues above; ``λ = damping`` (absolute), or ``damping * mean(E)`` per layer when
  ``relative=True``. The result is a :class:`Materialized` layer: the damped inverse is not a
  Kronecker product, so an exact factorised preconditioned gradient does not exist (only the
  undamped ``G^{-1} ⊗ A^{-1}`` would be); a preconditioned query is one dense ``(K, D)`` per
  sample, and scoring it against factorised training gradients stays factorised on the train
  side (``rule.dense_per_token``), which is what keeps token granularity exact.
* **Vector layers** (``rule.exact_fisher``: a ``"dense"`` / ``"sparse"`` / ``"mask"`` projection,
  matrix form ``(1, P)``): one token with ``a = v``, ``g = 1``, so ``G ⊗ A`` is the exact Fisher
  ``(1/N) sum_n v_n v_n^T`` and K-FAC and EK-FAC agree; damping as above.
* **Other layers** (embeddings, norms, ``param_grad``, tied groups with a non-eligible site):
  ``non_kronecker="skip"`` (default) leaves them out of the fit and of the scores, with one
  warning that lists them; ``"diagonal"`` preconditions them with the exact diagonal empirical
  Fisher ``(1/N) sum_n m_n^2`` (EK-FAC in the identity basis; it materialises their gradients
  during the fit, fine for norms, costly for large embeddings).

* **Fused experts** (``rule.kronecker_blocks(kw) = E > 1``, ``"moe.experts"``): the matrix
  form stacks ``E`` expert matrices ``M_e`` ``(K, D)``, and K-FAC is block-diagonal,
  ``F ≈ blockdiag_e(G_e ⊗ A_e)`` with ``G_e = (1/N) sum_n sum_{t->e} g g^T`` (``N``: *every*
  sample, as for a linear layer: the Fisher is a mean over samples, and a sample that did not
  reach expert ``e`` contributes its zero block) and ``A_e = (1/N_e) sum_{t->e} a a^T``
  (``N_e``: the counted routed (token, expert = e) slots, ``tokens`` as above). Covariances,
  eigenvectors and eigenvalues carry a leading expert axis (``A``: ``(E, D, D)``, EK-FAC
  eigenvalues ``(E, K, D)``); preconditioning is per expert,
  ``Q_{G_e} [(Q_{G_e}^T M_e Q_{A_e}) / (E_e + λ)] Q_{A_e}^T``, with ``relative`` damping
  scaled by the mean eigenvalue of the whole layer. An expert no counted slot of the fit data
  reached has ``A_e = G_e = 0`` (and zero EK-FAC eigenvalues): its block is preconditioned by
  damping alone, ``M_e / λ`` (refused as singular when ``λ = 0``).

Tied weights whose sites are all eligible (a :class:`Shared` layer) are one layer whose tokens
are the union of the sites' tokens. Under ``torch.distributed`` every accumulator is
all-reduced (sums and counts), and rank 0's eigenvectors are broadcast, so every rank holds the
same fit. Persistence (:meth:`KroneckerCovariances.save`, :meth:`KroneckerFactors.save`):
safetensors + JSON metadata, versioned and validated on load; no pickle.

Modules, in the order of a fit: :mod:`.covariances` (which layers K-FAC reads, the running sums
``A``, ``G`` and diagonal Fishers, their all-reduce, the files of the family),
:mod:`.factors` (:func:`eigendecompose`, the damping-free :class:`KroneckerFactors` and its
preconditioner), :mod:`.correction` (EK-FAC's eigenvalues in that basis).
"""

from __future__ import annotations

from dattri_llm.gradient.kronecker.correction import (
    EigenvalueCorrection,
    fit_eigenvalue_correction,
)
from dattri_llm.gradient.kronecker.covariances import (
    FORMAT_VERSION,
    DiagonalFisher,
    KroneckerCovariances,
    LayerCovariance,
    NonKronecker,
    TokenCount,
    fit_shapes,
    is_kronecker_layer,
)
from dattri_llm.gradient.kronecker.factors import KroneckerFactors, LayerEigen, eigendecompose

__all__ = [
    "FORMAT_VERSION",
    "NonKronecker",
    "TokenCount",
    "LayerCovariance",
    "DiagonalFisher",
    "KroneckerCovariances",
    "LayerEigen",
    "KroneckerFactors",
    "is_kronecker_layer",
    "fit_shapes",
    "eigendecompose",
    "EigenvalueCorrection",
    "fit_eigenvalue_correction",
]
