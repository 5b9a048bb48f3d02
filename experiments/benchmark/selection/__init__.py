"""Targeted data selection with LESS (Xia et al., 2024) on a pool of real offline corpora."""
