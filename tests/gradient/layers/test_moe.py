"""Fused-expert MoE capture (``gradient/layers/moe.py``) against one backward pass per sample.

Every family is built from its config (2 layers, 4 experts, top-2, tiny widths) in float64 with
the eager expert loop (transformers' grouped-mm kernels refuse float64; the capture re-derives
routing from the module's inputs, so it does not depend on the implementation that ran).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dattri_llm import REGISTER_ALL, HookManager, HookManagerConfig
from dattri_llm.gradient.callbacks import CaptureCallback
from dattri_llm.gradient.layers import get_rule
from dattri_llm.gradient.layers.moe import expert_covariances, split_expert_factor
from tests.helpers.moe import E, H, I, K, V, _config, build, loss_fn
from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads, rel_err

transformers = pytest.importorskip("transformers")

TOL = 1e-10


def capture(model, *batches, config=None):
    """One captured step per batch (several: gradient accumulation, one backward each)."""
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, config or HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cb])
    with hm.collect():
        for x in batches:
            loss_fn(model, x).backward()
    model.zero_grad(set_to_none=True)
    return hm, cb.records


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]


def _expert_layers(record) -> list[str]:
    return [n for n, lg in record.gradient.layers.items() if lg.layer_type == "moe.experts"]


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch) -> None:
    """Warnings are emitted once per process: start each test with none emitted."""
    from dattri_llm.gradient.hooks import coverage, manager

    monkeypatch.setattr(manager, "_WARNED", set())
    monkeypatch.setattr(coverage, "_WARNED_UNCAPTURED", set())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_exact_vs_one_sample_backward(family: str) -> None:
    model = build(family)
    x = torch.randint(0, V, (3, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hm, (record,) = capture(model, x)
    got = captured_by_parameter(hm, record.gradient, model)
    ref = per_sample_loop_grads(model, loss_fn, x)
    experts = [
        n for n in ref if n.endswith(("gate_up_proj", "down_proj", "_bias")) and ".experts." in n
    ]
    assert experts and all(n in got for n in experts), sorted(set(ref) - set(got))
    routers = [n for n in ref if ".gate.weight" in n or ".router." in n]
    assert routers and all(n in got for n in routers)
    # everything else is captured too (Qwen2-MoE's shared expert and the HF RMS norms included),
    # but gpt-oss' attention sinks (no layer rule covers them)
    assert {n for n in ref if "sinks" not in n} == set(got)
    errs = {n: rel_err(got[n], ref[n]) for n in got}
    print(family, "max rel err", max(errs.values()))
    for name in got:
        assert rel_err(got[name], ref[name]) < TOL, (family, name, rel_err(got[name], ref[name]))
    # no warning about any captured layer: the first-step coverage check ran and found the
    # per-expert captures adding up to autograd's gradient of every parameter
    assert not [str(w.message) for w in caught if "mlp" in str(w.message)]
    hm.remove()


def _trainable_fraction(model, hm) -> float:
    captured = {id(p) for layer in hm.layer_parameters().values() for p in layer.values()}
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return sum(p.numel() for p in model.parameters() if id(p) in captured) / total


def test_register_all_captures_experts_and_routers() -> None:
    model = build("mixtral")
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    names = hm.layer_names
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.down_proj" in names
    assert "model.layers.0.mlp.gate" in names
    # every parameter is captured (the RMS norms by the HF norm registry)
    assert _trainable_fraction(model, hm) == 1.0
    assert hm.coverage().fraction == 1.0 and not hm.coverage().left_out
    hm.remove()


def test_unreached_expert_has_no_slots_and_zero_gradient() -> None:
    model = build("mixtral", seed=3)
    x = torch.randint(0, V, (4, 2))  # 2 tokens x top-2: at most 4 (token, expert) pairs
    hm, (record,) = capture(model, x)
    lg = record.gradient.layers["model.layers.1.mlp.experts.down_proj"]
    assert lg.a.shape[:2] == (4, 2 * K)  # one slot per routed pair, whatever E
    dense = lg.materialize().data.reshape(4, E, H, I)
    _, ids = split_expert_factor(lg.a, lg.module_kwargs)
    zero_seen = False
    for b in range(4):
        for e in range(E):
            if e not in ids[b].tolist():
                assert torch.count_nonzero(dense[b, e]) == 0
                zero_seen = True
    assert zero_seen
    hm.remove()


def test_gradient_accumulation_two_backwards() -> None:
    model = build("olmoe")
    xs = [torch.randint(0, V, (2, 5)), torch.randint(0, V, (3, 4))]
    hm, records = capture(model, *xs)
    assert len(records) == 2
    for x, record in zip(xs, records):
        ref = per_sample_loop_grads(model, loss_fn, x)
        got = captured_by_parameter(hm, record.gradient, model)
        assert set(ref) == set(got)
        for name in got:
            assert rel_err(got[name], ref[name]) < TOL
    hm.remove()


def test_grams_and_norms_vs_dense() -> None:
    model = build("qwen2_moe")
    x1, x2 = torch.randint(0, V, (3, 5)), torch.randint(0, V, (2, 4))
    _, (r1,) = capture(model, x1)
    _, (r2,) = capture(model, x2)
    for name in _expert_layers(r1):
        l1, l2 = r1.gradient.layers[name], r2.gradient.layers[name]
        rule, kw = get_rule("moe.experts"), l1.module_kwargs
        d1, d2 = l1.materialize().data, l2.materialize().data
        assert rel_err(rule.gram(l1.a, l1.g, l2.a, l2.g, kw), d1 @ d2.T) < TOL
        assert rel_err(rule.norm_sq(l1.a, l1.g, kw), d1.pow(2).sum(1)) < TOL
        assert rel_err(rule.dense_cross(l1.a, l1.g, d2, kw), d1 @ d2.T) < TOL
        per_tok = rule.materialize_per_token(l1.a, l1.g, kw)
        assert rel_err(per_tok.sum(1), d1) < TOL
        assert rel_err(rule.gram_per_token(l1.a, l1.g, l2.a, l2.g, kw), per_tok @ d2.T) < TOL


def test_expert_kfac_factors_vs_brute_force() -> None:
    model = build("mixtral", seed=1)
    x = torch.randint(0, V, (3, 5))
    _, (record,) = capture(model, x)
    lg = record.gradient.layers["model.layers.0.mlp.experts.gate_up_proj"]
    a_sum, g_sum, count = expert_covariances(lg.a, lg.g, lg.module_kwargs)
    feat, ids = split_expert_factor(lg.a, lg.module_kwargs)
    for e in range(E):  # brute force: loop over every slot
        a_ref = torch.zeros(H, H, dtype=torch.float64)
        g_ref = torch.zeros(2 * I, 2 * I, dtype=torch.float64)
        n = 0
        for b in range(3):
            for s in range(ids.shape[1]):
                if ids[b, s] == e and lg.g[b, s].abs().sum() > 0:
                    a_ref += torch.outer(feat[b, s], feat[b, s])
                    g_ref += torch.outer(lg.g[b, s], lg.g[b, s])
                    n += 1
        assert rel_err(a_sum[e], a_ref) < TOL and rel_err(g_sum[e], g_ref) < TOL
        assert count[e] == n


@pytest.mark.parametrize("style", ["logra", "dense", "mask", "sparse"])
def test_projected_capture_vs_explicit_projection(style: str) -> None:
    from dattri_llm.gradient.ops.projection import ProjectionConfig, layer_projection

    model = build("mixtral", seed=2)
    x = torch.randint(0, V, (3, 5))
    name = "model.layers.0.mlp.experts.down_proj"
    _, (exact,) = capture(model, x)
    dim = 16
    pc = ProjectionConfig(style=style, proj_dim=dim, seed=7)
    cfg = HookManagerConfig(linear_io=REGISTER_ALL, projection={name: pc})
    _, (proj,) = capture(model, x, config=cfg)
    dense = exact.gradient.layers[name].materialize().data
    lp = layer_projection(pc, "moe.experts", exact.gradient.layers[name].module_kwargs, name)
    m = lp.matrices(torch.float64)
    got = proj.gradient.layers[name].materialize().data
    if style == "logra":
        ek, d = lp.shape
        want = torch.stack([m["row"].T @ g.reshape(ek, d) @ m["col"] for g in dense])
        want = want.reshape(dense.shape[0], -1)
    elif style == "dense":
        want = dense @ m["matrix"]
    elif style == "mask":
        want = dense[:, m["indices"]]
    else:
        from dattri_llm.gradient.ops.sparse_projection import sketch_item

        want = sketch_item(exact.gradient.layers[name].materialize(), lp.shape, dim, lp.matrices)
    assert rel_err(got, want) < TOL


def test_unknown_expert_layout_is_refused_by_name() -> None:
    class StrangeExperts(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 6, 3))
            self.down_proj = torch.nn.Parameter(torch.randn(4, 3, 3))

        def forward(self, x):
            return x

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), StrangeExperts())
    with pytest.raises(ValueError, match="StrangeExperts follows no known layout"):
        HookManager(model, HookManagerConfig(linear_io=["1"]))
    with pytest.warns(UserWarning, match="StrangeExperts follows no known layout"):
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
    assert hm.layer_names == ["0"]
    hm.remove()


def test_coverage_check_catches_a_wrong_expert_layout(monkeypatch) -> None:
    """The first-step check guards the layout: drop the routing weights, and it warns."""
    from dattri_llm.gradient.layers.moe import MoEExpertsRule

    original = MoEExpertsRule.context_output_grad

    def unweighted(self, grad, kw, context):
        return original(self, grad, kw, {**context, "weight": torch.ones_like(context["weight"])})

    monkeypatch.setattr(MoEExpertsRule, "context_output_grad", unweighted)
    model = build("mixtral")
    with pytest.warns(UserWarning, match="experts.down_proj"):
        capture(model, torch.randint(0, V, (2, 5)))


def test_dropped_pairs_are_zero_slots() -> None:
    """A top-k slot holding the masking index ``E`` (expert parallelism) reaches no expert."""
    model = build("mixtral", seed=4)
    gate = model.model.layers[0].mlp.gate
    forward = gate.forward

    seen = []

    def dropping(hidden):
        logits, scores, idx = forward(hidden)
        drop = hidden[:, 0] > 0  # per token, so a sample alone drops what it drops in a batch
        idx = idx.clone()
        idx[drop, 1] = E  # the second choice reaches no expert
        seen.append(drop)
        return logits, scores, idx

    gate.forward = dropping
    x = torch.randint(0, V, (3, 5))
    hm, (record,) = capture(model, x)
    drop = seen[-1]
    assert 0 < int(drop.sum()) < drop.numel()
    got = captured_by_parameter(hm, record.gradient, model)
    ref = per_sample_loop_grads(model, loss_fn, x)
    for name in got:
        assert rel_err(got[name], ref[name]) < TOL, name
    lg = record.gradient.layers["model.layers.0.mlp.experts.gate_up_proj"]
    slots = lg.a.reshape(-1, K, lg.a.shape[-1])  # (token, choice, width)
    assert torch.count_nonzero(slots[drop, 1]) == 0
    assert bool((slots[~drop, 1, :-1] != 0).any(-1).all())
    hm.remove()


def test_float32_grouped_mm_forward() -> None:
    """transformers' default ``grouped_mm`` experts: routing re-derived, rows recomputed.

    float32: the recomputed rows round differently from the grouped kernel's, so the
    tolerance is float32 round-off over a sum of a few dozen terms (measured 2e-7).
    """
    cfg = _config("mixtral")
    cfg._experts_implementation = None
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm")
    model = model.float().eval()
    assert model.config._experts_implementation == "grouped_mm"
    x = torch.randint(0, V, (3, 6))
    hm, (record,) = capture(model, x)
    got = captured_by_parameter(hm, record.gradient, model)
    ref = per_sample_loop_grads(model, loss_fn, x)
    assert any(".experts." in n for n in got)
    for name in got:
        assert rel_err(got[name], ref[name]) < 1e-5, name
    hm.remove()


def test_materialized_and_auto_capture_equal_factorized() -> None:
    model = build("qwen3_moe")
    x = torch.randint(0, V, (2, 5))
    _, (fact,) = capture(model, x)
    for style in ("materialized", "auto"):
        cfg = HookManagerConfig(linear_io=REGISTER_ALL, capture_style=style)
        _, (rec,) = capture(model, x, config=cfg)
        for name in _expert_layers(fact):
            want = fact.gradient.layers[name].materialize().data
            assert rel_err(rec.gradient.layers[name].materialize().data, want) < TOL


@pytest.mark.parametrize("storage_dtype", [None, "bfloat16"])
def test_store_round_trip_keeps_expert_slots(tmp_path, storage_dtype) -> None:
    """Written factorised (expert indices in the factor) and read back; bf16 holds E exactly."""
    from dattri_llm import GradientStorageManager, OffloadCallback

    model = build("mixtral").float()
    x = torch.randint(0, V, (3, 5))
    cap = CaptureCallback()
    store = GradientStorageManager(tmp_path / "store")
    off = OffloadCallback(file_manager=store, keep_token_factors=True, storage_dtype=storage_dtype)
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap, off])
    with hm.collect(deregister_on_exit=True):
        loss_fn(model, x).backward()
    record = cap.pop()
    back = GradientStorageManager(tmp_path / "store").load_record(0)
    for name in _expert_layers(record):
        mem, disk = record.gradient.layers[name], back.gradient.layers[name]
        assert disk.layer_type == "moe.experts" and disk.a.shape == mem.a.shape
        assert torch.equal(
            split_expert_factor(disk.a, disk.module_kwargs)[1], mem.a[..., -1].long()
        )
        want = mem.materialize().data
        tol = 1e-6 if storage_dtype is None else 2e-2  # bf16 keeps 8 bits of each factor
        assert rel_err(disk.materialize().data, want) < tol


def test_expert_index_column_is_checked() -> None:
    rule = get_rule("moe.experts")
    kw = {"num_experts": 4, "param": "down_proj", "in_features": 3, "out_features": 2}
    a = torch.zeros(1, 2, 4)
    a[0, 1, -1] = 4.0  # expert 4 of 4
    with pytest.raises(ValueError, match="expert-index column"):
        rule.materialize(a, torch.zeros(1, 2, 2), kw)
    a[0, 1, -1] = 1.5
    with pytest.raises(ValueError, match="expert-index column"):
        rule.norm_sq(a, torch.zeros(1, 2, 2), kw)


@pytest.mark.parametrize("normalized", [False, True])
def test_tracin_on_a_moe_model_vs_brute_force(tmp_path, normalized: bool) -> None:
    """Grad-Dot / Grad-Cos through the score engine, against dot products of loop gradients."""
    from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor

    model = build("mixtral", seed=5)
    for n, p in model.named_parameters():  # the norms are another rule's: leave them out
        p.requires_grad_("norm" not in n)
    gen = torch.Generator().manual_seed(0)
    train = [{"input_ids": torch.randint(0, V, (5,), generator=gen)} for _ in range(5)]
    test = [{"input_ids": torch.randint(0, V, (5,), generator=gen)} for _ in range(2)]

    def task_loss(m, batch):
        return loss_fn(m, batch["input_ids"])

    args = AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        show_progress=False,
        per_device_train_batch_size=3,
        per_device_eval_batch_size=2,
    )
    att = TracInAttributor(args, task=AttributionTask(task_loss, model), normalized_grad=normalized)
    score = att.attribute(train, test).query(train, test)

    def rows(ds):
        x = torch.stack([d["input_ids"] for d in ds])
        grads = per_sample_loop_grads(model, loss_fn, x)
        return torch.cat([g.reshape(len(ds), -1) for g in grads.values()], 1)

    gt, ge = rows(train), rows(test)
    if normalized:
        gt, ge = gt / gt.norm(dim=1, keepdim=True), ge / ge.norm(dim=1, keepdim=True)
    assert rel_err(score, gt @ ge.T) < 1e-10


def test_block_called_on_sub_batches_is_refused() -> None:
    """Rows of a sub-batch call cannot be given to samples: refused, never mis-assigned."""
    model = build("mixtral")
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda h: torch.cat([forward(h[:2]), forward(h[2:])])
    x = torch.randint(0, V, (4, 4))  # 2 x 4 rows per call: a multiple of the batch size 4
    with pytest.raises(RuntimeError, match="cannot be given to samples"):
        capture(model, x)


def test_frozen_expert_weight_leaves_its_layer_out() -> None:
    """A frozen ``gate_up_proj`` is left out; its bias, ``down_proj`` and the router stay exact."""
    model = build("gpt_oss", seed=7)
    for layer in model.model.layers:
        layer.mlp.experts.gate_up_proj.requires_grad_(False)
    x = torch.randint(0, V, (2, 5))
    hm, (record,) = capture(model, x)
    # gpt-oss' gate_up bias still trains: the layer captures it alone
    params = hm.layer_parameters()["model.layers.0.mlp.experts.gate_up_proj"]
    assert list(params) == ["gate_up_proj_bias"]
    got = captured_by_parameter(hm, record.gradient, model)
    assert not [n for n in got if n.endswith("gate_up_proj")]
    ref = per_sample_loop_grads(model, loss_fn, x)
    assert "model.layers.0.mlp.experts.down_proj" in got
    for name in got:
        assert rel_err(got[name], ref[name]) < TOL, name
    hm.remove()


def test_preconditioned_capture_adamw_vs_optimizer_maths() -> None:
    """LESS-style capture: each sample's AdamW update direction, expert blocks included."""
    from tests.helpers.trajectory import explicit_directions

    model = build("mixtral", seed=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    warm = torch.randint(0, V, (2, 5))
    loss_fn(model, warm).backward()
    opt.step()
    opt.zero_grad()
    x = torch.randint(0, V, (3, 5))
    cb = CaptureCallback()
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), [cb], optimizer=opt)
    with hm.collect():
        loss_fn(model, x).backward()
    got = captured_by_parameter(hm, cb.pop().gradient, model)
    model.zero_grad(set_to_none=True)
    want = explicit_directions(model, opt, per_sample_loop_grads(model, loss_fn, x))
    assert any(".experts." in n for n in got)
    for name in got:
        assert rel_err(got[name], want[name]) < 1e-9, name
    hm.remove()
