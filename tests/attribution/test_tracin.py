"""TracIn / Grad-Dot / Grad-Cos against brute-force per-sample gradients (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from dattri_llm import (
    AttributionArguments,
    AttributionTask,
    HookManager,
    HookManagerConfig,
    TracInAttributor,
)
from dattri_llm.gradient.gradient import Gradient
from dattri_llm.gradient.sources import GradientBlock, InMemoryGradientSource
from tests.helpers.reference import assert_same_formula
from tests.helpers.tracin import V, args, dataset, make_mlp, mlp_loss, vmap_grads


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


# ---- live, single checkpoint -------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "factorized", "materialized"])
def test_live_grad_dot_mlp_matches_brute_force(tmp_path, mode):
    model = make_mlp()
    train, test = dataset(7), dataset(5, seed=2)
    att = TracInAttributor(
        args(tmp_path, score_block_size=2), task=AttributionTask(mlp_loss, model), mode=mode
    )
    score = att.attribute(train, test)
    ref = vmap_grads(model, train) @ vmap_grads(model, test).T
    assert rel(score.query(train, test), ref) < 1e-10
    # the test side is materialized once (not per train block) where the router densifies
    from dattri_llm.gradient.streaming import GradientStreamer

    tg = Gradient.concatenate([b.gradient for b in GradientStreamer(model, test, mlp_loss)])
    kinds = {type(lg).__name__ for lg in att._densify_test(tg).layers.values()}
    assert kinds == ({"Factorized"} if mode == "factorized" else kinds)
    if mode == "materialized":
        assert "Materialized" in kinds
    ids, matrix = score.agnostic_matrix()
    assert matrix.shape == (7, 5) and matrix.dtype == torch.float64
    assert score.train_steps == [0] * 7
    assert not (tmp_path / "out").exists()  # nothing written


def test_test_layer_reformed_per_chunk_is_held_dense_within_the_budget(tmp_path):
    """A test layer the router would re-materialize for every train chunk is materialized once,
    however large its dense form is relative to its factors (here 4.7x), unless the budget's
    room is too small; the scores are the same either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(150, 150), nn.Tanh()).double()

    def loss(m: nn.Module, batch: dict) -> torch.Tensor:
        return m(batch["x"]).pow(2).sum()

    data = [{"x": torch.randn(16, 150, dtype=torch.float64)} for _ in range(32)]
    train, test = data[:16], data[16:]
    from dattri_llm.gradient.streaming import GradientStreamer

    tg = Gradient.concatenate([b.gradient for b in GradientStreamer(model, test, loss)])
    (layer,) = tg.layers.values()
    p = 150 * 151
    assert p * 16 > 4 * layer.nbytes / 8  # dense form more than 4x the factors
    scores = {}
    for gb, kind in ((1.0, "Materialized"), (1e-4, "Factorized")):
        kw = {"per_device_train_batch_size": 16, "score_memory_gb": gb}
        att = TracInAttributor(args(tmp_path, **kw), task=AttributionTask(loss, model))
        (got,) = att._densify_test(tg).layers.values()
        assert type(got).__name__ == kind, gb
        scores[gb] = att.attribute(train, test).query(train, test)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(pr: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, pr, (x,)).pow(2).sum()

    def flat(ds: list[dict]) -> torch.Tensor:
        g = vmap(grad(one), in_dims=(None, 0))(params, torch.stack([d["x"] for d in ds]))
        return torch.cat([g[k].reshape(len(ds), -1) for k in params], dim=1)

    ref = flat(train) @ flat(test).T
    for s in scores.values():
        assert rel(s, ref) < 1e-10


def gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=40,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg).double()


def padded(lengths: list[int], t: int = 8, seed: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        mask = (torch.arange(t) < n).long()
        out.append(
            {"input_ids": torch.randint(1, 40, (t,), generator=g) * mask, "attention_mask": mask}
        )
    return out


def gpt2_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(input_ids=ids, attention_mask=mask).logits
    labels = ids.masked_fill(mask == 0, -100)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum"
    )


