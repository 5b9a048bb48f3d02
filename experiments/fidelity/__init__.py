"""Fidelity of the capture on OLMo-core runs (see run.py)."""
