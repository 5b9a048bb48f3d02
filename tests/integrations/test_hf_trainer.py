"""The Hugging Face ``Trainer`` integration: the stored gradients are the declared per-sample
loss's, whatever padding, label masking, ``num_items_in_batch`` and gradient accumulation do.

Every reference is a one-sample ``backward()`` of the declared loss on the sample alone
(unpadded), at the weights the trainer held when it took that step (snapshotted by a callback).
The model's loss is computed in float64 here (transformers upcasts its causal-LM loss to
float32, which would cap the agreement at ~1e-7).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dattri_llm import (  # noqa: E402
    AttributionArguments,
    GradientStorageManager,
    TracInAttributor,
    hash_sample,
)
from dattri_llm.integrations.hf_trainer import AttributionCallback, capture_queries  # noqa: E402

SEQ = 10
LENGTHS = [3, 9, 5, 10, 4, 7, 6, 8, 2, 5]


def _float64_causal_loss(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """transformers' ForCausalLMLoss without its float32 upcast."""
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab_size), shift.reshape(-1), ignore_index=-100, reduction=reduction
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def _sample(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 40, (n,))
    pad = SEQ - n
    return {
        "input_ids": torch.cat([ids, torch.zeros(pad, dtype=torch.long)]),
        "attention_mask": torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(pad).long()]),
        "labels": torch.cat([ids, torch.full((pad,), -100)]),
    }


def _model(dropout: float = 0.0) -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=40,
        n_positions=SEQ,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config).double()
    model.loss_type = "ForCausalLM"
    model.loss_function = _float64_causal_loss
    return model


