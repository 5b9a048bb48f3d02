"""LESS (trajectory and frozen forms) against the explicit formula Σ_t w_t cos(Γ_t(z), q_t).

Γ_t(z): each sample's Adam update direction from the pre-step state, by hand from torch.func
per-sample gradients (``trajectory_reference.adam_direction``); q_t: the queries' raw
per-sample gradients by torch.func; cosines over all captured layers concatenated. Model:
Embedding + LayerNorm + Linear + tied head, float64, a warm-started Adam.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    GradientRecord,
    GradientStorageManager,
    HookManager,
    LESSAttributor,
    OffloadCallback,
)
from dattri_llm.utils.hashing import hash_sample
from tests.helpers.trajectory import (
    DT,
    explicit_directions,
    layer_rows,
    lm_batch,
    lm_loss_row,
    lm_sample_losses,
    make_lm,
    per_sample_grads,
    rel_err,
)

LAYERS = ["emb", "norm", "fc"]
LRS = [0.03, 0.02, 0.012]
T, B, Q = 3, 3, 2


def args(tmp_path):
    return AttributionArguments(
        output_dir=str(tmp_path / "out"), use_cpu=True, show_progress=False, score_block_size=2
    )


def flat_rows(model, per_param) -> torch.Tensor:
    rows = layer_rows(model, per_param, LAYERS)
    return torch.cat([rows[n] for n in LAYERS], dim=1)


def cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a / a.norm(dim=1, keepdim=True)) @ (b / b.norm(dim=1, keepdim=True)).T


def _capture(model, store, batch, ids, **kw):
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store)], **kw)
    with hm.collect():
        hm.set_sample_ids(ids)
        lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
    hm.remove()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A preconditioned training capture, per-step and final query stores, and the references."""
    root = tmp_path_factory.mktemp("less")
    model = make_lm()
    opt = torch.optim.Adam(
        model.parameters(), lr=LRS[0], betas=(0.8, 0.95), eps=1e-4, weight_decay=0.01
    )
    for i in range(2):  # warm start
        b = lm_batch(4, seed=70 + i)
        opt.zero_grad()
        lm_sample_losses(model(**b), b["input_ids"]).sum().backward()
        opt.step()
    queries = lm_batch(Q, seed=5)
    qids = [f"q{j}" for j in range(Q)]
    train = GradientStorageManager(root / "train")
    per_step = GradientStorageManager(root / "query_steps")
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=train)], optimizer=opt)
    hm_q = HookManager(model, callbacks=[OffloadCallback(file_manager=per_step)])  # raw
    gammas, q_steps, hashes = [], [], []
    with hm.collect():
        for t in range(T):
            for g in opt.param_groups:
                g["lr"] = LRS[t]
            batch = lm_batch(B, seed=t)
            ids = [f"s{t}_{i}" for i in range(B)]
            if t == 2:  # a sample seen twice: its rows are summed by agnostic_matrix
                batch["input_ids"][0] = lm_batch(B, seed=0)["input_ids"][1]
                ids[0] = "s0_1"
            with hm.paused():  # the queries at θ_t (raw) for pair_by="step", the references
                with hm_q.collect():  # its step counter labels the captures 0, 1, 2
                    hm_q.set_sample_ids(qids)
                    lm_sample_losses(model(**queries), queries["input_ids"]).sum().backward()
                q_steps.append(flat_rows(model, per_sample_grads(model, lm_loss_row, queries)))
                grads = per_sample_grads(model, lm_loss_row, batch)
                gammas.append(flat_rows(model, explicit_directions(model, opt, grads)))
            hashes.append(ids)
            opt.zero_grad()
            hm.set_sample_ids(ids)
            lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
            opt.step()
    hm.remove()
    hm_q.remove()
    final = GradientStorageManager(root / "query_final")
    _capture(model, final, queries, qids)
    q_final = flat_rows(model, per_sample_grads(model, lm_loss_row, queries))
    return {
        "root": root,
        "gammas": gammas,
        "q_steps": q_steps,
        "q_final": q_final,
        "hashes": hashes,
        "qids": qids,
        "model": model,
    }


