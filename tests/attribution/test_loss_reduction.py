"""Scores do not depend on how the data was batched, whatever the loss's reduction.

A loss that averages over the batch (``model(**batch).loss``) is recognised on its first batch
and turned into the sum of per-sample losses; a loss that is neither a sum nor a mean (a
token mean over a padded batch) is refused; a loss of ``None`` (no labels) says so.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
from dattri_llm.attribution.task import SampleSumLoss
from tests.helpers.reference import assert_same_formula

V = 11


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.fc = nn.Linear(6, 8)
        self.head = nn.Linear(8, V)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(input_ids))))


def per_sample_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B,) each sample's own loss: the mean over its next-token predictions."""
    logits = model(input_ids=ids)[:, :-1]
    tok = nn.functional.cross_entropy(
        logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none"
    )
    return tok.view(ids.shape[0], -1).mean(1)


def sum_loss(model, batch):
    return per_sample_loss(model, batch["input_ids"]).sum()


def mean_loss(model, batch):  # what model(**batch).loss does for equal-length samples
    return per_sample_loss(model, batch["input_ids"]).mean()


def data(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (6,), generator=g)} for _ in range(n)]


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def reference(model: nn.Module, train: list[dict], test: list[dict]) -> torch.Tensor:
    """Grad-Dot of each sample's own loss, by torch.func (independent of the library)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, ids):
        return per_sample_loss(
            lambda input_ids: functional_call(model, p, (input_ids,)), ids[None]
        )[0]

    def grads(ds):
        ids = torch.stack([d["input_ids"] for d in ds])
        g = vmap(grad(one), in_dims=(None, 0))(params, ids)
        return torch.cat([g[k].reshape(len(ds), -1) for k in params], dim=1)

    return grads(train) @ grads(test).T


def run(task, train, test, tmp_path, bs: int, eval_bs: int = 2) -> torch.Tensor:
    args = AttributionArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=bs,
        per_device_eval_batch_size=eval_bs,
        show_progress=False,
    )
    return TracInAttributor(args, task=task).attribute(train, test).query(train, test)


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


@pytest.mark.parametrize("bs", [2, 3, 5])
def test_mean_loss_scores_match_the_per_sample_reference_for_any_batching(tmp_path, bs):
    model = make_model()
    train, test = data(5, 1), data(3, 2)  # 5 = 2+2+1 = 3+2: partial last batches
    ref = reference(model, train, test)
    task = AttributionTask(loss_func=mean_loss, model=model)  # loss_reduction="auto"
    got = run(task, train, test, tmp_path, bs)
    assert rel(got, ref) < 1e-10
    assert task.train_loss.reduction == "mean"
    # a summed loss is recognised as such and gives the same scores
    task_sum = AttributionTask(loss_func=sum_loss, model=model)
    assert rel(run(task_sum, train, test, tmp_path, bs), ref) < 1e-10
    assert task_sum.train_loss.reduction == "sum"


def test_declared_reduction_is_used_without_a_check(tmp_path):
    model = make_model()
    train, test = data(4, 1), data(2, 2)
    ref = reference(model, train, test)
    task = AttributionTask(loss_func=mean_loss, model=model, loss_reduction="mean")
    assert rel(run(task, train, test, tmp_path, 4), ref) < 1e-10
    calls = []

    def counting(model, batch):
        calls.append(len(batch["input_ids"]))
        return sum_loss(model, batch)

    task = AttributionTask(loss_func=counting, model=model, loss_reduction="sum")
    assert rel(run(task, train, test, tmp_path, 4), ref) < 1e-10
    assert calls == [2, 4]  # no single-sample evaluations: the test batch, then the train one


def test_neither_sum_nor_mean_is_refused(tmp_path):
    model = make_model()
    train = data(4, 1)
    for i, d in enumerate(train):  # samples with different numbers of label tokens
        d["labels"] = d["input_ids"].clone()
        d["labels"][: i + 1] = -100

    def token_mean(model, batch):  # Hugging Face's labels= loss: a mean over label tokens
        logits = model(input_ids=batch["input_ids"])[:, :-1]
        return nn.functional.cross_entropy(
            logits.reshape(-1, V), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
        )

    task = AttributionTask(loss_func=token_mean, model=model)
    with pytest.raises(ValueError, match="neither the sum .* nor the mean"):
        run(task, train, train[:1], tmp_path, 4, eval_bs=1)


def test_ambiguous_and_failing_checks_ask_for_a_declaration(tmp_path):
    model = make_model()
    train, test = data(4, 1), data(2, 2)

    def zero(model, batch):  # sum and mean agree on 0: the reduction cannot be told
        return (model(input_ids=batch["input_ids"]) * 0).sum()

    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        run(AttributionTask(loss_func=zero, model=model), train, test, tmp_path, 4)

    def batch_only(model, batch):  # breaks on one sample
        ids = batch["input_ids"]
        if len(ids) < 2:
            raise RuntimeError("needs two samples")
        return sum_loss(model, batch)

    with pytest.raises(RuntimeError, match="needs two samples.*loss_reduction='sum'"):
        run(AttributionTask(loss_func=batch_only, model=model), train, test, tmp_path, 4)


def test_bad_reduction_and_none_loss_are_explained(tmp_path):
    model = make_model()
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        AttributionTask(loss_func=sum_loss, model=model, loss_reduction="avg")
    train, test = data(2, 1), data(1, 2)

    def no_labels(model, batch):
        return None  # what model(**batch).loss gives without labels

    with pytest.raises(TypeError, match=r"returned None.*labels"):
        run(AttributionTask(loss_func=no_labels, model=model), train, test, tmp_path, 2)


def test_hugging_face_loss_without_labels_and_with_labels(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=8, vocab_size=V, n_positions=8, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    model.loss_type = "ForCausalLM"
    train, test = data(3, 1), data(2, 2)

    def spec_loss(model, batch):  # the specification's on-the-fly snippet
        return model(**batch).loss

    with pytest.raises(TypeError, match=r"returned None.*labels="):
        run(AttributionTask(loss_func=spec_loss, model=model), train, test, tmp_path, 2)

    labelled = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in train]
    labelled_test = [{"input_ids": d["input_ids"], "labels": d["input_ids"]} for d in test]

    def times_len(model, batch):  # the specification's other snippet: a sum
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss * len(ids)

    ref = run(AttributionTask(loss_func=times_len, model=model), train, test, tmp_path, 3)
    for bs in (1, 2, 3):
        task = AttributionTask(loss_func=spec_loss, model=model)
        got = run(task, labelled, labelled_test, tmp_path, bs)
        assert rel(got, ref) < 1e-10, bs


def test_sample_sum_loss_on_its_own():
    model = make_model()
    batch = {"input_ids": torch.stack([d["input_ids"] for d in data(3, 1)])}
    loss = SampleSumLoss(mean_loss)
    assert loss.reduction == "auto"
    out = loss(model, batch)
    assert loss.reduction == "mean"
    assert torch.allclose(out, sum_loss(model, batch))
    one = SampleSumLoss(mean_loss)
    one(model, {"input_ids": batch["input_ids"][:1]})
    assert one.reduction == "auto"  # a single sample cannot tell; sum and mean agree on it


# ---- the reduction recorded once at capture ---------------------------------------------------
def _recorded_runs(tmp_path, reduction: str, recorded: str | None):
    """A DVEmb (SGD) and an AdamW run whose loop reduced the loss with ``reduction``, captured
    with ``OffloadCallback(loss_reduction=recorded)``; ``{name: (cls, call, reference)}``
    with the scores written out by hand (``tests/helpers/trajectory.py``)."""
    from dattri_llm import AdamWInfluenceAttributor, DVEmbAttributor
    from tests.helpers import adamw_run, dvemb_run
    from tests.helpers.trajectory import adam_step_matrices, query_grads, unroll_explicit

    kw = {"offload_kw": {"loss_reduction": recorded}}
    sgd = dvemb_run.make_run(tmp_path / "sgd", reduction=reduction, **kw)
    lrs = [0.02, 0.015, 0.01, 0.01]
    adam = adamw_run.make_run(tmp_path / "adam", "adamw", lrs=lrs, reduction=reduction, **kw)
    dvemb_ref = dvemb_run.scores_of(dvemb_run.product_formula(sgd), query_grads(sgd))
    adam_ref, _ = unroll_explicit(adam, lambda t: adam_step_matrices(adam, t), query_grads(adam))
    return {
        "dvemb": (
            DVEmbAttributor,
            lambda att: att.attribute_from_cache(
                tmp_path / "sgd" / "train",
                tmp_path / "sgd" / "query",
                learning_rate=dvemb_run.LRS,
            ),
            lambda score: dvemb_run.compare(dvemb_run.occurrences(score, sgd), dvemb_ref),
        ),
        "adamw": (
            AdamWInfluenceAttributor,
            lambda att: att.attribute_from_cache(
                tmp_path / "adam" / "train",
                tmp_path / "adam" / "query",
                dynamics=adam.extra["dynamics"],
            ),
            lambda score: adamw_run.compare_occurrences(
                adamw_run.occurrences(score, adam), adam_ref
            ),
        ),
    }


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduction_recorded_at_capture_is_used_and_checked(tmp_path, reduction):
    """``OffloadCallback(loss_reduction=...)`` records the loop's reduction once;
    DVEmb / AdamW-influence score with it, undeclared and without a warning, equal to the
    product / forward-mode formulas written out by hand (1e-9); an argument that contradicts
    the recording is refused, naming both."""
    import warnings

    a = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)
    other = "sum" if reduction == "mean" else "mean"
    for name, (cls, call, error_vs_formula) in _recorded_runs(
        tmp_path, reduction, reduction
    ).items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # recorded: no warning
            recorded = call(cls(a))
            declared = call(cls(a, loss_reduction=reduction))
        assert error_vs_formula(recorded) <= 1e-9, name
        assert_same_formula(recorded.scores, declared.scores)
        with pytest.raises(ValueError, match=rf"loss_reduction='{other}'.*'{reduction}'"):
            call(cls(a, loss_reduction=other))
        att = cls(a)
        call(att)
        assert att.loss_reduction is None  # no state survives the call


def test_reduction_declared_nowhere_is_refused_and_both_remedies_work(tmp_path):
    """A store captured from a mean-loss loop, its reduction declared nowhere, was scored as a
    sum with a warning; now the call is refused naming both ways to declare it, and each way
    gives the formula written out by hand for the mean (1e-9)."""
    from dattri_llm.attribution.trajectory.reduction import resolve_reduction

    a = AttributionArguments(output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False)
    nowhere = _recorded_runs(tmp_path / "nowhere", "mean", None)
    recorded = _recorded_runs(tmp_path / "recorded", "mean", "mean")
    for name, (cls, call, error_vs_formula) in nowhere.items():
        att = cls(a)
        with pytest.raises(ValueError, match="loss_reduction is declared nowhere") as refused:
            call(att)
        msg = str(refused.value)
        assert f'{cls.__name__}(..., loss_reduction="mean")' in msg, msg
        assert 'OffloadCallback(..., loss_reduction="mean")' in msg, msg
        assert att.loss_reduction is None  # a refused call leaves the attributor as built
        # remedy 1: the attributor's argument
        assert error_vs_formula(call(cls(a, loss_reduction="mean"))) <= 1e-9, name
        # remedy 2: the capture records it (OffloadCallback(loss_reduction="mean"))
        cls2, call2, error2 = recorded[name]
        assert error2(call2(cls2(a))) <= 1e-9, name
    # DVEmb's embeddings take the same road
    from dattri_llm import DVEmbAttributor
    from tests.helpers import dvemb_run

    train = tmp_path / "nowhere" / "sgd" / "train"
    with pytest.raises(ValueError, match="DVEmbAttributor.embed: loss_reduction is declared"):
        DVEmbAttributor(a).embed(train, learning_rate=dvemb_run.LRS)
    DVEmbAttributor(a, loss_reduction="mean").embed(train, learning_rate=dvemb_run.LRS)
    # the live path trains with the task's per-sample sum and needs no declaration
    assert resolve_reduction("X", "attribute", None, None, live=True) == "sum"


def test_bad_reduction_values_are_refused(tmp_path):
    from dattri_llm import OffloadCallback
    from dattri_llm.attribution.trajectory.reduction import recorded_reduction
    from dattri_llm.gradient.gradient import GradientBlock

    with pytest.raises(ValueError, match="loss_reduction.*'avg'"):
        OffloadCallback(file_manager=tmp_path / "x", loss_reduction="avg")
    blocks = [
        GradientBlock(0, None, ["a"], metadata={"loss_reduction": "mean"}),
        GradientBlock(1, None, ["b"], metadata={"loss_reduction": "sum"}),
    ]
    with pytest.raises(ValueError, match="disagree.*'mean' \\(step 0\\), 'sum' \\(step 1\\)"):
        recorded_reduction(blocks, "test")
