"""``dattri-llm attribute``: score two gradient stores with any attributor that reads a store.

The methods are the :data:`METHODS` registry: a CLI name mapped to a :class:`Method`, whose
factory builds the library's attributor. Adding a method is one entry, e.g.::

    Method("less", "LESS: ...", attributor("LESSAttributor")),

(``attributor(name, **kwargs)`` builds ``dattri_llm.<name>(args, **kwargs)`` lazily; pass
``call_kwargs=`` for options of its ``attribute_from_cache`` call).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dattri_llm.cli._common import (
    RUN_FILE,
    HelpFormatter,
    UsageError,
    add_progress_flag,
    open_store,
    select_layers,
    show_progress,
)

__all__ = ["Method", "METHODS", "attributor", "RUN_FILE"]


Factory = Callable[[argparse.Namespace, Any], Any]


def attributor(name: str, **kwargs: Any) -> Factory:
    """A factory of ``dattri_llm.<name>(args, **kwargs)``, imported when the command runs.

    ``--repeats`` is passed as ``repeats=`` (``None``: the method's default).
    """

    def build(ns: argparse.Namespace, args: Any) -> Any:
        import dattri_llm

        return getattr(dattri_llm, name)(args, repeats=ns.repeats, **kwargs)

    return build


@dataclass(frozen=True)
class Method:
    """One ``--method`` of ``dattri-llm attribute``.

    Attributes:
        name: The CLI name.
        help: One line for ``--help``.
        factory: ``factory(namespace, AttributionArguments) -> attributor``.
        last_checkpoint: Score only the train store's last checkpoint label unless
            ``--checkpoints`` is given (single-checkpoint methods such as Grad-Dot).
        damping: Takes ``--damping`` / ``--relative-damping`` (passed to the call).
        non_kronecker: Takes ``--non-kronecker`` (its factory reads it).
        call_kwargs: Extra keyword arguments of ``attribute_from_cache`` from the namespace.
        sums_repeats: Takes ``--repeats sum`` only (a trajectory method: a sample's rows are
            the parts of one removal's effect).
    """

    name: str
    help: str
    factory: Factory
    last_checkpoint: bool = False
    damping: bool = False
    non_kronecker: bool = False
    call_kwargs: Callable[[argparse.Namespace], dict] | None = None
    sums_repeats: bool = False


def _registry(*methods: Method) -> dict[str, Method]:
    return {m.name: m for m in methods}


#: The methods, by CLI name (see the module docstring to add one).
METHODS: dict[str, Method] = _registry(
    Method(
        "tracin",
        "TracIn: gradient dot products summed over every stored checkpoint",
        attributor("TracInAttributor"),
    ),
    Method(
        "grad-dot",
        "Grad-Dot: gradient dot products at one checkpoint (the last, by default)",
        attributor("TracInAttributor"),
        last_checkpoint=True,
    ),
    Method(
        "grad-cos",
        "Grad-Cos: gradient cosines at one checkpoint (the last, by default)",
        attributor("TracInAttributor", normalized_grad=True),
        last_checkpoint=True,
    ),
    Method(
        "kfac",
        "K-FAC influence, fitted from the train store",
        lambda ns, args: _kronecker("KFACAttributor", ns, args),
        damping=True,
        non_kronecker=True,
    ),
    Method(
        "ekfac",
        "EK-FAC influence, fitted from the train store",
        lambda ns, args: _kronecker("EKFACAttributor", ns, args),
        damping=True,
        non_kronecker=True,
    ),
    Method(
        "projected-fisher",
        "each layer's exact Fisher in its captured (projected) space, fitted from the train store",
        attributor("ProjectedFisherAttributor"),
        damping=True,
    ),
    Method(
        "less",
        "LESS: cosines of preconditioned train gradients with raw queries, weighted by lr",
        attributor("LESSAttributor"),
        call_kwargs=lambda ns: {"learning_rates": ns.learning_rate, "pair_by": ns.pair_by},
    ),
    Method(
        "adamw-influence",
        "AdamW-influence: unrolled through the recorded Adam/AdamW run (needs --dynamics)",
        lambda ns, args: _trajectory("AdamWInfluenceAttributor", ns, args),
        call_kwargs=lambda ns: {"dynamics": _need(ns.dynamics, "--dynamics")},
        sums_repeats=True,
    ),
    Method(
        "dvemb",
        "DVEmb: data value embeddings of an SGD run (needs --learning-rate or --dynamics)",
        lambda ns, args: _trajectory("DVEmbAttributor", ns, args),
        call_kwargs=lambda ns: {
            "learning_rate": ns.learning_rate,
            "dynamics": _need(ns.dynamics, "--dynamics or --learning-rate")
            if ns.learning_rate is None
            else ns.dynamics,
        },
        sums_repeats=True,
    ),
)


def _kronecker(name: str, ns: argparse.Namespace, args: Any) -> Any:
    import dattri_llm

    return getattr(dattri_llm, name)(
        args, non_kronecker=ns.non_kronecker or "skip", repeats=ns.repeats
    )


def _trajectory(name: str, ns: argparse.Namespace, args: Any) -> Any:
    import dattri_llm

    return getattr(dattri_llm, name)(args, loss_reduction=ns.loss_reduction, repeats=ns.repeats)


def _need(value: Any, flag: str) -> Any:
    if value is None:
        raise UsageError(flag.split()[0], f"this method needs {flag}.")
    return value


DESCRIPTION = """Score every (training sample, query) pair from two gradient stores (no model
needed) and write an AttributionScore to --out (scores.safetensors + scores.json, plus
attribution_run.json with the settings and the run's warnings). A positive score means the
training sample helped the query (training on it lowered the query's loss). A training sample
stored several times under one checkpoint label (epochs captured under one label, duplicates)
has its rows combined by the method's repeats rule: the mean for grad-cos (a cosine stays a
cosine), the sum for the others (--repeats chooses).

methods:
"""


def add_parser(sub: Any) -> None:
    """Register the command."""
    methods = "\n".join(f"  {m.name:<10} {m.help}" for m in METHODS.values())
    p = sub.add_parser(
        "attribute",
        help="score two gradient stores with an attribution method",
        description=DESCRIPTION + methods,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--method",
        required=True,
        choices=list(METHODS),
        metavar="METHOD",
        help=f"attribution method: {', '.join(METHODS)} (see above)",
    )
    p.add_argument(
        "--train", required=True, metavar="STORE", help="gradient store of the train set"
    )
    p.add_argument("--test", required=True, metavar="STORE", help="gradient store of the queries")
    p.add_argument("--out", required=True, metavar="DIR", help="where the scores are written")
    p.add_argument(
        "--damping",
        type=float,
        default=None,
        help="kfac/ekfac/projected-fisher: absolute damping (default: 0.1 x mean eigenvalue)",
    )
    p.add_argument(
        "--relative-damping",
        action="store_true",
        help="kfac/ekfac/projected-fisher: --damping is a factor of the mean eigenvalue",
    )
    p.add_argument(
        "--checkpoints",
        type=int,
        nargs="+",
        metavar="C",
        default=None,
        help="score only records with these checkpoint labels (default: all; for grad-dot and "
        "grad-cos the train store's last)",
    )
    p.add_argument(
        "--layers",
        nargs="+",
        metavar="PATTERN",
        help="score only these layers: shell globs matched against whole layer names "
        "(fnmatch; a plain name is itself), e.g. 'transformer.h.1.*' (block 1, not 10 or "
        "11); a pattern that matches no layer is refused; the scored names are recorded in "
        "attribution_run.json",
    )
    p.add_argument(
        "--non-kronecker",
        choices=("skip", "diagonal"),
        default=None,
        help="kfac/ekfac: layers without a Kronecker form (embeddings, norms): 'skip' leaves "
        "them out of the scores, 'diagonal' preconditions them with a diagonal Fisher "
        "(default: skip)",
    )
    p.add_argument(
        "--granularity",
        choices=("sample", "token"),
        default="sample",
        help="token: also split each score over the train sample's token positions",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        metavar="K",
        help="also print the K top proponents and opponents of each query (0: none)",
    )
    p.add_argument(
        "--dynamics",
        metavar="DIR",
        default=None,
        help="adamw-influence, dvemb: the trajectory directory OptimizerStateCallback wrote",
    )
    p.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        metavar="LR",
        help="less: one weight for every step (default: the recorded learning rates); dvemb: "
        "the constant learning rate (default: the recorded ones, --dynamics)",
    )
    p.add_argument(
        "--loss-reduction",
        choices=("sum", "mean"),
        default=None,
        help="adamw-influence, dvemb: how the training loss combined each batch (default: what "
        "the store recorded, OffloadCallback(loss_reduction=...); recorded nowhere, it must be "
        "given here)",
    )
    p.add_argument(
        "--pair-by",
        choices=("checkpoint", "step"),
        default="checkpoint",
        help="less: pair train and query gradients by checkpoint label or by step",
    )
    p.add_argument(
        "--repeats",
        choices=("sum", "mean"),
        default=None,
        help="how a training sample's rows under one checkpoint label combine (default: the "
        "method's: mean for grad-cos, sum for the others; adamw-influence and dvemb: sum only)",
    )
    p.add_argument("--cpu", action="store_true", help="compute on the CPU even with a GPU")
    p.add_argument(
        "--block-size", type=int, default=1024, help="train rows and queries scored per block"
    )
    add_progress_flag(p)
    p.set_defaults(run=run)


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError("--out", f"{out!r} exists and is not a directory.")
    if os.path.isdir(out):
        names = set(os.listdir(out))
        if names and "scores.json" not in names:
            raise UsageError(
                "--out",
                f"{out!r} exists and holds other files ({sorted(names)[:3]}); pass a new "
                "directory or one written by dattri-llm attribute.",
            )


def run(args: argparse.Namespace) -> int:
    """Run the command."""
    from dattri_llm import AttributionArguments, __version__

    method = METHODS[args.method]
    if not method.damping and (args.damping is not None or args.relative_damping):
        flag = "--damping" if args.damping is not None else "--relative-damping"
        takes = ", ".join(m.name for m in METHODS.values() if m.damping)
        raise UsageError(flag, f"--method {method.name} takes no damping (only {takes} do).")
    if not method.non_kronecker and args.non_kronecker is not None:
        takes = ", ".join(m.name for m in METHODS.values() if m.non_kronecker)
        raise UsageError("--non-kronecker", f"only {takes} take it, not --method {method.name}.")
    if args.damping is not None and args.damping < 0:
        raise UsageError("--damping", f"must be >= 0, got {args.damping}.")
    if args.relative_damping and args.damping is None:
        raise UsageError("--relative-damping", "needs --damping (the factor).")
    if args.top_k < 0:
        raise UsageError("--top-k", f"must be >= 0, got {args.top_k}.")
    if args.repeats == "mean" and method.sums_repeats:
        raise UsageError(
            "--repeats",
            f"--method {method.name} sums a sample's rows (one per step it trained at: the "
            "parts of one removal's effect); pass --repeats sum or leave it out.",
        )
    if args.block_size < 1:
        raise UsageError("--block-size", f"must be >= 1, got {args.block_size}.")
    _check_out(args.out)
    train = open_store(args.train, "--train")
    test = open_store(args.test, "--test")
    checkpoints = args.checkpoints
    for name, store in (("--train", train), ("--test", test)):
        if checkpoints is not None:
            missing = sorted(set(checkpoints) - set(store.available_checkpoints()))
            if missing:
                raise UsageError(
                    "--checkpoints",
                    f"{missing} not in {name} {store.save_dir} (it holds checkpoint labels "
                    f"{store.available_checkpoints()}).",
                )
    layers = None
    if args.layers:
        layers = select_layers(args.layers, train.layer_names, f"--train {train.save_dir}")
        missing = [n for n in layers if n not in test.layer_names]
        if missing:
            raise UsageError(
                "--layers", f"{missing} not in --test {test.save_dir}: it holds "
                f"{test.layer_names}."
            )  # fmt: skip
    if checkpoints is None and method.last_checkpoint and len(train.available_checkpoints()) > 1:
        last = train.available_checkpoints()[-1]
        if last not in test.available_checkpoints():
            raise UsageError(
                "--checkpoints",
                f"--method {method.name} scores one checkpoint: the train store holds labels "
                f"{train.available_checkpoints()} and the test store "
                f"{test.available_checkpoints()}; choose one that both hold.",
            )
        checkpoints = [last]
    progress = show_progress(args)
    run_args = AttributionArguments(
        output_dir=args.out,
        use_cpu=args.cpu,
        score_block_size=args.block_size,
        show_progress=progress,
    )
    kwargs: dict[str, Any] = {}
    if method.damping and args.damping is not None:
        kwargs["damping"] = args.damping
        kwargs["relative"] = bool(args.relative_damping)
    if method.call_kwargs is not None:
        kwargs.update(method.call_kwargs(args))
    t0 = time.perf_counter()
    score = method.factory(args, run_args).attribute_from_cache(
        train, test, args.granularity, layers, checkpoints=checkpoints, **kwargs
    )
    seconds = time.perf_counter() - t0
    score.save(args.out)
    settings = {
        "method": method.name,
        "train store": os.path.abspath(args.train),
        "test store": os.path.abspath(args.test),
        "checkpoints": "all" if checkpoints is None else checkpoints,
        # the names actually scored, never the patterns: a report shows what was scored
        "layers": layers if layers is not None else list(train.layer_names),
        "granularity": args.granularity,
        "repeats": score.repeats,
        "seconds": round(seconds, 3),
        "dattri_llm": __version__,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if method.non_kronecker:
        settings["non-kronecker layers"] = args.non_kronecker or "skip"
    if method.damping:
        settings["damping"] = (
            "default (0.1 x mean eigenvalue)"
            if args.damping is None
            else f"{args.damping:g}" + (" x mean eigenvalue" if args.relative_damping else "")
        )
    settings["warnings"] = score.warnings
    with open(os.path.join(args.out, RUN_FILE), "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=1)
    ids, _ = score.agnostic_matrix()
    print(
        f"{method.name}: {len(ids)} training samples x {score.num_test} queries "
        f"({len(score.train_hashes)} rows over steps {score.steps[:8]}"
        f"{'...' if len(score.steps) > 8 else ''}) in {seconds:.1f} s -> {args.out}",
        file=sys.stdout,
    )
    if args.top_k:
        from dattri_llm.cli.top import print_top

        print_top(score, k=args.top_k, texts={}, queries=None)
    return 0
