"""Progress bars: the one place the library makes them (tqdm, imported when a bar is made).

``show`` follows tqdm's own convention: ``None`` (the default everywhere) shows a bar only when
its stream (standard error) is a terminal, so logs of CI jobs and redirected runs carry no
bars; ``True`` forces a bar, ``False`` none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["progress_bar", "progress", "check_show"]


def check_show(show: object, name: str = "show_progress") -> bool | None:
    """``show`` if it is ``None``, ``True`` or ``False``.

    Raises:
        TypeError: anything else, naming ``name``.
    """
    if show is None or isinstance(show, bool):
        return show
    raise TypeError(
        f"{name} must be None (bars only on a terminal), True or False, got {show!r} "
        f"({type(show).__name__})."
    )


def progress_bar(show: bool | None, **kwargs: Any) -> Any:
    """A tqdm bar (``tqdm.auto``, ``leave=False``), or ``None`` when ``show`` is ``False``.

    Args:
        show: ``None``: a bar only when its stream is a terminal (tqdm's ``disable=None``);
            ``True``: always; ``False``: no bar.
        **kwargs: tqdm's arguments (``total``, ``desc``, ``unit``, ``file``, ...).
    """
    show = check_show(show)
    if show is False:
        return None
    from tqdm.auto import tqdm

    kwargs.setdefault("leave", False)
    return tqdm(disable=None if show is None else False, **kwargs)


def progress(items: Iterable, show: bool | None, **kwargs: Any) -> Iterable:
    """``items`` wrapped in a bar as :func:`progress_bar` decides (``items`` itself if none)."""
    if check_show(show) is False:
        return items
    if "total" not in kwargs and hasattr(items, "__len__"):
        kwargs["total"] = len(items)  # type: ignore[arg-type]
    return progress_bar(show, iterable=items, **kwargs)