def loop_grads(model: nn.Module, loss_fn, ds: list) -> torch.Tensor:
    """Brute force: one sample per backward, every parameter (tied weights counted once)."""
    was = model.training
    model.eval()
    rows = []
    for item in ds:
        model.zero_grad(set_to_none=True)
        batch = (
            {k: v[None] for k, v in item.items()}
            if isinstance(item, dict)
            else tuple(v[None] for v in item)
        )
        loss_fn(model, batch).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    model.train(was)
    return torch.stack(rows)


def test_live_gpt2_default_capture_matches_brute_force(tmp_path):
    model = gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    train, test = padded([8, 5, 6, 3, 8]), padded([7, 4], seed=4)
    score = TracInAttributor(args(tmp_path), task=AttributionTask(gpt2_loss, model)).attribute(
        train, test
    )
    ref = loop_grads(model, gpt2_loss, train) @ loop_grads(model, gpt2_loss, test).T
    assert rel(score.query(train, test), ref) < 1e-10
    # default capture covers wte (tied with lm_head) and wpe: the sum above includes them
    hm = HookManager(model, HookManagerConfig())
    assert {"transformer.wte", "transformer.wpe", "lm_head"} <= set(hm.layer_names)
    hm.remove()


def test_grad_cos_matches_brute_force(tmp_path):
    model = make_mlp()
    train, test = dataset(6), dataset(3, seed=2)
    score = TracInAttributor(
        args(tmp_path), task=AttributionTask(mlp_loss, model), normalized_grad=True
    ).attribute(train, test)
    gt, ge = vmap_grads(model, train), vmap_grads(model, test)
    ref = (gt / gt.norm(dim=1, keepdim=True)) @ (ge / ge.norm(dim=1, keepdim=True)).T
    got = score.query(train, test)
    assert rel(got, ref) < 1e-10
    assert got.abs().max() <= 1 + 1e-12


# ---- several checkpoints ----------------------------------------------------------------------
@pytest.mark.parametrize("as_files", [False, True])
def test_tracin_checkpoints_weighted(tmp_path, as_files):
    model = make_mlp()
    states = [{k: v.clone() for k, v in make_mlp(s).state_dict().items()} for s in (10, 11, 12)]
    ckpts: list = states
    if as_files:
        ckpts = []
        for i, st in enumerate(states):
            path = tmp_path / f"ckpt{i}.pt"
            torch.save(st, path)
            ckpts.append(str(path))
    weights = [0.5, 2.0, -1.5]
    train, test = dataset(5), dataset(3, seed=2)
    calls = []

    def target(m, b):  # counts test-side batches: streamed once per checkpoint
        calls.append(len(b["input_ids"]))
        return mlp_loss(m, b)

    # a declared sum: "auto" would evaluate target on single samples once to decide
    task = AttributionTask(
        mlp_loss, model, checkpoints=ckpts, target_func=target, loss_reduction="sum"
    )
    score = TracInAttributor(args(tmp_path), task=task, checkpoint_weights=weights).attribute(
        train, test
    )
    per = []
    for st in states:
        model.load_state_dict(st)
        per.append(vmap_grads(model, train) @ vmap_grads(model, test).T)
    ref = sum(w * p for w, p in zip(weights, per))
    assert rel(score.query(train, test), ref) < 1e-10
    assert score.steps == [0, 1, 2]
    assert calls == [2, 1] * 3
    for c in range(3):
        ids, m = score.step_matrix(c)
        assert rel(m, weights[c] * per[c]) < 1e-10
    # the model holds the last checkpoint's weights afterwards
    assert all(torch.equal(v, states[-1][k]) for k, v in model.state_dict().items())


def test_checkpoint_weights_length_checked(tmp_path):
    task = AttributionTask(mlp_loss, make_mlp(), checkpoints=[make_mlp().state_dict()] * 2)
    with pytest.raises(ValueError, match="checkpoint_weights has 3 entries"):
        TracInAttributor(args(tmp_path), task=task, checkpoint_weights=[1, 2, 3])


