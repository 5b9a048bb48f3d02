"""Scores as people read them: the self-contained HTML report and token-level heatmaps."""
