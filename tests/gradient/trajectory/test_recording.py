"""Trajectory recording: optimizer moments, parameter snapshots, replay, crash safety.

References are the optimizer's own ``state_dict()`` (cloned in the hand-written loop before and
after every ``optimizer.step()``), the parameters cloned in the loop, and the gradients a
gradient store captured while training.
"""

from __future__ import annotations

import copy
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch import nn

from dattri_llm import (
    GradientStorageManager,
    HookManager,
    HookManagerConfig,
    OffloadCallback,
    OptimizerDynamics,
    OptimizerStateCallback,
    ParameterSnapshotCallback,
    ReplayGradientSource,
    TrajectorySnapshots,
)
from dattri_llm.gradient.sources import DiskGradientSource
from dattri_llm.gradient.store import StoreFormatError
from tests.helpers.trajectory import (
    DT,
    lm_batch,
    lm_sample_losses,
    make_lm,
    param_rows,
)

LM_LAYERS = ["emb", "norm", "fc"]


def _index_to_param(opt):
    return [p for g in opt.param_groups for p in g["params"]]


def _state_rows(model, opt, sd: dict, key: str) -> dict[str, torch.Tensor]:
    """``{layer: (K*D,)}`` of one ``state_dict()`` field laid out in the matrix form by hand."""
    params = _index_to_param(opt)
    by_id = {id(p): n for n, p in model.named_parameters()}
    tensors = {by_id[id(params[i])]: st[key] for i, st in sd["state"].items() if key in st}
    return param_rows(model, tensors, LM_LAYERS) if len(tensors) == len(params) else None


OPTS = {
    "adamw_amsgrad_groups": lambda m: torch.optim.AdamW(
        [
            {"params": [m.emb.weight, m.fc.weight, m.fc.bias]},
            {"params": [m.norm.weight, m.norm.bias], "betas": (0.6, 0.7), "eps": 1e-3},
        ],
        lr=0.02,
        betas=(0.8, 0.9),
        eps=1e-5,
        weight_decay=0.1,
        amsgrad=True,
    ),
    "adam_coupled": lambda m: torch.optim.Adam(
        m.parameters(), lr=0.02, betas=(0.7, 0.95), weight_decay=0.05
    ),
    "sgd_momentum": lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01
    ),
}


def _train(model, opt, steps, *, warm, rec=None, callbacks=(), accumulation=1, lrs=None):
    """Hand-written loop; returns per-step (state_dict before, after, params before)."""
    for i in range(warm):
        b = lm_batch(3, seed=50 + i)
        opt.zero_grad()
        lm_sample_losses(model(**b), b["input_ids"]).sum().backward()
        opt.step()
    hm = HookManager(model, callbacks=[*callbacks, *([rec] if rec else [])])
    out = []
    with hm.collect():
        for t in range(steps):
            if lrs is not None:
                for g in opt.param_groups:
                    g["lr"] = lrs[t]
            opt.zero_grad()
            for k in range(accumulation):
                b = lm_batch(3, seed=10 * t + k)
                lm_sample_losses(model(**b), b["input_ids"]).sum().backward()
            pre = copy.deepcopy(opt.state_dict())
            theta = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            if rec is not None:
                rec.record_post(t)
            out.append((pre, copy.deepcopy(opt.state_dict()), theta))
    hm.remove()
    return out