def _args(output_dir, **options) -> TrainingArguments:
    """Quiet CPU training arguments (no saves, logs or reports) with ``options`` on top."""
    quiet = dict(use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no")
    return TrainingArguments(output_dir=str(output_dir), disable_tqdm=True, **{**quiet, **options})


class _Snapshots(TrainerCallback):
    """The weights at the start of every optimizer step."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.at[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(tmp: Path, per_sample_loss: str = "sum", epochs: int = 2, **cb_kwargs):
    torch.manual_seed(0)
    data = [_sample(n) for n in LENGTHS]
    model = _model()
    snaps = _Snapshots()
    callback = AttributionCallback(tmp / "train", per_sample_loss=per_sample_loss, **cb_kwargs)
    trainer = Trainer(
        model=model,
        args=_args(
            tmp / "run",
            per_device_train_batch_size=3,  # batches of 3, 3, 3, 1 rows: unequal label counts
            gradient_accumulation_steps=2,
            num_train_epochs=epochs,
            learning_rate=1e-2,
        ),
        train_dataset=data,
        callbacks=[snaps],
    )
    trainer.add_callback(callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return model, data, callback, snaps, caught


def _one_sample_grads(model, sample, per_sample_loss: str) -> dict[str, torch.Tensor]:
    n = int(sample["attention_mask"].sum())
    ids = sample["input_ids"][:n][None]
    logits = model(input_ids=ids).logits[0, :-1]
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")
    if per_sample_loss == "mean":
        loss = loss / (n - 1)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters()}


def _compare_store(store, snaps, ref, reference, rtol: float) -> int:
    """Every stored row against ``reference(ref, hash)`` at its step's weights; rows compared."""
    compared = 0
    for i, info in enumerate(store.records()):
        record = store.load_record(i)
        ref.load_state_dict(snaps.at[info.step])
        mat = record.gradient.materialize()
        for j, h in enumerate(record.hashes):
            want = reference(ref, h)
            for name in mat.layer_names:
                for p, got in mat.layers[name].parameters().items():
                    expected = want[f"{name}.{p}"]
                    torch.testing.assert_close(
                        got[j], expected, rtol=rtol, atol=rtol * float(expected.abs().max())
                    )
            compared += 1
    return compared


def _check_store(store, data, snaps, per_sample_loss: str) -> int:
    by_hash = {hash_sample({"input_ids": d["input_ids"]}): d for d in data}
    return _compare_store(
        store,
        snaps,
        _model(),
        lambda ref, h: _one_sample_grads(ref, by_hash[h], per_sample_loss),
        rtol=1e-10,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    return tmp, *_train(tmp)


def test_stored_gradients_are_one_sample_backward_of_the_summed_loss(run):
    """Every sample of every step, padded batches of unequal label counts, 2 epochs, GA 2."""
    tmp, _, data, _, snaps, _ = run
    store = GradientStorageManager(tmp / "train")
    assert _check_store(store, data, snaps, "sum") == 2 * len(data)


def test_steps_are_optimizer_steps_and_labels_follow_the_epochs(run):
    tmp, model, _, callback, _, _ = run
    store = GradientStorageManager(tmp / "train")
    # 4 micro-batches an epoch (3, 3, 3, 1 rows), 2 per optimizer step
    assert [(r.step, r.checkpoint, len(r.hashes)) for r in store.records()] == [
        (0, 0, 3), (0, 0, 3), (1, 0, 3), (1, 0, 1),
        (2, 1, 3), (2, 1, 3), (3, 1, 3), (3, 1, 1),
    ]  # fmt: skip
    assert sorted(callback.checkpoints) == [0, 1]
    assert [callback.checkpoints[c]["global_step"] for c in (0, 1)] == [2, 4]
    assert callback.manager is not None and not callback.manager.capturing  # closed at the end


def test_no_warning_and_grad_cos_within_one(run):
    tmp, model, data, callback, _, caught = run
    queries = [{"input_ids": d["input_ids"][: int(d["attention_mask"].sum())]} for d in data[:3]]
    with warnings.catch_warnings(record=True) as scoring:
        warnings.simplefilter("always")
        qstore = callback.capture_queries(model, queries, tmp / "test")
        args = AttributionArguments(output_dir=str(tmp / "scores"), show_progress=False)
        score = TracInAttributor(args, normalized_grad=True).attribute_from_cache(
            tmp / "train", tmp / "test", checkpoints=[1]
        )
    assert [str(w.message) for w in caught + scoring] == []
    assert [r.checkpoint for r in qstore.records()] == [1]  # the final weights: label 1
    _, matrix = score.agnostic_matrix()
    assert matrix.shape == (len(data), 3)
    assert float(matrix.abs().max()) <= 1 + 1e-12
    # a query is its own train sample: cosine 1 with the captured train gradient of label 1
    own = score.query([hash_sample({"input_ids": data[0]["input_ids"]})], [hash_sample(queries[0])])
    assert float(own) > 0


def test_mean_convention_is_each_samples_own_token_mean(tmp_path):
    _, data, _, snaps, caught = _train(tmp_path, per_sample_loss="mean", epochs=1)
    store = GradientStorageManager(tmp_path / "train")
    assert _check_store(store, data, snaps, "mean") == len(data)
    assert caught == []


def test_labels_per_save(tmp_path):
    """checkpoint_every='save' without saves: one label, closed at the end of training."""
    _, _, callback, _, _ = _train(tmp_path, epochs=2, checkpoint_every="save")
    store = GradientStorageManager(tmp_path / "train")
    assert store.available_checkpoints() == [0]
    assert callback.checkpoints[0]["reason"] == "end"


def test_queries_are_eval_mode_one_sample_gradients(tmp_path):
    torch.manual_seed(1)
    model = _model(dropout=0.3)  # dropout on: train mode would change the gradients
    model.train()
    queries = [{"input_ids": torch.randint(1, 40, (n,))} for n in (4, 9, 6)]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    store = capture_queries(model, queries, tmp_path / "q", per_sample_loss="sum", batch_size=2)
    assert model.training
    assert all(bool((p.grad == 1).all()) for p in model.parameters())  # param.grad as found
    ref = _model(dropout=0.3)
    ref.load_state_dict(model.state_dict())
    ref.eval()
    got = {}
    for i in range(len(store)):
        record = store.load_record(i)
        mat = record.gradient.materialize()
        for j, h in enumerate(record.hashes):
            got[h] = {
                f"{n}.{p}": g[j]
                for n in mat.layer_names
                for p, g in mat.layers[n].parameters().items()
            }
    assert set(got) == {hash_sample(q) for q in queries}
    for q in queries:
        n = len(q["input_ids"])
        sample = {"input_ids": q["input_ids"], "attention_mask": torch.ones(n, dtype=torch.long)}
        want = _one_sample_grads(ref, sample, "sum")
        for name, g in got[hash_sample(q)].items():
            torch.testing.assert_close(
                g, want[name], rtol=1e-10, atol=1e-10 * float(want[name].abs().max())
            )


def test_queries_at_other_weights_are_refused_and_recapturing_fixes_it(run, tmp_path):
    tmp, model, data, callback, _, _ = run
    queries = [{"input_ids": d["input_ids"][: int(d["attention_mask"].sum())]} for d in data[:2]]
    stale = _model()  # the untrained weights: no train label stands for them
    with pytest.raises(ValueError, match="match none of the checkpoint labels"):
        callback.capture_queries(stale, queries, tmp_path / "refused")
    callback.capture_queries(stale, queries, tmp_path / "stale", checkpoint=1)
    args = AttributionArguments(output_dir=str(tmp_path / "s"), show_progress=False)
    with pytest.raises(ValueError, match=r"label 1: 0:") as err:
        TracInAttributor(args).attribute_from_cache(tmp / "train", tmp_path / "stale")
    assert "capture the queries at the weights" in str(err.value).lower()
    # the fix the message names: capture them at the checkpoint's weights
    callback.capture_queries(model, queries, tmp_path / "fresh")
    TracInAttributor(args).attribute_from_cache(tmp / "train", tmp_path / "fresh")
    # or, on purpose, across weights
    args.check_weights = False
    TracInAttributor(args).attribute_from_cache(tmp / "train", tmp_path / "stale")


def test_per_sample_loss_must_agree_with_the_train_store(run, tmp_path):
    tmp, model, data, _, _, _ = run
    queries = [{"input_ids": data[0]["input_ids"][:3]}]
    with pytest.raises(ValueError, match="per_sample_loss='sum'"):
        capture_queries(
            model, queries, tmp_path / "q", train_store=tmp / "train", per_sample_loss="mean"
        )


def test_refuses_a_loss_computed_outside_the_model(tmp_path):
    torch.manual_seed(0)
    model = _model()
    trainer = Trainer(
        model=model,
        args=_args(
            tmp_path / "run",
            per_device_train_batch_size=2,
            max_steps=1,
            label_smoothing_factor=0.1,
        ),
        train_dataset=[_sample(n) for n in (3, 5)],
    )
    trainer.add_callback(AttributionCallback(tmp_path / "train"))
    with pytest.raises(RuntimeError, match="computed no loss from labels="):
        trainer.train()


def test_refuses_trl_preference_trainers(tmp_path):
    trl = pytest.importorskip("trl")
    args = trl.DPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    callback = AttributionCallback(tmp_path / "train")
    with pytest.raises(ValueError, match="DPOConfig trains with a loss that is not"):
        callback.on_train_begin(args, None, None, model=_model())
    assert callback.manager is None and not (tmp_path / "train").exists()


# ---- TRL GRPOTrainer ---------------------------------------------------------------------------
GRPO_PROMPTS = ["w1 w2 w3", "w4", "w5 w6", "w7 w8 w9 w10", "w3 w3", "w11 w12 w2", "w9", "w2 w5"]


def _grpo_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "[UNK]"] + [f"w{i}" for i in range(21)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="<pad>", eos_token="<eos>"
    )


def _grpo_reward(completions, **kwargs):
    """Rewards that differ within a group (non-zero advantages of both signs)."""
    return [c.count("w1") / max(len(c.split()), 1) + 0.1 * len(c.split()) for c in completions]


def _grpo_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=24,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        tie_word_embeddings=False,  # TRL's fused head bypasses the lm_head module
    )
    return GPT2LMHeadModel(config).double()


