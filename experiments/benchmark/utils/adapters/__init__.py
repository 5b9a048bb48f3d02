"""Adapters that run one library (ours or a peer) on the benchmark's models and data."""
