"""Fuzzing config.json and profile contents: whatever the file holds, the result is a correct load or one
clear, single-line error (ModelLoadError / ProfileError), within a time and a memory bound."""

from __future__ import annotations

import json
import math
import time
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import BASE_CONFIG

from app import profiles as P
from app.profiles import Profile, ProfileError
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.settings import EngineSettings

SECONDS = 1.0  # per example
PEAK_BYTES = 32 << 20  # Python allocations per example

JSON_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 4, 1023, 1024, 1025, 10**9, 10**18]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["linear_attention", "full_attention", "qwen3_5_text", "qwen3_5"]),
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
CONFIG_KEYS = [*BASE_CONFIG, "model_type", "text_config", "full_attention_interval", "rope_scaling", "rope_theta"]


def _bounded(call):
    """Run `call` and return (result, error); assert the time and memory bound and the one-line error."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        return call(), None
    except (ModelLoadError, ProfileError) as exc:
        msg = str(exc)
        assert msg and "\n" not in msg and len(msg) < 1000, msg
        return None, exc
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert elapsed < SECONDS and peak < PEAK_BYTES, (elapsed, peak)


def _check_config(cfg: ModelConfig) -> None:
    """A config that loads means something: ranges a model can run with."""
    assert 1 <= cfg.num_layers <= 1024 and 0 <= cfg.mtp_num_hidden_layers <= 16
    assert 0 < cfg.partial_rotary_factor <= 1 and cfg.rotary_dim >= 2 and cfg.rotary_dim % 2 == 0
    assert math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0 and 0 < cfg.rms_norm_eps <= 0.1
    assert all(0 <= t < cfg.vocab_size for t in cfg.eos_token_ids)
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert isinstance(cfg.tie_word_embeddings, bool)


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUE, max_size=4),
    drop=st.lists(st.sampled_from(CONFIG_KEYS), max_size=2),
    nested=st.booleans(),
)
def test_fuzzed_config_json_loads_correctly_or_fails_in_one_line(changes, drop, nested):
    text = {k: v for k, v in BASE_CONFIG.items() if k not in drop} | changes
    raw = {"model_type": "qwen3_5", "text_config": text} if nested else text | {"model_type": "qwen3_5_text"}
    if "model_type" in changes and not nested:
        raw["model_type"] = changes["model_type"]
    cfg, _ = _bounded(lambda: ModelConfig.from_dict(json.loads(json.dumps(raw)), source="DIR/config.json"))
    if cfg is not None:
        _check_config(cfg)


@settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzzed_config_bytes(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_bytes(data)
    cfg, _ = _bounded(lambda: ModelConfig.from_file(path))
    if cfg is not None:
        _check_config(cfg)


GOOD_SETTINGS = EngineSettings().to_dict()
SETTING_KEYS = [*GOOD_SETTINGS, "sub_vocab_fraction"]
TOML_LEAF = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
)
TOML_VALUE = st.recursive(
    TOML_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    top=st.dictionaries(st.sampled_from(["version", "name", "notes", "bench", "hardware", "extra"]), TOML_VALUE),
    knobs=st.dictionaries(st.sampled_from(SETTING_KEYS), TOML_VALUE, max_size=3),
    drop=st.lists(st.sampled_from(SETTING_KEYS), max_size=1),
)
def test_fuzzed_profile_contents_load_correctly_or_fail_in_one_line(tmp_path_factory, top, knobs, drop):
    import tomli_w

    data = {"version": 1, "name": "fuzz"} | top
    data["settings"] = {k: v for k, v in GOOD_SETTINGS.items() if k not in drop} | knobs
    try:
        text = tomli_w.dumps(data)
    except (TypeError, ValueError):
        return  # not representable in TOML
    path = tmp_path_factory.mktemp("prof") / "fuzz.toml"
    path.write_text(text, encoding="utf-8")
    profile, _ = _bounded(lambda: P.read_profile_file(path))
    if profile is not None:  # a profile that loads saves and loads again to the same settings
        assert isinstance(profile.settings, EngineSettings) and profile.name.strip()
        again = P.parse_profile(P.tomllib.loads(profile.to_toml()), "again")
        assert again.settings == profile.settings


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_fuzzed_profile_bytes_never_hide_a_good_profile(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("store")
    store = P.ProfileStore(directory, shipped_dir=None)
    store.save(Profile(name="good", settings=EngineSettings()))
    (directory / "fuzz.toml").write_bytes(data)
    (profiles, problems), _ = _bounded(store.list)
    assert "good" in [p.name for p in profiles]
    assert all("\n" not in str(p) for p in problems)


@pytest.mark.parametrize("n", [10, 1000, 100_000])
def test_deep_nesting_is_bounded(tmp_path, n):
    path = Path(tmp_path) / "deep.toml"
    path.write_text("version = 1\nx = " + "[" * n + "]" * n)
    _bounded(lambda: pytest.raises(ProfileError, P.read_profile_file, path))
    (tmp_path / "config.json").write_text("[" * n + "]" * n)
    _bounded(lambda: pytest.raises(ModelLoadError, ModelConfig.from_file, tmp_path / "config.json"))
