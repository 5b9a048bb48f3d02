"""TrackStar's recipe (Chang et al., 2024) as tracing rows: second-moment correction,
preconditioning and unit normalization, per checkpoint, summed over the run's checkpoints.

* :func:`trackstar_full`: ``ProjectedFisherAttributor(normalized_grad=True, second_moment=[v_c])``
  on a ``"mask"`` capture: per checkpoint ``c``, gradients ``g̃ = g / √(v_c + ε)`` on the mask's
  coordinates, ``R_c`` = their exact second-moment matrix per layer (relative damping), score
  ``cos(R_c^{-1/2} g̃, R_c^{-1/2} q̃)``, summed over the checkpoints. TrackStar mixes coordinates
  with a random projection *after* the correction; a capture-time mixing projection would have
  to come before it (refused by the library), so the coordinates here are a seeded subsample.
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


def ekfac_moment(d: tdata.TracingData, states: Any, attribute: Any, load: Any) -> torch.Tensor:
    """EK-FAC unit + diagonal with the second-moment correction over every checkpoint."""
    kw = {
        "normalized_grad": True,
        "non_kronecker": "diagonal",
        "second_moment": second_moments(d, states, load),
    }
    return attribute(d, states, "EKFACAttributor", kw)
