"""A model folder from the internet is untrusted: every file it holds gets a size cap, a type check and a
range check before anything is built from it, and every failure is one line naming the file and field."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
from tiny_models import BASE_CONFIG, write_tiny_model

from engine import Engine, EngineError, ModelLoadError
from engine.config import ModelConfig


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("hostile") / "sharded", seed=1, shards=2)


@pytest.fixture()
def model(tiny_model_dir, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_model_dir, dst)
    return dst


@pytest.fixture()
def sharded(sharded_dir, tmp_path) -> Path:
    dst = tmp_path / "s"
    shutil.copytree(sharded_dir, dst)
    return dst


def load_error(path: Path, seconds: float = 30.0, **kwargs) -> str:
    """Engine.load's one-line error, in a thread with a deadline (a regression must not hang the suite)."""
    out: dict = {}

    def run():
        try:
            Engine.load(path, **kwargs)
            out["error"] = None
        except BaseException as exc:  # noqa: BLE001 (reported below)
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"Engine.load did not return within {seconds} s"
    exc = out["error"]
    assert isinstance(exc, ModelLoadError), f"expected ModelLoadError, got {exc!r}"
    msg = str(exc)
    assert "\n" not in msg and len(msg) < 600
    return msg


def edit_config(path: Path, edit) -> None:
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


# ---- model.safetensors.index.json: shard paths stay in the folder -------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "../outside.safetensors",
        "../../../../etc/passwd",
        "/etc/passwd",
        "/tmp/x.safetensors",
        "sub/../../x.safetensors",
        "C:/Windows/x.safetensors",
        "c:x.safetensors",
        "..\\x.safetensors",
        "a\\b.safetensors",
        "./model-00001-of-00002.safetensors",
        "",
        "model.bin",
        "x.safetensors\0.txt",
        12,
        None,
    ],
)
def test_index_shard_paths_outside_the_folder_are_refused(sharded, entry):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = entry
    index.write_text(json.dumps(data))
    msg = load_error(sharded)
    assert "model.safetensors.index.json" in msg and ("refusing" in msg or "must be file names" in msg)


def test_index_that_is_not_an_index(sharded):
    index = sharded / "model.safetensors.index.json"
    for text in ('{"weight_map": ["a"]}', "[1, 2]", '{"weight_map": {"a": 1}}', "{" * 100_000, "NaN"):
        index.write_text(text)
        msg = load_error(sharded)
        assert "model.safetensors.index.json" in msg


