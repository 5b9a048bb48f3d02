"""Randomized differential test of the capture core, many seeds (the CI suite runs a few).

Builds a random small model per seed (``capture_models.random_case``: chains, residuals,
branches, module reuse, tied weights with and without biases, frozen parameters, checkpointing,
in-place activations, every supported layer type, float32 / float64), captures it under every
capture style and compares the per-parameter per-sample gradients and the routed inner products
(every routing mode) with one backward pass per sample. Prints one line per failing
seed, then a table of the largest relative errors per dtype and how often each feature occurred.
Exit status 1 if any seed failed.

Usage (from the repository root)::

    python tests/fuzz/capture_fuzz.py                  # seeds 0..1999
    python tests/fuzz/capture_fuzz.py --start 5000 --seeds 500
    python tests/fuzz/capture_fuzz.py --seed 123 -v     # one seed, its model printed
    python tests/fuzz/capture_fuzz.py --device cuda --seeds 300
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.fuzz.capture_models import check_case, random_case  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--start", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=2000, help="number of seeds")
    p.add_argument("--seed", type=int, default=None, help="run this one seed only")
    p.add_argument("-v", "--verbose", action="store_true", help="print each model")
    p.add_argument("--device", default=None, help="e.g. cuda (TF32 is turned off)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)
    print(
        f"# capture fuzz: seeds {seeds[0]}..{seeds[-1]}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, device {args.device or 'cpu'}"
    )
    t0 = time.perf_counter()
    worst: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    features: collections.Counter[str] = collections.Counter()
    failed = 0
    for seed in seeds:
        case = random_case(seed)
        if args.verbose:
            print(case.model)
        out = check_case(case, device=args.device)
        key = str(case.dtype).removeprefix("torch.")
        w = worst[key]
        w[0], w[1], w[2] = max(w[0], out.param_err), max(w[1], out.gram_err), w[2] + 1
        features.update(case.features)
        if out.failures:
            failed += 1
            print(f"seed {seed} ({key}; {', '.join(case.features)}): {out.failures[0]}")
    elapsed = time.perf_counter() - t0
    print(f"\n{len(seeds)} seeds, {failed} failed, {elapsed:.0f} s\n")
    print("| dtype | models | max rel. error, per-parameter | max rel. error, inner products |")
    print("|---|---|---|---|")
    for key, (pe, ge, n) in sorted(worst.items()):
        print(f"| {key} | {n} | {pe:.1e} | {ge:.1e} |")
    print("\n| feature | models |\n|---|---|")
    for name, n in sorted(features.items()):
        print(f"| {name} | {n} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
