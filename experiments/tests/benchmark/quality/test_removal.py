"""The small-removal LDS harness (``experiments/benchmark/quality/removal.py``): the removed
samples are dropped from the reference run's own batches (common random numbers), the subsets
are dattri's draw, and the LDS is dattri's with a bootstrap interval around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("sklearn")
pytest.importorskip("dattri")

from experiments.benchmark.quality import removal  # noqa: E402
from experiments.benchmark.quality.common import TupleDataset, loader_index_batches  # noqa: E402


def test_remove_drops_samples_from_the_full_runs_batches_and_skips_empty_ones():
    ds = TupleDataset(torch.arange(10.0)[:, None], torch.arange(10))
    loader = DataLoader(ds, batch_size=4)
    full = [idx.tolist() for idx, _, _ in loader_index_batches(loader)]
    assert full == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    got = [
        idx.tolist() for idx, _, _ in loader_index_batches(loader, remove=torch.tensor([1, 8, 9]))
    ]
    # brute force: each full batch minus the removed indices, empty batches left out
    want = [[i for i in b if i not in (1, 8, 9)] for b in full]
    assert got == [b for b in want if b]
    assert got == [[0, 2, 3], [4, 5, 6, 7]]
    for idx, x, y in loader_index_batches(loader, remove=torch.tensor([1, 8, 9])):
        assert torch.equal(x[:, 0].long(), idx) and torch.equal(y, idx)


@pytest.mark.slow  # four 2400-step digits-LR runs: ~5 s quiet, ~100 s on the loaded machine
def test_digits_remove_one_equals_the_trajectory_mask_and_remove_none_the_full_run():
    from experiments.benchmark.quality.digits import make_setting

    s = make_setting("digits-lr")
    loader = DataLoader(s.train, batch_size=s.batch_size)
    full = s.train_func(loader, seed=0).state_dict()
    masked = s.train_func(loader, seed=0, mask_index=7).state_dict()
    removed = s.train_func(loader, seed=0, remove=torch.tensor([7])).state_dict()
    nothing = s.train_func(loader, seed=0, remove=torch.tensor([], dtype=torch.long)).state_dict()
    for k in full:
        assert torch.equal(masked[k], removed[k])
        assert torch.equal(full[k], nothing[k])
        assert not torch.equal(full[k], removed[k])


def test_kept_indices_are_dattris_subset_draw():
    # dattri's retrain_lds: default_rng(seed + i).choice(n, int(n * ratio), replace=False)
    for i in range(3):
        want = np.random.default_rng(1000 + i).choice(1000, 500, replace=False)
        got = removal.kept_indices(1000, 0.5, 1000, i)
        assert np.array_equal(got, np.sort(want))
    assert len(removal.kept_indices(1000, 0.01, 1000, 0)) == 990


def test_lds_with_ci_point_is_dattris_lds_and_brute_force():
    from scipy.stats import spearmanr

    gen = torch.Generator().manual_seed(0)
    n, q, s = 30, 5, 12
    scores = torch.randn(n, q, generator=gen, dtype=torch.float64)
    kept = torch.stack([torch.randperm(n, generator=gen)[:27] for _ in range(s)])
    gt = torch.stack([scores[k].sum(0) for k in kept]) + 0.5 * torch.randn(s, q, generator=gen)
    got = removal.lds_with_ci(scores, gt, kept)
    summed = torch.stack([scores[k].sum(0) for k in kept]).numpy()
    want = np.mean([spearmanr(summed[:, t], gt[:, t].numpy())[0] for t in range(q)])
    assert abs(got["mean"] - want) < 1e-12
    assert (
        got["lo"] <= got["mean"] + 0.05
        and got["hi"] >= got["mean"] - 0.05
        and got["lo"] < got["hi"]
    )


class _CountingRuns:
    """A fake setting: a run's "model" holds one weight, the sum of the kept samples' values
    plus its seed; the target reads it. Counts the runs it trains."""

    def __init__(self, n: int = 40) -> None:
        from types import SimpleNamespace

        self.calls = 0
        self.train = TupleDataset(torch.arange(float(n))[:, None], torch.arange(n))
        self.test = TupleDataset(torch.zeros(3, 1), torch.arange(3))
        self.setting = SimpleNamespace(
            train=self.train,
            test=self.test,
            batch_size=8,
            train_func=self.train_func,
            target=lambda model, loader: (
                model.weight.detach().double().reshape(1).repeat(3)
                * torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
            ),
        )

    def train_func(self, loader, seed=0, remove=None):
        self.calls += 1
        gone = set() if remove is None else set(remove.tolist())
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(sum(i for i in range(len(self.train)) if i not in gone) + seed)
        return model


def test_removal_ground_truth_extends_a_cached_one_subset_by_subset(tmp_path):
    fake = _CountingRuns()
    ref = fake.train_func(None, seed=0).state_dict()
    args = (fake.setting, tmp_path, 0.1)
    fake.calls = 0
    small, meta = removal.removal_ground_truth(*args, 3, 2, ref)
    assert fake.calls == 2 + 3 * 2  # the 2 full runs, then 3 subsets x 2 runs
    assert meta["spec"]["num_subsets"] == 3 and small["per_run"].shape == (3, 2, 3)
    fake.calls = 0
    big, meta = removal.removal_ground_truth(*args, 5, 2, ref)
    assert fake.calls == 2 * 2  # only subsets 3 and 4 (the full runs are cached)
    assert meta["spec"]["num_subsets"] == 5
    # the same as one build of 5 subsets from an empty cache
    other = _CountingRuns()
    (tmp_path / "fresh").mkdir()
    fresh, _ = removal.removal_ground_truth(other.setting, tmp_path / "fresh", 0.1, 5, 2, ref)
    for k in ("gt", "indices", "per_run", "delta"):
        assert torch.equal(big[k], fresh[k]), k
    # brute force of one entry: subset 4, run 1 = -(sum of the kept samples + seed 1) * sign
    kept = removal.kept_indices(40, 0.1, removal.LDS_SEED, 4)
    assert big["per_run"][4, 1, 2].item() == -(kept.sum() + 1) * 2.0
    # fewer than cached: the first ones, no training
    fake.calls = 0
    first, meta = removal.removal_ground_truth(*args, 2, 2, ref)
    assert fake.calls == 0 and meta["spec"]["num_subsets"] == 2
    assert torch.equal(first["per_run"], big["per_run"][:2])
    # another fraction or run count is not reused
    fake.calls = 0
    removal.removal_ground_truth(fake.setting, tmp_path, 0.1, 2, 3, ref)
    assert fake.calls > 0


def test_removal_ground_truth_keeps_the_subsets_of_an_interrupted_build(tmp_path):
    fake = _CountingRuns()
    ref = fake.train_func(None, seed=0).state_dict()
    real = fake.train_func

    def dies_on_the_7th_run(loader, seed=0, remove=None):
        if fake.calls == 6:  # 2 full runs + 2 subsets x 2 runs done
            raise KeyboardInterrupt
        return real(loader, seed=seed, remove=remove)

    fake.setting.train_func = dies_on_the_7th_run
    fake.calls = 0
    with pytest.raises(KeyboardInterrupt):
        removal.removal_ground_truth(fake.setting, tmp_path, 0.05, 4, 2, ref)
    fake.setting.train_func = real
    fake.calls = 0
    got, meta = removal.removal_ground_truth(fake.setting, tmp_path, 0.05, 4, 2, ref)
    assert fake.calls == 2 * 2 and meta["spec"]["num_subsets"] == 4


def test_gpt2_remove_drops_the_set_from_every_batch(monkeypatch):
    """``remove=`` drops the set from every batch (the schedule still advances) and equals a
    written-out loop; ``mask_index`` of one sample is the same run as ``remove`` of it."""
    pytest.importorskip("transformers")
    from experiments.benchmark.quality import gpt2

    ids = torch.randint(0, 256, (16, gpt2.BLOCK + 1), generator=torch.Generator().manual_seed(0))
    train = TupleDataset(ids[:12, :-1].clone(), ids[:12, 1:].clone())
    test = TupleDataset(ids[12:, :-1].clone(), ids[12:, 1:].clone())
    monkeypatch.setattr(gpt2, "make_data", lambda: (None, train, test, {}))
    monkeypatch.setitem(gpt2.MODEL, "n_layer", 1)
    monkeypatch.setitem(gpt2.HP, "epochs", 2)
    torch.manual_seed(1)
    start = gpt2.TinyGPT2(**gpt2.MODEL).state_dict()
    monkeypatch.setattr(gpt2, "pretrain", lambda make_model, _ids: start)
    s = gpt2.make_setting()
    loader = DataLoader(s.train, batch_size=s.batch_size)

    def run(**kw):
        return s.train_func(loader, seed=3, **kw).state_dict()

    full = run()
    got = run(remove=torch.tensor([2, 5]))
    one, masked = run(remove=torch.tensor([5])), run(mask_index=5)
    assert all(torch.equal(one[k], masked[k]) for k in full)
    # written out: the same loop with samples 2 and 5 left out of their batches
    gpt2.seed_all(3)
    model = s.make_model()
    model.load_state_dict(start, strict=False)
    opt = torch.optim.AdamW(
        model.parameters(), lr=gpt2.HP["lr"], betas=gpt2.HP["betas"], weight_decay=0
    )
    gen = torch.Generator().manual_seed(3)
    steps, step = 2 * 2, 0
    for _ in range(2):
        perm = torch.randperm(12, generator=gen)
        for b in range(0, 12, 8):
            step += 1
            idx = perm[b : b + 8]
            idx = idx[(idx != 2) & (idx != 5)]
            for group in opt.param_groups:
                group["lr"] = gpt2.HP["lr"] * (1 - (step - 1) / steps)
            ce = gpt2.per_sample_ce(model, train.x[idx], train.y[idx])
            opt.zero_grad(set_to_none=True)
            ce.mean().backward()
            opt.step()
    want = model.state_dict()
    for k in full:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    assert any(not torch.allclose(got[k], full[k], atol=1e-6) for k in full)
