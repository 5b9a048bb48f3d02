"""Randomized differential tests (larger runs than the CI suite's fixed seed sets)."""
