"""The model's shape, parsed from a Hugging Face `config.json` (text-only or the real nested layout)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    eos_token_ids: tuple[int, ...]
    nested: bool  # real checkpoint layout (text under text_config, weights under model.language_model.)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported; SpecDeck loads Qwen3.5 hybrid "
                f"models ({' or '.join(SUPPORTED_MODEL_TYPES)})"
            )
        nested = "text_config" in raw
        text = dict(raw["text_config"]) if nested else dict(raw)

        def need(key: str) -> Any:
            if key not in text:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return text[key]

        def num(key: str, default: Any = None, kind: type = int) -> Any:
            value = text.get(key, default)
            if value is None:
                value = need(key)
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ModelLoadError(f"{source}: field {key!r} must be a positive integer, got {value!r}")
            if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ModelLoadError(f"{source}: field {key!r} must be a number, got {value!r}")
            return kind(value)

        n_layers = num("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) != n_layers or not set(layer_types) <= {"full_attention", "linear_attention"}:
            raise ModelLoadError(
                f"{source}: layer_types must list {n_layers} entries of 'linear_attention' or 'full_attention'"
            )
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
        hidden = num("hidden_size")
        heads = num("num_attention_heads")
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        cfg = cls(
            vocab_size=num("vocab_size"),
            hidden_size=hidden,
            intermediate_size=num("intermediate_size"),
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=num("num_key_value_heads"),
            head_dim=num("head_dim", text.get("head_dim") or hidden // heads),
            linear_num_key_heads=num("linear_num_key_heads"),
            linear_num_value_heads=num("linear_num_value_heads"),
            linear_key_head_dim=num("linear_key_head_dim"),
            linear_value_head_dim=num("linear_value_head_dim"),
            linear_conv_kernel_dim=num("linear_conv_kernel_dim", 4),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rms_norm_eps=num("rms_norm_eps", 1e-6, float),
            tie_word_embeddings=bool(tie),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0)) or 0),
            eos_token_ids=eos_ids,
            nested=nested,
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ModelLoadError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not path.is_file():
            raise ModelLoadError(f"{path}: config.json not found; point --model at a Hugging Face model directory")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))
