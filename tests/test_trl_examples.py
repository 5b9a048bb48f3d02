"""The TRL trainer examples: exact per-sample gradients captured through the stock trainers.

Each example's ``main`` runs in a temp dir with small arguments; the checks compare what the
examples wrote to disk against references computed here, one sample at a time.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from dattri_llm import GradientStorageManager, hash_sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    path = ROOT / "examples" / "trainers" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _flat(record_gradient, row: int) -> torch.Tensor:
    g = record_gradient.materialize()
    return torch.cat([g.layers[n].data[row] for n in g.layer_names])


def _reference_model(out: dict):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(out["model_config"]).to(torch.float64)
    model.load_state_dict(out["initial_state"])
    return model


# ---- SFTTrainer --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    module = _load("trl_sft")
    argv = ["--per-topic", "5", "--queries-per-topic", "1", "--epochs", "2"]
    argv += ["--batch-size", "4", "--grad-accum", "2", "--dtype", "float64"]
    argv += ["--workdir", str(tmp_path_factory.mktemp("trl_sft"))]
    return module.main(argv)


def test_sft_hashes_are_the_dataset_rows(sft):
    tok, seq = sft["tokenizer"], sft["seq_len"]
    expected = []
    for _, text in sft["train"]:  # SFTTrainer appends EOS, truncates, the collator pads to seq
        ids = (tok(text)["input_ids"] + [tok.eos_token_id])[:seq]
        ids = torch.tensor(ids + [tok.pad_token_id] * (seq - len(ids)))
        expected.append(hash_sample({"input_ids": ids}))
    assert expected == sft["train_hashes"]
    store = GradientStorageManager(sft["train_dir"])
    n, bs, ga = len(sft["train"]), 4, sft["grad_accum"]
    # every row once per epoch, one record per micro-batch, stored step = the optimizer step
    # (an epoch's last update may take fewer micro-batches), one checkpoint label per epoch
    assert store.num_samples == sft["epochs"] * n
    assert Counter(h for r in store.records() for h in r.hashes) == Counter(
        {h: sft["epochs"] for h in expected}
    )
    micro = math.ceil(n / bs)
    updates = math.ceil(micro / ga)
    assert len(store) == sft["epochs"] * micro
    assert [(r.step, r.checkpoint) for r in store.records()] == [
        (e * updates + i // ga, e) for e in range(sft["epochs"]) for i in range(micro)
    ]
    assert "lm_head" not in store.layer_names and "transformer.wte" in store.layer_names


def _param_grads(mat, j: int, names) -> dict[str, torch.Tensor]:
    return {f"{n}.{p}": g[j] for n in names for p, g in mat.layers[n].parameters().items()}


def test_sft_per_sample_gradients_are_exact(sft):
    """Step 0 (both accumulated micro-batches, at the initial weights) vs per-sample references.

    The example declares ``per_sample_loss="sum"``: each stored row is the gradient of the
    sample's own summed token loss, whatever SFT's token mean over the accumulated batch was.
    TRL's fused LM head computes the log-softmax in float32 tiles even for a float64 model, so
    (1) a plain float64 forward of each sample alone (unpadded, unfused) agrees to ~1e-7 only;
    (2) the fused loss of the same padded micro-batch, one sample's term at a time
    (``autograd.grad``), agrees to float64 rounding.
    """
    from trl.trainer.utils import add_fused_lm_head

    store = GradientStorageManager(sft["train_dir"])
    tok, seq = sft["tokenizer"], sft["seq_len"]
    row_of = {h: i for i, h in enumerate(sft["train_hashes"])}
    records = [store.load_record(i) for i, r in enumerate(store.records()) if r.step == 0]
    assert len(records) == sft["grad_accum"]
    names = records[0].gradient.layer_names
    assert len(names) == 2 + 2 * 6 + 1  # wte, wpe, per block 2 LayerNorms + 4 Conv1D, ln_f

    def ids_of(h: str) -> torch.Tensor:
        return torch.tensor(
            (tok(sft["train"][row_of[h]][1])["input_ids"] + [tok.eos_token_id])[:seq]
        )

    # (1) independent of TRL: one sample alone, token NLL summed
    plain = _reference_model(sft)
    params = dict(plain.named_parameters())
    for rec in records:
        mat = rec.gradient.materialize()
        for j, h in enumerate(rec.hashes):
            ids = ids_of(h)[None]
            nll = torch.nn.functional.cross_entropy(
                plain(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="sum"
            )
            plain.zero_grad(set_to_none=True)
            nll.backward()
            for name, got in _param_grads(mat, j, names).items():
                ref = params[name].grad
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max())

    # (2) exact: the trainer's loss on the padded micro-batch, one sample's term at a time. The
    # fused head returns float32 log-probabilities even for a float64 model: each token's -log p
    # enters the loss with the weight float32(1/N) (N: num_items_in_batch of the step), which is
    # what the rescaling divides by.
    n_tokens = sum(len(ids_of(h)) for rec in records for h in rec.hashes)
    weight = float(torch.tensor(1 / n_tokens, dtype=torch.float32))  # as the fused head sees it
    fused = _reference_model(sft)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy", "is_top1"))
    fused.train()
    params = dict(fused.named_parameters())
    for rec in records:
        mat = rec.gradient.materialize()
        ids = torch.stack(
            [torch.nn.functional.pad(ids_of(h), (0, seq - len(ids_of(h)))) for h in rec.hashes]
        )
        mask = (ids != tok.pad_token_id).long()
        out = fused(
            input_ids=ids,
            attention_mask=mask,
            labels=ids.masked_fill(mask == 0, -100),
            use_cache=False,
            fused_lm_head=True,
        )
        for j in range(len(ids)):
            got = _param_grads(mat, j, names)
            refs = torch.autograd.grad(
                -out.log_probs[j].sum() / n_tokens, [params[n] for n in got], retain_graph=True
            )
            for g, ref in zip(got.values(), (r / weight for r in refs)):
                torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-13 * ref.abs().max())


def test_sft_tracin_scores_from_cache(sft):
    """Scores = sum over the occurrences of a train row of <g_train, g_test>, computed here."""
    train = GradientStorageManager(sft["train_dir"])
    test = GradientStorageManager(sft["test_dir"])
    q = test.load_record(0).gradient
    assert q.batch_size == len(sft["queries"])
    test_flat = torch.stack([_flat(q, j) for j in range(q.batch_size)])
    expected = torch.zeros(len(sft["train"]), q.batch_size, dtype=torch.float64)
    row_of = {h: i for i, h in enumerate(sft["train_hashes"])}
    for block in train:
        for j, h in enumerate(block.hashes):
            expected[row_of[h]] += test_flat @ _flat(block.gradient, j)
    torch.testing.assert_close(sft["scores"].to(torch.float64), expected, rtol=1e-8, atol=0)
    assert 0.0 <= sft["topic_share"] <= 1.0


# ---- GRPOTrainer -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    module = _load("trl_grpo")
    argv = ["--steps", "2", "--prompts-per-step", "2", "--num-generations", "4"]
    argv += ["--max-completion-length", "6", "--dtype", "float64"]
    argv += ["--workdir", str(tmp_path_factory.mktemp("trl_grpo"))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module.main(argv)
    out["warnings"] = [w for w in caught if issubclass(w.category, UserWarning)]
    return out


def test_grpo_example_runs_warning_free(grpo):
    """The callback labels the run's weights and the queries are captured at the final label."""
    assert [str(w.message) for w in grpo["warnings"]] == []


