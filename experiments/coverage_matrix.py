"""The model matrix: what ``HookManagerConfig(linear_io=REGISTER_ALL)`` captures, per family.

For each Hugging Face family (and LoRA / QLoRA variants) the script builds the tiny model the
tests use (``tests/helpers/hf_families.py``), runs one captured step (a parameter found used outside
its module at the step counts as left out), and prints ``HookManager.coverage()``; for the base
families it also builds transformers' *default* config (the released size: Llama-2-7B,
Mixtral-8x7B, ...) on the ``meta`` device (no memory) and prints the coverage there, where a
mixture-of-experts model's experts are most of the parameters. The last column names the test
that proves the captured gradients exact.

    OMP_NUM_THREADS=1 python -m experiments.coverage_matrix [--json]

Fused MoE experts and routers are captured by ``gradient/layers/moe.py`` (exact in float64 with
the eager expert kernels: ``tests/gradient/layers/test_moe.py``).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dattri_llm import REGISTER_ALL, HookManager, HookManagerConfig
from tests.helpers.hf_families import FAMILIES, MOE_FAMILIES, build

HF = "tests/gradient/layers/test_hf_classes.py::"
LORA = "tests/gradient/layers/test_lora.py::"
TESTS = {
    "gpt2": "tests/gradient/test_models.py::test_gpt2_default_capture_matches_torch_func",
    **{f: f"{HF}test_dense_family_captures_every_parameter_exactly[{f}]" for f in FAMILIES},
    **{
        f: f"{HF}test_moe_family_captures_every_parameter_exactly[{f}] (float32); "
        "tests/gradient/layers/test_moe.py (float64)"
        for f in MOE_FAMILIES
    },
    "gpt2+lora": f"{LORA}test_gpt2_lora_on_fused_c_attn_is_exact",
    "llama+lora": f"{LORA}test_llama_lora_on_q_and_v_is_exact",
    "llama+qlora": f"{LORA}test_qlora_4bit_base_frozen_adapters_exact",
    "mixtral+lora": f"{LORA}test_moe_expert_adapters_via_target_parameters_are_reported_"
    "not_captured",
}


def _lora(model: nn.Module, **config: Any) -> nn.Module:
    import peft

    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, **config)
    return peft.get_peft_model(model, cfg).eval()


def _qlora() -> nn.Module:
    import tempfile

    import peft
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, attn_implementation="eager")  # fmt: skip
    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                            bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:  # from_pretrained reads it fully
        transformers.LlamaForCausalLM(cfg).save_pretrained(tmp)
        model = transformers.LlamaForCausalLM.from_pretrained(
            tmp, quantization_config=quant, device_map="cpu", dtype=torch.float32
        )
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return _lora(model, target_modules=["q_proj", "v_proj"])


def variants() -> dict[str, Callable[[], nn.Module]]:
    """``{row: builder}`` of every model in the matrix (float32, eval mode)."""
    rows: dict[str, Callable[[], nn.Module]] = {
        f: (lambda f=f: build(f, torch.float32)) for f in ("gpt2", *FAMILIES)
    }
    rows["gpt2+lora"] = lambda: _lora(
        build("gpt2", torch.float32), target_modules=["c_attn"], fan_in_fan_out=True
    )
    rows["llama+lora"] = lambda: _lora(
        build("llama", torch.float32), target_modules=["q_proj", "v_proj"]
    )
    rows["mixtral+lora"] = lambda: _lora(
        build("mixtral", torch.float32),
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.down_proj"],
    )
    rows["llama+qlora"] = _qlora
    return rows


def _summary(names: tuple[str, ...]) -> str:
    """Left-out parameter names grouped by their last two segments (``experts.down_proj``)."""
    kinds: dict[str, int] = {}
    for n in names:
        parts = [s for s in n.split(".") if s not in ("weight", "default")]
        key = ".".join(parts[-2:])
        kinds[key] = kinds.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in kinds.items()) or "-"


def measure(model: nn.Module, step: bool = True) -> dict[str, Any]:
    """Coverage of ``REGISTER_ALL`` on ``model``, after one captured step when ``step``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the matrix reports what the warnings name
        hm = HookManager(model, HookManagerConfig(linear_io=REGISTER_ALL))
        status = "not run"
        if step:
            ids = torch.randint(1, 37, (2, 6))
            try:
                with hm.collect():
                    model(input_ids=ids).logits.float().pow(2).mean().backward()
                status = "ok"
            except RuntimeError as err:  # Qwen2-MoE's shared expert sees (B*T, H) rows
                what = "flattened token rows" if "rows in one step" in str(err) else str(err)
                status = f"the step is refused ({what[:60]})"
        cov = hm.coverage()
        hm.remove()
    return {
        "parameters": cov.total,
        "coverage": cov.fraction,
        "left_out": _summary(cov.left_out),
        "step": status,
    }


def released(family: str) -> dict[str, Any] | None:
    """Coverage at transformers' default config of ``family``, built on the meta device."""
    import transformers

    if family == "gpt2":
        cfg, cls = transformers.GPT2Config(), transformers.GPT2LMHeadModel
    elif family in FAMILIES:
        cfg_name, model_name, _ = FAMILIES[family]
        cfg, cls = getattr(transformers, cfg_name)(), getattr(transformers, model_name)
    else:
        return None
    with torch.device("meta"):
        model = cls(cfg)
    return measure(model, step=False)


def main() -> None:
    """Print the matrix (markdown, or JSON with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, make in variants().items():
        try:
            model = make()
        except ImportError as err:  # peft / bitsandbytes missing
            rows.append({"model": name, "step": f"skipped: {err}"})
            continue
        row = {"model": name, **measure(model)}
        big = released(name)
        if big is not None:
            row["released_parameters"] = big["parameters"]
            row["released_coverage"] = big["coverage"]
        row["test"] = TESTS[name]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | tiny: coverage (params) | default config: coverage (params) | left out |"
          " exactness test |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in rows:
        if "coverage" not in r:
            print(f"| {r['model']} | {r['step']} | | | |")
            continue
        tiny = f"{r['coverage']:.1%} ({r['parameters']:,})"
        big = (
            f"{r['released_coverage']:.1%} ({r['released_parameters'] / 1e9:.2f} B)"
            if "released_coverage" in r
            else "-"
        )
        left = r["left_out"] + ("" if r["step"] == "ok" else f"; {r['step']}")
        print(f"| {r['model']} | {tiny} | {big} | {left} | `{r['test']}` |")


if __name__ == "__main__":
    main()
