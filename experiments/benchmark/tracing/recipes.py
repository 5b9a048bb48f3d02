"""TrackStar's recipe (Chang et al., 2024) as tracing rows: second-moment correction,
preconditioning and unit normalization, per checkpoint, summed over the run's checkpoints.

* :func:`trackstar_full`: ``ProjectedFisherAttributor(normalized_grad=True, second_moment=[v_c])``
  on a ``"mask"`` capture: per checkpoint ``c``, gradients ``g̃ = g / √(v_c + ε)`` on the mask's
  coordinates, ``R_c`` = their exact second-moment matrix per layer (relative damping), score
  ``cos(R_c^{-1/2} g̃, R_c^{-1/2} q̃)``, summed over the checkpoints. TrackStar mixes coordinates
  with a random projection *after* the correction; a capture-time mixing projection would have
  to come before it (refused by the library), so the coordinates here are a seeded subsample.
* :func:`trackstar_dense` (TrackStar's order): per checkpoint, train and query gradients
  captured with ``HookManager(optimizer=AdamW(state c), precondition="second_moment")`` and a
  ``"dense"`` projection to :data:`DENSE_DIM` per layer, so ``g̃ = g / √(v_c + ε)`` comes first
  and the Gaussian projection mixes every corrected coordinate;
  ``ProjectedFisherAttributor(normalized_grad=True)`` on them (``R_c`` the exact second-moment
  matrix of the projected corrected train gradients per layer), summed over the checkpoints;
  and the same gradients under ``TracInAttributor(normalized_grad=True)`` (``R = I``), which
  separates what the projection costs from what ``R`` does.
* :func:`ekfac_moment`: ``EKFACAttributor(normalized_grad=True, non_kronecker="diagonal",
  second_moment=[v_c])`` on raw gradients: the eigenvalue correction (and the diagonal
  embeddings / norms) fit on the corrected gradients in the K-FAC basis of the raw ones.

Each checkpoint's ``v_c`` is the AdamW ``exp_avg_sq`` saved with it (``Snapshots.optimizer``),
laid out by a ``HookManager`` with the capture's own configuration.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from experiments.benchmark.tracing import data as tdata

#: Coordinates per layer of the TrackStar row's mask capture.
MASK_DIM = 1024


def mask_config(dim: int = MASK_DIM) -> Any:
    """A ``HookManagerConfig`` capturing ``dim`` seeded coordinates of every layer."""
    from dattri_llm import HookManagerConfig, ProjectionConfig

    return HookManagerConfig(projection=ProjectionConfig("mask", proj_dim=dim, seed=0))


#: Numbers per layer of the dense projection of :func:`trackstar_dense`.
DENSE_DIM = 1024
#: The row name of :func:`trackstar_dense`.
TRACKSTAR_DENSE = "TrackStar: ProjectedFisher unit, corrected then dense-1024 (3 ckpts)"
#: The row name of :func:`trackstar_dense` with ``R = I`` (Grad-Cos).
TRACIN_DENSE = "TracIn-Cos, corrected then dense-1024 (3 ckpts)"


def second_moments(d: tdata.TracingData, states: Any, load: Any, config: Any = None) -> list:
    """One ``SecondMoment`` per checkpoint of ``states``, laid out by ``config``'s capture."""
    from dattri_llm import HookManager, HookManagerConfig, SecondMoment

    out = []
    for state, opt_state in zip(states, states.optimizer):
        model = load(d, state)
        opt = torch.optim.AdamW(model.parameters())
        opt.load_state_dict(copy.deepcopy(opt_state))
        hm = HookManager(model, config or HookManagerConfig())
        try:
            out.append(SecondMoment.from_optimizer(opt, hm))
        finally:
            hm.remove()
    return out


def trackstar_full(d: tdata.TracingData, states: Any, attribute: Any, load: Any) -> torch.Tensor:
    """TrackStar with its ``R``: see the module docstring (``attribute`` is ``run._attribute``)."""
    cfg = mask_config()
    moments = second_moments(d, states, load, cfg)
    kw = {"normalized_grad": True, "second_moment": moments}
    return attribute(d, states, "ProjectedFisherAttributor", kw, {"hook_config": cfg})


def trackstar_dense(
    d: tdata.TracingData, states: Any, streamed: Any, method: str = "ProjectedFisherAttributor"
) -> torch.Tensor:
    """TrackStar corrected, then densely projected (``streamed`` is ``run._streamed``), scored
    by ``method(normalized_grad=True)`` per checkpoint and summed."""
    from dattri_llm import HookManagerConfig, ProjectionConfig

    cfg = HookManagerConfig(projection=ProjectionConfig("dense", proj_dim=DENSE_DIM, seed=0))
    total = None
    for state, opt_state in zip(states, states.optimizer):

        def stream(model: Any, opt_state: Any = opt_state) -> dict:
            opt = torch.optim.AdamW(model.parameters())
            opt.load_state_dict(copy.deepcopy(opt_state))
            return {"hook_config": cfg, "optimizer": opt, "precondition": "second_moment"}

        part = streamed(d, state, method, {"normalized_grad": True}, stream)
        total = part if total is None else total + part
    return total


def ekfac_moment(d: tdata.TracingData, states: Any, attribute: Any, load: Any) -> torch.Tensor:
    """EK-FAC unit + diagonal with the second-moment correction over every checkpoint."""
    kw = {
        "normalized_grad": True,
        "non_kronecker": "diagonal",
        "second_moment": second_moments(d, states, load),
    }
    return attribute(d, states, "EKFACAttributor", kw)