def test_grpo_store_holds_every_rollout(grpo):
    store = GradientStorageManager(grpo["train_dir"])
    records = store.records()
    assert [r.step for r in records] == list(range(grpo["steps"]))
    assert all(len(r.hashes) == grpo["batch_size"] for r in records)
    assert store.num_samples == grpo["steps"] * grpo["batch_size"]
    # each stored row is a rollout the trainer differentiated, identified by its input_ids
    for h in store.sample_hashes():
        assert hash_sample({"input_ids": grpo["rollouts"][h]["input_ids"]}) == h
    assert "lm_head" not in store.layer_names


def test_grpo_per_rollout_gradients_are_the_policy_gradient(grpo):
    """Step 0 (initial weights): row j = -A_j * grad log pi(completion_j | prompt_j).

    ``A_j`` is the group-normalised reward (recomputed here from the completion text); TRL's
    default ``"dapo"`` loss divides it by the completion tokens of the generation batch, which
    the callback undoes (the declared per-sample loss is ``-A_j`` times the completion's summed
    log-likelihood). TRL's fused LM head computes the log-softmax in float32, hence the 1e-5
    tolerances; a gradient leaking between rollouts would be off by O(1).
    """
    store = GradientStorageManager(grpo["train_dir"])
    rec = store.load_record(0)
    assert rec.step == 0
    rows = [grpo["rollouts"][h] for h in rec.hashes]
    rewards = torch.tensor([r["reward"] for r in rows], dtype=torch.float32)
    groups: dict[str, list[int]] = {}
    for j, r in enumerate(rows):
        groups.setdefault(r["prompt"], []).append(j)
    assert sorted(len(g) for g in groups.values()) == [grpo["num_generations"]] * len(groups)
    advantages = torch.zeros(len(rows), dtype=torch.float64)
    for members in groups.values():
        r = rewards[members]
        advantages[members] = ((r - r.mean()) / (r.std() + 1e-4)).double()

    model = _reference_model(grpo)
    params = dict(model.named_parameters())
    names = rec.gradient.layer_names
    mat = rec.gradient.materialize()
    for j, r in enumerate(rows):
        ids, mask = r["input_ids"][None], r["attention_mask"][None]  # the trainer's padded row
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[0, :-1], -1)
        target = r["completion_mask"][1:]
        loglik = logp[target].gather(1, ids[0, 1:][target][:, None]).sum()
        model.zero_grad(set_to_none=True)
        loglik.backward()
        got = torch.cat([g.flatten() for g in _param_grads(mat, j, names).values()])
        ref = torch.cat([params[n].grad.flatten() for n in _param_grads(mat, j, names)])
        expected = -float(advantages[j])
        torch.testing.assert_close(got, expected * ref, rtol=1e-5, atol=1e-5 * abs(expected))
    assert (advantages != 0).any()


def test_grpo_tracin_scores_from_cache(grpo):
    train = GradientStorageManager(grpo["train_dir"])
    test = GradientStorageManager(grpo["test_dir"])
    q = test.load_record(0).gradient
    assert q.batch_size == 1 and test.sample_hashes() == [grpo["query_store_hash"]]
    query = _flat(q, 0)
    expected = torch.zeros(len(grpo["train_hashes"]), dtype=torch.float64)
    row_of = {h: i for i, h in enumerate(grpo["train_hashes"])}
    for block in train:
        for j, h in enumerate(block.hashes):
            expected[row_of[h]] += query @ _flat(block.gradient, j)
    torch.testing.assert_close(grpo["scores"].to(torch.float64), expected, rtol=1e-8, atol=0)
    # the query is the best-rewarded rollout (positive advantage): after a few small steps,
    # its own training update is a proponent of it
    best = grpo["rollouts"][grpo["query_hash"]]["reward"]
    assert best == max(r["reward"] for r in grpo["rollouts"].values())
    assert grpo["scores"][row_of[grpo["query_hash"]]] > 0
