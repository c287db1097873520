"""Model side of the default-model training: config, the MTP head (plain torch), losses, export and checks.

MTP semantics (the engine implements the same; tensor names are those of the real Qwen3.5 checkpoints):
  weights  mtp.fc.weight [H, 2H], mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight [H],
           mtp.norm.weight [H] (zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32),
           mtp.layers.0.* = one full-attention Qwen3.5 decoder layer (same names as a target layer).
  row r    (r = 0..T-2) e = pre_fc_norm_embedding(embed(tok[r+1])); hn = pre_fc_norm_hidden(h[r]) with h[r] the
           target's hidden state AFTER its final norm at position r; x = fc(cat([e, hn], -1)) (embedding first);
           x = layer(x) with causal attention over rows 0..r and RoPE position r; y = mtp.norm(x);
           logits = lm_head(y) (the target's, tied to embed_tokens) predict tok[r+2].
  chained  a second draft step takes y (after mtp.norm) as its hidden and the token it drafted: row r of the
           chained pass is x = fc(cat([norm_e(embed(tok[r+2])), norm_h(y[r])])) at RoPE position r+1, attending
           to the first pass's keys/values of rows 0..r and to itself (what the engine's MTP KV cache holds at
           that point); it predicts tok[r+3]. Training uses it as an extra, smaller loss; the weights and the
           single-step semantics above are unchanged by it.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FULL = "full_attention"
LINEAR = "linear_attention"
SHARD_LIMIT_BYTES = 15 * 1024 * 1024
EOS_ID = 0
BOS_ID = 0


# ----------------------------------------------------------------------------------------------------------- config
def config_dict(
    vocab_size: int,
    hidden_size: int = 384,
    layer_types: tuple[str, ...] = (LINEAR, LINEAR, FULL, LINEAR, LINEAR, FULL),
    intermediate_size: int = 1024,
    num_attention_heads: int = 6,
    num_key_value_heads: int = 2,
    head_dim: int = 64,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_key_head_dim: int = 64,
    linear_value_head_dim: int = 64,
    linear_conv_kernel_dim: int = 4,
    rope_theta: float = 10000.0,
    partial_rotary_factor: float = 0.25,
    max_position_embeddings: int = 4096,
    rms_norm_eps: float = 1e-6,
) -> dict:
    """The text-only config.json (also the kwargs of transformers' Qwen3_5TextConfig)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layer_types),
        "layer_types": list(layer_types),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": linear_num_key_heads,
        "linear_num_value_heads": linear_num_value_heads,
        "linear_key_head_dim": linear_key_head_dim,
        "linear_value_head_dim": linear_value_head_dim,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "tie_word_embeddings": True,
        "max_position_embeddings": max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(rope_theta),
            "partial_rotary_factor": float(partial_rotary_factor),
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "bfloat16",
    }


def hf_config(cfg: dict):
    from transformers import Qwen3_5TextConfig

    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype", "transformers_version")}
    kwargs["use_cache"] = False
    return Qwen3_5TextConfig(**kwargs)


def build_target(cfg: dict, seed: int):
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(cfg))
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("lm_head must be tied to embed_tokens")
    return model


