"""Live ``attribute()`` of the trajectory methods equals the run recorded by hand.

``AdamWInfluenceAttributor.attribute`` / ``DVEmbAttributor.attribute`` train a copy of the task's
model while recording (``attribute/trajectory/training.py``), then take the queries at the
trained weights. The reference here is the user's own route, written out in the test: torch's
``DataLoader`` with the documented seed, a plain AdamW / SGD loop under a ``HookManager`` with
``OffloadCallback`` + ``OptimizerStateCallback`` (the default linear learning-rate decay written
out), the queries captured at the final weights, then
``attribute_from_cache`` (itself checked against explicit unrolled formulas in
``test_adamw_influence.py`` / ``test_dvemb.py``). Queries taken at the untrained model, a wrong
data order, learning rate or optimizer each change the scores.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    AttributionTask,
    DVEmbAttributor,
    GradientStorageManager,
    HookManager,
    LiveRunArguments,
    OffloadCallback,
    OptimizerStateCallback,
)
from dattri_llm.gradient.streaming import sample_id
from tests.helpers.trajectory import DT, make_mlp, mlp_sample_losses, rel_err

N, Q = 9, 3


def mlp_loss(model, batch):
    return mlp_sample_losses(model(batch["x"]), batch["y"]).sum()


def items(n: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=DT)
    y = torch.randint(0, 3, (n,), generator=g)
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def arguments(tmp_path) -> AttributionArguments:
    return AttributionArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        show_progress=False,
        per_device_train_batch_size=3,
        seed=11,
    )


def live_run(optimizer: str) -> LiveRunArguments:
    return LiveRunArguments(
        learning_rate=0.05,
        weight_decay=0.01 if optimizer == "adamw_torch" else 0.0,
        optimizer=optimizer,
        num_train_epochs=2,
        max_grad_norm=0.0,
    )


def with_ids(batch_items: list[dict]) -> tuple[dict, list[str]]:
    return default_collate(batch_items), [sample_id(it) for it in batch_items]


def record_by_hand(tmp_path, model, train, test, args, run, optimizer: str):
    """The run and the queries, recorded through the public capture API."""
    trained = copy.deepcopy(model)
    params = list(trained.parameters())
    if optimizer == "adamw_torch":
        opt = torch.optim.AdamW(params, lr=run.learning_rate, weight_decay=run.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=run.learning_rate)
    loader = DataLoader(
        train,
        batch_size=args.per_device_train_batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(args.seed),
        collate_fn=with_ids,
    )
    store = GradientStorageManager(tmp_path / "train", fsync=False)
    rec = OptimizerStateCallback(trained, opt)
    hm = HookManager(trained, callbacks=[OffloadCallback(file_manager=store), rec])
    total = math.ceil(len(loader) * run.num_train_epochs)
    step = 0
    with hm.collect(deregister_on_exit=True):
        while step < total:
            for batch, ids in loader:
                for group in opt.param_groups:  # the default "linear" decay to 0
                    group["lr"] = run.learning_rate * max(0.0, 1 - step / total)
                hm.set_sample_ids(ids)
                mlp_loss(trained, batch).backward()
                opt.step()
                rec.record_post(step)
                opt.zero_grad(set_to_none=True)
                step += 1
                if step >= total:
                    break
    store.close()
    queries = GradientStorageManager(tmp_path / "query", fsync=False)
    hm = HookManager(trained, callbacks=[OffloadCallback(file_manager=queries)])
    batch, ids = with_ids(test)
    with hm.collect(deregister_on_exit=True):
        hm.set_sample_ids(ids)
        mlp_loss(trained, batch).backward()
    queries.close()
    return rec.dynamics()


@pytest.mark.parametrize(
    ("method", "optimizer"), [(AdamWInfluenceAttributor, "adamw_torch"), (DVEmbAttributor, "sgd")]
)
def test_live_attribute_equals_the_run_recorded_by_hand(tmp_path, method, optimizer) -> None:
    model = make_mlp(seed=1)
    before = copy.deepcopy(model.state_dict())
    train, test = items(N, seed=0), items(Q, seed=1)
    args, run = arguments(tmp_path), live_run(optimizer)
    dynamics = record_by_hand(tmp_path, model, train, test, args, run, optimizer)
    ref = method(args, loss_reduction="sum").attribute_from_cache(
        tmp_path / "train", tmp_path / "query", dynamics=dynamics
    )
    live = method(
        args, task=AttributionTask(mlp_loss, model), loss_reduction="sum", live_run=run
    ).attribute(train, test)
    for name, value in model.state_dict().items():  # the user's model is left as it is
        assert torch.equal(value, before[name]), name
    train_ids = [sample_id(it) for it in train]
    test_ids = [sample_id(it) for it in test]
    got, want = live.query(train_ids, test_ids), ref.query(train_ids, test_ids)
    assert sorted(zip(live.train_hashes, live.train_steps)) == sorted(
        zip(ref.train_hashes, ref.train_steps)
    )
    assert want.abs().max() > 0
    assert rel_err(got, want) < 1e-10
