"""HookManager behaviour: steps, reuse, tied weights, checkpointing, selection and errors."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dattri_llm import REGISTER_ALL, CaptureCallback, HookCallback, HookManager, HookManagerConfig
from dattri_llm.gradient import Shared, ops
from dattri_llm.utils.hashing import hash_batch, hash_sample
from tests.helpers.reference import assert_same_formula, flat, per_sample_grads, rel_err


class TinyLM(nn.Module):
    """Embedding -> linear (used twice) -> norm -> head tied to the embedding."""

    def __init__(self, vocab: int = 17, dim: int = 6, tie: bool = True, ckpt: str | None = None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.unused = nn.Linear(dim, 2)
        if tie:
            self.head.weight = self.emb.weight
        self.ckpt = ckpt

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(torch.tanh(self.fc(h))))  # module reuse

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        if self.ckpt:
            h = checkpoint(self.block, h, use_reentrant=self.ckpt == "reentrant")
        else:
            h = self.block(h)
        return self.head(self.norm(h))


def lm_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["input_ids"]
    logits = model(input_ids=ids)
    return nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def run(model: nn.Module, batches: list[torch.Tensor], **cfg) -> list:
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, config=HookManagerConfig(**cfg), callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        for ids in batches:
            lm_loss(model, {"input_ids": ids}).backward()
    return cb.records


def ref_flat(model: nn.Module, ids: torch.Tensor, exclude: tuple[str, ...] = ("unused",)):
    g = per_sample_grads(model, lm_loss, {"input_ids": ids})
    return flat({k: v for k, v in g.items() if not k.startswith(exclude)})


@pytest.mark.parametrize("ckpt", [None, "reentrant", "non_reentrant"])
def test_reuse_tied_and_checkpointing_exact(ckpt: str | None) -> None:
    torch.manual_seed(0)
    model = TinyLM(ckpt=ckpt).double()
    x1, x2 = torch.randint(0, 17, (3, 5)), torch.randint(0, 17, (4, 5))
    recs = run(model, [x1, x2])
    assert len(recs) == 2 and [r.step for r in recs] == [0, 1]
    g1, g2 = recs[0].gradient, recs[1].gradient
    assert isinstance(g1.layers["emb"], Shared)  # tied emb / head: one parameter
    assert "head" not in g1.layers
    assert g1.layers["fc"].num_tokens == 10  # two calls joined along the token axis
    model.ckpt = None  # the torch.func reference cannot trace a reentrant checkpoint
    r1, r2 = ref_flat(model, x1), ref_flat(model, x2)
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-10
        assert rel_err(ops.grad_norm_sq(g1, mode=mode), (r1 * r1).sum(1)) < 1e-10
    # the unused layer is reported with an exactly zero gradient
    assert torch.all(g1.layers["unused"].materialize().data == 0)


def test_shared_separate_is_block_diagonal() -> None:
    model = TinyLM().double()
    x = torch.randint(0, 17, (3, 5))
    g = run(model, [x], shared_parameters="separate")[0].gradient
    assert "head" in g.layers and not isinstance(g.layers["emb"], Shared)


def test_gradient_accumulation_records_each_backward_and_grad_is_untouched() -> None:
    model = TinyLM(tie=False).double()
    xs = [torch.randint(0, 17, (2, 5)) for _ in range(3)]
    ref_model = TinyLM(tie=False).double()
    ref_model.load_state_dict(model.state_dict())
    for x in xs:
        lm_loss(ref_model, {"input_ids": x}).backward()
    recs = run(model, xs)
    assert len(recs) == 3
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad)
    # per-sample gradients of one step sum to that step's batch gradient
    total = sum(r.gradient.aggregate().flatten() for r in recs)
    assert total.shape[0] == 1


def test_no_grad_forwards_are_ignored_and_remove_restores_model() -> None:
    model = TinyLM().double()
    before = {
        n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()
    }
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    with hm.collect():
        with torch.no_grad():
            model(torch.randint(0, 17, (2, 5)))
        model(torch.randint(0, 17, (2, 5)))  # grad-enabled forward without backward
        lm_loss(model, {"input_ids": torch.randint(0, 17, (2, 5))}).backward()
    assert len(cb.records) == 1
    hm.remove()
    hm.remove()  # idempotent
    after = {
        n: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for n, m in model.named_modules()
    }
    assert before == after
    with pytest.raises(RuntimeError, match="removed"):
        with hm.collect():
            pass


def test_backward_outside_collect_records_nothing() -> None:
    model = TinyLM()
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    lm_loss(model, {"input_ids": torch.randint(0, 17, (2, 5))}).backward()
    assert cb.records == []
    hm.remove()


def test_hashes_identify_samples_independent_of_position() -> None:
    model = TinyLM()
    x = torch.randint(0, 17, (4, 5))
    perm = torch.tensor([2, 0, 3, 1])
    r1 = run(model, [x])[0]
    r2 = run(model, [x[perm]])[0]
    assert r1.hashes == [hash_sample({"input_ids": row}) for row in x]
    assert r2.hashes == [r1.hashes[i] for i in perm.tolist()]
    assert hash_batch({"input_ids": x[1:3]}) == r1.hashes[1:3]
    # hashes are content-only: dtype and shape matter, position does not
    assert hash_sample({"input_ids": x[0]}) != hash_sample({"input_ids": x[0].int()})


def test_sample_id_key_and_manual_ids() -> None:
    class WithIds(TinyLM):
        def forward(self, input_ids: torch.Tensor, sample_id: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids)

    model = WithIds()
    cb = CaptureCallback()
    hm = HookManager(model, config=HookManagerConfig(sample_id_key="sample_id"), callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        ids = torch.randint(0, 17, (3, 5))
        out = model(input_ids=ids, sample_id=torch.tensor([7, 8, 9]))
        out.sum().backward()
    assert cb.pop().hashes == ["7", "8", "9"]
    cb2 = CaptureCallback()
    hm = HookManager(model, callbacks=[cb2])
    with hm.collect(deregister_on_exit=True):
        hm.set_sample_ids(["a", "b", "c"])
        model(input_ids=ids, sample_id=torch.tensor([7, 8, 9])).sum().backward()
    assert cb2.pop().hashes == ["a", "b", "c"]


def test_sample_id_key_of_the_wrong_shape_is_refused_at_capture() -> None:
    """Two ids for a batch of four, or a 2-D id field, would give distinct samples one id."""

    class WithIds(TinyLM):
        def forward(self, input_ids: torch.Tensor, sample_id: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids)

    model = WithIds()
    ids = torch.randint(0, 17, (4, 5))
    cases = {
        "too few": (torch.tensor([7, 8]), r"shape \(2,\) for a batch of 4 samples"),
        "2-D": (torch.tensor([[1, 2], [1, 3], [1, 4], [1, 5]]), r"shape \(4, 2\)"),
    }
    for field, match in cases.values():
        cb = CaptureCallback()
        hm = HookManager(model, config=HookManagerConfig(sample_id_key="sample_id"), callbacks=[cb])
        with pytest.raises(ValueError, match=match) as err:
            with hm.collect(deregister_on_exit=True):
                model(input_ids=ids, sample_id=field).sum().backward()
        assert "sample_id_key 'sample_id'" in str(err.value)
        assert "shape (4,)" in str(err.value) and "set_sample_ids" in str(err.value)
        assert cb.record is None
    # one id per row, also as a (B, 1) column, is taken
    cb = CaptureCallback()
    hm = HookManager(model, config=HookManagerConfig(sample_id_key="sample_id"), callbacks=[cb])
    with hm.collect(deregister_on_exit=True):
        model(input_ids=ids, sample_id=torch.tensor([[4], [5], [6], [7]])).sum().backward()
    assert cb.pop().hashes == ["4", "5", "6", "7"]
    # the live path's per-item ids follow the same rule
    from dattri_llm.gradient.streaming import sample_id

    config = HookManagerConfig(sample_id_key="sample_id")
    assert sample_id({"input_ids": ids[0], "sample_id": torch.tensor(3)}, config) == "3"
    with pytest.raises(ValueError, match=r"sample_id_key 'sample_id'.*shape \(2,\)"):
        sample_id({"input_ids": ids[0], "sample_id": torch.tensor([3, 4])}, config)


def test_selection_errors_are_clear() -> None:
    model = TinyLM()
    with pytest.raises(ValueError, match="fc"):
        HookManager(model, config=HookManagerConfig(hook_types={"fcc": "linear_io"}))
    with pytest.raises(ValueError, match="matches no module"):
        HookManager(model, config=HookManagerConfig(linear_io=["nothing.*"]))
    with pytest.raises(ValueError, match="unsupported layer type"):
        HookManager(
            model,
            config=HookManagerConfig(
                hook_types={"fc": "linear_io"}, layer_types={"fc": "nn.Bogus"}
            ),
        )
    with pytest.raises(ValueError, match="capture_style"):
        HookManagerConfig(capture_style="dense")

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

    m = nn.Sequential(Odd())
    with pytest.raises(ValueError, match="no layer rule"):
        HookManager(m, config=HookManagerConfig(hook_types={"0": "linear_io"}))
    with pytest.raises(ValueError, match="empty"):
        HookManager(m)


def test_regex_selection_and_exclude() -> None:
    model = TinyLM(tie=False)
    hm = HookManager(model, config=HookManagerConfig(linear_io=["fc|head"]))
    assert hm.layer_names == ["fc", "head"]
    hm.remove()
    hm = HookManager(model, config=HookManagerConfig(linear_io=REGISTER_ALL, exclude=["unused"]))
    assert "unused" not in hm.layer_names and "emb" in hm.layer_names
    hm.remove()


def test_frozen_layers_are_not_selected_by_register_all() -> None:
    model = TinyLM(tie=False)
    model.fc.requires_grad_(False)
    hm = HookManager(model)
    assert "fc" not in hm.layer_names
    hm.remove()


def test_param_grad_layers_batch_one_exact() -> None:
    model = TinyLM(tie=False).double()
    x = torch.randint(0, 17, (1, 5))
    rec = run(model, [x], linear_io=["fc"], param_grad=["norm"])[0]
    ref = per_sample_grads(model, lm_loss, {"input_ids": x})
    got = rec.gradient.layers["norm"].data
    want = torch.cat([ref["norm.weight"].reshape(1, -1), ref["norm.bias"].reshape(1, -1)], 1)
    assert rel_err(got, want) < 1e-12
    with pytest.raises(RuntimeError, match="batch size 1"):
        run(model, [torch.randint(0, 17, (2, 5))], linear_io=["fc"], param_grad=["norm"])


def test_callback_hook_points_are_called_in_order() -> None:
    events: list[str] = []

    class Spy(HookCallback):
        def on_context_start(self) -> None:
            events.append("start")

        def on_forward(self, layer, module, a) -> None:
            events.append(f"f:{layer}")

        def on_backward(self, layer, module, a, g) -> None:
            events.append(f"b:{layer}")

        def on_step_end(self, record) -> None:
            events.append("step")

        def on_context_end(self) -> None:
            events.append("end")

    model = TinyLM(tie=False)
    hm = HookManager(model, config=HookManagerConfig(linear_io=["norm"]), callbacks=[Spy()])
    with hm.collect(deregister_on_exit=True):
        lm_loss(model, {"input_ids": torch.randint(0, 17, (2, 5))}).backward()
    assert events == ["start", "f:norm", "b:norm", "step", "end"]


@pytest.mark.parametrize(
    "layer",
    [
        nn.Conv2d(4, 4, 3, groups=2),
        nn.ConvTranspose1d(4, 4, 3, groups=2),
        nn.Embedding(5, 3, scale_grad_by_freq=True),
    ],
)
def test_unsupported_layer_options_are_clear_errors(layer: nn.Module) -> None:
    model = nn.Sequential(layer, nn.Linear(3, 3))
    with pytest.raises(ValueError, match="layer '0'.*(groups|scale_grad_by_freq)"):
        HookManager(model, config=HookManagerConfig(linear_io=["0"]))
    with pytest.warns(UserWarning, match="leaves out layer '0'"):
        hm = HookManager(model)  # REGISTER_ALL: left out, loudly
    assert hm.layer_names == ["1"]
    hm.remove()


class FusedHeadLM(TinyLM):
    """Computes the logits from ``head.weight`` directly (as TRL's fused LM head does)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.block(self.emb(input_ids)))
        return h @ self.head.weight.T


@pytest.mark.parametrize("tie", [False, True])
def test_weight_used_outside_its_module_warns_once(tie: bool) -> None:
    import dattri_llm.gradient.hooks.manager as manager

    manager._WARNED.clear()
    torch.manual_seed(0)
    batches = [torch.randint(0, 17, (3, 5)) for _ in range(2)]
    with pytest.warns(UserWarning) as rec:
        records = run(FusedHeadLM(tie=tie).double(), batches, linear_io=REGISTER_ALL)
    bypass = [w for w in rec if "its weight received a gradient" in str(w.message)]
    if not tie:
        assert len(bypass) == 1 and "layer 'head'" in str(bypass[0].message)  # once, not per step
    else:  # the tied weight's other site (emb) ran: not a bypass, but the first-step coverage
        # check sees the tied weight's missing share
        assert not [w for w in rec if "received a gradient" in str(w.message)]
        assert any("layer 'emb': the captured per-sample gradients" in str(w.message) for w in rec)
    head = records[0].gradient.layers["emb" if tie else "head"]
    if not tie:  # the bypassed layer is what the warning says: recorded as exact zeros
        assert float(head.materialize().data.abs().max()) == 0.0
    # the same model calling its head module: exact, and no warning
    manager._WARNED.clear()
    model = TinyLM(tie=tie).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        records = run(model, batches[:1], linear_io=REGISTER_ALL, exclude=["unused"])
    g, r = records[0].gradient, ref_flat(model, batches[0])
    assert rel_err(ops.cross_dot(g, g), r @ r.T) < 1e-10


def test_canonical_name_drops_wrapper_segments_anywhere() -> None:
    from dattri_llm.gradient.hooks.config import canonical_name

    assert canonical_name("fc._fsdp_wrapped_module") == "fc"  # FSDP1 wrapping a leaf
    assert canonical_name("_fsdp_wrapped_module") == ""
    assert canonical_name("h.0._checkpoint_wrapped_module.mlp._orig_mod.fc") == "h.0.mlp.fc"
    assert canonical_name("module.h.0", data_parallel=True) == "h.0"
    assert canonical_name("my_fsdp_wrapped_module_x.fc") == "my_fsdp_wrapped_module_x.fc"


def test_paused_suspends_capture_and_restores_it() -> None:
    torch.manual_seed(0)
    model = TinyLM().double()
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, callbacks=[cb])
    x = torch.randint(0, 17, (2, 5))
    with hm.collect(deregister_on_exit=True):
        with hm.paused():
            lm_loss(model, {"input_ids": x}).backward()  # not recorded
        assert cb.records == [] and hm.transforms == ()
        lm_loss(model, {"input_ids": x}).backward()  # recorded again
    assert len(cb.records) == 1 and cb.records[0].step == 0


