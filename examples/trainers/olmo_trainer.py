"""Capture per-sample gradients from an OLMo ``Trainer`` run (ai2-olmo), check them, attribute.

OLMo's own training code runs unchanged: a tiny OLMo (RMS norms with a bias, QK-norms, SwiGLU,
RoPE) is built from its ``ModelConfig`` (no download), trained a few steps by
``olmo.train.Trainer.fit()`` on windows of Python's documentation topics (``pydoc_data``, a
byte-level BPE trained on the fly), and dattri_llm only wraps ``fit()`` in a ``HookManager``
context with an ``OffloadCallback``. OLMo's norm classes are declared with ``layer_types`` (the
the norm-layer recipe of docs/guides/capturing.md), so every trainable parameter is captured.

The script then checks what it stored: the records of the first step (taken at the initial
weights) are compared, parameter by parameter, with one-sample-at-a-time ``backward()`` of
OLMo's own loss on a copy of the initial model, and it fails loudly above the tolerance.
Finally the stored gradients are scored against query gradients taken at the final weights
(``TracInAttributor.attribute_from_cache``).

Weight tying. With ``weight_tying=True`` OLMo computes its logits as
``F.linear(x, wte.weight)``: the embedding weight is used outside ``wte``, where no hook sees
it, so that share of its gradient would be missing. The library's first-step coverage check
warns about exactly that; this script refuses such a model, and ``--weight-tying`` shows the
supported way: :func:`tie_head_as_module` computes the same logits through an ``nn.Linear``
that shares ``wte.weight``, and the library captures the tied weight exactly (the sum of its
embedding and head sites).

OLMo's ``Trainer`` needs ``torch.distributed`` even on one process: the script starts a gloo
group of world size 1 (``file://`` rendezvous in the work directory) and wraps the model in
``DistributedDataParallel`` as OLMo's own training script does. Needs the ``olmo`` extra, in its
own virtual environment (see docs/guides/capturing.md, "OLMo and OLMo-core")::

    OMP_NUM_THREADS=1 python examples/trainers/olmo_trainer.py [--weight-tying] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

os.environ.setdefault("WANDB_MODE", "disabled")

from olmo.config import (  # noqa: E402
    DataConfig,
    DDPConfig,
    DistributedStrategy,
    ModelConfig,
    OptimizerConfig,
    SchedulerConfig,
    TrainConfig,
)
from olmo.data import build_train_dataloader  # noqa: E402
from olmo.model import LayerNorm as OLMoLayerNorm  # noqa: E402
from olmo.model import OLMo, RMSLayerNorm  # noqa: E402
from olmo.optim import build_optimizer, build_scheduler  # noqa: E402
from olmo.train import Trainer  # noqa: E402

from dattri_llm import (  # noqa: E402
    REGISTER_ALL,
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.demo import build_tokenizer, load_corpus  # noqa: E402

SEQ = 32
BATCH = 8
TOPICS = ("try", "import", "comparisons", "assignment")
WINDOWS_PER_TOPIC = 8
STEPS = len(TOPICS) * WINDOWS_PER_TOPIC // BATCH  # one epoch
TOLERANCE = 1e-4  # relative, float32 (the hooks' arithmetic matches autograd's closely)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--weight-tying",
        action="store_true",
        help="tie the head to the embedding (captured exactly through tie_head_as_module)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="OLMo's save folder, stores and scores (default: a temp dir, removed at exit)",
    )
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dattri_llm_olmo_") as tmp:
        work = Path(opts.out or tmp)
        work.mkdir(parents=True, exist_ok=True)
        kept = "" if opts.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"OLMo save folder, stores and scores go to {work}{kept}")
        init = work / "dist_init"
        init.unlink(missing_ok=True)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
        try:
            return run(work, weight_tying=opts.weight_tying)
        finally:
            dist.destroy_process_group()


def tie_head_as_module(model: OLMo) -> OLMo:
    """Compute a tied OLMo's logits through an ``nn.Linear`` sharing ``wte.weight``.

    ``OLMo.forward`` computes tied logits as ``F.linear(x, wte.weight)``, a use of the weight no
    module hook sees. This adds ``transformer.ff_out``, an ``nn.Linear`` whose weight *is*
    ``wte.weight`` (the same ``Parameter``, no copy), and gives the model a copy of its config
    with ``weight_tying=False``, so its forward takes the untied path ``ff_out(x)``: the same
    logits, parameters and optimizer state, and both uses of the weight now run through
    modules. dattri_llm then captures the tied weight as one parameter whose per-sample
    gradient sums its embedding and head sites. The ``TrainConfig`` keeps
    ``weight_tying=True``.

    Call it after building the optimizer (OLMo's parameter groups would otherwise list the
    weight twice, once as an embedding and once as a linear weight) and before wrapping the
    model in DDP / FSDP. Do not call ``model.reset_parameters()`` afterwards: it would
    re-initialise the shared weight as a head.
    """
    if not model.config.weight_tying:
        return model
    wte = model.transformer.wte
    head = nn.Linear(wte.weight.shape[1], wte.weight.shape[0], bias=False, device="meta")
    head.weight = wte.weight
    model.transformer.ff_out = head
    model.config = dataclasses.replace(model.config, weight_tying=False)
    return model


def olmo_layer_types(model: nn.Module) -> dict[str, str]:
    """``layer_types`` declaring OLMo's own norm classes (module kwargs are read off them)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, RMSLayerNorm):
            out[name] = "nn.RMSNorm"
        elif isinstance(module, OLMoLayerNorm):
            out[name] = "nn.LayerNorm"
    return out