def _grpo_train(tmp: Path, per_sample_loss: str = "sum", prompts: int = 8, **config):
    """A GRPO run with the callback; every loss call's inputs and every step's weights kept."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from dattri_llm import REGISTER_ALL, HookManagerConfig

    seen: list[dict[str, torch.Tensor]] = []

    class Recording(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append({k: v.detach().clone() for k, v in inputs.items() if torch.is_tensor(v)})
            return super()._compute_loss(model, inputs)

    torch.manual_seed(0)
    model = _grpo_model()
    snaps = _Snapshots()
    settings = dict(
        output_dir=str(tmp / "run"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=5,
        num_train_epochs=1,
        learning_rate=1e-2,
        bf16=False,  # GRPOConfig's default autocasts to bfloat16: compare in float64
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    settings.update(config)
    trainer = Recording(
        model=model,
        reward_funcs=_grpo_reward,
        args=trl.GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": GRPO_PROMPTS[:prompts]}),
        processing_class=_grpo_tokenizer(),
        callbacks=[snaps],
    )
    callback = AttributionCallback(
        tmp / "train",
        per_sample_loss=per_sample_loss,
        config=HookManagerConfig(linear_io=REGISTER_ALL, exclude=[r"lm_head"]),
    )
    trainer.add_callback(callback)  # the whole integration: one line
    trainer.train()
    return model, callback, seen, snaps


def _grpo_reference(model, row: dict[str, torch.Tensor], per_sample_loss: str):
    """One-sample backward of -A (Σ or mean over the completion) of log pi(completion)."""
    ids, attn = row["ids"][None], row["attn"][None]  # the trainer's own padded row
    logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[0, :-1], -1)
    picked = logp.gather(1, ids[0, 1:, None])[:, 0]
    completion = row["completion_mask"].to(torch.bool)
    k = completion.numel()
    loglik = picked[-k:][completion].sum()
    if per_sample_loss == "mean":
        loglik = loglik / completion.sum().clamp_min(1)
    loss = -row["advantage"] * loglik
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _grpo_rows(seen) -> dict[str, dict[str, torch.Tensor]]:
    from dattri_llm import hash_batch

    rows = {}
    for inputs in seen:
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        for j, h in enumerate(hash_batch({"input_ids": ids})):
            rows[h] = {
                "ids": ids[j],
                "attn": attn[j],
                "completion_mask": inputs["completion_mask"][j],
                "advantage": inputs["advantages"][j].double(),
            }
    return rows


def _check_grpo_store(tmp: Path, seen, snaps, per_sample_loss: str) -> int:
    rows = _grpo_rows(seen)
    return _compare_store(
        GradientStorageManager(tmp / "train"),
        snaps,
        _grpo_model(),
        lambda ref, h: _grpo_reference(ref, rows[h], per_sample_loss),
        rtol=1e-5,  # TRL's fused head takes its log-softmax in float32
    )


@pytest.mark.parametrize(
    ("loss_type", "accumulation", "per_generation", "prompts"),
    [
        ("grpo", 2, 2, 8),
        ("bnpo", 2, 2, 8),
        ("dr_grpo", 1, 1, 8),
        ("dapo", 2, 1, 8),
        ("bnpo", 2, 1, 6),  # 3 micro-batches an epoch: the last step accumulates only one
    ],
)
def test_grpo_rows_are_one_sample_backward_of_the_advantage_weighted_loss(
    tmp_path, loss_type, accumulation, per_generation, prompts
):
    """Row = ∇(-A_i Σ_t log pi(c_it)) at the step's weights, whatever TRL's normaliser."""
    _, callback, seen, snaps = _grpo_train(
        tmp_path,
        prompts=prompts,
        loss_type=loss_type,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=per_generation,
    )
    assert _check_grpo_store(tmp_path, seen, snaps, "sum") == sum(
        len(s["advantages"]) for s in seen
    )
    assert any(bool((s["advantages"] != 0).any()) for s in seen)  # a test that can fail
    steps = [r.step for r in GradientStorageManager(tmp_path / "train").records()]
    assert len(steps) == len(seen)
    if prompts == 6:
        assert steps == [0, 0, 1]
    facts = callback.checkpoints
    assert facts and all(v["reason"] in ("epoch", "end") for v in facts.values())


def test_grpo_mean_convention_and_queries_at_the_final_label(tmp_path):
    model, callback, seen, snaps = _grpo_train(tmp_path, per_sample_loss="mean")
    assert _check_grpo_store(tmp_path, seen, snaps, "mean") > 0
    from dattri_llm.gradient.store.checkpoints import read_checkpoints_file

    facts = read_checkpoints_file(tmp_path / "train")
    assert facts["objective"] == "grpo" and facts["grpo_loss_type"] == "dapo"
    # the queries at the final weights get the last label: scored without any warning
    row = next(iter(_grpo_rows(seen).values()))
    prompt = torch.zeros(len(row["ids"]) - len(row["completion_mask"]), dtype=torch.long)
    labels = row["ids"].masked_fill(torch.cat([prompt, row["completion_mask"]]) == 0, -100)
    query = {"input_ids": row["ids"], "attention_mask": row["attn"], "labels": labels}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qstore = callback.capture_queries(model, [query], tmp_path / "test")
        args = AttributionArguments(output_dir=str(tmp_path / "scores"), show_progress=False)
        TracInAttributor(args).attribute_from_cache(tmp_path / "train", tmp_path / "test")
    assert [str(w.message) for w in caught] == []
    assert [r.checkpoint for r in qstore.records()] == [max(callback.checkpoints)]


@pytest.mark.parametrize(
    ("option", "fix", "fixed"),
    [
        ({"beta": 0.1}, "beta=0.0", {"beta": 0.0}),
        ({"num_iterations": 2}, "num_iterations=1", {"num_iterations": 1}),
        ({"loss_type": "sapo"}, "loss_type='grpo'", {"loss_type": "grpo"}),
        (
            {"loss_type": "dapo", "gradient_accumulation_steps": 2},
            "loss_type='grpo' or 'bnpo'",
            {"loss_type": "bnpo", "gradient_accumulation_steps": 2},
        ),
        ({"entropy_coef": 0.01}, "entropy_coef=0.0", {"entropy_coef": 0.0}),
        ({"temperature": 0.7}, "temperature=1.0", {"temperature": 1.0}),
    ],
)
def test_grpo_refuses_what_cannot_be_rescaled_and_the_named_fix_works(tmp_path, option, fix, fixed):
    """Each refusal names the option; the configuration with it applied is accepted (and the
    accepted loss types are exact: the parametrized test above)."""
    trl = pytest.importorskip("trl")
    base = dict(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    base.update(per_device_train_batch_size=4, num_generations=2)
    callback = AttributionCallback(tmp_path / "train")
    with pytest.raises(ValueError, match=re.escape(fix)):
        callback.on_train_begin(trl.GRPOConfig(**base, **option), None, None, model=_model())
    assert callback.manager is None and not (tmp_path / "train").exists()
    accepted = trl.GRPOConfig(**base, **{**option, **fixed})
    callback.on_train_begin(accepted, None, None, model=_model())
    assert callback.manager is not None and callback.manager.capturing
    callback.close()


# ---- optimizer state for the trajectory methods ------------------------------------------------
class _Batches(TrainerCallback):
    """Every differentiated forward's inputs, grouped by optimizer step (a forward pre-hook)."""

    def __init__(self, model) -> None:
        self.steps: list[list[dict]] = []
        self.handle = model.register_forward_pre_hook(self._see, with_kwargs=True)

    def on_step_begin(self, args, state, control, **kwargs):
        self.steps.append([])

    def _see(self, module, args, kwargs):
        if torch.is_grad_enabled() and "labels" in kwargs:
            self.steps[-1].append({k: v for k, v in kwargs.items() if v is not None})


