"""Capture per-rollout gradients from a TRL ``GRPOTrainer`` run, then attribute from disk.

The training code is the stock ``GRPOTrainer``: dattri_llm only adds one callback,
``AttributionCallback``. Each training sample of GRPO is a rollout (prompt + sampled
completion); its stored gradient is that of ``-A_i Σ_t log π(c_it | prompt_i, c_i<t)``, its
advantage times its completion's negative log-likelihood, whatever normaliser TRL's
``loss_type`` divides the batch's loss by. Offline: a tiny GPT-2 built from
a config, a byte-level BPE tokenizer trained on the fly on Python's documentation topics, a
handful of prompts and a programmatic reward (the share of a letter in the completion).

The query is the best-rewarded rollout: its completion's negative log-likelihood gradient at the
final weights (``capture_queries``, labelled with the train checkpoint of those weights) is
attributed to the training rollouts with TracIn from the two gradient stores. Positive scores
mark rollouts whose updates made the query more likely.

As in ``trl_sft.py``, TRL computes log-probabilities with a fused LM head that hooks cannot
see, so ``lm_head`` is left out of the capture and the input embedding is untied from it.

    python examples/trainers/trl_grpo.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dattri_llm import (
    REGISTER_ALL,
    AttributionArguments,
    GradientStorageManager,
    HookManagerConfig,
    TracInAttributor,
    hash_batch,
    hash_sample,
)
from dattri_llm.integrations.hf_trainer import AttributionCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_sft import build_model, build_tokenizer  # noqa: E402  (the sibling example's builders)

#: The tokenizer's training text: a few of Python's documentation topics (standard library).
TOKENIZER_TOPICS = ("debugger", "comparisons", "formatstrings", "import", "try")

PROMPTS = (
    "The debugger stops",
    "A comparison of numbers",
    "The import statement",
    "Format strings use",
    "An exception handler",
    "The module is loaded",
    "Each expression is evaluated",
    "Commands can be abbreviated",
)


def letter_reward(letter: str):
    """A reward function: the share of ``letter`` among the completion's characters."""

    def reward(completions: list[str], **kwargs: object) -> list[float]:
        return [c.count(letter) / max(len(c), 1) for c in completions]

    reward.__name__ = f"share_of_{letter}"
    return reward


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the example; returns what the test checks (paths, rollouts, scores, weights)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--prompts-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=8)
    parser.add_argument("--letter", type=str, default="e", help="the rewarded character")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=str,
        default=None,
        help="Trainer output, stores and scores (default: a temp dir, removed at exit)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dattri_llm_trl_grpo_") as tmp:
        work = Path(args.workdir or tmp)
        kept = "" if args.workdir else " (temporary, removed at exit: --workdir DIR keeps them)"
        print(f"Trainer output, stores and scores go to {work}{kept}")
        return run(args, work)


def run(args: argparse.Namespace, work: Path) -> dict:
    """The example itself; everything is written under ``work``."""
    t0 = time.perf_counter()

    import datasets
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    datasets.disable_progress_bars()
    torch.manual_seed(args.seed)
    n_prompts = args.steps * args.prompts_per_step
    if n_prompts > len(PROMPTS):
        raise ValueError(f"--steps x --prompts-per-step = {n_prompts} > {len(PROMPTS)} prompts")
    from pydoc_data.topics import topics

    tokenizer = build_tokenizer([topics[t] for t in TOKENIZER_TOPICS], 512)
    model = build_model(tokenizer, 64, getattr(torch, args.dtype))
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    for store_dir in ("train_grads", "test_grads"):
        if (work / store_dir).exists():  # a store appends: a second run would mix in the first
            raise FileExistsError(f"--workdir {work} already holds {store_dir}; pass a new one.")
    reward = letter_reward(args.letter)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(
            output_dir=str(work / "run"),
            per_device_train_batch_size=args.prompts_per_step * args.num_generations,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            max_steps=args.steps,
            learning_rate=args.lr,
            seed=args.seed,
            bf16=False,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_dict({"prompt": list(PROMPTS[:n_prompts])}),
        processing_class=tokenizer,
    )

    # only to print the rollouts' text below (dattri_llm identifies them by content hash):
    # remember the model inputs of every forward that will be differentiated
    rollouts: dict[str, dict] = {}

    def remember(module: torch.nn.Module, args_: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")  # GRPO's loss forward: labels mark the completion tokens
        if torch.is_grad_enabled() and labels is not None:
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            for h, i, m, lab in zip(hash_batch({"input_ids": ids}), ids, mask, labels):
                completion = tokenizer.decode(i[lab != -100], skip_special_tokens=True)
                rollouts[h] = {
                    "input_ids": i.clone(),
                    "attention_mask": m.clone(),
                    "completion_mask": lab != -100,  # GRPO scores the completion tokens only
                    "prompt": tokenizer.decode(i[(m == 1) & (lab == -100)]),
                    "completion": completion,
                    "reward": reward([completion])[0],
                }

    handle = model.register_forward_pre_hook(remember, with_kwargs=True)

    # (1) attach one callback: per-rollout gradients of -A_i x log pi(completion_i | prompt_i)
    #     go to disk as it trains, one checkpoint label per epoch
    capture = AttributionCallback(
        work / "train_grads", config=HookManagerConfig(linear_io=REGISTER_ALL, exclude=[r"lm_head"])
    )
    trainer.add_callback(capture)
    trainer.train()
    handle.remove()
    train_store = GradientStorageManager(str(work / "train_grads"))

    # (2) the query: the best-rewarded rollout's completion log-likelihood gradient at the final
    #     weights, labelled with the train label that stands for them
    train_hashes = train_store.sample_hashes()
    best = max(train_hashes, key=lambda h: rollouts[h]["reward"])
    q = rollouts[best]
    query = {
        "input_ids": q["input_ids"],
        "attention_mask": q["attention_mask"],
        "labels": q["input_ids"].masked_fill(~q["completion_mask"], -100),
    }
    capture.capture_queries(model, [query], work / "test_grads")

    # (3) attribute from the cache: no model needed
    score = TracInAttributor(
        AttributionArguments(output_dir=str(work / "scores"), show_progress=False)
    ).attribute_from_cache(str(work / "train_grads"), str(work / "test_grads"))
    scores = score.query(train_hashes)[:, 0]
    print(f"query (reward {q['reward']:.2f}): {q['prompt']!r} -> {q['completion']!r}")
    order = scores.argsort(descending=True)
    for k in order[:3].tolist():
        r = rollouts[train_hashes[k]]
        print(
            f"  proponent {scores[k]:+.2e} (reward {r['reward']:.2f}): "
            f"{r['prompt']!r} -> {r['completion']!r}"
        )
    seconds = time.perf_counter() - t0
    print(
        f"{len(train_store)} offloaded steps, {train_store.num_samples} per-rollout gradients "
        f"({len(train_hashes)} distinct rollouts); {seconds:.1f} s"
    )
    return {
        "workdir": str(work),
        "train_dir": str(work / "train_grads"),
        "test_dir": str(work / "test_grads"),
        "rollouts": rollouts,
        "train_hashes": train_hashes,
        "query_hash": best,
        "query": query,
        "query_store_hash": hash_sample(query),
        "scores": scores,
        "initial_state": initial_state,
        "model_config": model.config,
        "tokenizer": tokenizer,
        "reward": reward,
        "num_generations": args.num_generations,
        "steps": args.steps,
        "batch_size": args.prompts_per_step * args.num_generations,
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
