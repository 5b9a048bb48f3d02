"""Integrations with training frameworks, one module each, imported on demand.

Nothing here is imported by ``import dattri_llm``: each module needs its framework installed
(its extra) and raises an ``ImportError`` naming that extra otherwise.

* :mod:`dattri_llm.integrations.olmo_core` — OLMo-core (``pip install -e ".[olmo-core]"``):
  :class:`~dattri_llm.integrations.olmo_core.GradientCaptureCallback`, a trainer callback that
  captures from the first real training step, and
  :func:`~dattri_llm.integrations.olmo_core.olmo_core_layer_types` for OLMo-core's norm classes.
"""
