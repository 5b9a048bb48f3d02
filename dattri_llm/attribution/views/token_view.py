"""Render per-token attribution scores: an ANSI terminal heatmap and a self-contained HTML page.

Token scores come from ``AttributionScore.token_scores(train_hash)`` (token granularity). With
the gradient-similarity attributors a positive score means a training step on that token lowers
the query's loss (the token supports the query); a negative score means it raises it. Tokens are
coloured green (positive) or red (negative) with an intensity proportional to ``|score| / scale``;
exact zeros (padding, positions outside the loss) stay uncoloured.

The HTML page has no external assets (no scripts, fonts or style sheets are fetched): one
``<span>`` per token whose ``title`` (the hover tooltip) shows the position and the score, and
every piece of text is HTML-escaped.

Example:
    ```python
    pos, ts = score.token_scores(train_hash)
    print(terminal_heatmap(tokens, ts[:, 0]))
    write_html("tokens.html", [TokenHeatmap("train sample 3", tokens, ts[:, 0])])
    ```
"""

from __future__ import annotations

import html
import math
import os
import sys
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = [
    "TokenHeatmap",
    "token_window",
    "display_token",
    "token_color",
    "color_enabled",
    "terminal_heatmap",
    "html_tokens",
    "html_page",
    "write_html",
]

#: RGB of the strongest positive (supports the query) and negative (opposes it) colour.
POSITIVE_RGB = (0, 158, 74)
NEGATIVE_RGB = (215, 38, 38)
_WHITE = (255, 255, 255)


def _floats(scores: Any, name: str = "scores") -> list[float]:
    if hasattr(scores, "detach"):  # a torch tensor
        scores = scores.detach().cpu().reshape(-1).tolist()
    try:
        out = [float(s) for s in scores]
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a 1-d tensor or a sequence of numbers, got {type(scores).__name__}."
        ) from None
    return out


def _check(tokens: Sequence[str], scores: list[float]) -> None:
    if isinstance(tokens, str):
        raise TypeError("tokens must be a sequence of token strings, not one string.")
    if len(tokens) != len(scores):
        raise ValueError(
            f"tokens has {len(tokens)} entries but scores has {len(scores)}: give one score per "
            "token (e.g. score.token_scores(h)[1][:, j] for test column j)."
        )


def token_window(tokens: Sequence[str], scores: Any) -> slice:
    """The positions of ``scores`` that ``tokens`` name, when the token list is shorter.

    A sample's token list (from a texts file) may omit the padding its batch added, so it can be
    shorter than the scored positions. The tokens then sit at the start (right padding) or the
    end (left padding) of the positions; the side is the one whose left-out positions score
    exactly zero (padding is outside the loss), for every query column. Tokens are never paired
    with positions by truncation.

    Args:
        tokens: The token strings.
        scores: ``(T,)`` or ``(T, M)`` scores of the positions (``AttributionScore.token_scores``).

    Returns:
        The slice of positions the tokens belong to (all of them when the lengths agree).

    Raises:
        ValueError: more tokens than positions, or no side (or both, with scores that differ
            between them) whose left-out positions are padding.
    """
    if hasattr(scores, "detach"):  # a torch tensor
        scores = scores.detach().cpu().reshape(scores.shape[0], -1).tolist()
    rows = [list(r) if isinstance(r, (list, tuple)) else [r] for r in scores]
    total, n = len(rows), len(tokens)
    if n == total:
        return slice(0, total)

    def padding(part: list[list[float]]) -> bool:
        return all(float(v) == 0.0 for row in part for v in row)

    if n < total:
        sides = {
            "right": (slice(0, n), padding(rows[n:])),
            "left": (slice(total - n, total), padding(rows[: total - n])),
        }
        fits = [w for w, ok in sides.values() if ok]
        if len(fits) == 1 or (fits and padding(rows)):
            return fits[0]
    raise ValueError(
        f"tokens has {n} entries but the scores have {total} positions, and the positions "
        f"{'left out' if n < total else 'missing'} are not padding on one side alone, so the "
        "tokens cannot be placed: give one token string per scored position (padding included)."
    )


def _auto_scale(scores: Sequence[float]) -> float:
    finite = [abs(s) for s in scores if math.isfinite(s)]
    return max(finite, default=0.0)


def display_token(token: str) -> str:
    r"""A visible rendering of a token (no control characters survive).

    Newlines become ``⏎``, tabs ``⇥``, carriage returns ``␍`` and other control / format
    characters ``\xNN`` (or ``\uNNNN``) escapes, so a token can never inject terminal codes.
    """
    out = []
    for ch in token:
        if ch == "\n":
            out.append("⏎")
        elif ch == "\t":
            out.append("⇥")
        elif ch == "\r":
            out.append("␍")
        elif unicodedata.category(ch) in ("Cc", "Cf") and ch != " ":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def token_color(score: float, scale: float) -> tuple[int, int, int] | None:
    """Background RGB of a score (``None``: leave uncoloured: zero, non-finite or no scale)."""
    if scale <= 0 or score == 0 or not math.isfinite(score):
        return None
    alpha = min(1.0, abs(score) / scale)
    base = POSITIVE_RGB if score > 0 else NEGATIVE_RGB
    r, g, b = (int(w * (1 - alpha) + c * alpha + 0.5) for w, c in zip(_WHITE, base))
    return r, g, b