def refuse_functional_tie(model: OLMo) -> None:
    """Refuse a model whose head is ``F.linear(x, wte.weight)``: hooks cannot see that use."""
    if model.config.weight_tying:
        raise ValueError(
            "model: OLMo with weight_tying=True computes its logits as F.linear(x, wte.weight), "
            "outside any module, so per-sample gradients of transformer.wte.weight would miss "
            "the head's share. Call tie_head_as_module(model) after building the optimizer "
            "and before wrapping the model in DDP (exact), or exclude transformer.wte "
            "(HookManagerConfig(exclude=['transformer.wte']))."
        )


def write_tokens(path: Path, ids: list[int]) -> None:
    """The flat uint16 token file OLMo's ``MemMapDataset`` cuts into ``SEQ``-token windows."""
    np.asarray(ids, dtype=np.uint16).tofile(path)


def build(work: Path, weight_tying: bool):
    """The tokenizer, token windows, ``TrainConfig`` and the stock OLMo training objects."""
    corpus = load_corpus(TOPICS)
    tok = build_tokenizer([t for _, t in corpus], vocab_size=256)
    eos = tok.get_vocab_size()
    windows, topics, queries, query_topics = [], [], [], []
    for topic in TOPICS:
        paragraphs = [t for k, t in corpus if k == topic]
        q = tok.encode(paragraphs[-1]).ids[:SEQ]  # held out: one query per topic
        queries.append(q + [eos] * (SEQ - len(q)))
        query_topics.append(topic)
        ids: list[int] = []
        for text in paragraphs[:-1]:
            ids += tok.encode(text).ids + [eos]
        for i in range(WINDOWS_PER_TOPIC):
            windows.append(ids[i * SEQ : (i + 1) * SEQ])
            topics.append(topic)
    # a training window per topic as a query too: its top proponent should be itself
    query_rows: list[int | None] = [None] * len(queries)
    for k in range(len(TOPICS)):
        row = k * WINDOWS_PER_TOPIC + 1
        queries.append(windows[row])
        query_topics.append(topics[row])
        query_rows.append(row)
    # OLMo's MemMapDataset cuts the flat file into SEQ-token windows: exactly ours
    write_tokens(work / "train.npy", [t for w in windows for t in w])

    cfg = TrainConfig(
        run_name="dattri_llm_olmo",
        seed=0,
        model=ModelConfig(
            d_model=32,
            n_heads=2,
            n_layers=2,
            mlp_ratio=4,
            max_sequence_length=SEQ,
            vocab_size=eos + 1,
            embedding_size=eos + 1,
            eos_token_id=eos,
            pad_token_id=eos,
            rope=True,
            attention_layer_norm=True,  # QK-norms
            layer_norm_type="rms",
            include_bias=False,
            bias_for_layer_norm=True,  # OLMo's norms with a bias
            weight_tying=weight_tying,
            attention_dropout=0.0,
            residual_dropout=0.0,
            embedding_dropout=0.0,
            init_device="cpu",
        ),
        optimizer=OptimizerConfig(name="adamw", learning_rate=1e-2, weight_decay=0.0),
        scheduler=SchedulerConfig(name="constant"),
        data=DataConfig(paths=[str(work / "train.npy")], pad_direction="right"),
        save_folder=str(work / "run"),
        save_overwrite=True,
        save_interval=None,
        save_interval_unsharded=None,
        global_train_batch_size=BATCH,
        device_train_batch_size=BATCH,
        device_train_microbatch_size=BATCH,
        max_duration=STEPS,
        eval_interval=10**6,
        precision="fp32",
        distributed_strategy=DistributedStrategy.ddp,
        ddp=DDPConfig(),
        save_data_indices=False,
        console_log_interval=10**6,
    )
    torch.manual_seed(0)
    model = OLMo(cfg.model)
    optim = build_optimizer(cfg, model)
    if weight_tying:
        tie_head_as_module(model)  # the one line a user adds for a tied head
    refuse_functional_tie(model)
    initial = copy.deepcopy(model)
    trainer = Trainer(
        cfg=cfg,
        epoch=0,
        model=model,
        dist_model=DistributedDataParallel(model),
        optim=optim,
        scheduler=build_scheduler(cfg),
        train_loader=build_train_dataloader(cfg),
        device=torch.device("cpu"),
        evaluators=[],
        indices_file=None,
    )
    data = {
        "windows": torch.tensor(windows, dtype=torch.long),
        "topics": topics,
        "queries": torch.tensor(queries, dtype=torch.long),
        "query_topics": query_topics,
        "query_rows": query_rows,
    }
    return tok, trainer, initial, data