# -------------------------------------------------------------------------------------------------------- MTP head
def rope_cos_sin(positions: torch.Tensor, head_dim: int, partial: float, theta: float, dtype) -> tuple:
    """cos, sin [T, rot] for plain (text-only) partial NeoX RoPE, computed in fp32."""
    rot = int(head_dim * partial)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot, 2, dtype=torch.float32, device=positions.device) / rot))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; rotates the first cos.shape[-1] dims."""
    rot = cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    xr = xr * cos + _rotate_half(xr) * sin
    return torch.cat([xr, xp], dim=-1)


def chain_mask(T: int, device) -> torch.Tensor:
    """[T, 2T] bool, True = attend: row r sees first-pass rows 0..r and chained row r."""
    idx = torch.arange(T, device=device)
    first = idx[None, :] <= idx[:, None]
    second = idx[None, :] == idx[:, None]
    return torch.cat([first, second], dim=1)


class MTPHead(nn.Module):
    """One MTP layer with the real checkpoint's parameter names (under the `mtp.` prefix)."""

    def __init__(self, hf_cfg):
        super().__init__()
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        H = hf_cfg.hidden_size
        eps = hf_cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(H, eps=eps)
        self.norm = Qwen3_5RMSNorm(H, eps=eps)
        full_idx = list(hf_cfg.layer_types).index(FULL)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(hf_cfg, full_idx)])
        self.head_dim = hf_cfg.head_dim
        self.n_heads = hf_cfg.num_attention_heads
        self.n_kv = hf_cfg.num_key_value_heads
        self.partial = hf_cfg.rope_parameters.get("partial_rotary_factor", 0.25)
        self.theta = hf_cfg.rope_parameters["rope_theta"]
        self.init_weights(hf_cfg.initializer_range)

    def init_weights(self, std: float) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=std)
            elif type(m).__name__ == "Qwen3_5RMSNorm":
                nn.init.zeros_(m.weight)  # zero-centred: the scale is (1 + w)

    def combine(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))

    def _attention(self, x, cos, sin, prev_kv=None):
        attn = self.layers[0].self_attn
        B, T, _ = x.shape
        hd = self.head_dim
        q, gate = torch.chunk(attn.q_proj(x).view(B, T, self.n_heads, 2 * hd), 2, dim=-1)
        gate = gate.reshape(B, T, self.n_heads * hd)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(B, T, self.n_kv, hd)).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, self.n_kv, hd).transpose(1, 2)
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        if prev_kv is None:
            kk, vv, mask, causal = k, v, None, True
        else:
            kk = torch.cat([prev_kv[0], k], dim=2)
            vv = torch.cat([prev_kv[1], v], dim=2)
            mask, causal = chain_mask(T, x.device), False
        rep = self.n_heads // self.n_kv
        kk = kk.repeat_interleave(rep, dim=1)
        vv = vv.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(
            q, kk.to(q.dtype), vv.to(q.dtype), attn_mask=mask, is_causal=causal, scale=hd**-0.5
        )
        o = o.transpose(1, 2).reshape(B, T, self.n_heads * hd)
        o = o * torch.sigmoid(gate)
        return attn.o_proj(o), (k, v)

    def layer_forward(self, x: torch.Tensor, positions: torch.Tensor, prev_kv=None):
        """The decoder layer over rows x [B, T, H] at RoPE `positions` [T]; causal, or chained over prev_kv."""
        layer = self.layers[0]
        cos, sin = rope_cos_sin(positions, self.head_dim, self.partial, self.theta, torch.float32)
        a, kv = self._attention(layer.input_layernorm(x), cos, sin, prev_kv)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv

    def forward(self, embed_next: torch.Tensor, hidden: torch.Tensor, embed_next2: torch.Tensor | None = None):
        """embed_next [B,T,H] = embed(tok[r+1]), hidden [B,T,H] = target post-norm h[r].
        Returns y1 (after mtp.norm, predicts tok[r+2]) and, if embed_next2 = embed(tok[r+2]) is given,
        y2 of the chained step (predicts tok[r+3])."""
        T = embed_next.shape[1]
        pos = torch.arange(T, device=embed_next.device)
        x1, kv1 = self.layer_forward(self.combine(embed_next, hidden), pos)
        y1 = self.norm(x1)
        if embed_next2 is None:
            return y1, None
        x2, _ = self.layer_forward(self.combine(embed_next2, y1), pos + 1, prev_kv=kv1)
        return y1, self.norm(x2)


# ----------------------------------------------------------------------------------------------------- forward/loss
def forward_all(model, mtp: MTPHead, window: torch.Tensor, chain: bool):
    """window [B, T+3] token ids. Returns logits (target, mtp1, mtp2|None) over rows 0..T-1 and the targets."""
    T = window.shape[1] - 3
    x = window[:, :T]
    h = model.model(input_ids=x, use_cache=False).last_hidden_state
    logits0 = model.lm_head(h)
    emb = model.model.embed_tokens
    y1, y2 = mtp(emb(window[:, 1 : T + 1]), h, emb(window[:, 2 : T + 2]) if chain else None)
    logits1 = model.lm_head(y1)
    logits2 = model.lm_head(y2) if y2 is not None else None
    targets = (window[:, 1 : T + 1], window[:, 2 : T + 2], window[:, 3 : T + 3])
    return (logits0, logits1, logits2), targets