# ---- from a cache -----------------------------------------------------------------------------
def offload(model, ds, path, batch=3, checkpoint=0, store=None, keep_token_factors=False):
    from dattri_llm import GradientStorageManager, OffloadCallback

    fm = store if store is not None else GradientStorageManager(str(path))
    off = OffloadCallback(
        file_manager=fm, recording_type="per_sample", keep_token_factors=keep_token_factors
    )
    hm = HookManager(model, HookManagerConfig(), callbacks=[off])
    hm.checkpoint = checkpoint
    model.eval()
    with hm.collect():
        for i in range(0, len(ds), batch):
            model.zero_grad(set_to_none=True)
            ids = torch.stack([d["input_ids"] for d in ds[i : i + batch]])
            mlp_loss(model, {"input_ids": ids}).backward()
    hm.remove()
    model.zero_grad(set_to_none=True)
    fm.flush()
    return fm


def test_from_cache_equals_live_and_brute_force(tmp_path):
    pytest.importorskip("dattri_llm.gradient.store")
    model = make_mlp()
    train, test = dataset(7), dataset(4, seed=2)
    offload(model, train, tmp_path / "train")
    offload(model, train, tmp_path / "train-tokens", keep_token_factors=True)
    offload(model, test, tmp_path / "test", batch=2)
    att = TracInAttributor(
        args(tmp_path, score_block_size=3), task=AttributionTask(mlp_loss, model)
    )
    cached = att.attribute_from_cache(str(tmp_path / "train"), str(tmp_path / "test"))
    live = att.attribute(train, test)
    ref = vmap_grads(model, train) @ vmap_grads(model, test).T
    assert rel(cached.query(train, test), ref) < 1e-10
    assert rel(cached.query(train, test), live.query(train, test)) < 1e-10
    assert cached.train_steps == [0, 0, 0, 1, 1, 1, 2]  # store steps, not checkpoints
    tok = att.attribute_from_cache(  # token granularity needs the train store's token axis
        tmp_path / "train-tokens", tmp_path / "test", attribution_granularity="token"
    )
    assert rel(tok.query(train, test), ref) < 1e-10


def test_from_cache_multi_checkpoint_pairing(tmp_path):
    pytest.importorskip("dattri_llm.gradient.store")
    from dattri_llm import GradientStorageManager

    model = make_mlp()
    states = [make_mlp(s).state_dict() for s in (20, 21)]
    train, test = dataset(4), dataset(2, seed=2)
    tr_store = GradientStorageManager(str(tmp_path / "train"))
    te_store = GradientStorageManager(str(tmp_path / "test"))
    per = []
    for c, st in enumerate(states):
        model.load_state_dict(st)
        offload(model, train, None, batch=2, checkpoint=c, store=tr_store)
        offload(model, test, None, batch=2, checkpoint=c, store=te_store)
        per.append(vmap_grads(model, train) @ vmap_grads(model, test).T)
    score = TracInAttributor(
        args(tmp_path), checkpoint_weights={0: 3.0, 1: 0.25}
    ).attribute_from_cache(str(tmp_path / "train"), str(tmp_path / "test"))
    assert rel(score.query(train, test), 3.0 * per[0] + 0.25 * per[1]) < 1e-10
    # checkpoints=[1]: Grad-Dot at the last checkpoint only, from the same two stores
    last = TracInAttributor(args(tmp_path)).attribute_from_cache(
        tmp_path / "train", tmp_path / "test", checkpoints=[1]
    )
    assert rel(last.query(train, test), per[1]) < 1e-10
    from dattri_llm import DiskGradientSource

    src = DiskGradientSource(tmp_path / "train", checkpoints=[0])
    assert len(src) == 2 and src.num_samples == 4 and {b.checkpoint for b in src} == {0}
    with pytest.raises(KeyError, match=r"checkpoint labels \[0, 1\] \(missing: \[5\]\)"):
        DiskGradientSource(tmp_path / "train", checkpoints=[5])

    # a test store with a single checkpoint pairs with every train checkpoint
    model.load_state_dict(states[1])
    offload(model, test, tmp_path / "test1", batch=2, checkpoint=1)
    g1 = vmap_grads(model, test)
    ref = 0.0
    for st in states:
        model.load_state_dict(st)
        ref = ref + vmap_grads(model, train) @ g1.T
    score = TracInAttributor(args(tmp_path)).attribute_from_cache(
        str(tmp_path / "train"), str(tmp_path / "test1")
    )
    assert rel(score.query(train, test), ref) < 1e-10