@pytest.mark.parametrize("name", sorted(OPTS))
@pytest.mark.parametrize("warm", [0, 2])
def test_recorded_moments_equal_state_dict_every_step(tmp_path, name, warm):
    model = make_lm()
    opt = OPTS[name](model)
    snaps = TrajectorySnapshots(tmp_path / "traj")
    rec = OptimizerStateCallback(model, opt, snapshots=snaps)
    lrs = [0.03, 0.02, 0.01]
    hist = _train(model, opt, 3, warm=warm, rec=rec, lrs=lrs)
    on_disk = rec.dynamics()
    reopened = OptimizerDynamics.load(tmp_path / "traj")
    assert on_disk.steps == reopened.steps == [0, 1, 2]
    assert reopened.learning_rates() == dict(enumerate(lrs))
    adam = not name.startswith("sgd")
    fields = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if "amsgrad" in name else [])
    if not adam:
        fields = ["momentum_buffer"]
    for t, (pre, post, theta) in enumerate(hist):
        sd = reopened.step(t)
        for field in fields:
            for suffix, state in (("", pre), (".post", post)):
                want = _state_rows(model, opt, state, field)
                if want is None:  # the optimizer holds no state before its first update
                    assert t == 0 and warm == 0 and suffix == ""
                    if not adam:  # SGD: no buffer yet (it starts as the gradient)
                        assert not sd.has("emb", field)
                        continue
                    zeros = {n: torch.zeros_like(v) for n, v in model.named_parameters()}
                    want = param_rows(model, zeros, LM_LAYERS)
                for layer in LM_LAYERS:
                    got = sd.tensor(layer, field + suffix)
                    assert got.dtype == DT
                    assert torch.equal(got, want[layer]), (t, field + suffix, layer)
        for layer in LM_LAYERS:
            lr = sd.hyper_vector(layer, "lr", DT)
            assert torch.all(lr == lrs[t])
            if adam:
                count = sd.count_vector(layer, DT)
                steps = {int(s["step"]) for s in pre["state"].values()} or {0}
                assert torch.all(count == steps.pop() + 1)
        if name == "adamw_amsgrad_groups":
            b1 = sd.hyper_vector("norm", "beta1", DT)
            assert torch.all(b1 == 0.6) and torch.all(sd.hyper_vector("fc", "beta1", DT) == 0.8)
        if name == "adam_coupled":  # θ_t is part of the consumed gradient
            want = param_rows(model, theta, LM_LAYERS)
            for layer in LM_LAYERS:
                assert torch.equal(sd.tensor(layer, "param"), want[layer])
    # the in-memory record equals the one on disk, and survives a save
    mem_rec = OptimizerStateCallback(model2 := make_lm(), opt2 := OPTS[name](model2))
    _train(model2, opt2, 3, warm=warm, rec=mem_rec, lrs=lrs)
    saved = mem_rec.dynamics().save(tmp_path / "saved")
    for t in range(3):
        a, b = saved.step(t), reopened.step(t)
        for key in b._tensors:
            assert torch.equal(a.tensor(*key.split("|")), b.tensor(*key.split("|")))


def test_gradient_accumulation_declared(tmp_path):
    model = make_lm()
    opt = OPTS["adamw_amsgrad_groups"](model)
    rec = OptimizerStateCallback(model, opt, gradient_accumulation_steps=2)
    store = GradientStorageManager(tmp_path / "g")
    off = OffloadCallback(file_manager=store, gradient_accumulation_steps=2)
    hist = _train(model, opt, 3, warm=1, rec=rec, callbacks=[off], accumulation=2)
    dyn = rec.dynamics()
    assert dyn.steps == [0, 1, 2]
    assert sorted({r.step for r in store.records()}) == [0, 1, 2]
    for t, (pre, post, _) in enumerate(hist):
        sd = dyn.step(t)
        for field in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            for suffix, state in (("", pre), (".post", post)):
                want = _state_rows(model, opt, state, field)
                for layer in LM_LAYERS:
                    assert torch.equal(sd.tensor(layer, field + suffix), want[layer])


def _bwd(model, seed=0):
    b = lm_batch(2, seed=seed)
    lm_sample_losses(model(**b), b["input_ids"]).sum().backward()


