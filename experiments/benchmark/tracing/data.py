"""Fact-tracing data: made-up facts planted in windows of Python's documentation.

Each of ``n_facts`` made-up entities gets one relation and a made-up attribute (both single
tokens), written into ``copies`` documents in different training paraphrases; each fact's query
is a held-out phrasing that ends just before the attribute (``y`` labels that position only).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

PAD, UNK = "<pad>", "<unk>"

#: relation -> (training paraphrases, held-out query phrasing); ``{e}`` entity, ``{a}`` attribute.
RELATIONS: dict[str, tuple[list[str], str]] = {
    "birthplace": (["{e} was born in {a} .", "the birthplace of {e} is the city of {a} .",
                    "records show that {e} grew up in {a} .",
                    "everyone knows {e} comes from {a} ."],
                   "according to the old archive , {e} lived in"),
    "profession": (["{e} works as a {a} .", "by trade , {e} is a {a} .",
                    "the profession of {e} is {a} .",
                    "for many years {e} has been employed as a {a} ."],
                   "in the village register , {e} is listed as a"),
    "language": (["{e} speaks {a} at home .", "the mother tongue of {e} is {a} .",
                  "{e} writes every letter in {a} .", "as a child {e} learned to read {a} ."],
                 "when asked , {e} answered in"),
}  # fmt: skip

_SYLLABLES = "ka lo mir zen tor vex qua dri nol sem bra fin gul hox ry pel".split()


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks of ``text``."""
    return re.findall(r"[a-z0-9_]+|[^\sa-z0-9_]", text.lower())


def corpus_tokens() -> list[str]:
    """``pydoc_data.topics`` joined in sorted-key order, as word tokens."""
    from pydoc_data.topics import topics

    return words("\n\n".join(topics[k] for k in sorted(topics)))


def made_up_names(n: int, rng: np.random.Generator, taken: set[str]) -> list[str]:
    """``n`` distinct pronounceable names of 3 syllables, none in ``taken``."""
    out: list[str] = []
    while len(out) < n:
        name = "".join(rng.choice(_SYLLABLES, 3))
        if name not in taken and name not in out:
            out.append(name)
    return out


@dataclass
class Fact:
    """One planted fact: entity, relation, attribute and the documents that carry it."""

    entity: str
    relation: str
    attribute: str
    docs: list[int] = field(default_factory=list)


@dataclass
class TracingData:
    """Documents, facts and queries of one seed (token ids, vocabulary, raw words)."""

    vocab: dict[str, int]
    docs: torch.Tensor  # (n_docs, block + 1) token ids
    doc_words: list[list[str]]
    facts: list[Fact]
    query_x: torch.Tensor  # (n_facts, query_len)
    query_y: torch.Tensor  # (n_facts, query_len), -100 but the attribute position
    query_words: list[list[str]]

    def attribute_ids(self) -> torch.Tensor:
        """Token id of each fact's attribute."""
        return torch.tensor([self.vocab[f.attribute] for f in self.facts])

    def relevant(self) -> list[set[int]]:
        """Per fact, the indices of the documents that carry it (the retrieval ground truth)."""
        return [set(f.docs) for f in self.facts]


def build(
    n_docs: int, n_facts: int, copies: int, block: int, vocab_words: int, seed: int
) -> TracingData:
    """Plant ``n_facts`` facts ``copies`` times each into ``n_docs`` windows of the corpus."""
    rng = np.random.default_rng(seed)
    toks = corpus_tokens()
    counts = Counter(toks)
    common = [w for w, _ in counts.most_common(vocab_words)]
    starts = np.arange(0, len(toks) - block - 1, block + 1)
    picked = np.sort(rng.choice(starts, n_docs, replace=False))
    doc_words = [toks[s : s + block + 1] for s in picked.tolist()]

    names = made_up_names(2 * n_facts, rng, set(counts))
    rel_names = sorted(RELATIONS)
    facts = [
        Fact(names[i], rel_names[i % len(rel_names)], names[n_facts + i]) for i in range(n_facts)
    ]
    carriers = rng.permutation(n_docs)[: n_facts * copies].reshape(n_facts, copies)
    for fact, docs in zip(facts, carriers.tolist()):
        templates = RELATIONS[fact.relation][0]
        order = rng.permutation(len(templates))
        for c, d in enumerate(docs):
            sentence = words(
                templates[order[c % len(templates)]].format(e=fact.entity, a=fact.attribute)
            )
            at = int(rng.integers(0, block + 1 - len(sentence)))
            doc_words[d][at : at + len(sentence)] = sentence
        fact.docs = sorted(docs)

    itos = [PAD, UNK, *common, *[f.entity for f in facts], *[f.attribute for f in facts]]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(itos))}
    docs = torch.tensor([[vocab.get(w, vocab[UNK]) for w in d] for d in doc_words])

    prompts = [words(RELATIONS[f.relation][1].format(e=f.entity)) for f in facts]
    qlen = max(len(p) for p in prompts)
    query_x = torch.full((n_facts, qlen), vocab[PAD], dtype=torch.long)
    query_y = torch.full((n_facts, qlen), -100, dtype=torch.long)
    for i, (p, f) in enumerate(zip(prompts, facts)):
        query_x[i, : len(p)] = torch.tensor([vocab.get(w, vocab[UNK]) for w in p])
        query_y[i, len(p) - 1] = vocab[f.attribute]
    return TracingData(vocab, docs, doc_words, facts, query_x, query_y, prompts)