class FunctionalTieLM(TinyLM):
    """Calls its embedding module, then reuses its weight functionally for the logits (the
    way OLMo ties: ``F.linear(h, wte.weight)``): no forward is bypassed, a share is missing."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.block(self.emb(input_ids)))
        return nn.functional.linear(h, self.emb.weight)


def test_coverage_check_catches_a_functional_tie_once() -> None:
    import dattri_llm.gradient.hooks.manager as manager

    manager._WARNED.clear()
    torch.manual_seed(0)
    batches = [torch.randint(0, 17, (3, 5)) for _ in range(2)]
    model = FunctionalTieLM(tie=False).double()
    with pytest.warns(UserWarning, match=r"layer 'emb': the captured per-sample gradients") as rec:
        run(model, batches, linear_io=["emb", "fc", "norm"])
    assert sum("coverage" in str(w.message) or "'emb'" in str(w.message) for w in rec) == 1
    # opted out: silent; and the same check passes quietly on a correct capture (fc reused)
    manager._WARNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(model, batches, linear_io=["emb", "fc", "norm"], check_coverage=False)
        run(TinyLM(tie=False).double(), batches, linear_io=["emb", "fc", "norm", "head"])


def test_linked_groups_join_items_through_shared_keys_in_first_index_order():
    from dattri_llm.utils.grouping import linked_groups

    # 0-3 linked through "b" then "c" (transitively), 1 alone, 4 joins 2 via "d", 5 empty
    keys = [["a", "b"], ["x"], ["c", "d"], ["b", "c"], ["d"], []]
    assert linked_groups(keys) == [[0, 2, 3, 4], [1], [5]]
    assert linked_groups([]) == []


def test_second_backward_through_a_retained_graph_keeps_identity_and_does_not_warn() -> None:
    """``backward(retain_graph=True)`` twice: the second pass runs no forward of its own; it is
    recorded with the samples' content hashes, no "forward never ran" warning."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1)).double()
    cap = CaptureCallback(keep_all=True)
    hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL), callbacks=[cap])
    x = torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hm.collect(deregister_on_exit=True):
            loss = model(x).pow(2).sum()
            loss.backward(retain_graph=True)
            loss.backward()
    first, second = cap.records
    assert second.hashes == first.hashes and not second.hashes[0].startswith("step")
    for name in first.gradient.layer_names:
        a = first.gradient.layers[name].materialize().data
        b = second.gradient.layers[name].materialize().data
        assert a.abs().max() > 0
        assert_same_formula(b, a)


