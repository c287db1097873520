"""Tiny random Qwen3.5-hybrid model directories for tests (no download, a few hundred KB each).

`write_tiny_model(path, seed=0, **overrides)` writes config.json, safetensors (single or sharded),
tokenizer.json and generation_config.json, in the text-only or the real nested layout, with an MTP head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TOKENIZER_TEXT = (
    "def main():\n    return 0\n\nclass Foo:\n    pass\n\nimport os\nfor i in range(10):\n    print(i)\n"
    "The quick brown fox jumps over the lazy dog. It was the best of times, it was the worst of times.\n"
)

BASE_CONFIG: dict[str, Any] = {
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "mtp_num_hidden_layers": 1,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "eos_token_id": 0,
    "bos_token_id": 0,
}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    tok.save(str(path))


def _layer_tensors(prefix: str, cfg: dict[str, Any], kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]

    def lin(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * (gain * cols**-0.5)

    def znorm(n: int) -> torch.Tensor:  # zero-centred norm weight: small values around 0
        return torch.randn(n, generator=g) * 0.1

    t = {
        "input_layernorm.weight": znorm(h),
        "post_attention_layernorm.weight": znorm(h),
        "mlp.gate_proj.weight": lin(inter, h),
        "mlp.up_proj.weight": lin(inter, h),
        "mlp.down_proj.weight": lin(h, inter, 0.5),
    }
    if kind == "full_attention":
        d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        t |= {
            "self_attn.q_proj.weight": lin(nq * d * 2, h),
            "self_attn.k_proj.weight": lin(nkv * d, h),
            "self_attn.v_proj.weight": lin(nkv * d, h),
            "self_attn.o_proj.weight": lin(h, nq * d, 0.5),
            "self_attn.q_norm.weight": znorm(d),
            "self_attn.k_norm.weight": znorm(d),
        }
    else:
        hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        conv_dim = 2 * hk * dk + hv * dv
        t |= {
            "linear_attn.in_proj_qkv.weight": lin(conv_dim, h),
            "linear_attn.in_proj_z.weight": lin(hv * dv, h),
            "linear_attn.in_proj_b.weight": lin(hv, h),
            "linear_attn.in_proj_a.weight": lin(hv, h),
            "linear_attn.conv1d.weight": torch.randn(conv_dim, 1, cfg["linear_conv_kernel_dim"], generator=g) * 0.5,
            "linear_attn.A_log": torch.log(torch.rand(hv, generator=g) * 8 + 0.5),
            "linear_attn.dt_bias": torch.randn(hv, generator=g) * 0.5,
            "linear_attn.norm.weight": 1.0 + torch.randn(dv, generator=g) * 0.1,
            "linear_attn.out_proj.weight": lin(h, hv * dv, 0.5),
        }
    return {prefix + k: v for k, v in t.items()}


def make_tensors(cfg: dict[str, Any], seed: int, nested: bool, with_mtp: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    base = "model.language_model." if nested else "model."
    out = {base + "embed_tokens.weight": torch.randn(vocab, h, generator=g) * 0.5}
    for i, kind in enumerate(cfg["layer_types"]):
        out |= _layer_tensors(f"{base}layers.{i}.", cfg, kind, g)
    out[base + "norm.weight"] = torch.randn(h, generator=g) * 0.1
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = torch.randn(vocab, h, generator=g) * (h**-0.5)
    if with_mtp and cfg.get("mtp_num_hidden_layers", 0):
        out |= _layer_tensors("mtp.layers.0.", cfg, "full_attention", g)
        out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * ((2 * h) ** -0.5)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{name}.weight"] = torch.randn(h, generator=g) * 0.1
    if nested:
        out["model.visual.patch_embed.proj.weight"] = torch.randn(4, 4, generator=g)
    return out


def write_tiny_model(
    path: Path | str,
    seed: int = 0,
    nested: bool = False,
    shards: int = 1,
    with_mtp: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random model directory; config fields may be overridden (e.g. layer_types=...)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(BASE_CONFIG)) | overrides
    cfg["num_hidden_layers"] = len(cfg["layer_types"])
    tensors = make_tensors(cfg, seed, nested, with_mtp)
    if nested:
        config = {
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": cfg["tie_word_embeddings"],
            "text_config": cfg | {"model_type": "qwen3_5_text"},
            "vision_config": {"depth": 1},
        }
    else:
        config = cfg | {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    names = sorted(tensors)
    if shards <= 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k].contiguous() for k in part}, str(path / fname))
            weight_map |= {k: fname for k in part}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_tokenizer(path / "tokenizer.json", min(cfg["vocab_size"], 300))
    return path