def hook_config(model: nn.Module) -> HookManagerConfig:
    return HookManagerConfig(linear_io=REGISTER_ALL, layer_types=olmo_layer_types(model))


def olmo_loss(model: nn.Module, ids: torch.Tensor, tokens_in_batch: int) -> torch.Tensor:
    """OLMo's training loss (``Trainer.train_micro_batch``): summed next-token CE / tokens."""
    logits = model(input_ids=ids).logits[:, :-1]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )
    return ce / tokens_in_batch


def check_first_step(store: GradientStorageManager, initial: nn.Module, windows: torch.Tensor):
    """Compare the stored first step with one-sample backward passes at the initial weights."""
    by_hash = {hash_sample({"input_ids": w}): w for w in windows}
    rec_info = next(r for r in store.records() if r.step == 0)
    grad = store.load_record(store.records().index(rec_info)).gradient
    params = dict(initial.named_parameters())
    tokens = BATCH * SEQ
    worst: dict[str, float] = {}
    covered: set[str] = set()
    dense = {n: grad.layers[n].materialize().parameters() for n in grad.layer_names}
    owners: dict[int, list[str]] = {}  # modules sharing a parameter: the tied embedding / head
    for name, p in initial.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rpartition(".")[0])
    tied = {m for mods in owners.values() if len(mods) > 1 for m in mods}
    for row, h in enumerate(rec_info.hashes):
        initial.zero_grad(set_to_none=True)
        olmo_loss(initial, by_hash[h][None], tokens).backward()
        for layer, parts in dense.items():
            for key, g in parts.items():
                name = f"{layer}.{key}"
                ref = params[name].grad
                err = float((g[row].to(ref) - ref).norm() / ref.norm().clamp_min(1e-30))
                kind = type(initial.get_submodule(layer)).__name__
                if layer in tied:  # a compact store holds a tied group as its summed gradient
                    kind += " (tied head)"
                worst[kind] = max(worst.get(kind, 0.0), err)
                covered.add(name)
    missing = sorted(set(params) - covered)
    return worst, missing, len(rec_info.hashes)


def run(work: Path, weight_tying: bool = False) -> dict:
    """Train with OLMo's Trainer while offloading, check the first step, then attribute."""
    tok, trainer, initial, data = build(work, weight_tying)
    model = trainer.model
    train_store = GradientStorageManager(str(work / "train_grads"))
    hm = HookManager(
        model,
        config=hook_config(model),
        callbacks=[OffloadCallback(file_manager=train_store, recording_type="per_sample")],
    )
    with hm.collect(deregister_on_exit=True):  # OLMo's training code, unchanged
        trainer.fit()
    train_store.close()
    print(
        f"OLMo Trainer.fit(): {len(train_store)} steps of {BATCH} windows offloaded "
        f"(weight_tying={weight_tying}, {sum(p.numel() for p in model.parameters())} parameters)"
    )

    worst, missing, n = check_first_step(train_store, initial, data["windows"])
    print(f"step-0 records ({n} samples) vs one-sample backward() at the initial weights:")
    for kind, err in sorted(worst.items()):
        print(f"  {kind:22s} max relative error {err:.1e}")
    if missing or max(worst.values()) > TOLERANCE:
        raise SystemExit(f"capture check FAILED: missing {missing}, errors {worst}")
    print(f"  exact: every trainable parameter captured (max relative error < {TOLERANCE:g})")

    # query gradients at the final weights, through the same hooks
    queries = data["queries"]
    test_store = GradientStorageManager(str(work / "test_grads"))
    hm = HookManager(
        model, config=hook_config(model), callbacks=[OffloadCallback(file_manager=test_store)]
    )
    with hm.collect(deregister_on_exit=True):
        olmo_loss(model, queries, queries.numel()).backward()
    model.zero_grad(set_to_none=True)
    test_store.close()

    # attribute from the cache: no model needed
    score = TracInAttributor(
        AttributionArguments(output_dir=str(work / "scores"))
    ).attribute_from_cache(str(work / "train_grads"), str(work / "test_grads"))
    train_ids, matrix = score.agnostic_matrix()
    print(f"TracIn scores: {tuple(matrix.shape)} (train x test), summed over {STEPS} steps")
    row_of = {hash_sample({"input_ids": w}): i for i, w in enumerate(data["windows"])}
    hits = 0
    for j, q in enumerate(queries):
        best = row_of[train_ids[int(matrix[:, j].argmax())]]
        seen = data["query_rows"][j]
        hits += best == seen
        what = "training window" if seen is not None else "held out"
        print(f"query [{data['query_topics'][j]}, {what}] {tok.decode(q.tolist())[:48]!r}")
        print(
            f"  top proponent [{data['topics'][best]}] "
            f"{tok.decode(data['windows'][best].tolist())[:48]!r}"
        )
    seen_queries = sum(r is not None for r in data["query_rows"])
    print(f"training windows whose top proponent is the window itself: {hits}/{seen_queries}")
    return {"errors": worst, "missing": missing, "self_hits": hits}


if __name__ == "__main__":
    main()