class _PositionsThroughLinear(nn.Module):
    """A position table sliced (not called) and fed through a Linear, broadcast over the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.pos = nn.Embedding(5, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = self.proj(self.pos.weight[: input_ids.shape[1]].unsqueeze(0))  # (1, T, D)
        return self.head(self.emb(input_ids) + positions)


@pytest.mark.parametrize("only_proj", [False, True])
def test_a_layer_fed_an_unbatched_input_is_refused(only_proj: bool) -> None:
    """The Linear saw 1 row for a batch of 4 and its inner products came out
    with the wrong shape; it is now refused, naming the layer and both sizes."""
    model = _PositionsThroughLinear()
    config = HookManagerConfig(linear_io=["proj"] if only_proj else ["emb", "proj", "head"])
    hm = HookManager(model, config, callbacks=[CaptureCallback()])
    ids = torch.randint(0, 7, (4, 5))
    with pytest.raises(RuntimeError, match=r"'proj': 1.*the model's batch has 4"):
        with hm.collect(deregister_on_exit=True):
            model(ids).sum().backward()


def test_shared_separate_equals_the_untied_model() -> None:
    """``shared_parameters="separate"``: each site of the tied embedding / head is its own
    block, i.e. the per-sample gradients of the *untied* model (same values, two parameters)
    by torch.func; inner products are the untied model's Gram, without the sites' cross terms
    (which ``"sum"`` has), in float64 to 1e-10."""
    torch.manual_seed(1)
    model = TinyLM().double()
    untied = TinyLM(tie=False).double()
    state = {k: v for k, v in model.state_dict().items()}
    state["head.weight"] = model.emb.weight.detach().clone()
    untied.load_state_dict(state)
    x1, x2 = torch.randint(0, 17, (3, 5)), torch.randint(0, 17, (2, 5))
    g1, g2 = (r.gradient for r in run(model, [x1, x2], shared_parameters="separate"))
    ref1, ref2 = (per_sample_grads(untied, lm_loss, {"input_ids": x}, names=None) for x in (x1, x2))
    for layer in ("emb", "head"):
        got = g1.layers[layer].materialize().data.reshape(3, -1)
        assert rel_err(got, ref1[f"{layer}.weight"].reshape(3, -1)) < 1e-10, layer
    r1 = flat({k: v for k, v in ref1.items() if not k.startswith("unused")})
    r2 = flat({k: v for k, v in ref2.items() if not k.startswith("unused")})
    for mode in ("auto", "factorized", "materialized"):
        assert rel_err(ops.cross_dot(g1, g2, mode=mode), r1 @ r2.T) < 1e-10, mode
        assert rel_err(ops.grad_norm_sq(g1, mode=mode), (r1 * r1).sum(1)) < 1e-10, mode
    # "sum" differs by the cross terms between the sites: the tied model's Gram
    s1, s2 = (r.gradient for r in run(model, [x1, x2]))
    tied1, tied2 = ref_flat(model, x1), ref_flat(model, x2)
    assert rel_err(ops.cross_dot(s1, s2), tied1 @ tied2.T) < 1e-10
    assert rel_err(tied1 @ tied2.T, r1 @ r2.T) > 1e-3


def test_plain_capture_loads_no_moe_or_optimizer_correction_module(tmp_path):
    """Capturing a plain model enters neither ``layers/moe.py`` nor ``optim/second_moment.py``."""
    code = f"""