def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# ---------------------------------------------------------------------------------------------------------- export
def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def export_tensors(model, mtp: MTPHead) -> dict[str, torch.Tensor]:
    """Tensors under the real checkpoint names, bf16, on the CPU; no lm_head (tied)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        if not k.startswith("model."):
            raise ValueError(f"unexpected target tensor {k}")
        out["model.language_model." + k[len("model.") :]] = v
    for k, v in mtp.state_dict().items():
        out["mtp." + k] = v
    return {
        k: v.detach().to("cpu", torch.bfloat16).contiguous()
        for k, v in sorted(out.items(), key=lambda kv: _natural_key(kv[0]))
    }


def write_shards(
    tensors: dict[str, torch.Tensor], out_dir: str | Path, max_shard_bytes: int = SHARD_LIMIT_BYTES
) -> dict:
    """Write safetensors shards of at most `max_shard_bytes` (file size) and the HF index; returns the index."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header_reserve = 64 * 1024
    budget = max_shard_bytes - header_reserve
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nb = t.numel() * t.element_size()
        if nb > budget:
            raise ValueError(f"tensor {name} ({nb} bytes) does not fit a shard of {max_shard_bytes} bytes")
        if groups[-1] and size + nb > budget:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nb
    n = len(groups)
    for old in out_dir.glob("model*.safetensors"):
        old.unlink()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(out_dir / fname), metadata={"format": "pt"})
        if os.path.getsize(out_dir / fname) > max_shard_bytes:
            raise AssertionError(f"{fname} is larger than {max_shard_bytes} bytes")
        for k in names:
            weight_map[k] = fname
    index = {
        "metadata": {"total_size": int(sum(t.numel() * t.element_size() for t in tensors.values()))},
        "weight_map": dict(sorted(weight_map.items(), key=lambda kv: _natural_key(kv[0]))),
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


def export_model(
    out_dir: str | Path, model, mtp: MTPHead, cfg: dict, tokenizer_json: str, max_shard_bytes: int = SHARD_LIMIT_BYTES
) -> dict:
    """Write config.json, generation_config.json, tokenizer.json, the shards and the index."""
    import transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = write_shards(export_tensors(model, mtp), out_dir, max_shard_bytes)
    full_cfg = dict(cfg)
    full_cfg["transformers_version"] = transformers.__version__
    (out_dir / "config.json").write_text(json.dumps(full_cfg, indent=2) + "\n")
    gen = {
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    return index


def load_mtp_from_dir(model_dir: str | Path, hf_cfg) -> MTPHead:
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for fname in sorted(set(index["weight_map"].values())):
        for k, v in load_file(str(model_dir / fname)).items():
            if k.startswith("mtp."):
                state[k[len("mtp.") :]] = v.float()
    mtp = MTPHead(hf_cfg)
    mtp.load_state_dict(state, strict=True)
    mtp.eval()
    return mtp


def verify_export(model_dir: str | Path, model, mtp: MTPHead, ids: torch.Tensor, tol: float = 1e-4) -> dict:
    """Load the export with transformers (fp32, CPU) and compare target logits and MTP logits with `model`/`mtp`
    (which must hold the bf16-rounded weights). Raises on missing keys or a mismatch; returns the differences."""
    from transformers import Qwen3_5ForCausalLM

    loaded, info = Qwen3_5ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
    if missing or info.get("mismatched_keys"):
        raise AssertionError(f"transformers load: missing {missing}, mismatched {info.get('mismatched_keys')}")
    if not torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight):
        raise AssertionError("loaded lm_head is not tied to embed_tokens")
    loaded.eval()
    ref = _cpu_fp32_copy(model)
    ref_mtp = _cpu_fp32_copy(mtp)
    ids = ids.to("cpu")
    with torch.no_grad():
        # forward_all runs the loaded model's own modules: a0 is exactly loaded(input_ids=ids[:, :-3]).logits
        (a0, a1, _), _ = forward_all(loaded, load_mtp_from_dir(model_dir, loaded.config), ids, chain=False)
        (b0, b1, _), _ = forward_all(ref, ref_mtp, ids, chain=False)
        diff = (a0 - b0).abs().max().item()
        diff_mtp = (a1 - b1).abs().max().item()
    if not (diff <= tol and diff_mtp <= tol):
        raise AssertionError(f"exported logits differ: target {diff}, mtp {diff_mtp}")
    return {
        "max_abs_logit_diff_target": diff,
        "max_abs_logit_diff_mtp": diff_mtp,
        "unexpected_keys_ignored": len(info.get("unexpected_keys", [])),
    }


def _cpu_fp32_copy(module: nn.Module) -> nn.Module:
    import copy

    m = copy.deepcopy(module).to("cpu", torch.float32)
    m.eval()
    return m


def round_to_bf16_(*modules: nn.Module) -> None:
    """Round every parameter to bf16 in place (kept in its dtype), so the model is exactly what is exported."""
    with torch.no_grad():
        for mod in modules:
            for p in mod.parameters():
                p.copy_(p.to(torch.bfloat16).to(p.dtype))


def param_count(model, mtp: MTPHead) -> dict:
    target = sum(p.numel() for p in model.parameters())  # tied head counted once
    emb = model.model.embed_tokens.weight.numel()
    m = sum(p.numel() for p in mtp.parameters())
    return {"target": target, "target_non_embedding": target - emb, "embedding": emb, "mtp": m, "total": target + m}


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * t)))