def _hand_loop(tmp: Path, initial, steps, optim: str, lr: float, accumulation: int):
    """The same run, written out: the replayed micro-batches, the optimizer, the recorders."""
    from dattri_llm import HookManager, OffloadCallback, OptimizerStateCallback

    model = _model()
    model.load_state_dict(initial)
    if optim == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    else:  # the Trainer's AdamW defaults
        opt = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0
        )
    store = GradientStorageManager(tmp / "loop")
    rec = OptimizerStateCallback(model, opt, gradient_accumulation_steps=accumulation)
    offload = OffloadCallback(
        file_manager=store, gradient_accumulation_steps=accumulation, loss_reduction="sum"
    )
    manager = HookManager(model, callbacks=[offload, rec])
    with manager.collect(deregister_on_exit=True):
        for t, micro in enumerate(steps):
            manager.step = t * accumulation
            for kwargs in micro:  # the trainer's loss: Σ_i S_i / num_items_in_batch
                model(**kwargs).loss.backward()
            opt.step()
            rec.record_post(t)
            opt.zero_grad(set_to_none=True)
    store.close()
    return model, rec


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd"])
def test_optimizer_state_through_the_callback_equals_a_hand_written_loop(tmp_path, optim):
    """AdamW-influence (AdamW) and DVEmb (SGD) from a Trainer run through the callback equal
    the same methods on a hand-written loop that replays the run's micro-batches."""
    from dattri_llm import AdamWInfluenceAttributor, DVEmbAttributor

    torch.manual_seed(0)
    data = [_sample(n) for n in LENGTHS]
    model = _model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = _Batches(model)
    # AdamW's moments written to disk as the run goes (snapshots=), the others kept in memory
    on_disk = tmp_path / "trajectory" if optim == "adamw_torch" else None
    callback = AttributionCallback(
        tmp_path / "train", per_sample_loss="share", optimizer_state=True, snapshots=on_disk
    )
    lr, accumulation = 1e-2, 2
    trainer = Trainer(
        model=model,
        args=_args(
            tmp_path / "run",
            per_device_train_batch_size=3,  # 4 micro-batches: 2 updates of unequal token counts
            gradient_accumulation_steps=accumulation,
            num_train_epochs=1,
            learning_rate=lr,
            lr_scheduler_type="constant",
            optim=optim,
            max_grad_norm=0.0,  # an update must be the sum of the stored rows
        ),
        train_dataset=data,
        callbacks=[batches],
    )
    trainer.add_callback(callback)
    trainer.train()
    batches.handle.remove()
    loop_model, rec = _hand_loop(tmp_path, initial, batches.steps, optim, lr, accumulation)
    for (name, a), b in zip(model.state_dict().items(), loop_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)  # the same run
    # the stored rows: the same shares, summing to the applied gradients
    got = GradientStorageManager(tmp_path / "train")
    want = GradientStorageManager(tmp_path / "loop")
    assert [(r.step, r.hashes) for r in got.records()] == [
        (r.step, r.hashes) for r in want.records()
    ]
    for i in range(len(want)):
        a, b = got.load_record(i).gradient.materialize(), want.load_record(i).gradient.materialize()
        for name in b.layer_names:
            x, y = a.layers[name].data, b.layers[name].data
            # fused AdamW rounds its update differently: weights equal to ~1e-16 after a step
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12 * float(y.abs().max()))
    queries = [{"input_ids": d["input_ids"][: int(d["attention_mask"].sum())]} for d in data[:3]]
    callback.capture_queries(model, queries, tmp_path / "test")  # the final label
    args = AttributionArguments(output_dir=str(tmp_path / "scores"), show_progress=False)
    method = DVEmbAttributor if optim == "sgd" else AdamWInfluenceAttributor
    # loss_reduction is not passed: the store declares "sum"
    ours = method(args).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", dynamics=callback.dynamics()
    )
    theirs = method(args).attribute_from_cache(
        tmp_path / "loop", tmp_path / "test", dynamics=rec.dynamics()
    )
    assert ours.train_hashes == theirs.train_hashes and ours.train_steps == theirs.train_steps
    assert float(theirs.scores.abs().max()) > 0
    torch.testing.assert_close(ours.scores, theirs.scores, rtol=1e-9, atol=0)
    if on_disk is not None:
        assert any(on_disk.iterdir())


