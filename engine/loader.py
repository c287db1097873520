"""Hugging Face model directory -> tensors on the requested device and dtype.

Accepts both layouts: real checkpoints (`Qwen3_5ForConditionalGeneration`, weights under
`model.language_model.`, `model.visual.*` skipped) and text-only ones (`Qwen3_5ForCausalLM`, weights
under `model.`); single or sharded safetensors; tied or untied LM head; `mtp.*` kept for the draft head.
Tensors are renamed to one canonical scheme: `embed_tokens.weight`, `layers.N.*`, `norm.weight`,
`lm_head.weight`, `mtp.*`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .errors import ModelLoadError
from .untrusted import MiB, check_regular, exists, load_json, one_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Small tensors that stay fp32 whatever the model dtype (they feed fp32 math).
FP32_SUFFIXES = ("A_log", "dt_bias", "norm.weight", "layernorm.weight", "q_norm.weight", "k_norm.weight")


def _decoder_layer_shapes(cfg: ModelConfig, kind: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
    }
    if kind == "full_attention":
        shapes |= {
            "self_attn.q_proj.weight": (cfg.num_attention_heads * d * 2, h),
            "self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
            "self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
            "self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
            "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,),
        }
    else:
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        shapes |= {
            "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, h),
            "linear_attn.in_proj_z.weight": (hv * dv, h),
            "linear_attn.in_proj_b.weight": (hv, h),
            "linear_attn.in_proj_a.weight": (hv, h),
            "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
            "linear_attn.A_log": (hv,),
            "linear_attn.dt_bias": (hv,),
            "linear_attn.norm.weight": (dv,),
            "linear_attn.out_proj.weight": (h, hv * dv),
        }
    return shapes


def expected_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(target tensors, MTP tensors) by canonical name."""
    h = cfg.hidden_size
    target: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        target["lm_head.weight"] = (cfg.vocab_size, h)
    for i, kind in enumerate(cfg.layer_types):
        for name, shape in _decoder_layer_shapes(cfg, kind).items():
            target[f"layers.{i}.{name}"] = shape
    mtp: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.mtp_num_hidden_layers):
        for name, shape in _decoder_layer_shapes(cfg, "full_attention").items():
            mtp[f"mtp.layers.{i}.{name}"] = shape
    if cfg.mtp_num_hidden_layers:
        mtp |= {
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        }
    return target, mtp


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> canonical name, or None for tensors SpecDeck does not use."""
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            rest = name[len(prefix) :]
            if rest.startswith("visual.") or name.startswith("model.visual."):
                return None
            return rest
    if name.startswith("mtp.") or name == "lm_head.weight":
        return name
    return None


MAX_INDEX_BYTES = 64 * MiB  # a 1000-shard index of a huge model is a few MiB
MAX_HEADER_BYTES = 100 * MiB  # safetensors' own limit on the JSON header


def shard_path(model_dir: Path, index: Path, entry: object) -> Path:
    """The shard an index entry names, confined to the model folder. The entry's text is checked, not the
    resolved path: the Hugging Face cache links each file to a blob elsewhere, which is fine."""
    if not isinstance(entry, str):
        raise ModelLoadError(f"{index}: weight_map values must be file names, got {type(entry).__name__}")
    shown = ascii(entry)[:80]
    if not entry or "\\" in entry or "\0" in entry or entry.startswith("/") or (len(entry) > 1 and entry[1] == ":"):
        raise ModelLoadError(f"{index}: shard {shown} is not a file name inside the model folder; refusing it")
    parts = entry.split("/")
    if any(part in ("", ".", "..") for part in parts) or not entry.endswith(".safetensors"):
        raise ModelLoadError(f"{index}: shard {shown} is not a .safetensors file inside the model folder; refusing it")
    return model_dir.joinpath(*parts)


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Canonical-able checkpoint name -> the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if exists(index):
        data = load_json(index, MAX_INDEX_BYTES, "safetensors index", ModelLoadError)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: not a valid safetensors index (no 'weight_map' object)")
        files = {}
        checked: set[Path] = set()
        for name, fname in weight_map.items():
            path = shard_path(model_dir, index, fname)
            if path not in checked:
                if not exists(path):
                    raise ModelLoadError(f"{path}: shard listed in {index.name} is missing")
                check_regular(path, "shard", ModelLoadError)
                checked.add(path)
            files[name] = path
        return files
    if exists(single):
        return {name: single for name in _keys(single)}
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"{model_dir}: no model.safetensors or model.safetensors.index.json found")
    files = {}
    for shard in shards:
        for name in _keys(shard):
            files[name] = shard
    return files


def _keys(path: Path) -> list[str]:
    check_header(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # safetensors raises its own error types for a damaged header
        raise ModelLoadError(
            f"{path}: cannot read safetensors header ({one_line(exc)}); the file may be truncated"
        ) from None


def check_header(path: Path) -> None:
    """A regular file whose header length (the first 8 bytes) fits the file and the cap: checked before
    the safetensors library maps it (a FIFO would block, a huge length would allocate)."""
    st = check_regular(path, "safetensors file", ModelLoadError)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > MAX_HEADER_BYTES or n + 8 > st.st_size:
        raise ModelLoadError(
            f"{path}: cannot read safetensors header (header length {n} does not fit a file of {st.st_size} "
            "bytes); the file may be truncated"
        )


def load_weights(
    model_dir: Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], bool]:
    """Read, rename, check and place every tensor. Returns (weights, has_mtp)."""
    files = _tensor_files(model_dir)
    target_shapes, mtp_shapes = expected_shapes(cfg)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, path in files.items():
        canon = canonical_name(name)
        if canon is None or (canon not in target_shapes and canon not in mtp_shapes):
            if canon == "lm_head.weight":  # tied model that still ships a head: use it
                target_shapes = dict(target_shapes) | {"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)}
            else:
                continue
        by_file.setdefault(path, []).append((name, canon))
    weights: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        check_header(path)
        try:
            # Straight to the requested device: safetensors copies each tensor there as it reads it.
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name, canon in names:
                    tensor = f.get_tensor(name)
                    weights[canon] = _place(tensor, canon, path, device, dtype)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read tensor data ({exc}); the file may be truncated") from None
    missing = [n for n in target_shapes if n not in weights]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; the checkpoint does not match config.json"
        )
    present_mtp = [n for n in mtp_shapes if n in weights]
    has_mtp = bool(mtp_shapes) and len(present_mtp) == len(mtp_shapes)
    if present_mtp and not has_mtp:
        lacking = next(n for n in mtp_shapes if n not in weights)
        raise ModelLoadError(f"{model_dir}: MTP tensor {lacking} is missing (the draft head is incomplete)")
    for name, tensor in weights.items():
        shape = (target_shapes | mtp_shapes).get(name)
        if shape is not None and tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{files_for(name, files)}: tensor {name} has shape {tuple(tensor.shape)}, config.json implies {shape}"
            )
    if cfg.tie_word_embeddings and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["embed_tokens.weight"]
    for name in list(weights):
        if name.endswith("conv1d.weight"):
            weights[name] = weights[name][:, 0, :].contiguous()
    return weights, has_mtp


def files_for(canon: str, files: dict[str, Path]) -> str:
    for name, path in files.items():
        if canonical_name(name) == canon:
            return str(path)
    return canon


def _place(tensor: torch.Tensor, canon: str, path: Path, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise ModelLoadError(f"{path}: tensor {canon} has dtype {tensor.dtype}; expected a floating-point tensor")
    target = torch.float32 if canon.endswith(FP32_SUFFIXES) else dtype
    placed = tensor.to(device=device, dtype=target).contiguous()
    # NaN and Inf survive a sum (with no full-size temporary); count them only when there are some.
    if placed.numel() and not bool(torch.isfinite(placed.sum(dtype=torch.float32))):
        bad = sum(int((~torch.isfinite(part)).sum()) for part in placed.reshape(-1).split(1 << 24))
        after = "" if target == tensor.dtype else f" (in {str(target).replace('torch.', '')})"
        what = f"{bad} NaN or infinite value(s){after}" if bad else "values so large that they overflow"
        raise ModelLoadError(f"{path}: tensor {canon} has {what}; the checkpoint is damaged")
    return placed