def test_undeclared_accumulation_and_missing_record_post_refused():
    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    # two backward passes per update, not declared
    rec = OptimizerStateCallback(model, opt)
    hm = HookManager(model, callbacks=[rec])
    with hm.collect():
        _bwd(model)
        with pytest.raises(RuntimeError, match=r"record_post\(0\) was never called") as e:
            _bwd(model, 1)
    assert "gradient_accumulation_steps" in str(e.value)
    hm.remove()
    # an update without record_post
    rec = OptimizerStateCallback(model, opt)
    hm = HookManager(model, callbacks=[rec])
    with hm.collect():
        _bwd(model)
        opt.step()
        with pytest.raises(RuntimeError, match=r"record_post\(0\) was never called"):
            _bwd(model, 1)
    hm.remove()
    # accumulation declared, but the loop updates after every backward pass
    rec = OptimizerStateCallback(model, opt, gradient_accumulation_steps=2)
    hm = HookManager(model, callbacks=[rec])
    with hm.collect():
        _bwd(model)
        opt.step()
        with pytest.raises(RuntimeError, match="updated between two backward passes"):
            _bwd(model, 1)
    hm.remove()
    # record_post for a step that was not captured, or without an update
    rec = OptimizerStateCallback(model, opt)
    with pytest.raises(RuntimeError, match="nothing was recorded"):
        rec.dynamics()
    hm = HookManager(model, callbacks=[rec])
    with hm.collect():
        _bwd(model)
        with pytest.raises(RuntimeError, match="no captured step 5"):
            rec.record_post(5)
        with pytest.raises(RuntimeError, match="zero or several times"):
            rec.record_post(0)
    hm.remove()
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        OptimizerStateCallback(model, opt, gradient_accumulation_steps=0)


def test_dense_projection_refused_by_the_moments_recorder():
    from dattri_llm import ProjectionConfig

    model = make_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    cfg = HookManagerConfig(projection={"fc": ProjectionConfig("dense", proj_dim=4)})
    with pytest.raises(ValueError, match="dense") as e:
        HookManager(model, config=cfg, callbacks=[OptimizerStateCallback(model, opt)])
    assert "'fc'" in str(e.value) or "['fc']" in str(e.value)


# ---- parameter snapshots -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parameter_snapshots_bit_exact(tmp_path, dtype):
    model = make_lm().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    snaps = TrajectorySnapshots(tmp_path / "traj")
    cb = ParameterSnapshotCallback(model, snaps, optimizer=opt)
    every2 = ParameterSnapshotCallback(model, tmp_path / "every2", every=2)
    hist = _train(model, opt, 4, warm=1, callbacks=[cb, every2], lrs=[0.04, 0.03, 0.02, 0.01])
    re = TrajectorySnapshots(tmp_path / "traj")
    assert re.steps("parameters") == [0, 1, 2, 3]
    assert re.learning_rates() == {0: 0.04, 1: 0.03, 2: 0.02, 3: 0.01}
    for t, (_, _, theta) in enumerate(hist):
        params, rng = re.load_parameters(t)
        assert set(params) == {n for n, _ in model.named_parameters()}
        for n, v in params.items():
            assert v.dtype == dtype and torch.equal(v, theta[n]), (t, n)
        assert "cpu" in rng
    sparse = TrajectorySnapshots(tmp_path / "every2")
    assert sparse.steps("parameters") == [0, 2]
    assert torch.equal(sparse.load_parameters(2)[0]["fc.weight"], hist[2][2]["fc.weight"])


# ---- replay --------------------------------------------------------------------------------------
class DropMLP(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def drop_loss(model, batch):
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="sum")