import sys
import torch
from torch import nn
from dattri_llm import GradientStorageManager, HookManager, OffloadCallback

model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
fm = GradientStorageManager({str(tmp_path / "store")!r})
cb = OffloadCallback(offload_interval=1, file_manager=fm, recording_type="per_sample")
with HookManager(model, callbacks=[cb]).collect():
    model(torch.randn(5, 4)).pow(2).sum().backward()
assert len(GradientStorageManager({str(tmp_path / "store")!r})) == 1
loaded = [m for m in ("dattri_llm.gradient.layers.moe", "dattri_llm.gradient.optim.second_moment")
          if m in sys.modules]
assert not loaded, loaded
"""
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[3]
    )


# ---- fixed-weights capture ----------------------------------------------------------------------
class ConvLM(nn.Module):
    """Embedding -> Conv1d over the tokens -> LayerNorm -> Linear: every layer kind at once."""

    def __init__(self, vocab: int = 11, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.emb(input_ids).transpose(1, 2)).transpose(1, 2)
        return self.fc(torch.tanh(self.norm(h)))


def conv_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(input_ids=x) ** 2).sum()  # a sum over samples: each row's own gradient


def capture_one(model: nn.Module, x: torch.Tensor, fixed: bool, **config) -> tuple:
    cb = CaptureCallback(keep_all=True)
    hm = HookManager(model, config=HookManagerConfig(**config), callbacks=[cb], fixed_weights=fixed)
    with hm.collect(deregister_on_exit=True):
        conv_loss(model, x).backward()
    return hm, cb.records[0].gradient


@pytest.mark.parametrize("projection", [None, "sparse", "logra"])
def test_fixed_weights_capture_is_exact_and_leaves_the_parameters_as_found(projection) -> None:
    from dattri_llm.gradient.ops.projection import ProjectionConfig, project_gradient
    from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads

    if projection == "logra":
        pytest.importorskip("dattri")
    torch.manual_seed(0)
    model = ConvLM().double()
    model.norm.bias.requires_grad_(False)  # a frozen parameter stays frozen and uncaptured
    sentinel = torch.full_like(model.fc.weight, 7.0)
    model.fc.weight.grad = sentinel
    x = torch.randint(0, 11, (3, 5))
    ref = per_sample_loop_grads(model, conv_loss, x)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    cfg = None if projection is None else ProjectionConfig(projection, 16, seed=3)
    hm, fixed = capture_one(model, x, True, linear_io=REGISTER_ALL, projection=cfg)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert model.fc.weight.grad is sentinel and model.conv.weight.grad is None
    assert bool((sentinel == 7.0).all())  # its values too (the first step is an ordinary one)
    _, ordinary = capture_one(model, x, False, linear_io=REGISTER_ALL, projection=cfg)
    assert model.conv.weight.grad is not None  # an ordinary capture computes weight grads
    assert set(fixed.layers) == {"emb", "conv", "norm", "fc"} == set(ordinary.layers)
    for name in fixed.layers:
        a, b = fixed.layers[name].materialize(), ordinary.layers[name].materialize()
        assert torch.equal(a.data, b.data), name
    if projection is None:
        got = captured_by_parameter(hm, fixed, model)
        assert set(got) == set(ref) - {"norm.bias"}
        for n, v in got.items():
            assert rel_err(v, ref[n]) < 1e-12, n
    else:  # the reference, projected as the capture is
        exact = capture_one(model, x, True, linear_io=REGISTER_ALL)[1]
        want = project_gradient(exact, cfg)
        for name in fixed.layers:
            a, b = fixed.layers[name].materialize(), want.layers[name].materialize()
            assert a.layer_type == b.layer_type and rel_err(a.data, b.data) < 1e-12, name


def test_fixed_weights_on_a_frozen_model_matches_one_sample_backward() -> None:
    """An all-frozen model with include_frozen: no torch error, ordinary or fixed weights."""
    import copy

    from tests.helpers.reference import captured_by_parameter, per_sample_loop_grads

    torch.manual_seed(0)
    model = ConvLM().double()
    x = torch.randint(0, 11, (2, 4))
    ref = per_sample_loop_grads(copy.deepcopy(model), conv_loss, x)
    model.requires_grad_(False)
    for fixed in (True, False):
        hm, g = capture_one(model, x, fixed, linear_io=REGISTER_ALL, include_frozen=True)
        got = captured_by_parameter(hm, g, model)
        assert set(got) == set(ref)
        for n, v in got.items():
            assert rel_err(v, ref[n]) < 1e-12, (fixed, n)
        assert not any(p.requires_grad or p.grad is not None for p in model.parameters())


def test_fixed_weights_mode_restores_flags_after_an_error_and_still_checks_coverage() -> None:
    import dattri_llm.gradient.hooks.manager as manager

    manager._WARNED.clear()
    torch.manual_seed(0)
    model = FunctionalTieLM(tie=False).double()
    hm = HookManager(
        model, config=HookManagerConfig(linear_io=["emb", "fc", "norm"]), fixed_weights=True
    )
    with pytest.raises(KeyError), hm.collect():
        assert not model.head.weight.requires_grad  # not captured: frozen in the block
        raise KeyError("boom")
    assert all(p.requires_grad for p in model.parameters())
    # the first step stays ordinary: the functional tie is still found; later steps freeze
    with pytest.warns(UserWarning, match=r"layer 'emb': the captured per-sample gradients"):
        with hm.collect():
            lm_loss(model, {"input_ids": torch.randint(0, 17, (2, 5))}).backward()
            assert not model.emb.weight.requires_grad
    hm.remove()
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="fixed_weights"):
        HookManager(model, fixed_weights="yes")


def test_fixed_weights_keeps_param_grad_layers_and_their_gradient() -> None:
    """A ``param_grad`` layer is read from ``.grad``: under fixed weights its parameters still
    take their gradient (on every step, not only the first), the same as an ordinary capture."""
    torch.manual_seed(0)
    model = ConvLM().double()
    cfg = {"linear_io": ["emb", "conv", "norm"], "param_grad": ["fc"]}
    xs = [torch.randint(0, 11, (1, 4)) for _ in range(2)]  # param_grad: one sample a step
    got = {}
    for fixed in (True, False):
        cb = CaptureCallback(keep_all=True)
        hm = HookManager(model, HookManagerConfig(**cfg), [cb], fixed_weights=fixed)
        with hm.collect(deregister_on_exit=True):
            for x in xs:
                conv_loss(model, x).backward()
                if fixed:  # after the first (checked) step: only fc still takes a gradient
                    assert model.fc.weight.requires_grad and not model.conv.weight.requires_grad
        model.zero_grad(set_to_none=True)
        got[fixed] = [r.gradient for r in cb.records]
    for a, b in zip(got[True], got[False]):
        assert set(a.layers) == {"emb", "conv", "norm", "fc"}
        for name in a.layers:
            assert torch.equal(a.layers[name].materialize().data, b.layers[name].materialize().data)