def by_row(score) -> dict[tuple[str, int], torch.Tensor]:
    out = {}
    for i, (h, s) in enumerate(zip(score.train_hashes, score.train_steps)):
        assert (h, s) not in out
        out[(h, s)] = score.scores[i]
    return out


def check(score, run, weights, per_step: bool) -> float:
    """Max relative error of every (sample, step) row against the explicit formula."""
    assert score.test_hashes == run["qids"]
    assert score.scores.dtype == DT
    rows = by_row(score)
    assert len(rows) == T * B
    ref_all, got_all = [], []
    for t in range(T):
        q = run["q_steps"][t] if per_step else run["q_final"]
        ref = weights[t] * cos(run["gammas"][t], q)
        for i, h in enumerate(run["hashes"][t]):
            ref_all.append(ref[i])
            got_all.append(rows[(h, t)])
    err = rel_err(torch.stack(got_all), torch.stack(ref_all))
    # agnostic: the sample seen at steps 0 and 2 has its two rows summed
    ids, matrix = score.agnostic_matrix()
    assert len(ids) == T * B - 1
    both = matrix[ids.index("s0_1")]
    assert rel_err(both, rows[("s0_1", 0)] + rows[("s0_1", 2)]) <= 1e-12
    return err


def test_trajectory_form_equals_explicit_formula(run, tmp_path):
    r = run["root"]
    att = LESSAttributor(args(tmp_path))
    s = att.attribute_from_cache(r / "train", r / "query_final")  # recorded learning rates
    assert check(s, run, LRS, per_step=False) <= 1e-10
    s = att.attribute_from_cache(r / "train", r / "query_steps", pair_by="step")
    assert check(s, run, LRS, per_step=True) <= 1e-10


def test_consecutive_calls_are_independent(run, tmp_path):
    """Weights given to one call never leak into the next (an earlier implementation's bug)."""
    r = run["root"]
    att = LESSAttributor(args(tmp_path))
    w1, w2 = [1.0, 2.0, 3.0], {0: 0.5, 1: -1.0, 2: 0.25}
    s1 = att.attribute_from_cache(r / "train", r / "query_final", learning_rates=w1)
    s0 = att.attribute_from_cache(r / "train", r / "query_final")
    s2 = att.attribute_from_cache(r / "train", r / "query_final", learning_rates=w2)
    s3 = att.attribute_from_cache(r / "train", r / "query_final", learning_rates=lambda t: 0.1 * t)
    s4 = att.attribute_from_cache(r / "train", r / "query_final", learning_rates=0.5)
    assert check(s1, run, w1, per_step=False) <= 1e-10
    assert check(s0, run, LRS, per_step=False) <= 1e-10
    assert check(s2, run, [w2[t] for t in range(T)], per_step=False) <= 1e-10
    # the callable's weight at step 0 is 0: a zero row
    assert check(s3, run, [0.0, 0.1, 0.2], per_step=False) <= 1e-10
    assert check(s4, run, [0.5] * T, per_step=False) <= 1e-10


def test_store_without_learning_rates_needs_weights(run, tmp_path):
    """A preconditioned store recorded without learning rates: an error, never a silent 1."""
    r = run["root"]
    src = GradientStorageManager(r / "train")
    bare = GradientStorageManager(tmp_path / "bare")
    for i in range(len(src.records())):
        rec = src.load_record(i)
        meta = {"preconditioned": dict(rec.metadata["preconditioned"])}
        bare.write(GradientRecord(rec.step, rec.hashes, rec.gradient, rec.checkpoint, meta))
    bare.close()
    att = LESSAttributor(args(tmp_path))
    with pytest.raises(ValueError, match="no recorded learning rate") as e:
        att.attribute_from_cache(tmp_path / "bare", r / "query_final")
    assert "learning_rates=" in str(e.value)
    s = att.attribute_from_cache(tmp_path / "bare", r / "query_final", learning_rates=LRS)
    assert check(s, run, LRS, per_step=False) <= 1e-10
    with pytest.raises(ValueError, match="no recorded learning rate"):  # and nothing was kept
        att.attribute_from_cache(tmp_path / "bare", r / "query_final")


