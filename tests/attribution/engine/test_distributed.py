"""Scoring split across 2 and 3 gloo ranks equals one process (full matrix and top-k).

TracIn (one checkpoint; live, the train set sliced; two checkpoints with other batchings, which
takes the row split),
EK-FAC (collective fit), LESS (preconditioned store, learning rates per step), AdamW-influence
(adjoint: queries split; forward: samples split) and DVEmb (forward), float64. A rank killed
mid-way (SIGKILL) and rerun with ``resumable=True`` resumes from its own checkpoint, and the
others do not score again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dattri_llm import (
    AdamWInfluenceAttributor,
    AttributionArguments,
    AttributionScore,
    DVEmbAttributor,
    EKFACAttributor,
    GradientStorageManager,
    HookManager,
    LESSAttributor,
    OffloadCallback,
    OptimizerStateCallback,
    TracInAttributor,
)
from tests.helpers.distributed import expect_ok, init_group, run_ranks

pytestmark = pytest.mark.distributed

REPO = str(Path(__file__).resolve().parents[3])
METHODS = ["tracin", "tracin_live", "tracin_ckpts", "ekfac", "less", "adamw", "adamw_fwd", "dvemb"]


def _rendezvous() -> str:
    """A fresh file for a gloo group to meet through (a port picked free can be taken again
    before the ranks bind it)."""
    fd, path = tempfile.mkstemp(prefix="pg_init.")
    os.close(fd)
    os.remove(path)
    return path


def _args(out: str, **kw) -> AttributionArguments:
    kw.setdefault("score_memory_gb", 1e-6)
    return AttributionArguments(output_dir=out, use_cpu=True, show_progress=False, **kw)


def score(name: str, root: str, out: str, top_k: int | None) -> AttributionScore:
    """One method on the stores under ``root`` (the same call in every process)."""
    r = os.path.join
    a = _args(out)
    if name == "tracin":
        return TracInAttributor(a).attribute_from_cache(
            r(root, "train"), r(root, "test"), top_k=top_k
        )
    if name == "tracin_live":  # each rank streams a contiguous slice of the train set
        from dattri_llm import AttributionTask
        from tests.helpers.scoring import lm_loss, make_model, samples

        att = TracInAttributor(
            _args(out, per_device_train_batch_size=4), task=AttributionTask(lm_loss, make_model())
        )
        return att.attribute(samples(24, 1), samples(5, 2), top_k=top_k)
    if name == "tracin_ckpts":
        att = TracInAttributor(a, checkpoint_weights=[1.0, 0.5])
        return att.attribute_from_cache(r(root, "mtrain"), r(root, "mtest"), top_k=top_k)
    if name == "ekfac":
        att = EKFACAttributor(a, non_kronecker="diagonal")
        return att.attribute_from_cache(r(root, "train"), r(root, "test"), top_k=top_k)
    if name == "less":
        return LESSAttributor(a).attribute_from_cache(
            r(root, "less_train"), r(root, "less_query"), top_k=top_k
        )
    train, query, dyn = (
        r(root, "adamw", "train"),
        r(root, "adamw", "query"),
        r(root, "adamw", "traj"),
    )
    if name in ("adamw", "adamw_fwd"):
        att = AdamWInfluenceAttributor(
            a, loss_reduction="sum", method="forward" if name == "adamw_fwd" else "adjoint"
        )
        return att.attribute_from_cache(train, query, dynamics=dyn, top_k=top_k)
    att = DVEmbAttributor(
        a, loss_reduction="sum", learning_rate=[2e-3, 1.5e-3, 1.5e-3, 1e-3], method="forward"
    )
    return att.attribute_from_cache(train, query, top_k=top_k)


def _worker(rank: int, world: int, workdir: str, root: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    sys.path.insert(0, REPO)
    init_group(rank, world, workdir)
    try:
        import warnings

        warnings.simplefilter("ignore")
        for name in METHODS:
            for k in (None, 2):
                s = score(name, root, os.path.join(out, f"work{rank}"), k)
                s.save(os.path.join(out, f"{name}-{k}-r{rank}"))
    finally:
        dist.destroy_process_group()


# ---- the stores ---------------------------------------------------------------------------
def _less_stores(root) -> None:
    from tests.helpers.trajectory import lm_batch, lm_sample_losses, make_lm

    model = make_lm()
    opt = torch.optim.Adam(model.parameters(), lr=0.03, betas=(0.8, 0.95), eps=1e-4)
    train = GradientStorageManager(root / "less_train")
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=train)], optimizer=opt)
    with hm.collect():
        for t, lr in enumerate([0.03, 0.02, 0.012, 0.01]):
            for g in opt.param_groups:
                g["lr"] = lr
            batch = lm_batch(3, seed=t)
            opt.zero_grad()
            lm_sample_losses(model(**batch), batch["input_ids"]).sum().backward()
            opt.step()
    hm.remove()
    train.close()
    q = GradientStorageManager(root / "less_query")
    hq = HookManager(model, callbacks=[OffloadCallback(file_manager=q)])
    queries = lm_batch(4, seed=9)
    with hq.collect():
        lm_sample_losses(model(**queries), queries["input_ids"]).sum().backward()
    hq.remove()
    q.close()


def _adamw_stores(root) -> None:
    from dattri_llm import TrajectorySnapshots
    from tests.helpers.adamw_run import CONFIGS, SCHEDULE, SMALL_LRS, data
    from tests.helpers.trajectory import capture_queries, make_mlp, record_mlp_run

    factory, hyper = CONFIGS["adamw"]
    model = make_mlp(seed=1)
    opt = factory(model.parameters())
    (X, Y, XQ, YQ), warm = data()
    d = root / "adamw"

    def callbacks_for(m, o):
        store = GradientStorageManager(d / "train", fsync=False)
        rec = OptimizerStateCallback(m, o, snapshots=TrajectorySnapshots(d / "traj"))
        return [OffloadCallback(file_manager=store), rec], {"rec": rec}

    record_mlp_run(model, opt, hyper, (X, Y, XQ, YQ), SCHEDULE, SMALL_LRS, callbacks_for, warm=warm)
    capture_queries(model, GradientStorageManager(d / "query", fsync=False), XQ, YQ)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from tests.helpers.scoring import capture, make_model, samples

    root = tmp_path_factory.mktemp("dist")
    model = make_model()
    train, test = samples(24, 1), samples(5, 2)
    capture(model, GradientStorageManager(root / "train"), train, 3)
    capture(model, GradientStorageManager(root / "test"), test, 5)
    # two checkpoints, other batching and order at each: one sample's rows span records
    model2 = make_model(seed=5)
    mtrain = samples(10, 3)
    capture(model, GradientStorageManager(root / "mtrain"), mtrain, 4, ckpt=0)
    capture(model2, GradientStorageManager(root / "mtrain", mode="append"), mtrain[::-1], 3, ckpt=1)
    capture(model, GradientStorageManager(root / "mtest"), test, 5, ckpt=0)
    capture(model2, GradientStorageManager(root / "mtest", mode="append"), test, 5, ckpt=1)
    _less_stores(root)
    _adamw_stores(root)
    singles = {}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in METHODS:
            for k in (None, 2):
                singles[(name, k)] = score(name, str(root), str(root / "single"), k)
    return root, singles


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


def _same_top_k(a: AttributionScore, b: AttributionScore) -> None:
    ta, tb = a.top_k(2, duplicates="sum"), b.top_k(2, duplicates="sum")
    assert ta.proponent_hashes == tb.proponent_hashes
    assert ta.opponent_hashes == tb.opponent_hashes
    assert _rel(ta.proponent_scores, tb.proponent_scores) < 1e-10
    assert _rel(ta.opponent_scores, tb.opponent_scores) < 1e-10


@pytest.mark.parametrize("world", [2, 3])
def test_split_scoring_equals_one_process(stores, tmp_path, world):
    root, singles = stores
    expect_ok(run_ranks(_worker, world, tmp_path / "ranks", str(root), str(tmp_path)))
    for name in METHODS:
        ref = singles[(name, None)]
        # rank 0 (every rank for the trajectory methods) holds the full matrix, in order
        full_ranks = range(world) if name.startswith(("adamw", "dvemb")) else [0]
        for r in full_ranks:
            got = AttributionScore.load(tmp_path / f"{name}-None-r{r}")
            assert got.train_hashes == ref.train_hashes, name
            assert got.train_steps == ref.train_steps, name
            assert got.test_hashes == ref.test_hashes, name
            assert _rel(got.scores, ref.scores) < 1e-10, name
        if not name.startswith(("adamw", "dvemb")):  # the other ranks: their own rows
            rows = {}
            for r in range(1, world):
                own = AttributionScore.load(tmp_path / f"{name}-None-r{r}")
                for i, key in enumerate(zip(own.train_hashes, own.train_steps)):
                    rows.setdefault(key, []).append(own.scores[i])
            ref_rows = dict(zip(zip(ref.train_hashes, ref.train_steps), ref.scores))
            for key, vals in rows.items():
                assert any(_rel(v, ref_rows[key]) < 1e-10 for v in vals), name
        for r in range(world):  # top-k: every rank holds the merged result
            got = AttributionScore.load(tmp_path / f"{name}-2-r{r}")
            assert got.top_k_kept == 2 and got.num_train == singles[(name, 2)].num_train
            _same_top_k(got, ref)


_PRELUDE = textwrap.dedent(
    f"""
    import sys
    sys.path.insert(0, {REPO!r})
    import torch.distributed as dist
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2],
                            rank=rank, world_size=2)
    from dattri_llm import AttributionArguments, TracInAttributor
    """
)


def _two_ranks(code: str) -> list[str]:
    """Run ``code`` as ranks 0 and 1 of a gloo group; their stdout."""
    port = _rendezvous()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r), port], stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    return [p.communicate(timeout=120)[0] for p in procs]


def test_ranks_must_see_the_same_store(stores, tmp_path):
    """A rank that sees another store stops every rank with an error naming the ranks."""
    root, _ = stores
    code = _PRELUDE + textwrap.dedent(
        f"""
        train = {str(root / "train")!r} if rank == 0 else {str(root / "mtrain")!r}
        a = AttributionArguments(output_dir={str(tmp_path)!r}, use_cpu=True, show_progress=False)
        try:
            TracInAttributor(a).attribute_from_cache(train, {str(root / "test")!r})
        except RuntimeError as e:
            print("ERROR", e)
        """
    )
    for o in _two_ranks(code):
        assert "ERROR distributed scoring cannot start" in o and "different train stores" in o


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {repo!r})
    import torch, torch.distributed as dist
    rank, world, port, kill = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + port, rank=rank,
                            world_size=world)
    from dattri_llm import AttributionArguments, EKFACAttributor, TracInAttributor
    from dattri_llm.attribution.engine import resume, scoring
    saves = {{"n": 0}}
    orig = resume.ScoreCheckpoint.save

    def save(self, sink, done):
        orig(self, sink, done)
        saves["n"] += 1
        if kill == "yes" and rank == world - 1 and saves["n"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    resume.ScoreCheckpoint.save = save
    chunks = {{"n": 0}}
    sc = scoring.ScoreLoop.score_chunk

    def counting(self, blocks):
        chunks["n"] += 1
        return sc(self, blocks)

    scoring.ScoreLoop.score_chunk = counting
    a = AttributionArguments(output_dir={out!r}, use_cpu=True, show_progress=False,
                             score_memory_gb=1e-6, resumable=True)
    att = {make}
    s = att.attribute_from_cache({train!r}, {test!r})
    if rank == 0:
        s.save({result!r})
    print("CHUNKS", chunks["n"], flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.parametrize("make", ["TracInAttributor(a)", "EKFACAttributor(a)"])
def test_killed_rank_reruns_from_its_checkpoint(stores, tmp_path, make):
    root, singles = stores
    world = 2
    code = _KILLED.format(
        repo=REPO,
        out=str(tmp_path / "out"),
        train=str(root / "train"),
        test=str(root / "test"),
        result=str(tmp_path / "result"),
        make=make,
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def launch(kill: str) -> list[subprocess.Popen]:
        port = _rendezvous()
        return [
            subprocess.Popen(
                [sys.executable, "-c", code, str(r), str(world), port, kill],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for r in range(world)
        ]

    first = launch("yes")
    assert first[-1].wait(timeout=300) == -signal.SIGKILL
    # the survivor scores its whole share, then waits in the merge (or fails there): once its
    # checkpoint covers its 4 records, end it as a launcher would
    deadline = time.time() + 120
    while first[0].poll() is None and time.time() < deadline:
        done = [
            json.loads(p.read_text())["units_done"]
            for p in (tmp_path / "out").rglob("rank_0_of_2/progress.json")
        ]
        if done and done[0] == 4:
            break
        time.sleep(0.2)
    first[0].kill()
    first[0].communicate()
    second = launch("no")
    outs = [p.communicate(timeout=300) for p in second]
    assert all(p.returncode == 0 for p in second), [o[1][-2000:] for o in outs]
    chunks = [int(o[0].split("CHUNKS")[1]) for o in outs]
    # 8 records, 4 per rank: rank 0 had checkpointed all of its share, rank 1 two chunks
    assert chunks == [0, 2], chunks
    got = AttributionScore.load(tmp_path / "result")
    ref = singles[("tracin" if "TracIn" in make else "ekfac", None)]
    if "EKFAC" in make:  # the test's default damping differs from non_kronecker="diagonal"
        a = _args(str(tmp_path / "ref"))
        ref = EKFACAttributor(a).attribute_from_cache(root / "train", root / "test")
    assert got.train_hashes == ref.train_hashes
    assert _rel(got.scores, ref.scores) < 1e-10


def test_a_rank_scoring_alone_is_told_how_to_fix_it(stores, tmp_path):
    """Rank 0 calling alone fails after distributed_timeout_s; distributed_scoring=False works."""
    root, singles = stores
    code = _PRELUDE + textwrap.dedent(
        f"""
        if rank == 0:
            for split in (True, False):
                a = AttributionArguments(output_dir={str(tmp_path)!r}, use_cpu=True,
                                         show_progress=False, distributed_scoring=split,
                                         distributed_timeout_s=2)
                try:
                    s = TracInAttributor(a).attribute_from_cache(
                        {str(root / "train")!r}, {str(root / "test")!r})
                    s.save({str(tmp_path / "alone")!r})
                    print("SCORED", len(s.train_hashes))
                except RuntimeError as e:
                    print("ERROR", e)
        dist.barrier()
        """
    )
    out = _two_ranks(code)[0]
    assert "rank(s) [1] did not join" in out and "distributed_scoring=False" in out
    assert "SCORED 24" in out
    got = AttributionScore.load(tmp_path / "alone")
    assert torch.allclose(got.scores, singles[("tracin", None)].scores, rtol=1e-10)


def test_a_rank_that_cannot_read_its_part_stops_every_rank(stores, tmp_path):
    import shutil

    root, _ = stores
    shutil.copytree(root / "train", tmp_path / "train")
    last = GradientStorageManager(tmp_path / "train").records()[-1].path
    last.unlink()  # the index still names it: whoever holds that record cannot read it
    code = _PRELUDE + textwrap.dedent(
        f"""
        a = AttributionArguments(output_dir={str(tmp_path)!r}, use_cpu=True, show_progress=False)
        try:
            TracInAttributor(a).attribute_from_cache({str(tmp_path / "train")!r},
                                                     {str(root / "test")!r})
        except RuntimeError as e:
            print("ERROR", e)
        """
    )
    for o in _two_ranks(code):
        assert "ERROR distributed scoring cannot start" in o
        assert f"cannot read its train shard {last}" in o