# ---- identity ---------------------------------------------------------------------------------
def test_query_realigns_shuffled_dataset(tmp_path):
    model = make_mlp()
    train, test = dataset(6), dataset(3, seed=2)
    att = TracInAttributor(args(tmp_path), task=AttributionTask(mlp_loss, model))
    a = att.attribute(train, test)
    perm = torch.randperm(6).tolist()
    shuffled = [train[i] for i in perm]
    b = att.attribute(shuffled, test[::-1])
    assert_same_formula(b.agnostic_matrix()[1], b.query(shuffled, test[::-1]))
    assert rel(a.query(train, test), b.query(train, test)) < 1e-12
    assert not torch.allclose(a.agnostic_matrix()[1], b.agnostic_matrix()[1])
    with pytest.raises(KeyError, match="not in the scores"):
        a.query(dataset(1, seed=99), test)


# ---- token granularity -------------------------------------------------------------------------
def test_token_scores_sum_to_instance_scores_and_padding_is_zero(tmp_path):
    model = gpt2()
    lengths = [8, 5, 6, 3]
    train, test = padded(lengths), padded([7, 4], seed=4)
    att = TracInAttributor(args(tmp_path), task=AttributionTask(gpt2_loss, model))
    inst = att.attribute(train, test)
    tok = att.attribute(train, test, attribution_granularity="token")
    ref = loop_grads(model, gpt2_loss, train) @ loop_grads(model, gpt2_loss, test).T
    assert rel(tok.query(train, test), ref) < 1e-10
    for item, n in zip(train, lengths):
        pos, ts = tok.token_scores(item)
        assert pos.tolist() == list(range(8)) and ts.shape == (8, 2)
        assert rel(ts.sum(0), inst.query([item], test)[0]) < 1e-10
        # padding positions (and the last real token, whose target is padding) score exactly 0
        assert torch.all(ts[n - 1 :] == 0)
        assert ts[: n - 1].abs().sum() > 0


def test_token_scores_against_materialized_test_side(tmp_path):
    model = make_mlp()
    train, test = dataset(5), dataset(3, seed=2)
    from dattri_llm.gradient.streaming import GradientStreamer

    tr = list(GradientStreamer(model, train, mlp_loss, batch_size=2))
    te = [
        GradientBlock(b.step, b.gradient.materialize(), b.hashes, b.checkpoint)
        for b in GradientStreamer(model, test, mlp_loss, batch_size=3)
    ]
    att = TracInAttributor(args(tmp_path))
    score = att.attribute_sources(
        InMemoryGradientSource(tr), InMemoryGradientSource(te), attribution_granularity="token"
    )
    ref = vmap_grads(model, train) @ vmap_grads(model, test).T
    assert rel(score.query(train, test), ref) < 1e-10
    for item in train:
        assert rel(score.token_scores(item)[1].sum(0), score.query([item], test)[0]) < 1e-10
    # a materialized train side has no token axis
    tr_dense = [GradientBlock(b.step, b.gradient.materialize(), b.hashes) for b in tr]
    with pytest.raises(ValueError, match="capture factorized|Capture factorized"):
        att.attribute_sources(
            InMemoryGradientSource(tr_dense),
            InMemoryGradientSource(te),
            attribution_granularity="token",
        )