def test_ambiguous_query_store_raises(run, tmp_path):
    """Several gradients of one query under one pairing key are refused, never collapsed."""
    r = run["root"]
    att = LESSAttributor(args(tmp_path))
    # the per-step store holds each query T times at checkpoint 0
    with pytest.raises(ValueError, match="several gradients") as e:
        att.attribute_from_cache(r / "train", r / "query_steps")  # pair_by="checkpoint"
    assert "'q0'" in str(e.value)
    # a query captured twice at the end of the run
    twice = GradientStorageManager(tmp_path / "twice")
    queries = lm_batch(Q, seed=5)
    for _ in range(2):
        _capture(run["model"], twice, queries, run["qids"])
    with pytest.raises(ValueError, match="several gradients"):
        att.attribute_from_cache(r / "train", tmp_path / "twice")


def test_raw_train_and_preconditioned_test_refused(run, tmp_path):
    r = run["root"]
    att = LESSAttributor(args(tmp_path))
    with pytest.raises(ValueError, match="raw, not preconditioned"):
        att.attribute_from_cache(r / "query_final", r / "query_final")
    with pytest.raises(ValueError, match="query gradients at step .* are preconditioned"):
        att.attribute_from_cache(r / "train", r / "train", pair_by="step")


def test_several_learning_rates_in_a_step_need_weights(tmp_path):
    model = make_lm()
    opt = torch.optim.AdamW(
        [
            {"params": [model.norm.weight, model.norm.bias], "lr": 0.5},
            {"params": [model.emb.weight, model.fc.weight, model.fc.bias]},
        ],
        lr=0.01,
    )
    store = GradientStorageManager(tmp_path / "train")
    _capture(model, store, lm_batch(2, seed=1), ["a", "b"], optimizer=opt)
    qs = GradientStorageManager(tmp_path / "q")
    _capture(model, qs, lm_batch(1, seed=2), ["q"])
    att = LESSAttributor(args(tmp_path))
    with pytest.raises(ValueError, match="several learning rates"):
        att.attribute_from_cache(tmp_path / "train", tmp_path / "q")
    att.attribute_from_cache(tmp_path / "train", tmp_path / "q", learning_rates=[1.0])


# ---- frozen form ---------------------------------------------------------------------------------
def _loss(model, batch):
    return lm_sample_losses(model(**batch), batch["input_ids"]).sum()


