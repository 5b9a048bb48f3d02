"""Real-text windows and a tiny causal LM for the 1M-sample benchmark (``million.py``).

Corpus: the shortened English Wikipedia dump and the Lee news corpus inside gensim 4.4.0's
wheel (``pip download --no-deps``, read from the zip) and Python's ``pydoc_data.topics``; a
byte-level BPE (vocab 1024) trained on it; every distinct ``seq``-token window at stride 1, the
last 2 % of the stream held out for the queries. The model: GPT-2 2 x 64 from a config, trained
``train_steps`` AdamW steps of 64 windows, saved as safetensors.
"""

from __future__ import annotations

import bz2
import glob
import json
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np
import torch

__all__ = ["prepare", "load_model", "VOCAB", "WIDTH", "N_LAYER"]

VOCAB, WIDTH, N_LAYER, N_HEAD = 1024, 64, 2, 2
_WIKI = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
_LEE = "gensim/test/test_data/lee_background.cor"


def _gensim_wheel(cache: str) -> str:
    found = glob.glob(os.path.join(cache, "gensim-4.4.0-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "gensim==4.4.0", "-d",
             cache],
            check=True,
        )  # fmt: skip
        found = glob.glob(os.path.join(cache, "gensim-4.4.0-*.whl"))
    return found[0]


def _wiki_text(raw: str) -> list[str]:
    """Article texts of a MediaWiki XML dump with the markup crudely removed."""
    out = []
    for body in re.findall(r"<text[^>]*>(.*?)</text>", raw, flags=re.S):
        t = re.sub(r"&lt;.*?&gt;", " ", body)  # escaped html tags
        for _ in range(3):  # nested templates
            t = re.sub(r"\{\{[^{}]*\}\}", " ", t)
        t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)  # [[target|label]] -> label
        t = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", t)
        t = re.sub(r"&[a-z]+;", " ", t)
        t = re.sub(r"'{2,}|={2,}|\{\||\|\}|^\s*[|!*#:;].*$", " ", t, flags=re.M)
        t = re.sub(r"\s+", " ", t).strip()
        if len(t) > 200:
            out.append(t)
    return out


def corpus(cache: str | None) -> dict[str, list[str]]:
    """The documents of each source; Python's docs alone where ``cache`` is None (no download)."""
    from pydoc_data.topics import topics

    if cache is None:
        return {"pydoc-topics": list(topics.values())}
    with zipfile.ZipFile(_gensim_wheel(cache)) as zf:
        wiki = bz2.decompress(zf.read(_WIKI)).decode("utf-8", "replace")
        lee = zf.read(_LEE).decode("utf-8", "replace")
    return {
        "wikipedia": _wiki_text(wiki),
        "lee-news": [line for line in lee.splitlines() if line.strip()],
        "pydoc-topics": list(topics.values()),
    }


def prepare(out_dir: str, seq: int, cache: str | None, train_steps: int = 300) -> dict:
    """Write ``windows.npy`` (train), ``queries.npy``, ``tokenizer.json``, the model, meta."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "data.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["seq"] == seq:
            return meta
    t0 = time.perf_counter()
    docs = corpus(cache)
    texts = [d for v in docs.values() for d in v]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                   initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )  # fmt: skip
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    stream = np.concatenate(
        [np.asarray(e.ids, dtype=np.int16) for e in tok.encode_batch(texts)]
    ).astype(np.int16)
    held = int(0.98 * len(stream))
    train_stream, query_stream = stream[:held], stream[held:]
    win = np.lib.stride_tricks.sliding_window_view(train_stream, seq)
    _, first = np.unique(np.ascontiguousarray(win).view(f"V{2 * seq}").ravel(), return_index=True)
    windows = np.ascontiguousarray(win[np.sort(first)])
    qwin = np.lib.stride_tricks.sliding_window_view(query_stream, seq)[::seq][:1000]
    np.save(os.path.join(out_dir, "windows.npy"), windows)
    np.save(os.path.join(out_dir, "queries.npy"), np.ascontiguousarray(qwin))
    train_loss = _train_model(out_dir, windows, seq, train_steps)
    meta = {
        "seq": seq,
        "sources": {
            k: {"documents": len(v), "characters": sum(map(len, v))} for k, v in docs.items()
        },  # fmt: skip
        "tokens": int(len(stream)),
        "train_tokens": int(held),
        "windows_distinct": int(len(windows)),
        "windows_stride1": int(len(win)),
        "windows_non_overlapping": int(held // seq),
        "query_windows": int(len(qwin)),
        "vocab": VOCAB,
        "model": {"family": "gpt2", "n_layer": N_LAYER, "width": WIDTH, "n_head": N_HEAD},
        "train_steps": train_steps,
        "train_loss_first_last": train_loss,
        "seconds": time.perf_counter() - t0,
    }
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def load_model(out_dir: str, seq: int) -> torch.nn.Module:
    """The model of ``out_dir`` (random init if not saved yet), eval mode (no dropout anyway)."""
    import warnings

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=N_LAYER, n_embd=WIDTH, n_head=N_HEAD, n_positions=seq, vocab_size=VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    path = os.path.join(out_dir, "model.safetensors")
    if os.path.exists(path):
        from safetensors.torch import load_file

        model.load_state_dict(load_file(path), strict=False)
        model.tie_weights()
    return model.eval()


def _train_model(out_dir: str, windows: np.ndarray, seq: int, steps: int) -> list[float]:
    from safetensors.torch import save_file

    model = load_model(out_dir, seq).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        ids = torch.from_numpy(windows[rng.integers(0, len(windows), 64)].astype(np.int64))
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, os.path.join(out_dir, "model.safetensors"))
    return [losses[0], float(np.mean(losses[-20:]))]
