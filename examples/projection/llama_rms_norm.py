"""Hugging Face norm layers with capture-time projection, checked against autograd.

The recipe of docs/guides/capturing.md, "Layers and model families": a Llama's final
``LlamaRMSNorm`` is declared as an ``nn.RMSNorm`` with ``layer_types`` +
``rms_norm_module_kwargs`` and captured unprojected, with a ``"dense"`` and a ``"mask"``
projection; every per-sample gradient is compared with autograd
(one backward per sample) projected with the same matrices. ``"logra"`` is refused on the norm
and used on the linear layers instead (a dict projection), where it stays factorised.

Run (CPU, a few seconds; needs the transformers and attribution extras)::

    OMP_NUM_THREADS=1 python examples/projection/llama_rms_norm.py
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from dattri_llm import CaptureCallback, HookManager, HookManagerConfig, ProjectionConfig
from dattri_llm.gradient import ops
from dattri_llm.utils.module import rms_norm_module_kwargs


def causal_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss summed over tokens and samples (so each sample's share is its own)."""
    logits = model(input_ids=ids).logits[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
    )


def capture(model: nn.Module, ids: torch.Tensor, config: HookManagerConfig):
    cb = CaptureCallback()
    hm = HookManager(model, config=config, callbacks=[cb])
    with hm.collect():
        causal_loss(model, ids).backward()
    hm.remove()
    model.zero_grad(set_to_none=True)
    return cb.pop().gradient, hm


def autograd_per_sample(model: nn.Module, ids: torch.Tensor, names: list[str]) -> dict:
    """``{param name: (B, *shape)}``: one backward per sample."""
    out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    params = dict(model.named_parameters())
    for row in ids:
        model.zero_grad(set_to_none=True)
        causal_loss(model, row[None]).backward()
        for n in names:
            out[n].append(params[n].grad.detach().clone())
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def rel(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max() / y.abs().max())


def main() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attn_implementation="eager",
        )
    ).double()
    norm = model.model.norm  # a LlamaRMSNorm
    with torch.no_grad():
        norm.weight.add_(0.2 * torch.randn_like(norm.weight))
    ids = torch.randint(0, 64, (4, 12))

    def recipe(projection: object) -> HookManagerConfig:
        return HookManagerConfig(
            hook_types={"model.norm": "linear_io"},
            layer_types={"model.norm": "nn.RMSNorm"},  # what the layer is
            module_kwargs={
                "model.norm": rms_norm_module_kwargs(
                    normalized_shape=norm.weight.shape[0], eps=norm.variance_epsilon
                )
            },
            projection=projection,
        )

    ref = autograd_per_sample(model, ids, ["model.norm.weight"])["model.norm.weight"]
    print("LlamaRMSNorm (model.norm), per-sample gradients vs autograd (max rel. error; the")
    print("module normalises in float32 internally, so ~1e-7 is exact agreement in float64):")
    for proj in (
        None,
        ProjectionConfig("dense", proj_dim=16, seed=0),
        ProjectionConfig("mask", proj_dim=16, seed=0),
    ):
        grad, hm = capture(model, ids, recipe(proj))
        layer = grad.layers["model.norm"]
        if proj is None:
            want = ref
        else:  # the same matrices, regenerated from the seed
            mats = hm.projection["model.norm"].matrices(ref.dtype)
            want = ref @ mats["matrix"] if proj.style == "dense" else ref[:, mats["indices"]]
        gram = ops.pairwise_dot(grad)
        assert rel(gram, want @ want.T) < 1e-6, proj
        print(
            f"  {proj.style if proj else 'exact':6s} {layer.layer_type:16s} "
            f"grad {rel(layer.materialize().data, want):.1e}  gram {rel(gram, want @ want.T):.1e}"
        )
    try:
        HookManager(model, recipe(ProjectionConfig("logra", proj_dim=16)))
    except ValueError as e:
        print(f"  logra on the norm is refused: {str(e)[:90]}...")

    # logra on the linear layers (factorised, never materialised), the mask on the norm
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    config = HookManagerConfig(
        linear_io=linears,
        hook_types={"model.norm": "linear_io"},
        layer_types={"model.norm": "nn.RMSNorm"},
        module_kwargs={"model.norm": rms_norm_module_kwargs(32, eps=norm.variance_epsilon)},
        projection={
            "model.norm": ProjectionConfig("mask", proj_dim=16),
            ".*": ProjectionConfig("logra", proj_dim=64, seed=1),
        },
    )
    grad, hm = capture(model, ids, config)
    names = [f"{n}.weight" for n in linears] + ["model.norm.weight"]
    ref = autograd_per_sample(model, ids, names)
    flat = []
    for n in [*linears, "model.norm"]:
        m = hm.projection[n].matrices(torch.float64)
        g = ref[f"{n}.weight"]
        if "row" in m:  # R^T G C in the projected (8 x 8) space
            flat.append((m["row"].T @ g @ m["col"]).flatten(1))
        else:
            flat.append(g[:, m["indices"]])
    want = torch.cat(flat, 1)
    err = rel(ops.pairwise_dot(grad, mode="factorized"), want @ want.T)
    assert err < 1e-6, err
    print(
        f"dict projection (logra on {len(linears)} linear layers + mask on the norm): "
        f"{grad.nbytes / ids.shape[0]:.0f} bytes per sample; Gram vs autograd "
        f"{err:.1e}"
    )


if __name__ == "__main__":
    main()