def test_frozen_form_equals_explicit_formula(tmp_path):
    model = make_lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.02, betas=(0.7, 0.9), eps=1e-3, amsgrad=True)
    ckpts, opt_states = [], []
    for k in range(2):
        for i in range(2 + k):
            b = lm_batch(4, seed=30 + 10 * k + i)
            opt.zero_grad()
            _loss(model, b).backward()
            opt.step()
        ckpts.append(copy.deepcopy(model.state_dict()))
        st = copy.deepcopy(opt.state_dict())
        st["param_groups"][0]["lr"] = [0.02, 0.005][k]  # each checkpoint's own learning rate
        opt_states.append(st)
    train = [{"input_ids": x} for x in lm_batch(5, seed=1)["input_ids"]]
    test = [{"input_ids": x} for x in lm_batch(3, seed=2)["input_ids"]]
    # the task's model and one optimizer per checkpoint holding that checkpoint's state
    live = make_lm(seed=9)
    opts = []
    for st in opt_states:
        o = torch.optim.Adam(live.parameters(), lr=1.0, betas=(0.7, 0.9), eps=1e-3, amsgrad=True)
        o.load_state_dict(st)
        opts.append(o)
    # the explicit formula, checkpoint by checkpoint
    tb = {"input_ids": torch.stack([d["input_ids"] for d in train])}
    qb = {"input_ids": torch.stack([d["input_ids"] for d in test])}
    per_ckpt = []
    for sd, st in zip(ckpts, opt_states):
        ref_model = make_lm(seed=9)
        ref_model.load_state_dict(sd)
        ref_opt = torch.optim.Adam(ref_model.parameters(), lr=1.0, betas=(0.7, 0.9), amsgrad=True)
        ref_opt.load_state_dict(st)
        gam = flat_rows(
            ref_model,
            explicit_directions(ref_model, ref_opt, per_sample_grads(ref_model, lm_loss_row, tb)),
        )
        q = flat_rows(ref_model, per_sample_grads(ref_model, lm_loss_row, qb))
        per_ckpt.append(cos(gam, q))
    task = AttributionTask(_loss, live, checkpoints=ckpts)
    a = args(tmp_path)
    a.per_device_train_batch_size = 2
    s = LESSAttributor(a, task=task, optimizers=opts).attribute(train, test)
    assert s.scores.dtype == DT
    ref = 0.02 * per_ckpt[0] + 0.005 * per_ckpt[1]  # default weights: each optimizer's lr
    assert rel_err(s.query(train, test), ref) <= 1e-10
    for k in range(2):
        ids, mat = s.step_matrix(k)
        order = [ids.index(hash_sample(d)) for d in train]
        assert rel_err(mat[order], [0.02, 0.005][k] * per_ckpt[k]) <= 1e-10
    s = LESSAttributor(a, task=task, optimizers=opts, checkpoint_weights=[1.0, -2.0]).attribute(
        train, test
    )
    assert rel_err(s.query(train, test), per_ckpt[0] - 2.0 * per_ckpt[1]) <= 1e-10
    with pytest.raises(ValueError, match="optimizers"):
        LESSAttributor(a, task=task, optimizers=opts[:1])


def test_frozen_form_refuses_one_state_kept_twice_and_warns_on_zero_weight(tmp_path):
    """``opt.state_dict()`` without ``copy.deepcopy`` keeps references to the live state: every
    checkpoint then holds the final one. Loading the same state twice is refused (shared tensors,
    or equal update counts); a checkpoint whose learning rate is 0 (end of a decaying schedule)
    is weighed 0 with a warning, never silently."""
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    ckpts, shallow = [], []
    for k in range(2):
        opt.zero_grad()
        _loss(model, lm_batch(4, seed=50 + k)).backward()
        opt.step()
        ckpts.append(copy.deepcopy(model.state_dict()))
        shallow.append(opt.state_dict())  # the mistake: references to the live state
    live = make_lm(seed=9)
    train = [{"input_ids": x} for x in lm_batch(3, seed=1)["input_ids"]]
    test = [{"input_ids": x} for x in lm_batch(2, seed=2)["input_ids"]]
    task = AttributionTask(_loss, live, checkpoints=ckpts)
    a = args(tmp_path)

    def optimizers(states: list, lrs: list[float]) -> list:
        out = []
        for st, lr in zip(states, lrs):
            o = torch.optim.AdamW(live.parameters(), lr=lr)
            o.load_state_dict(st)
            out.append(o)
        return out

    with pytest.raises(ValueError, match="deepcopy"):
        LESSAttributor(a, task=task, optimizers=optimizers(shallow, [0.02, 0.02])).attribute(
            train, test
        )
    same = [copy.deepcopy(opt.state_dict()) for _ in range(2)]  # one state, copied twice
    with pytest.raises(ValueError, match="same update counts"):
        LESSAttributor(a, task=task, optimizers=optimizers(same, [0.02, 0.02])).attribute(
            train, test
        )
    # distinct states, the second checkpoint at learning rate 0
    model2 = make_lm()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.02)
    states = []
    for k in range(2):
        opt2.zero_grad()
        _loss(model2, lm_batch(4, seed=60 + k)).backward()
        opt2.step()
        st = copy.deepcopy(opt2.state_dict())
        st["param_groups"][0]["lr"] = [0.02, 0.0][k]
        states.append(st)
    with pytest.warns(UserWarning, match="is 0"):
        LESSAttributor(a, task=task, optimizers=optimizers(states, [1.0, 1.0])).attribute(
            train, test
        )
