"""Grouping items that share a key (union-find), in a stable order."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

__all__ = ["linked_groups"]


def linked_groups(keys: Sequence[Iterable[Hashable]]) -> list[list[int]]:
    """Indices of the items joined, transitively, by a shared key.

    Args:
        keys: For each item, the keys it holds (e.g. sample identities, parameter ids).

    Returns:
        The groups as lists of item indices, each ascending, ordered by their first index.
    """
    parent = list(range(len(keys)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[Hashable, int] = {}
    for i, item_keys in enumerate(keys):
        for k in item_keys:
            a, b = find(i), find(owner.setdefault(k, i))
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(len(keys)):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())