def test_symlinked_shards_like_the_hf_cache_still_load(sharded, tmp_path):
    """The Hugging Face cache keeps files as links to blobs elsewhere: the entry text is checked, not
    where the link points, so such a folder loads."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in list(sharded.iterdir()):
        target = blobs / f"blob-{f.name}"
        shutil.move(str(f), target)
        os.symlink(target, f)
    eng = Engine.load(sharded)
    assert len(eng.generate("def", 4).tokens) == 4


# ---- files that are not regular files, or too large ------------------------------------------------------


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
@pytest.mark.parametrize(
    "name", ["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json", "generation_config.json"]
)
def test_a_fifo_in_the_model_folder_is_refused_not_opened(model, name):
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    msg = load_error(model, seconds=20)
    assert name in msg and "FIFO" in msg


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="/dev/zero")
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "chat_template.jinja"])
def test_a_link_to_a_device_is_refused(model, name):
    (model / name).unlink(missing_ok=True)
    os.symlink("/dev/zero", model / name)
    msg = load_error(model, seconds=20)
    assert name in msg and "device" in msg


def test_a_folder_where_a_file_belongs(model):
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert "folder" in load_error(model)


@pytest.mark.parametrize(
    "name,size", [("config.json", 5 << 20), ("generation_config.json", 2 << 20), ("chat_template.jinja", 2 << 20)]
)
def test_oversized_files_are_refused_before_parsing(model, name, size):
    with open(model / name, "wb") as f:  # sparse: costs no disk
        f.truncate(size)
    msg = load_error(model)
    assert name in msg and "larger than" in msg


@pytest.mark.parametrize("length", [2**60, 2**31, 10**6, 0])
def test_safetensors_header_length_is_checked_before_reading(model, length):
    path = model / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = length.to_bytes(8, "little")
    path.write_bytes(bytes(data))
    msg = load_error(model)
    assert "model.safetensors" in msg and "header" in msg


def test_config_not_utf8_or_not_an_object(model):
    for raw in (b"\xff\xfe{}", b"[1,2,3]", b'"text"', b"{" * 200_000, b'{"vocab_size": NaN}'):
        (model / "config.json").write_bytes(raw)
        msg = load_error(model)
        assert "config.json" in msg


# ---- config.json values: types and ranges, checked before anything is allocated ---------------------------


CONFIG_CASES = [
    ("num_hidden_layers", 10**9, "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", 0, "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", "4", "num_hidden_layers must be an integer"),
    ("num_hidden_layers", 4.0, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", True, "num_hidden_layers must be an integer"),
    ("mtp_num_hidden_layers", 10**9, "mtp_num_hidden_layers must be an integer in 0..16"),
    ("mtp_num_hidden_layers", -1, "mtp_num_hidden_layers must be an integer in 0..16"),
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("hidden_size", [64], "hidden_size must be an integer"),
    ("hidden_size", 10**12, "hidden_size must be an integer in 1..65536"),
    ("vocab_size", -5, "vocab_size must be an integer"),
    ("vocab_size", 10**9, "vocab_size must be an integer in 1..4194304"),
    ("head_dim", 0, "head_dim must be an integer in 2..1024"),
    ("head_dim", 4096, "head_dim must be an integer in 2..1024"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("linear_conv_kernel_dim", 0, "linear_conv_kernel_dim must be an integer in 2..64"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a number in (0, 0.1]"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a number in (0, 0.1]"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("eos_token_id", 10**6, "eos_token_id must be a token id or a list of token ids in 0..319"),
    ("eos_token_id", [0, "1"], "eos_token_id must be a token id"),
    ("eos_token_id", True, "eos_token_id must be a token id"),
    ("layer_types", "linear_attention", "layer_types must list 4 entries"),
    ("layer_types", ["linear_attention"] * 3 + [7], "layer_types must list 4 entries"),
    ("rope_parameters", "fast", "rope_parameters must be a JSON object"),
    ("rope_parameters", {"rope_theta": 0}, "rope_theta must be a number in (0, 1e+12]"),
    ("rope_parameters", {"rope_theta": -1.0}, "rope_theta must be a number in (0, 1e+12]"),
    ("rope_parameters", {"rope_theta": 1e300}, "rope_theta must be a number in (0, 1e+12]"),
    ("rope_parameters", {"partial_rotary_factor": 1.5}, "partial_rotary_factor must be a number in (0, 1]"),
    ("rope_parameters", {"partial_rotary_factor": 0}, "partial_rotary_factor must be a number in (0, 1]"),
    ("rope_parameters", {"partial_rotary_factor": "0.25"}, "partial_rotary_factor must be a number"),
    ("rope_parameters", {"partial_rotary_factor": 0.01}, "rotary dimensions; it must be a positive even number"),
    ("model_type", ["qwen3_5"], "is not supported"),
]


@pytest.mark.parametrize("field,value,expected", CONFIG_CASES, ids=[f"{c[0]}={str(c[1])[:20]}" for c in CONFIG_CASES])
def test_config_values_are_checked_by_type_and_range(model, field, value, expected):
    edit_config(model, lambda c: c.__setitem__(field, value))
    msg = load_error(model)
    assert "config.json" in msg and expected in msg, msg


@pytest.mark.parametrize("interval", [0, -1, "4", 10**9 + 1])
def test_full_attention_interval_zero_or_negative_is_an_error_not_a_division(model, interval):
    def edit(c):
        del c["layer_types"]
        c["full_attention_interval"] = interval

    edit_config(model, edit)
    assert "full_attention_interval must be an integer" in load_error(model)


def test_nested_layout_with_text_config_of_the_wrong_type(tmp_path):
    path = write_tiny_model(tmp_path / "n", nested=True)
    edit_config(path, lambda c: c.__setitem__("text_config", "qwen"))
    assert "text_config must be a JSON object" in load_error(path)


def test_absurd_layer_counts_fail_fast_and_allocate_nothing():
    for key in ("num_hidden_layers", "mtp_num_hidden_layers"):
        cfg = {k: v for k, v in BASE_CONFIG.items() if k != "layer_types"} | {"model_type": "qwen3_5_text"}
        cfg[key] = 10**9
        tracemalloc.start()
        t0 = time.perf_counter()
        with pytest.raises(ModelLoadError, match=key):
            ModelConfig.from_dict(cfg, source="config.json")
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert time.perf_counter() - t0 < 1.0 and peak < 1 << 20


# ---- weights ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(model, bad):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.2.mlp.up_proj.weight"][3, 5] = bad
    save_file(tensors, str(model / "model.safetensors"))
    msg = load_error(model)
    assert "layers.2.mlp.up_proj.weight" in msg and "NaN or infinite" in msg


def test_weights_that_overflow_the_chosen_dtype_are_refused(model):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.embed_tokens.weight"][0, 0] = 1e6  # finite in fp32, inf in fp16
    save_file(tensors, str(model / "model.safetensors"))
    Engine.load(model)  # fp32: fine
    msg = load_error(model, dtype="float16")
    assert "embed_tokens.weight" in msg and "(in float16)" in msg


# ---- chat templates -------------------------------------------------------------------------------------


QWEN_LIKE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _prompt_error(model: Path, template) -> str:
    from app.workloads import load_workloads

    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    eng = Engine.load(model)
    t0 = time.perf_counter()
    with pytest.raises(EngineError) as info:
        load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    assert time.perf_counter() - t0 < 10
    msg = str(info.value)
    assert "\n" not in msg and "tokenizer_config.json: chat template failed" in msg
    return msg


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{% for %}", "TemplateSyntaxError"),
        ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
        ("{{ 'a' * 1000000000 }}", "larger than"),
        ("{% for i in range(100000) %}{{ 'x' * 900 }}{% endfor %}", "output is larger"),
        ("{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "larger"),
        ("{{ 'a'|center(1000000000) }}", "larger than 100000"),
        ("{{ '%01000000000d' % 1 }}", "format width"),
        ("{{ 2 ** 100000000 }}", "power"),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
    ],
    ids=[
        "escape",
        "mutate",
        "syntax",
        "raise",
        "huge-string",
        "huge-output",
        "doubling",
        "filter",
        "fmt",
        "pow",
        "rec",
    ],
)
def test_a_bad_chat_template_is_one_line_naming_the_file(model, template, expected):
    assert expected in _prompt_error(model, template)


def test_a_looping_chat_template_stops_at_the_time_limit(model, monkeypatch):
    from engine import tokenizer as T

    monkeypatch.setattr(T, "TEMPLATE_SECONDS", 0.5)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    assert "ran for more than 0.5 s" in _prompt_error(model, loop)
    assert sys.gettrace() is None or sys.gettrace().__name__ != "tracer"  # the tracer is gone again


def test_the_hf_list_form_of_chat_template_uses_default(model):
    from app.workloads import load_workloads

    listed = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": QWEN_LIKE}]
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": listed}))
    eng = Engine.load(model)
    assert eng.tokenizer.chat_template == QWEN_LIKE
    w = load_workloads()["code_gen"]
    assert w.prompt_for(eng.tokenizer).startswith("<|im_start|>user\n" + w.chat)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": listed[:1]}))
    assert "none named 'default'" in load_error(model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": {"default": QWEN_LIKE}}))
    assert "chat_template must be a string or a list" in load_error(model)


def test_a_real_style_template_renders_as_the_plain_sandbox_does(model):
    """The limits change nothing for a well-behaved template (namespace, reversed slices, loop, tojson)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from engine.tokenizer import render_chat

    template = (
        "{%- set ns = namespace(last=messages|length - 1) %}{%- for m in messages[::-1] %}"
        "{%- if m.role == 'user' and ns.last == messages|length - 1 %}{%- set ns.last = loop.index0 %}{%- endif %}"
        "{%- endfor %}{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
        "{%- if m.content is string %}{{ m.content.split('</think>')[-1].lstrip('\\n') }}{%- else %}"
        "{{ m.content|tojson }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi " * 1000},
        {"role": "assistant", "content": "<think>x</think>\n\nhello"},
        {"role": "user", "content": ["a", {"b": 1}]},
    ]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
    expected = env.from_string(template).render(messages=messages, add_generation_prompt=True)
    assert render_chat(template, messages) == expected


def test_an_unreadable_model_folder_is_one_line(model):
    if os.geteuid() == 0:
        pytest.skip("root reads everything")
    model.chmod(0)
    try:
        assert "cannot be read" in load_error(model)
    finally:
        model.chmod(0o755)


@pytest.mark.gpu
def test_on_cuda_bad_weights_are_refused_and_a_dropped_stream_releases_its_session(model):
    """GPU check of the load-time finiteness test (the sum runs on the device) and of the session lock."""
    import gc

    from safetensors.torch import load_file, save_file

    eng = Engine.load(model, device="cuda", dtype="bfloat16")
    sess = eng.new_session()
    eng.stream("def", 4, session=sess)
    gc.collect()
    assert len(eng.generate("def", 4, session=sess).tokens) == 4
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.3.mlp.down_proj.weight"][1, 1] = math.nan
    save_file(tensors, str(model / "model.safetensors"))
    msg = load_error(model, device="cuda", dtype="bfloat16")
    assert "layers.3.mlp.down_proj.weight has 1 NaN" in msg
