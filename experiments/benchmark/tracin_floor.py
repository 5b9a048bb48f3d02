"""The floor table: live TracIn's ``attribute()`` against one plain forward+backward.

CPU, one thread; GPT-2 from config, vocab 1000, seq 64, batch 8; every layer but ``wpe`` (see
``utils/adapters/run_floor.py``). ``attribute()`` / one plain forward+backward over the same
samples, ours and the published ``dattri-llm`` 0.1.0 side by side (each in a fresh subprocess,
rounds interleaved, the order alternating), with peak RSS. 0.1.0 runs in
``experiments/benchmark/.venv-ref``; without that venv the table reports ours only.

    python experiments/benchmark/tracin_floor.py --parts floor --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env  # noqa: E402

if __name__ == "__main__":
    ensure_env()

from utils.env import header  # noqa: E402
from utils.models import ModelShape  # noqa: E402
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(BENCH_DIR))
REF_PY = os.path.join(BENCH_DIR, ".venv-ref", "bin", "python")
RUNNER = os.path.join(BENCH_DIR, "utils", "adapters", "run_floor.py")


def log(msg: str) -> None:
    print(f"[floor] {msg}", file=sys.stderr, flush=True)


def shape_of(spec: str) -> ModelShape:
    nl, w = (int(x) for x in spec.split("x"))
    return ModelShape("gpt2", nl, w, max(2, w // 64), 1000, 64, 8)


# ---- floor table ---------------------------------------------------------------------------------
def run_one(impl: str, spec: str, n: int, m: int, rounds: int, budget: float | None) -> dict:
    shape = shape_of(spec)
    cmd_shape = f"{shape.n_layer},{shape.width},{shape.n_head},{shape.vocab},{shape.seq}"
    args = ["--impl", impl, "--shape", cmd_shape, "--n", str(n), "--m", str(m)]
    args += ["--rounds", str(rounds)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if impl == "ref":
        env.pop("PYTHONPATH", None)
        cmd = [REF_PY, "-I", RUNNER, *args]
    else:
        env["PYTHONPATH"] = REPO
        cmd = [sys.executable, RUNNER, *args]
        if budget is not None:
            cmd += ["--budget-gb", str(budget)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    if res.returncode != 0:
        raise RuntimeError(f"{impl} {spec} {n}x{m} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _med(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _ratio(rs: list[dict]) -> float | None:
    return _med([x["attr_cpu"] / x["plain_cpu"] for x in rs]) if rs else None


def _peak(rs: list[dict]) -> float | None:
    return max(x["attr_peak"] for x in rs) if rs else None


def part_floor(rows_spec: list[tuple[str, int, int]], rounds: int, budget: float | None) -> str:
    have_ref = os.path.exists(REF_PY)
    table = []
    for spec, n, m in rows_spec:
        got: dict[str, list[dict]] = {"ours": [], "ref": []}
        for r in range(rounds):
            order = ["ours", "ref"] if r % 2 == 0 else ["ref", "ours"]
            for impl in order:
                if impl == "ref" and not have_ref:
                    continue
                got[impl] += run_one(impl, spec, n, m, 1, budget)["rounds"]
                last = got[impl][-1]
                log(f"{spec} {n}x{m} {impl}: {last['attr_cpu'] / last['plain_cpu']:.2f}x")

        o, f = _ratio(got["ours"]), _ratio(got["ref"])
        po, pf = _peak(got["ours"]), _peak(got["ref"])
        table.append(
            [
                f"4x{spec.split('x')[1]}" if spec.startswith("4") else spec,
                f"{n} x {m}",
                fmt_x(o),
                fmt_x(f),
                fmt_x(o / f) if f else "n/a",
                fmt_bytes(po),
                fmt_bytes(pf),
                f"{po / pf:.2f}" if pf else "n/a",
                fmt_s(_med([x["attr_cpu"] for x in got["ours"]])),
                fmt_s(_med([x["attr_cpu"] for x in got["ref"]])) if got["ref"] else "n/a",
            ]
        )
    return (
        f"### attribute() / plain forward+backward, ours vs dattri-llm 0.1.0 (median of {rounds} "
        "interleaved rounds, CPU time; peak RSS above the model and data)\n\n"
        + md_table(
            "model|train x test|ours|0.1.0|ours / 0.1.0|peak ours|peak 0.1.0|"
            "peak ours / 0.1.0|ours CPU|0.1.0 CPU".split("|"),
            table,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="floor", help="kept for the documented command")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-gb", type=float, default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    print(
        header(
            "Scoring at scale: the floor table",
            {
                "models": "GPT-2 from GPT2Config (random weights), vocab 1000, seq 64, batch 8; "
                "every layer except wpe captured (both implementations)",
                "timing": "process CPU time (steadier than wall clock under load)",
            },
        )
    )
    parts = a.parts.split(",")
    if "floor" in parts:
        rows = (
            [("4x256", 16, 8)]
            if a.quick
            else [
                ("4x256", 64, 16),
                ("4x512", 64, 16),
                ("6x512", 64, 16),
                ("4x1024", 64, 16),
                ("4x512", 256, 32),
                ("4x256", 1024, 64),
            ]
        )
        print(part_floor(rows, 1 if a.quick else a.rounds, a.budget_gb), flush=True)
    print(f"\nload average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
