"""The HTML report, opened in a real headless browser (Chromium), at 100 queries x 10 examples.

Checked: the page renders (a screenshot with text and the histogram's bars), it has one section
per query, and a ``<script>`` injected in a training text and in a query did not run (the DOM
after loading has no element the script would have added, and the text shows escaped).
``.ci/run`` installs Chromium from Debian's packages when it is missing; without it the test
is skipped.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from dattri_llm.attribution.score import AttributionScore
from dattri_llm.attribution.views.report import SampleText, write_report

BROWSER = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no Chromium (.ci/run installs it)")

INJECTED = (
    '<script>document.title="PWNED";document.body.setAttribute("data-pwned","1")</script>'
    "<img src=x onerror=\"document.body.setAttribute('data-pwned','2')\">"
)


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """``(width, height, rows of RGB(A) bytes)`` of an 8-bit RGB / RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), (depth, color)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, [bytes(r[i : i + 3]) for r in rows for i in range(0, stride, bpp)]


def browser(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    profile = f"--user-data-dir={cwd / 'profile'}"
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--no-first-run", "--disable-extensions", profile, *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=120)


def test_report_renders_in_chromium_and_injected_script_does_not_run(tmp_path: Path) -> None:
    n_train, n_test, k = 60, 100, 10
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(n_train, n_test, generator=g, dtype=torch.float64)
    train = [f"t{i:03d}" + "0" * 60 for i in range(n_train)]
    test = [f"q{j:03d}" + "0" * 60 for j in range(n_test)]
    scores[7] += 10.0  # train sample 7, the injected one, is every query's top proponent
    score = AttributionScore(scores, train, [0] * n_train, test)
    long_text = " ".join(f"word{i}" for i in range(400))
    train_texts = {
        h: SampleText(INJECTED if i == 7 else (long_text if i % 5 == 0 else f"train text {i}"),
                      labels={"topic": f"topic {i % 4}"})
        for i, h in enumerate(train)
    }  # fmt: skip
    test_texts = {h: SampleText(f"query {j} " + (INJECTED if j == 3 else "")) for j, h in
                  enumerate(test)}  # fmt: skip
    page = tmp_path / "report.html"
    write_report(page, score, train_texts, test_texts, k=k, settings={"method": "test"})
    html = page.read_text(encoding="utf-8")
    assert html.count('<section class="query"') == n_test
    assert html.count("<tr>") >= n_test * 2 * k  # 10 proponents + 10 opponents each
    assert page.stat().st_size < 3_000_000  # readable: folded texts keep it small

    dom = browser("--dump-dom", page.as_uri(), cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    out = dom.stdout
    assert out.count('<section class="query"') == n_test  # one section per query
    assert "data-pwned" not in out.split("<body", 1)[1].split(">", 1)[0]  # the script never ran
    assert "<title>PWNED" not in out and "<script" not in out and "<img" not in out
    assert out.count("&lt;script&gt;document.title") >= n_test + 1  # shown as text instead
    assert out.count("<details") >= n_test  # long texts are folded

    shot = tmp_path / "shot.png"
    r = browser("--window-size=1280,1600", f"--screenshot={shot}", page.as_uri(), cwd=tmp_path)
    assert r.returncode == 0 and shot.exists(), r.stderr[-2000:]
    width, height, pixels = decode_png(shot.read_bytes())
    assert (width, height) == (1280, 1600)
    ink = sum(1 for p in pixels if max(p) < 200)  # text, rules, bars
    green = sum(1 for p in pixels if p[1] > 120 and p[0] < 60 and p[2] < 110)  # histogram bars
    assert ink > 0.01 * len(pixels), ink  # the page is not blank
    assert green > 500, green  # the inline SVG histogram rendered