def _record_run(tmp_path, p: float, steps: int = 3):
    torch.manual_seed(0)
    model = DropMLP(p).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    store = GradientStorageManager(tmp_path / "grads")
    snaps = TrajectorySnapshots(tmp_path / "traj")
    hm = HookManager(
        model,
        callbacks=[OffloadCallback(file_manager=store), ParameterSnapshotCallback(model, snaps)],
    )
    g = torch.Generator().manual_seed(3)
    with hm.collect():
        for t in range(steps):
            batch = {"x": torch.randn(4, 4, generator=g, dtype=DT), "y": torch.randint(0, 3, (4,))}
            snaps.save_batch(t, batch)
            opt.zero_grad()
            drop_loss(model, batch).backward()
            opt.step()
    hm.remove()
    return model, store, snaps


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_replay_equals_stored_gradients(tmp_path, p):
    model, store, snaps = _record_run(tmp_path, p)
    final = {n: v.detach().clone() for n, v in model.named_parameters()}
    model.eval()
    rng = torch.get_rng_state()
    replay = ReplayGradientSource(model, TrajectorySnapshots(tmp_path / "traj"), drop_loss)
    stored = {b.step: b for b in DiskGradientSource(tmp_path / "grads")}
    assert replay.steps() == sorted(stored) == [0, 1, 2]
    for block in replay:
        ref = stored[block.step]
        assert block.hashes == ref.hashes
        a, b = block.gradient.flatten(), ref.gradient.flatten()
        assert a.dtype == DT
        # same numbers up to summation order (a reloaded batch may take another SIMD path)
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-13, block.step
    # the model is left as it was found
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)
    for n, v in model.named_parameters():
        assert torch.equal(v, final[n])
    if p > 0:  # non-vacuous: another dropout mask gives other gradients
        params, _ = snaps.load_parameters(1)
        m2 = DropMLP(p).double()
        m2.load_state_dict(params)
        cb = __import__("dattri_llm").CaptureCallback()
        hm = HookManager(m2, callbacks=[cb])
        with hm.collect():
            drop_loss(m2, snaps.load_batch(1)).backward()
        hm.remove()
        assert not torch.allclose(cb.pop().gradient.flatten(), stored[1].gradient.flatten())


def test_replay_with_recorded_model_inputs(tmp_path):
    """``record_batches=True``: the model's inputs are recorded; a label-free loss replays."""
    torch.manual_seed(0)
    model = DropMLP(0.25).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = GradientStorageManager(tmp_path / "grads")
    snaps = TrajectorySnapshots(tmp_path / "traj")
    cb = ParameterSnapshotCallback(model, snaps, record_batches=True)
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=store), cb])

    def loss(m, batch):
        return torch.logsumexp(m(**batch), -1).sum()

    with hm.collect():
        for _ in range(2):
            opt.zero_grad()
            loss(model, {"x": torch.randn(3, 4, dtype=DT)}).backward()
            opt.step()
    hm.remove()
    stored = {b.step: b for b in DiskGradientSource(tmp_path / "grads")}
    for block in ReplayGradientSource(model, tmp_path / "traj", loss):
        ref = stored[block.step].gradient.flatten()
        assert float((block.gradient.flatten() - ref).abs().max() / ref.abs().max()) <= 1e-13
        assert block.hashes == stored[block.step].hashes


def test_replay_refuses_dropout_without_recorded_random_state(tmp_path):
    torch.manual_seed(0)
    model = DropMLP(0.3).double()
    snaps = TrajectorySnapshots(tmp_path / "traj")
    snaps.save_parameters(0, dict(model.named_parameters()), meta={"training": True})
    snaps.save_batch(0, {"x": torch.randn(2, 4, dtype=DT), "y": torch.tensor([0, 1])})
    with pytest.raises(ValueError, match="dropout") as e:
        ReplayGradientSource(model, snaps, drop_loss).load_step(0)
    assert "step 0" in str(e.value)


# ---- crash safety --------------------------------------------------------------------------------
_WRITER = r"""
import sys, torch
from dattri_llm import TrajectorySnapshots
snaps = TrajectorySnapshots(sys.argv[1])
n = int(sys.argv[2])
for step in range(10**6):
    w = torch.full((n,), float(step), dtype=torch.float64)
    b = torch.arange(3.0) + step
    print("writing", step, flush=True)
    snaps.save_parameters(step, {"w": w, "b": b}, meta={"learning_rate": step / 10})
    snaps.save_batch(step, {"x": torch.full((2, 3), step), "tag": "s%d" % step})
"""


