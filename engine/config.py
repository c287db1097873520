"""The model's shape, parsed from a Hugging Face `config.json` (text-only or the real nested layout)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ModelLoadError
from .untrusted import MiB, exists, load_json

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
LAYER_KINDS = ("linear_attention", "full_attention")
# What a config.json may ask for, checked before anything is allocated from it: generous bounds
# (several times today's largest models), far below what would exhaust a machine.
MAX_CONFIG_BYTES = 4 * MiB
MAX_LAYERS = 1024
MAX_MTP_LAYERS = 16
MAX_WIDTH = 65536  # hidden_size
MAX_INTERMEDIATE = 1 << 20
MAX_VOCAB = 1 << 22
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024  # the attention kernels' limit on one row
MAX_CONTEXT = 1 << 24  # max_position_embeddings


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
    max_position_embeddings: int = 0  # the context the model was trained for (0: the config does not say)

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
        """Every field is checked for its JSON type and for a range the model can mean before anything is
        built from it; a bad field is one ModelLoadError naming it, what it must be and what it was."""
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{source}: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            shown = model_type if isinstance(model_type, (str, int, float, type(None))) else type(model_type).__name__
            raise ModelLoadError(
                f"{source}: model_type {_short(shown)} is not supported; SpecDeck loads Qwen3.5 hybrid "
                f"models ({' or '.join(SUPPORTED_MODEL_TYPES)})"
            )
        nested = "text_config" in raw
        if nested and not isinstance(raw["text_config"], dict):
            raise ModelLoadError(f"{source}: text_config must be a JSON object, got {_type_of(raw['text_config'])}")
        text = dict(raw["text_config"]) if nested else dict(raw)

        def need(key: str) -> Any:
            if key not in text:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            return text[key]

        def bad(key: str, expected: str, value: Any) -> ModelLoadError:
            return ModelLoadError(f"{source}: {key} must be {expected}, got {_short(value)}")

        def num(key: str, default: Any = None, kind: type = int, lo: Any = 1, hi: Any = None) -> Any:
            value = text.get(key, default)
            if value is None:
                value = need(key)
            if kind is int:
                if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                    raise bad(key, f"an integer in {lo}..{hi}", value)
                return value
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(key, f"a number in {lo}", value)
            return float(value)

        n_layers = num("num_hidden_layers", hi=MAX_LAYERS)
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = num("full_attention_interval", 4, hi=MAX_LAYERS)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if (
            not isinstance(layer_types, list)
            or len(layer_types) != n_layers
            or not all(isinstance(t, str) and t in LAYER_KINDS for t in layer_types)
        ):
            raise ModelLoadError(
                f"{source}: layer_types must list {n_layers} entries of 'linear_attention' or 'full_attention'"
            )
        layer_types = tuple(layer_types)
        rope = text.get("rope_parameters")
        if rope is None:
            rope = text.get("rope_scaling")
        if rope is None:
            rope = {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"{source}: rope_parameters must be a JSON object, got {_type_of(rope)}")

        def rope_num(key: str, default: float, lo: float, hi: float, lo_open: bool) -> float:
            value = rope.get(key, text.get(key, default))
            ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if ok:
                ok = (lo < value if lo_open else lo <= value) and value <= hi
            if not ok:
                raise bad(key, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", value)
            return float(value)

        rope_theta = rope_num("rope_theta", 10000.0, 0.0, 1e12, True)
        partial = rope_num("partial_rotary_factor", 0.25, 0.0, 1.0, True)
        hidden = num("hidden_size", hi=MAX_WIDTH)
        heads = num("num_attention_heads", hi=MAX_HEADS)
        head_dim_default = text.get("head_dim") or max(1, hidden // heads)
        eos = raw.get("eos_token_id", text.get("eos_token_id"))
        vocab = num("vocab_size", hi=MAX_VOCAB)
        eos_ids = eos_id_list(eos, vocab, f"{source}: eos_token_id")
        tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        if not isinstance(tie, bool):
            raise bad("tie_word_embeddings", "true or false", tie)
        mtp = text.get("mtp_num_hidden_layers", raw.get("mtp_num_hidden_layers", 0))
        if mtp is None:
            mtp = 0
        if isinstance(mtp, bool) or not isinstance(mtp, int) or not 0 <= mtp <= MAX_MTP_LAYERS:
            raise bad("mtp_num_hidden_layers", f"an integer in 0..{MAX_MTP_LAYERS}", mtp)
        eps = num("rms_norm_eps", 1e-6, float, "(0, 0.1]")
        if not 0.0 < eps <= 0.1:
            raise bad("rms_norm_eps", "a number in (0, 0.1]", eps)
        cfg = cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=num("intermediate_size", hi=MAX_INTERMEDIATE),
            layer_types=layer_types,
            num_attention_heads=heads,
            num_key_value_heads=num("num_key_value_heads", hi=MAX_HEADS),
            head_dim=num("head_dim", head_dim_default, lo=2, hi=MAX_HEAD_DIM),
            linear_num_key_heads=num("linear_num_key_heads", hi=MAX_HEADS),
            linear_num_value_heads=num("linear_num_value_heads", hi=MAX_HEADS),
            linear_key_head_dim=num("linear_key_head_dim", hi=MAX_HEAD_DIM),
            linear_value_head_dim=num("linear_value_head_dim", hi=MAX_HEAD_DIM),
            linear_conv_kernel_dim=num("linear_conv_kernel_dim", 4, lo=2, hi=64),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rms_norm_eps=eps,
            tie_word_embeddings=tie,
            mtp_num_hidden_layers=mtp,
            eos_token_ids=eos_ids,
            nested=nested,
            max_position_embeddings=num("max_position_embeddings", 0, lo=0, hi=MAX_CONTEXT),
        )
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            raise ModelLoadError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise ModelLoadError(f"{source}: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
            raise ModelLoadError(
                f"{source}: head_dim {cfg.head_dim} x partial_rotary_factor {partial:g} gives {cfg.rotary_dim} "
                "rotary dimensions; it must be a positive even number"
            )
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not exists(path):
            raise ModelLoadError(f"{path}: config.json not found; point --model at a Hugging Face model directory")
        raw = load_json(path, MAX_CONFIG_BYTES, "config.json", ModelLoadError)
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))


def eos_id_list(eos: Any, vocab_size: int, what: str) -> tuple[int, ...]:
    """eos_token_id as found in config.json / generation_config.json: absent, one id, or a list of ids."""
    if eos is None:
        return ()
    items = eos if isinstance(eos, list) else [eos]
    if len(items) > 1024 or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in items
    ):
        raise ModelLoadError(
            f"{what} must be a token id or a list of token ids in 0..{vocab_size - 1}, got {_short(eos)}"
        )
    return tuple(items)


def _type_of(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _short(value: Any, limit: int = 60) -> str:
    """repr() of a value from the file, cut short and ASCII-only (it may hold anything)."""
    if isinstance(value, (dict, list)) and len(repr(value)) > limit:
        return _type_of(value)
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