def color_enabled(stream: TextIO | None = None) -> bool:
    """Whether ANSI colours should be written to ``stream`` (default: ``sys.stdout``).

    Only to a terminal, and never when the ``NO_COLOR`` environment variable is set to a
    non-empty value (https://no-color.org).
    """
    if os.environ.get("NO_COLOR"):
        return False
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def terminal_heatmap(
    tokens: Sequence[str], scores: Any, scale: float | None = None, color: bool | None = None
) -> str:
    """One line of tokens with 24-bit ANSI background colours by score.

    Args:
        tokens: The token strings (e.g. ``[tokenizer.decode([i]) for i in ids]``).
        scores: One score per token (a 1-d tensor or a sequence).
        scale: ``|score|`` of full colour (default: the largest ``|score|`` here); share one
            scale across lines to compare them.
        color: Emit ANSI codes; ``False`` brackets non-zero tokens as ``[token|+1.2e-03]``
            instead (for logs and terminals without colour). ``None`` (default): colours
            when :func:`color_enabled` (standard output is a terminal and ``NO_COLOR`` is not
            set).
    """
    if color is None:
        color = color_enabled()
    values = _floats(scores)
    _check(tokens, values)
    scale = _auto_scale(values) if scale is None else float(scale)
    parts = []
    for tok, s in zip(tokens, values):
        text = display_token(tok)
        rgb = token_color(s, scale)
        if rgb is None:
            parts.append(text)
        elif color:
            r, g, b = rgb
            parts.append(f"\x1b[48;2;{r};{g};{b}m\x1b[38;2;0;0;0m{text}\x1b[0m")
        else:
            parts.append(f"[{text}|{s:+.2e}]")
    return "".join(parts)


def html_tokens(tokens: Sequence[str], scores: Any, scale: float | None = None) -> str:
    """An HTML fragment: one ``<span class="tok">`` per token, coloured by score.

    Each span's ``title`` (hover tooltip) shows the position and the score; ``data-score``
    holds the score. All text is escaped.
    """
    values = _floats(scores)
    _check(tokens, values)
    scale = _auto_scale(values) if scale is None else float(scale)
    spans = []
    for i, (tok, s) in enumerate(zip(tokens, values)):
        rgb = token_color(s, scale)
        style = "" if rgb is None else f' style="background-color: rgb{rgb}"'
        title = html.escape(f"position {i}: {s:+.4e}  ({tok!r})", quote=True)
        text = html.escape(display_token(tok), quote=True)
        spans.append(f'<span class="tok" title="{title}" data-score="{s!r}"{style}>{text}</span>')
    return '<div class="tokens">' + "".join(spans) + "</div>"


@dataclass
class TokenHeatmap:
    """One heatmap of an HTML page: a heading, the tokens and their scores.

    Attributes:
        heading: Section heading (plain text; escaped).
        tokens: Token strings.
        scores: One score per token.
        note: Optional line under the heading (plain text; escaped).
    """

    heading: str
    tokens: Sequence[str]
    scores: Any
    note: str = ""
    _values: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._values = _floats(self.scores)
        _check(self.tokens, self._values)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 72em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.1em; margin: 1.4em 0 0.3em; }
.note, .legend { color: #555; font-size: 0.9em; margin: 0.2em 0 0.6em; }
.tokens { font-family: ui-monospace, monospace; line-height: 1.9; white-space: pre-wrap;
          border: 1px solid #ddd; padding: 0.6em; border-radius: 4px; }
.tok { padding: 0.1em 0; border-radius: 2px; }
.tok:hover { outline: 1px solid #222; }
.swatch { display: inline-block; width: 1em; height: 1em; vertical-align: middle; }
"""


def html_page(
    heatmaps: Sequence[TokenHeatmap],
    title: str = "Token attribution",
    description: str = "",
    scale: float | None = None,
) -> str:
    """A self-contained HTML page of several heatmaps (no external assets).

    Args:
        heatmaps: The sections, in order.
        title: Page title (plain text; escaped).
        description: Paragraph under the title (plain text; escaped).
        scale: ``|score|`` of full colour, shared by every section (default: the largest
            ``|score|`` of the page, so colours compare across sections).
    """
    heatmaps = list(heatmaps)
    for h in heatmaps:
        if not isinstance(h, TokenHeatmap):
            raise TypeError(f"heatmaps must be TokenHeatmap objects, got {type(h).__name__}.")
    if scale is None:
        scale = max((_auto_scale(h._values) for h in heatmaps), default=0.0)
    esc = html.escape
    pos, neg = f"rgb{POSITIVE_RGB}", f"rgb{NEGATIVE_RGB}"
    body = [
        f"<h1>{esc(title)}</h1>",
        f'<p class="legend"><span class="swatch" style="background-color: {pos}"></span> '
        "positive: training on the token lowers the query's loss &nbsp; "
        f'<span class="swatch" style="background-color: {neg}"></span> negative: it raises '
        f"it &nbsp; (full colour at |score| = {scale:.3e}; hover a token for its score)</p>",
    ]
    if description:
        body.append(f'<p class="note">{esc(description)}</p>')
    for h in heatmaps:
        body.append(f"<section><h2>{esc(h.heading)}</h2>")
        if h.note:
            body.append(f'<p class="note">{esc(h.note)}</p>')
        body.append(html_tokens(h.tokens, h._values, scale) + "</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )


def write_html(
    path: str | os.PathLike,
    heatmaps: Sequence[TokenHeatmap],
    title: str = "Token attribution",
    description: str = "",
    scale: float | None = None,
) -> str:
    """Write :func:`html_page` to ``path`` (UTF-8; parent directories created); returns it."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(html_page(heatmaps, title, description, scale))
    return path