# ---- dattri interop ---------------------------------------------------------------------------
def test_from_dattri_round_trip_matches_brute_force(tmp_path):
    dattri_task_mod = pytest.importorskip("dattri.task")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(5, 7)
            self.ln = nn.LayerNorm(7)
            self.fc2 = nn.Linear(7, 3)

        def forward(self, x):
            return self.fc2(self.ln(torch.tanh(self.fc1(x))))

    torch.manual_seed(0)
    net = Net().double()

    def f(params, data):  # dattri style: (params, data), a mean over the batch
        x, y = data
        yhat = torch.func.functional_call(net, params, (x,))
        return nn.functional.cross_entropy(yhat, y)

    ckpt = {k: v.clone() for k, v in net.state_dict().items()}
    dtask = dattri_task_mod.AttributionTask(loss_func=f, model=net, checkpoints=ckpt)
    g = torch.Generator().manual_seed(5)
    train = [
        (torch.randn(5, generator=g, dtype=torch.float64), torch.tensor(i % 3)) for i in range(6)
    ]
    test = [
        (torch.randn(5, generator=g, dtype=torch.float64), torch.tensor(i % 3)) for i in range(3)
    ]
    att = TracInAttributor(args(tmp_path), task=dtask)  # accepted directly
    assert isinstance(att.task, AttributionTask)
    score = att.attribute(train, test)

    def per_sample(ds):
        rows = []
        for x, y in ds:
            net.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(net(x[None]), y[None]).backward()
            rows.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        net.zero_grad(set_to_none=True)
        return torch.stack(rows)

    ref = per_sample(train) @ per_sample(test).T
    assert rel(score.query(train, test), ref) < 1e-10
    assert att.task.train_loss.reduction == "mean"  # detected on the first batch
    # explicit reduction: "sum" would scale every per-sample gradient by 1/batch
    task_sum = AttributionTask.from_dattri(dtask, reduction="sum")
    s2 = TracInAttributor(
        args(tmp_path, per_device_train_batch_size=6, per_device_eval_batch_size=3), task=task_sum
    ).attribute(train, test)
    assert rel(s2.query(train, test), ref / 18) < 1e-10


# ---- bad input --------------------------------------------------------------------------------
def test_bad_inputs(tmp_path):
    model = make_mlp()
    train, test = dataset(4), dataset(2, seed=2)
    with pytest.raises(ValueError, match="needs a task"):
        TracInAttributor(args(tmp_path)).attribute(train, test)
    att = TracInAttributor(args(tmp_path), task=AttributionTask(mlp_loss, model))
    with pytest.raises(ValueError, match="attribution_granularity"):
        att.attribute(train, test, attribution_granularity="word")
    with pytest.raises(FileNotFoundError, match="train_dir"):
        att.attribute_from_cache(str(tmp_path / "nope"), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="test_dir"):
        att.attribute_from_cache(str(tmp_path), str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="mode"):
        TracInAttributor(args(tmp_path), mode="fast")
    with pytest.raises(TypeError, match="task"):
        TracInAttributor(args(tmp_path), task=object())
    with pytest.raises(ValueError, match="scalar"):
        TracInAttributor(
            args(tmp_path), task=AttributionTask(lambda m, b: m(b["input_ids"]).sum((1, 2)), model)
        ).attribute(train, test)

    from dattri_llm.gradient.streaming import GradientStreamer

    tr = list(GradientStreamer(model, train, mlp_loss, batch_size=2))
    te = list(GradientStreamer(model, test, mlp_loss, batch_size=2))
    bad = [GradientBlock(0, tr[0].gradient, tr[0].hashes[:1])]
    with pytest.raises(ValueError, match="1 sample hashes for 2 gradient rows"):
        att.attribute_sources(InMemoryGradientSource(bad), InMemoryGradientSource(te))
    with pytest.raises(ValueError, match="test block at step 0 .* 4 sample hashes"):
        att.attribute_sources(
            InMemoryGradientSource(tr),
            InMemoryGradientSource([GradientBlock(0, te[0].gradient, te[0].hashes * 2)]),
        )
    other = [GradientBlock(b.step, b.gradient.select_layers(["fc", "head"]), b.hashes) for b in te]
    with pytest.raises(
        ValueError,
        match=r"test gradients were captured on layers \['fc', "
        r"'head'\] but the train gradients on layers",
    ):
        att.attribute_sources(InMemoryGradientSource(tr), InMemoryGradientSource(other))
    ckpt_tests = [GradientBlock(0, te[0].gradient, te[0].hashes, checkpoint=c) for c in (1, 2)]
    with pytest.raises(ValueError, match="checkpoints \\[1, 2\\]"):
        att.attribute_sources(InMemoryGradientSource(tr), InMemoryGradientSource(ckpt_tests))
    with pytest.raises(ValueError, match="no gradients"):
        att.attribute_sources(InMemoryGradientSource(tr), InMemoryGradientSource([]))
    with pytest.raises(TypeError, match="no extra arguments"):
        att.attribute(train, test, covariances=1)
    assert isinstance(tr[0].gradient, Gradient)


