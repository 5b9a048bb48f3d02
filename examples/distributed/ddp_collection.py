"""Multi-process gradient collection under DDP, then attribution from the merged store.

Every rank wraps a tiny GPT-2 in ``DistributedDataParallel`` and trains a few steps on its
``DistributedSampler`` shard of byte-level windows of Python's own docs (``pydoc_data.topics``)
while a ``HookManager`` + ``OffloadCallback`` offload per-sample gradients: each rank writes its
own ``rank_N/`` partition of the store, with no rank logic in the loop. Rank 0 then captures the
query gradients, scores the merged store with ``TracInAttributor.attribute_from_cache`` and
checks that the stored step-0 gradients (taken at the initial weights) equal one-sample-at-a-time
``backward()`` on an undistributed copy of the model (float64, relative error < 1e-8).

    torchrun --nproc_per_node 2 examples/distributed/ddp_collection.py [--out DIR]
    python examples/distributed/ddp_collection.py [--out DIR]  # spawns 2 CPU gloo processes

On GPUs launch with torchrun and pass ``--backend nccl`` (each rank uses ``cuda:LOCAL_RANK``).
Stores and scores go to ``--out`` (every rank must see the same directory); without it, to a
temporary directory that rank 0 creates, shares with the other ranks and removes at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

from dattri_llm import (
    AttributionArguments,
    GradientStorageManager,
    HookManager,
    OffloadCallback,
    TracInAttributor,
    hash_sample,
)

TOPICS = ("assert", "for", "while", "import", "lambda", "with")
SEQ = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--nproc", type=int, default=2, help="processes for the self-spawned run")
    p.add_argument("--topics", type=int, default=4, help="how many pydoc topics to use")
    p.add_argument("--windows", type=int, default=4, help="train windows per topic")
    p.add_argument("--batch-size", type=int, default=2, help="per-rank batch size")
    p.add_argument(
        "--out",
        default=None,
        help="stores and scores, seen by every rank (default: a temp dir, removed at the end)",
    )
    return p.parse_args(argv)


def make_data(n_topics: int, windows: int) -> tuple[list[dict], list[dict]]:
    """Byte-level windows (vocab 256): ``windows`` train + 1 held-out query per topic."""
    train, test = [], []
    for topic in TOPICS[:n_topics]:
        ids = torch.tensor(list(topics[topic].encode("utf-8")), dtype=torch.long)
        chunks = ids[: (windows + 1) * SEQ].view(windows + 1, SEQ)
        train += [{"input_ids": c, "topic": topic} for c in chunks[:windows]]
        test.append({"input_ids": chunks[windows], "topic": topic})
    return train, test


def make_model() -> GPT2LMHeadModel:
    """The same initial weights in every process (seeded), float64, no dropout (exactness)."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_positions=SEQ,
        vocab_size=256,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).double()
    model.loss_type = "ForCausalLM"  # transformers 5 warns when a config leaves it unset
    return model


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Sum of the per-sample mean token losses (HF's loss is a mean over the batch)."""
    return model(input_ids=ids, labels=ids).loss * len(ids)


def shared_out(args: argparse.Namespace, rank: int) -> tuple[str, bool]:
    """The output directory every rank uses, and whether it is a temporary one of rank 0.

    Without ``--out`` (``torchrun`` starts the ranks; nobody chose a directory) rank 0 creates
    a temporary directory and broadcasts its path, so that all ranks write one store.
    """
    if args.out is not None:
        return args.out, False
    box = [tempfile.mkdtemp(prefix="dattri_llm_ddp_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        print(f"stores and scores go to {box[0]} (temporary, removed at the end; --out keeps)")
    return box[0], True


def worker(args: argparse.Namespace) -> None:
    """One rank: DDP training with offloading; rank 0 then attributes and checks."""
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = args.backend == "nccl"
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    init = os.environ.get("DDP_EXAMPLE_INIT_METHOD", "env://")  # torchrun: env://
    dist.init_process_group(
        args.backend,
        init_method=init,
        rank=rank,
        world_size=world,
        device_id=device if cuda else None,
    )
    out, temporary = None, False
    try:
        out, temporary = shared_out(args, rank)
        train, test = make_data(args.topics, args.windows)
        ddp = DistributedDataParallel(make_model().to(device), device_ids=[local] if cuda else None)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
        loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler)

        store = GradientStorageManager(f"{out}/train")  # under torch.distributed: rank_N/
        hm = HookManager(
            ddp, callbacks=[OffloadCallback(file_manager=store, recording_type="per_sample")]
        )
        with hm.collect(deregister_on_exit=True):
            for batch in loader:  # an ordinary DDP loop: each backward is one stored step
                opt.zero_grad(set_to_none=True)
                loss_fn(ddp, batch["input_ids"].to(device)).backward()  # DDP all-reduces here
                opt.step()
        store.close()  # this rank's records are durable
        dist.barrier()
        if rank == 0:
            trained = make_model().to(device)  # a plain copy: DDP's reducer stays out of it
            trained.load_state_dict(ddp.module.state_dict())
            report(trained, train, test, out, device)
        dist.barrier()
    finally:
        if temporary and rank == 0:
            shutil.rmtree(out, ignore_errors=True)
        dist.destroy_process_group()


def report(model, train: list[dict], test: list[dict], out: str, device) -> None:
    """Rank 0: query gradients, attribution over the merged store, the reference check."""
    model.eval()  # the trained weights, undistributed: the other ranks wait at the barrier
    queries = GradientStorageManager(f"{out}/test")  # rank 0 alone: one partition
    hm = HookManager(model, callbacks=[OffloadCallback(file_manager=queries)])
    with hm.collect(deregister_on_exit=True):
        for q in test:
            loss_fn(model, q["input_ids"][None].to(device)).backward()
    queries.close()

    store = GradientStorageManager(f"{out}/train")  # opening the root merges the partitions
    parts = sorted(p.name for p in Path(store.save_dir).iterdir() if p.is_dir())
    print(
        f"train store: partitions {parts} (ranks {store.ranks}), {len(store)} records "
        f"(steps {store.available_steps()}), {store.num_samples} samples"
    )
    # rank 0 scores alone (the others wait at the barrier): no split across the ranks
    args = AttributionArguments(
        output_dir=f"{out}/scores", show_progress=False, distributed_scoring=False
    )
    score = TracInAttributor(args).attribute_from_cache(f"{out}/train", f"{out}/test")
    by_hash = {hash_sample({"input_ids": s["input_ids"]}): s for s in train + test}
    train_ids, matrix = score.agnostic_matrix()
    print(f"TracIn scores from the merged store: {tuple(matrix.shape)} (train x query)")
    assert sorted(train_ids) == sorted(hash_sample({"input_ids": s["input_ids"]}) for s in train)
    top = score.top_k(3)
    for q, hs in zip(top.test_hashes, top.proponent_hashes):
        text = bytes(by_hash[q]["input_ids"].tolist()).decode("utf-8", "replace")
        print(
            f"query [{by_hash[q]['topic']}] {text!r:38} <- top proponents: "
            f"{[by_hash[h]['topic'] for h in hs]}"
        )

    # "matches the single-device reference": step-0 records were computed at the initial
    # weights, so one-sample backward() on a fresh, undistributed model must give the same.
    ref_model = make_model().to(device)
    params = dict(ref_model.named_parameters())
    worst, checked = 0.0, 0
    for i, rec in enumerate(store.records()):
        if rec.step != 0:
            continue
        grad = store.load_record(i).gradient
        for row, h in enumerate(rec.hashes):
            ref_model.zero_grad(set_to_none=True)
            loss_fn(ref_model, by_hash[h]["input_ids"][None].to(device)).backward()
            for layer in grad.layer_names:
                dense = grad.layers[layer].materialize().parameters()
                for key, g in dense.items():
                    ref = params[f"{layer}.{key}"].grad
                    err = float((g[row].to(ref) - ref).norm() / ref.norm())
                    worst = max(worst, err)
            checked += 1
    covered = {
        f"{n}.{k}" for n in grad.layer_names for k in grad.layers[n].materialize().parameters()
    }
    print(
        f"step-0 records: {checked} samples from ranks {store.ranks} vs single-process "
        f"backward(): max relative error {worst:.1e} over {len(covered)}/{len(params)} parameters"
    )
    assert worst < 1e-8 and len(covered) == len(params), (worst, covered)
    assert checked == len(store.ranks) * len(rec.hashes), checked


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # launched by torchrun (or by the branch below)
        worker(args)
        return
    # Plain `python ddp_collection.py`: start args.nproc copies of this very file with the
    # environment torchrun would give them. Chosen over torch.multiprocessing.spawn, which
    # pickles the worker by reference (module + name) so every child must re-import it: fine for
    # `python file.py` or runpy, but not when the file was loaded under a name the children
    # cannot import (importlib from a path, a notebook, `python -c`). Spawning the file itself
    # works however main() was reached, and the children run exactly the torchrun code path.
    with tempfile.TemporaryDirectory(prefix="dattri_llm_ddp_") as tmp:
        out = args.out or os.path.join(tmp, "out")
        kept = "" if args.out else " (temporary, removed at exit: pass --out DIR to keep them)"
        print(f"stores and scores go to {out}{kept}")
        init = f"file://{os.path.join(tmp, 'pg_init')}"  # file rendezvous: no free port to find
        cmd = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]
        if args.out is None:
            cmd += ["--out", out]
        procs = []
        for r in range(args.nproc):
            env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.nproc)}
            env |= {"LOCAL_WORLD_SIZE": str(args.nproc), "DDP_EXAMPLE_INIT_METHOD": init}
            procs.append(subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **env}))
        while any(p.poll() is None for p in procs):  # a failed rank would leave the others
            if any(p.poll() for p in procs):  # waiting in a collective: stop them
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}; see their output above")
    print(f"done: stores and scores in {out}" if args.out else "done")


if __name__ == "__main__":
    main()
