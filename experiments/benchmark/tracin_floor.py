"""Scoring at scale: where live TracIn's time and memory go, and the floor table.

Parts (CPU, one thread; GPT-2 from config, vocab 1000, seq 64, batch 8; every layer but
``wpe``, see ``utils/adapters/run_floor.py``):

* ``breakdown`` — one process, our ``TracInAttributor.attribute()`` instrumented: the probe
  forward/backward of the train and test streams, the test side's preparation, the train
  side's materialization, the scoring GEMMs and the rest of each chunk, the joins (copies) of
  blocks into chunks, and what remains (Python, bookkeeping); beside it the *floor* measured
  on the same shapes: a frozen forward/backward without hooks (no weight gradients), the
  weight-gradient share of a plain step (what forming every per-sample gradient costs at
  autograd's efficiency) and one ``N x M x P`` GEMM. Memory: the prepared test side, the
  chunk, the largest per-layer dense chunk, the score matrix, and the peak RSS.
* ``floor`` — ``attribute()`` / one plain forward+backward over the same samples, ours and the
  published ``dattri-llm`` 0.1.0 side by side (each in a fresh subprocess, rounds interleaved,
  the order alternating), with peak RSS. 0.1.0 runs in ``experiments/benchmark/.venv-ref``
  (see ``run_floor.py``); without that venv the part reports ours only.

Usage::

    python experiments/benchmark/tracin_floor.py --parts breakdown
    python experiments/benchmark/tracin_floor.py --parts floor --rounds 3
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from utils.env import BENCH_DIR, ensure_env  # noqa: E402

if __name__ == "__main__":
    ensure_env()

import torch  # noqa: E402
from utils.env import header  # noqa: E402
from utils.memory import peak_rss_bytes  # noqa: E402
from utils.models import ModelShape, batch_loss, build_model, describe, make_batch  # noqa: E402
from utils.table import fmt_bytes, fmt_s, fmt_x, md_table  # noqa: E402

REPO = os.path.dirname(os.path.dirname(BENCH_DIR))
REF_PY = os.path.join(BENCH_DIR, ".venv-ref", "bin", "python")
RUNNER = os.path.join(BENCH_DIR, "utils", "adapters", "run_floor.py")


def log(msg: str) -> None:
    print(f"[floor] {msg}", file=sys.stderr, flush=True)


def shape_of(spec: str) -> ModelShape:
    nl, w = (int(x) for x in spec.split("x"))
    return ModelShape("gpt2", nl, w, max(2, w // 64), 1000, 64, 8)


# ---- breakdown ---------------------------------------------------------------------------------
class Timers:
    """CPU seconds per label; nested labels are subtracted from their parent ("self" time)."""

    def __init__(self) -> None:
        self.total: collections.Counter = collections.Counter()
        self.child: collections.Counter = collections.Counter()
        self.stack: list[str] = []
        self.mem: dict[str, int] = {}

    def wrap(self, owner: object, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*a: object, **k: object) -> object:
            t0 = time.process_time()
            self.stack.append(label)
            try:
                return fn(*a, **k)
            finally:
                dt = time.process_time() - t0
                self.stack.pop()
                self.total[label] += dt
                if self.stack:
                    self.child[self.stack[-1]] += dt

        setattr(owner, attr, timed)

    def self_time(self, label: str) -> float:
        return self.total[label] - self.child[label]


def instrument(t: Timers) -> None:
    import dattri_llm.attribution.base as base
    import dattri_llm.attribution.engine.scoring as scoring
    import dattri_llm.gradient.gradient as gm
    import dattri_llm.gradient.layer_gradient as lgm
    import dattri_llm.gradient.streaming as st

    orig_iter = st.GradientStreamer.__iter__

    def it(self: object) -> object:
        g = orig_iter(self)
        label = "probe fwd+bwd (test)" if self.desc.startswith("test") else "probe fwd+bwd (train)"
        while True:
            t0 = time.process_time()
            try:
                b = next(g)
            except StopIteration:
                return
            t.total[label] += time.process_time() - t0
            yield b

    st.GradientStreamer.__iter__ = it
    t.wrap(base.BaseAttributor, "_test_side", "test side")
    t.wrap(scoring.ScoreLoop, "score_chunk", "chunk")
    t.wrap(lgm.Factorized, "materialize", "materialize")
    t.wrap(gm.Gradient, "concatenate", "join")
    orig_rows = scoring.ScoreLoop.chunk_rows

    def rows(self: object, block: object) -> int:
        first = self._rows is None
        n = orig_rows(self, block)
        if first:
            test = self.test_for(block)
            item = torch.finfo(test.dtype).bits // 8
            t.mem["test side (prepared)"] = test.nbytes
            t.mem["chunk rows"] = n
            t.mem["chunk gradients"] = block.gradient.nbytes // block.gradient.batch_size * n
            t.mem["largest layer, dense, per chunk"] = (
                scoring.dense_row_bytes(block.gradient, item) * n
            )
        return n

    scoring.ScoreLoop.chunk_rows = rows


def part_breakdown(shapes: list[str], sizes: list[tuple[int, int]], reps: int) -> str:
    timers = Timers()
    instrument(timers)
    out = []
    for spec in shapes:
        shape = shape_of(spec)
        model = build_model(shape)
        for n, m in sizes:
            out.append(_breakdown_one(shape, model, n, m, reps, timers))
    return "\n".join(out)


def _breakdown_one(
    shape: ModelShape, model: torch.nn.Module, n: int, m: int, reps: int, timers: Timers
) -> str:
    from dattri_llm import AttributionArguments, AttributionTask, TracInAttributor
    from dattri_llm.gradient.hooks import HookManagerConfig

    spec = f"{shape.n_layer}x{shape.width}"
    train, test = make_batch(shape, n=n, seed=1), make_batch(shape, n=m, seed=2)
    both = torch.cat([train, test])
    tr = [{"input_ids": x} for x in train]
    te = [{"input_ids": x} for x in test]
    cfg = HookManagerConfig(exclude=[r"transformer\.wpe"])
    args = AttributionArguments(output_dir="unused", use_cpu=True, show_progress=False)
    att = TracInAttributor(
        args, task=AttributionTask(lambda mod, b: batch_loss(mod, b["input_ids"]), model)
    )
    p = sum(x.numel() for n_, x in model.named_parameters() if "wpe" not in n_)

    def plain() -> None:
        for i in range(0, len(both), 8):
            model.zero_grad(set_to_none=True)
            batch_loss(model, both[i : i + 8]).backward()
        model.zero_grad(set_to_none=True)

    def frozen() -> None:  # forward + activation gradients only, no hooks
        ps = list(model.parameters())
        for q in ps:
            q.requires_grad_(False)
        try:
            for i in range(0, len(both), 8):
                x = both[i : i + 8]
                e = model.transformer.wte(x).detach().requires_grad_()
                logits = model(inputs_embeds=e).logits
                loss = torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
                )
                loss.backward()
        finally:
            for q in ps:
                q.requires_grad_(True)

    a_mat, b_mat = torch.randn(n, p), torch.randn(m, p)
    plain(), frozen(), att.attribute(tr[:8], te[:8], hook_config=cfg)
    best = None
    for _ in range(reps):
        timers.total.clear(), timers.child.clear()
        c = time.process_time()
        plain()
        t_plain = time.process_time() - c
        c = time.process_time()
        frozen()
        t_frozen = time.process_time() - c
        c = time.process_time()
        torch.mm(a_mat, b_mat.T)
        t_gemm = time.process_time() - c
        c = time.process_time()
        peak, _ = peak_rss_bytes(lambda: att.attribute(tr, te, hook_config=cfg))
        t_attr = time.process_time() - c
        if best is None or t_attr / t_plain < best[0]:
            best = (
                t_attr / t_plain,
                t_plain,
                t_frozen,
                t_gemm,
                t_attr,
                peak,
                dict(timers.total),
                dict(timers.child),
            )
        log(f"breakdown {spec} {n}x{m}: {t_attr / t_plain:.2f}x")
    _, t_plain, t_frozen, t_gemm, t_attr, peak, total, child = best
    timers.total, timers.child = collections.Counter(total), collections.Counter(child)
    tot = timers.total
    test_mat = tot["test side"] - timers.self_time("test side")
    parts = [
        ("probe fwd+bwd, train stream (hooks included)", tot["probe fwd+bwd (train)"]),
        ("probe fwd+bwd, test stream", tot["probe fwd+bwd (test)"]),
        ("test side: join, materialize once", tot["test side"]),
        ("train: materialize per-sample gradients", tot["materialize"] - test_mat),
        ("train: join blocks into chunks (copies)", tot["join"]),
        ("train: scoring GEMMs, casts, row bookkeeping", timers.self_time("chunk") - tot["join"]),
    ]
    parts.append(("other (Python per block, fit, result)", t_attr - sum(v for _, v in parts)))
    floor = t_plain + t_gemm  # frozen probe + the dW share (plain - frozen) + the GEMM
    rows = [[k, fmt_s(v), f"{100 * v / t_attr:.0f} %", fmt_x(v / t_plain)] for k, v in parts]
    rows += [
        ["**attribute() total**", fmt_s(t_attr), "100 %", fmt_x(t_attr / t_plain)],
        ["plain forward+backward (reference)", fmt_s(t_plain), "", "1.00x"],
        ["floor: frozen fwd+bwd, no hooks", fmt_s(t_frozen), "", fmt_x(t_frozen / t_plain)],
        [
            "floor: + per-sample gradients at autograd's dW cost",
            fmt_s(t_plain - t_frozen),
            "",
            fmt_x((t_plain - t_frozen) / t_plain),
        ],
        [f"floor: + one {n}x{m}x{p / 1e6:.1f}M GEMM", fmt_s(t_gemm), "", fmt_x(t_gemm / t_plain)],
        ["**floor total**", fmt_s(floor), "", fmt_x(floor / t_plain)],
    ]
    mem = [[k, fmt_bytes(v) if "rows" not in k else str(v)] for k, v in timers.mem.items()]
    mem.append(["score matrix", fmt_bytes(n * m * 4)])
    mem.append(["peak RSS of attribute() (above the model and data)", fmt_bytes(peak)])
    return (
        f"### {describe(shape, model)}: {n} train x {m} test (best of {reps} by ratio)\n\n"
        + md_table(["where", "CPU", "share", "/ plain step"], rows)
        + "\n"
        + md_table(["memory", "size"], mem)
    )


# ---- floor table ---------------------------------------------------------------------------------
def run_one(impl: str, spec: str, n: int, m: int, rounds: int, budget: float | None) -> dict:
    shape = shape_of(spec)
    cmd_shape = f"{shape.n_layer},{shape.width},{shape.n_head},{shape.vocab},{shape.seq}"
    args = [
        "--impl",
        impl,
        "--shape",
        cmd_shape,
        "--n",
        str(n),
        "--m",
        str(m),
        "--rounds",
        str(rounds),
    ]
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
            [
                "model",
                "train x test",
                "ours",
                "0.1.0",
                "ours / 0.1.0",
                "peak ours",
                "peak 0.1.0",
                "peak ours / 0.1.0",
                "ours CPU",
                "0.1.0 CPU",
            ],
            table,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="breakdown,floor")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget-gb", type=float, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--shapes", default="4x256,4x512", help="breakdown models")
    p.add_argument("--sizes", default="64x16,256x32", help="breakdown train x test")
    p.add_argument("--reps", type=int, default=3, help="breakdown repetitions (best kept)")
    a = p.parse_args()
    print(
        header(
            "Scoring at scale: breakdown and floor",
            {
                "models": "GPT-2 from GPT2Config (random weights), vocab 1000, seq 64, batch 8; "
                "every layer except wpe captured (both implementations)",
                "timing": "process CPU time (steadier than wall clock under load)",
            },
        )
    )
    parts = a.parts.split(",")
    if "breakdown" in parts:
        sizes = [tuple(int(v) for v in x.split("x")) for x in a.sizes.split(",")]
        shapes = a.shapes.split(",")
        if a.quick:
            shapes, sizes = ["4x256"], [(16, 8)]
        print(part_breakdown(shapes, sizes, 1 if a.quick else a.reps), flush=True)
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