def _check_trajectory(root) -> int:
    snaps = TrajectorySnapshots(root)
    steps = snaps.steps("parameters")
    assert steps == list(range(len(steps)))
    for s in steps:
        params, _ = snaps.load_parameters(s)
        assert torch.equal(params["w"], torch.full_like(params["w"], float(s)))
        assert torch.equal(params["b"], torch.arange(3.0) + s)
        assert snaps.meta("parameters", s)["learning_rate"] == s / 10
    for s in snaps.steps("batch"):
        batch = snaps.load_batch(s)
        assert torch.equal(batch["x"], torch.full((2, 3), s)) and batch["tag"] == f"s{s}"
    # the reopened directory accepts new writes (and drops a killed writer's unfinished files)
    nxt = (steps[-1] + 1) if steps else 0
    snaps.save_parameters(nxt + 1000, {"w": torch.zeros(2)})
    snaps.close()
    leftovers = [p for p in root.rglob(".*.tmp")]
    assert not leftovers
    again = TrajectorySnapshots(root)
    assert torch.equal(again.load_parameters(nxt + 1000)[0]["w"], torch.zeros(2))
    return len(steps)


def test_sigkill_during_snapshot_writes_leaves_a_readable_trajectory(tmp_path):
    """A writer killed with SIGKILL in the middle of a write (it announces each write; the kill
    lands 0-3 ms later, inside the 3 MB safetensors write + fsync)."""
    path = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    rnd = random.Random(0)
    mid_write = 0
    for trial in range(2):
        root = tmp_path / f"traj{trial}"
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(root), str(400_000)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
        )
        try:
            target = f"writing {3 + trial}"
            while (line := proc.stdout.readline().strip()) != target:
                assert line, proc.stderr.read()
            time.sleep(rnd.uniform(0.0, 0.003))
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        mid_write += any(True for _ in root.rglob(".*.tmp"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn index line is announced, not an error
            assert _check_trajectory(root) >= 3 + trial
    print(f"kills that left an unfinished file: {mid_write} of 2")


def test_torn_index_line_and_unfinished_file_are_recovered(tmp_path):
    root = tmp_path / "traj"
    snaps = TrajectorySnapshots(root)
    for s in range(3):
        snaps.save_parameters(
            s,
            {"w": torch.full((4,), float(s), dtype=DT), "b": torch.arange(3.0) + s},
            meta={"learning_rate": s / 10},
        )
    snaps.close()
    # a killed writer: half an index line and a temp file never renamed
    with open(root / "index.jsonl", "ab") as f:
        f.write(b'{"seq": 3, "kind": "parameters", "st')
    (root / "parameters" / ".000000003.safetensors.tmp").write_bytes(b"\x00" * 10)
    with pytest.warns(UserWarning, match="torn last"):
        assert _check_trajectory(root) == 3
    # a corrupted (completed) entry raises naming the file
    files = sorted((root / "parameters").glob("*.safetensors"))
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pytest.raises(StoreFormatError, match=files[0].name):
        TrajectorySnapshots(root).load_parameters(0)


def test_hook_config_is_respected_by_replay(tmp_path):
    """Replay with a hook config captures the same layers as the training capture."""
    model, store, snaps = _record_run(tmp_path, 0.0, steps=2)
    cfg = HookManagerConfig(linear_io=["fc2"])
    replay = ReplayGradientSource(model, snaps, drop_loss, hook_config=cfg)
    for block in replay:
        ref = next(b for b in DiskGradientSource(tmp_path / "grads") if b.step == block.step)
        assert block.gradient.layer_names == ["fc2"]
        assert torch.equal(
            block.gradient.layers["fc2"].materialize().data,
            ref.gradient.layers["fc2"].materialize().data,
        )