def test_layers_mismatch_between_stores(tmp_path):
    pytest.importorskip("dattri_llm.gradient.store")
    from dattri_llm import GradientStorageManager, OffloadCallback

    model = make_mlp()
    train, test = dataset(4), dataset(2, seed=2)
    offload(model, train, tmp_path / "train")
    fm = GradientStorageManager(str(tmp_path / "test"))
    hm = HookManager(
        model,
        HookManagerConfig(linear_io=["fc", "head"]),
        callbacks=[OffloadCallback(file_manager=fm)],
    )
    with hm.collect():
        mlp_loss(model, {"input_ids": torch.stack([d["input_ids"] for d in test])}).backward()
    hm.remove()
    fm.flush()
    with pytest.raises(ValueError, match=r"only in train: \['emb', 'norm'\]"):
        TracInAttributor(args(tmp_path)).attribute_from_cache(
            str(tmp_path / "train"), str(tmp_path / "test")
        )
    # scoring the common layers works
    score = TracInAttributor(args(tmp_path)).attribute_from_cache(
        str(tmp_path / "train"), str(tmp_path / "test"), layers=["fc", "head"]
    )
    assert score.agnostic_matrix()[1].shape == (4, 2)
    # and exactly: the brute-force Gram over those layers' parameters only
    names = [n for n, _ in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    keep = torch.cat(
        [torch.full((s,), n.split(".")[0] in ("fc", "head")) for n, s in zip(names, sizes)]
    )
    ref = vmap_grads(model, train)[:, keep] @ vmap_grads(model, test)[:, keep].T
    assert rel(score.query(train, test), ref) < 1e-10
    full = vmap_grads(model, train) @ vmap_grads(model, test).T
    assert rel(full, ref) > 1e-3  # the left-out layers matter here


def test_arguments_work_with_hf_argument_parser(tmp_path):
    transformers = pytest.importorskip("transformers")
    (parsed,) = transformers.HfArgumentParser(AttributionArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--score_block_size", "7"]
    )
    assert parsed.score_block_size == 7 and parsed.use_cpu
    assert parsed.device == torch.device("cpu")
    with pytest.raises(ValueError, match="score_block_size"):
        AttributionArguments(score_block_size=0)
    with pytest.raises(ValueError, match="dataloader_collate"):
        AttributionArguments(dataloader_collate="zip")


def test_pad_collate_on_variable_lengths(tmp_path):
    model = make_mlp()
    g = torch.Generator().manual_seed(7)
    train = [{"input_ids": torch.randint(0, V, (n,), generator=g)} for n in (4, 6, 5, 6)]
    test = dataset(2, t=6, seed=2)

    def loss(model, batch):  # padding (value 0) positions are masked out of the loss
        ids = batch["input_ids"]
        logits = model(input_ids=ids)
        tgt = ids[:, 1:].masked_fill(batch["mask"][:, 1:] == 0, -100)
        return nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, V), tgt.reshape(-1), reduction="sum"
        )

    def with_mask(ds):
        return [{**d, "mask": torch.ones_like(d["input_ids"])} for d in ds]

    train_m, test_m = with_mask(train), with_mask(test)
    a = args(tmp_path, dataloader_collate="pad", per_device_train_batch_size=3)
    score = TracInAttributor(a, task=AttributionTask(loss, model)).attribute(train_m, test_m)
    # reference: each sample alone, unpadded (padding tokens must not change the gradient
    # of the per-token model except through the masked loss)
    ref = loop_grads(model, loss, train_m) @ loop_grads(model, loss, test_m).T
    assert rel(score.query(train_m, test_m), ref) < 1e-10


def test_state_dict_checkpoint_sharing_live_memory_is_snapshotted() -> None:
    from dattri_llm import AttributionTask

    model = torch.nn.Linear(3, 2)
    live = model.state_dict()  # views of the live parameters
    other = {k: torch.randn_like(v) for k, v in live.items()}
    task = AttributionTask(
        loss_func=lambda m, b: m(b["x"]).sum(), model=model, checkpoints=[live, other]
    )
    before = {k: v.clone() for k, v in live.items()}
    task.load_checkpoint(1)
    task.load_checkpoint(0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