def test_optimizer_state_needs_the_share_convention_and_no_clipping(tmp_path):
    with pytest.raises(ValueError, match="per_sample_loss='share'"):
        AttributionCallback(tmp_path / "train", optimizer_state=True)
    callback = AttributionCallback(
        tmp_path / "train", per_sample_loss="share", optimizer_state=True
    )
    clipped = _args(tmp_path / "run")  # max_grad_norm=1.0, the default
    with pytest.raises(ValueError, match=r"max_grad_norm=0\.0"):
        callback.on_train_begin(clipped, None, None, model=_model())
    assert callback.manager is None and not (tmp_path / "train").exists()
    # the remedy: no clipping (a full run with it: the test above)
    unclipped = _args(tmp_path / "run", max_grad_norm=0.0)
    callback.on_train_begin(unclipped, None, None, model=_model())
    assert callback.recorder is not None
    callback.close()
    with pytest.raises(RuntimeError, match="optimizer_state=True"):
        AttributionCallback(tmp_path / "other").dynamics()


# ---- a multi-process Trainer -------------------------------------------------------------------
def _ddp_rank(rank: int, world: int, workdir: str) -> None:
    """One rank of a 2-process (gloo) Trainer run with the callback, as torchrun would start it."""
    from tests.helpers.distributed import init_group

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    init_group(rank, world, workdir)  # the Trainer takes the formed group
    torch.manual_seed(0)
    data = [_sample(n) for n in LENGTHS]
    snaps = _Snapshots()
    trainer = Trainer(
        model=_model(),
        args=_args(
            Path(workdir) / "run",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            learning_rate=1e-2,
            ddp_backend="gloo",
        ),
        train_dataset=data,
        callbacks=[snaps],
    )
    assert trainer.args.world_size == world
    trainer.add_callback(AttributionCallback(Path(workdir) / "train"))
    trainer.train()
    from safetensors.torch import save_file

    flat = {f"{step}|{k}": v.contiguous() for step, sd in snaps.at.items() for k, v in sd.items()}
    save_file(flat, str(Path(workdir) / f"weights.rank{rank}.safetensors"))


