"""Nearest-neighbour search over projected gradient stores: :class:`GradientIndex` (FAISS).

``gradient_index`` (the class: build, open, search), ``vectors`` (a store's layers as one
vector per sample, rows aggregated), ``kinds`` (the FAISS index kinds and their parameters),
``format`` (the index directory's files and the store fingerprint). FAISS is imported only
when an index is built or opened (``pip install "dattri_llm[index]"``).
"""

from __future__ import annotations

from dattri_llm.attribution.index.format import IndexFormatError, StaleIndexError
from dattri_llm.attribution.index.gradient_index import GradientIndex
from dattri_llm.attribution.index.vectors import NotVectorError

__all__ = ["GradientIndex", "IndexFormatError", "StaleIndexError", "NotVectorError"]
