"""Integrations with training frameworks, one module each, imported on demand.

Nothing here is imported by ``import dattri_llm``: each module needs its framework installed
(its extra) and raises an ``ImportError`` naming that extra otherwise.

* :mod:`dattri_llm.integrations.olmo_core` — OLMo-core (``pip install -e ".[olmo-core]"``):
  :class:`~dattri_llm.integrations.olmo_core.GradientCaptureCallback`, a trainer callback that
  captures from the first real training step, and
  :func:`~dattri_llm.integrations.olmo_core.olmo_core_layer_types` for OLMo-core's norm classes.
* :mod:`dattri_llm.integrations.hf_trainer` — the Hugging Face ``Trainer`` and TRL's
  ``SFTTrainer`` (the ``transformers`` extra):
  :class:`~dattri_llm.integrations.hf_trainer.AttributionCallback` and
  :func:`~dattri_llm.integrations.hf_trainer.capture_queries` (also ``dattri_llm.
  AttributionCallback`` / ``dattri_llm.capture_queries``, imported on first access).
"""