@pytest.mark.distributed
def test_two_process_trainer_stores_the_one_sample_gradients(tmp_path):
    """Each rank's rows are the one-sample backward of the summed loss at the step's weights:
    ``num_items_in_batch`` counted over both ranks and DDP's loss factor are undone."""
    from tests.helpers.distributed import expect_ok, run_ranks

    expect_ok(run_ranks(_ddp_rank, 2, tmp_path))
    from safetensors.torch import load_file

    weights = [load_file(str(tmp_path / f"weights.rank{r}.safetensors")) for r in (0, 1)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # DDP: in step
    snaps = _Snapshots()
    for key, value in weights[0].items():
        step, name = key.split("|")
        snaps.at.setdefault(int(step), {})[name] = value
    torch.manual_seed(0)
    data = [_sample(n) for n in LENGTHS]
    store = GradientStorageManager(tmp_path / "train")
    ranks = {r.path.parent.parent.name for r in store.records()}
    assert ranks == {"rank_0", "rank_1"}
    # the distributed sampler pads 10 samples to 12 (2 repeated): every row is checked
    assert _check_store(store, data, snaps, "sum") == 12
    assert {hash_sample({"input_ids": d["input_ids"]}) for d in data} == set(store.sample_hashes())
    assert store.available_checkpoints() == [0]
