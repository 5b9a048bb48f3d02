"""Capture under FSDP (2 gloo ranks on CPU): per-sample gradients equal the single-device ones.

Three wrappings of the same model run in one pair of processes: FSDP2 (``fully_shard`` on the
linears and the root), FSDP1 with ``use_orig_params=True`` (auto-wrapped linears), and FSDP1
with flat parameters, which must be refused with a clear error (its flat buffers would hide
the embedding and the norm from the hooks). Each rank stores its shard of the data; the
reference is torch.func on the unwrapped model, in float64; the live ``GradientStreamer``
(what ``attribute()`` streams) is checked through the same wrappers.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from dattri_llm import CaptureCallback, GradientStreamer, HookManager
from dattri_llm.gradient import ops
from tests.helpers.distributed import B, expect_ok, init_group, loss_fn, make, run_ranks
from tests.helpers.reference import flat, per_sample_grads, rel_err

pytestmark = pytest.mark.distributed

WORLD = 2
WRAPPINGS = ("fsdp2", "fsdp1_orig_params")
NAMES = ["emb", "fc", "ln", "out"]


def _wrap(model: nn.Module, how: str) -> nn.Module:
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for child in (model.fc, model.out):
            fully_shard(child)
        return fully_shard(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        device_id=torch.device("cpu"),
        use_orig_params=how == "fsdp1_orig_params",
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )


def _worker(rank: int, world: int, workdir: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # FSDP2 on 3-D Linear
    init_group(rank, world, workdir)
    try:
        result: dict[str, torch.Tensor] = {}
        for how in WRAPPINGS:
            model, ids = make()
            wrapped = _wrap(model, how)
            cb = CaptureCallback(keep_all=True)
            hm = HookManager(wrapped, callbacks=[cb])
            assert hm.layer_names == NAMES, hm.layer_names  # the unwrapped model's names
            mine = ids[rank::WORLD]
            with hm.collect(deregister_on_exit=True):
                for i in range(0, len(mine), B):
                    loss_fn(wrapped, {"input_ids": mine[i : i + B]}).backward()
            assert [r.step for r in cb.records] == list(range(len(mine) // B))
            assert hm.incomplete_steps == 0, how  # FSDP2 swaps in unsharded parameters
            for r in cb.records:
                assert r.gradient.layer_names == NAMES
                result[f"{how}/gram{r.step}"] = ops.cross_dot(r.gradient, r.gradient)
                result[f"{how}/norm{r.step}"] = ops.grad_norm_sq(r.gradient)
            # the live path (what attribute() streams) through the same wrapper
            samples = [{"input_ids": row} for row in mine]
            for k, block in enumerate(GradientStreamer(wrapped, samples, loss_fn, batch_size=B)):
                result[f"{how}/live{k}"] = ops.cross_dot(block.gradient, block.gradient)
        model, _ = make()
        try:
            HookManager(_wrap(model, "fsdp1_flat"))
        except ValueError as e:
            assert "use_orig_params=True" in str(e), e
            result["flat_refused"] = torch.ones(1)
        save_file(result, os.path.join(out_dir, f"rank{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_fsdp1_and_fsdp2_capture_equals_single_device(tmp_path):
    expect_ok(run_ranks(_worker, WORLD, tmp_path / "ranks", str(tmp_path)))
    old = torch.get_default_dtype()
    try:
        model, ids = make()
        ref = flat(per_sample_grads(model, loss_fn, {"input_ids": ids}))
    finally:
        torch.set_default_dtype(old)
    for rank in range(WORLD):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert "flat_refused" in got, "FSDP1 with flat parameters was not refused"
        mine = ref[rank::WORLD]
        for how in WRAPPINGS:
            for step in range(len(mine) // B):
                r = mine[step * B : (step + 1) * B]
                assert rel_err(got[f"{how}/gram{step}"], r @ r.T) < 1e-10, (how, rank, step)
                assert rel_err(got[f"{how}/norm{step}"], (r * r).sum(1)) < 1e-10
                assert rel_err(got[f"{how}/live{step}"], r @ r.T) < 1e-10, (how, rank, step)
