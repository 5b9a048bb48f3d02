"""Shared helpers of the speed benchmarks (models, timing, memory, tables, adapters)."""
