#!/usr/bin/env python3
"""A battery of hostile and broken inputs, each run in its own process with a timeout and a memory cap.

    python tests/hostile_battery.py                 # every case, in parallel; one line per case, then totals
    python tests/hostile_battery.py -k template -v  # the cases whose name holds "template", with messages
    python tests/hostile_battery.py --list

A case passes when the tool answers as it should: a clear error (EngineError / ModelLoadError /
ProfileError / ValueError / TypeError with a one-line message matching what the case expects), or a correct
result (the case checks it), within the timeout and the memory cap. A traceback of another kind, a hang,
a crash or running out of memory fails it. tests/test_hostile_battery.py runs a sample of these in CI.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CLEAR_ERRORS = ("EngineError", "ModelLoadError", "ProfileError", "ProfileWriteError", "ArgumentTypeError")


def under_test() -> Path:
    """The checkout whose code the cases run (--root; this one by default)."""
    return Path(os.environ.get("SPECDECK_BATTERY_ROOT", ROOT))


@dataclass
class Case:
    name: str
    run: Callable[[Work], object]
    expect: str  # "ok", or a regex the one-line error must match


CASES: list[Case] = []


def case(name: str, expect: str = "ok"):
    def register(fn):
        add(name, expect, fn)
        return fn

    return register


def add(name: str, expect: str, fn: Callable[[Work], object]) -> None:
    taken = {c.name for c in CASES}
    unique, n = name, 2
    while unique in taken:
        unique, n = f"{name}#{n}", n + 1
    CASES.append(Case(unique, fn, expect))


class Work:
    """What a case gets: a private folder and copies of the prepared tiny models."""

    def __init__(self, base: Path, work: Path) -> None:
        self.base, self.dir = base, work

    def model(self, kind: str = "single") -> Path:
        dst = self.dir / f"model-{kind}"
        if not dst.exists():
            shutil.copytree(self.base / kind, dst, symlinks=True)
        return dst

    def edit_config(self, path: Path, edit: Callable[[dict], object]) -> Path:
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    def load(self, path: Path | None = None, **kwargs):
        from engine import Engine

        return Engine.load(self.model() if path is None else path, **kwargs)

    def store(self):
        from app.profiles import Profile, ProfileStore
        from engine.settings import EngineSettings

        os.environ["SPECDECK_CONFIG_DIR"] = str(self.dir / "config")
        store = ProfileStore(self.dir / "config" / "profiles", shipped_dir=None)
        store.save(Profile(name="good", settings=EngineSettings()))
        return store


def good_profile_survives(w: Work, write: Callable[[Path], object], expect: str | None = None) -> str:
    """Write one bad file next to a good profile; the list still holds the good one and names the bad."""
    store = w.store()
    write(store.directory / "bad.toml")
    profiles, problems = store.list()
    assert [p.name for p in profiles] == ["good"], [p.name for p in profiles]
    bad = [str(p) for p in problems]
    assert len(bad) == 1 and "\n" not in bad[0] and bad[0].startswith("bad.toml: "), bad
    if expect:
        assert re.search(expect, bad[0]), bad[0]
    return bad[0]


# ---- model.safetensors.index.json ----------------------------------------------------------------------


def _index_entry(entry):
    def run(w: Work):
        path = w.model("sharded")
        index = path / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        data["weight_map"][next(iter(data["weight_map"]))] = entry
        index.write_text(json.dumps(data))
        w.load(path)

    return run


for i, entry in enumerate(
    [
        "../outside.safetensors",
        "../../../../../../etc/passwd",
        "/etc/passwd",
        "/proc/self/mem",
        "sub/../../x.safetensors",
        "C:/Windows/x.safetensors",
        "c:x.safetensors",
        "..\\x.safetensors",
        "a\\b.safetensors",
        "./model-00001-of-00002.safetensors",
        "",
        "model.bin",
        "x.safetensors\0.txt",
        "//server/share/x.safetensors",
        12,
        None,
        ["a.safetensors"],
    ]
):
    add(
        f"index/entry-{i}:{str(entry)[:24]!r}",
        r"model\.safetensors\.index\.json.*(refusing|must be file names)",
        _index_entry(entry),
    )


def _index_text(text: str):
    def run(w: Work):
        path = w.model("sharded")
        (path / "model.safetensors.index.json").write_text(text)
        w.load(path)

    return run


for i, text in enumerate(['{"weight_map": ["a"]}', "[1, 2]", "{" * 200_000, "NaN", '{"weight_map": {"a": 1}}']):
    add(f"index/not-an-index-{i}", r"model\.safetensors\.index\.json", _index_text(text))


@case("index/symlinked-blobs-like-the-hf-cache-load")
def _(w: Work):
    path = w.model("sharded")
    blobs = w.dir / "blobs"
    blobs.mkdir()
    for f in list(path.iterdir()):
        shutil.move(str(f), blobs / f.name)
        os.symlink(blobs / f.name, f)
    assert len(w.load(path).generate("def", 4).tokens) == 4


@case("index/shard-missing", r"model-00002-of-00002\.safetensors: shard listed .* is missing")
def _(w: Work):
    path = w.model("sharded")
    (path / "model-00002-of-00002.safetensors").unlink()
    w.load(path)


# ---- config.json values ---------------------------------------------------------------------------------

CONFIG_CASES = [
    ("num_hidden_layers", 10**9, "num_hidden_layers must be an integer in 1..1024"),
    ("num_hidden_layers", 0, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", -4, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", "4", "num_hidden_layers must be an integer"),
    ("num_hidden_layers", 4.0, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", True, "num_hidden_layers must be an integer"),
    ("num_hidden_layers", [4], "num_hidden_layers must be an integer"),
    ("num_hidden_layers", {"n": 4}, "num_hidden_layers must be an integer"),
    ("mtp_num_hidden_layers", 10**9, "mtp_num_hidden_layers must be an integer in 0..16"),
    ("mtp_num_hidden_layers", -1, "mtp_num_hidden_layers must be an integer"),
    ("mtp_num_hidden_layers", "1", "mtp_num_hidden_layers must be an integer"),
    ("hidden_size", "64", "hidden_size must be an integer"),
    ("hidden_size", 10**12, "hidden_size must be an integer in 1..65536"),
    ("hidden_size", None, "required field 'hidden_size' is missing"),
    ("intermediate_size", 10**15, "intermediate_size must be an integer"),
    ("vocab_size", -5, "vocab_size must be an integer"),
    ("vocab_size", 10**9, "vocab_size must be an integer in 1..4194304"),
    ("vocab_size", 100, "tokenizer has .* tokens, more than the model's vocab_size 100"),
    ("head_dim", 0, "head_dim must be an integer in 2..1024"),
    ("head_dim", 4096, "head_dim must be an integer in 2..1024"),
    ("num_attention_heads", 0, "num_attention_heads must be an integer"),
    ("num_key_value_heads", 3, "multiple of num_key_value_heads"),
    ("linear_num_key_heads", 3, "multiple of linear_num_key_heads"),
    ("linear_key_head_dim", -16, "linear_key_head_dim must be an integer"),
    ("linear_conv_kernel_dim", 0, "linear_conv_kernel_dim must be an integer in 2..64"),
    ("linear_conv_kernel_dim", 10**6, "linear_conv_kernel_dim must be an integer in 2..64"),
    ("rms_norm_eps", 0, r"rms_norm_eps must be a number in \(0, 0.1\]"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps must be a number"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number"),
    ("rms_norm_eps", 5.0, "rms_norm_eps must be a number"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),
    ("tie_word_embeddings", 0, "tie_word_embeddings must be true or false"),
    ("eos_token_id", 10**6, "eos_token_id must be a token id"),
    ("eos_token_id", -1, "eos_token_id must be a token id"),
    ("eos_token_id", [0, "1"], "eos_token_id must be a token id"),
    ("eos_token_id", True, "eos_token_id must be a token id"),
    ("layer_types", "linear_attention", "layer_types must list 4 entries"),
    ("layer_types", ["linear_attention"] * 3 + [7], "layer_types must list 4 entries"),
    ("layer_types", ["linear_attention"] * 10**5, "layer_types must list 4 entries"),
    ("layer_types", ["moe"] * 4, "layer_types must list 4 entries"),
    ("rope_parameters", "fast", "rope_parameters must be a JSON object"),
    ("rope_parameters", [1, 2], "rope_parameters must be a JSON object"),
    ("rope_parameters", {"rope_theta": 0}, r"rope_theta must be a number in \(0, 1e\+12\]"),
    ("rope_parameters", {"rope_theta": -1.0}, "rope_theta must be a number"),
    ("rope_parameters", {"rope_theta": 1e300}, "rope_theta must be a number"),
    ("rope_parameters", {"rope_theta": "10000"}, "rope_theta must be a number"),
    ("rope_parameters", {"partial_rotary_factor": 1.5}, r"partial_rotary_factor must be a number in \(0, 1\]"),
    ("rope_parameters", {"partial_rotary_factor": 0}, "partial_rotary_factor must be a number"),
    ("rope_parameters", {"partial_rotary_factor": -0.25}, "partial_rotary_factor must be a number"),
    ("rope_parameters", {"partial_rotary_factor": 0.01}, "positive even number"),
    ("model_type", ["qwen3_5"], "is not supported"),
    ("model_type", "llama", "'llama' is not supported"),
]
for field, value, expected in CONFIG_CASES:

    def _edit(c, field=field, value=value):
        if value is None:
            c.pop(field, None)
        else:
            c[field] = value

    add(
        f"config/{field}={str(value)[:20]}",
        r"config\.json.*" + expected if "tokenizer has" not in expected else expected,
        lambda w, _edit=_edit: w.load(w.edit_config(w.model(), _edit)),
    )

for interval in (0, -1, "4", 10**9 + 1, 2.5):

    def _edit(c, interval=interval):
        del c["layer_types"]
        c["full_attention_interval"] = interval

    add(
        f"config/full_attention_interval={interval}",
        "full_attention_interval must be an integer",
        lambda w, e=_edit: w.load(w.edit_config(w.model(), e)),
    )

add(
    "config/text_config-a-string",
    "text_config must be a JSON object",
    lambda w: w.load(w.edit_config(w.model("nested"), lambda c: c.__setitem__("text_config", "qwen"))),
)


def _config_bytes(data: bytes, expect: str):
    def run(w: Work):
        path = w.model()
        (path / "config.json").write_bytes(data)
        w.load(path)

    return run


for i, (data, expect) in enumerate(
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1,2,3]", "expected a JSON object"),
        (b"{" * 300_000, "not valid JSON"),
        (b'{"vocab_size": NaN}', "not valid JSON"),
        (b'{"vocab_size": Infinity}', "not valid JSON"),
        (b'{"vocab_size": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b"", "not valid JSON"),
    ]
):
    add(f"config/bytes-{i}", r"config\.json.*" + expect, _config_bytes(data, expect))


# ---- files that are not regular files, or too large -----------------------------------------------------


def _replace_file(name: str, how: str, kind: str = "single"):
    def run(w: Work):
        path = w.model(kind)
        target = path / name
        if target.exists() or target.is_symlink():
            target.unlink()
        if how == "fifo":
            os.mkfifo(target)
        elif how == "folder":
            target.mkdir()
        elif how == "dangling":
            os.symlink(path / "nowhere", target)
        elif how.startswith("/dev/"):
            os.symlink(how, target)
        else:  # a sparse file of `how` bytes
            with open(target, "wb") as f:
                f.truncate(int(how))
        w.load(path)

    return run


for name in (
    "config.json",
    "tokenizer.json",
    "model.safetensors",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
):
    add(f"files/{name}-fifo", re.escape(name) + ".*FIFO", _replace_file(name, "fifo"))
    add(f"files/{name}-dev-zero", re.escape(name) + ".*device", _replace_file(name, "/dev/zero"))
add("files/shard-fifo", r"safetensors.*FIFO", _replace_file("model-00001-of-00002.safetensors", "fifo", "sharded"))
add(
    "files/shard-dev-urandom",
    r"safetensors.*device",
    _replace_file("model-00002-of-00002.safetensors", "/dev/urandom", "sharded"),
)
add("files/config-a-folder", r"config\.json.*folder", _replace_file("config.json", "folder"))
add("files/config-dangling-link", r"config\.json.*(not found|broken link)", _replace_file("config.json", "dangling"))
add("files/config-5MiB", r"config\.json.*larger than", _replace_file("config.json", str(5 << 20)))
add("files/tokenizer-300MiB", r"tokenizer\.json.*larger than", _replace_file("tokenizer.json", str(300 << 20)))
add(
    "files/tokenizer_config-40MiB",
    r"tokenizer_config\.json.*larger than",
    _replace_file("tokenizer_config.json", str(40 << 20)),
)
add("files/template-2MiB", r"chat_template\.jinja.*larger than", _replace_file("chat_template.jinja", str(2 << 20)))
add(
    "files/index-80MiB",
    r"index\.json.*larger than",
    _replace_file("model.safetensors.index.json", str(80 << 20), "sharded"),
)


@case("files/tokenizer-not-utf8", r"tokenizer\.json: cannot read tokenizer")
def _(w: Work):
    path = w.model()
    (path / "tokenizer.json").write_bytes(b"\xff" * 100)
    w.load(path)


@case("files/tokenizer-garbage-json", r"tokenizer\.json: cannot read tokenizer")
def _(w: Work):
    path = w.model()
    (path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    w.load(path)


@case("files/generation_config-bad-eos", r"generation_config\.json: eos_token_id must be a token id")
def _(w: Work):
    path = w.model()
    (path / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    w.load(path)


for length in (2**63, 2**40, 10**8, 10**6, 1, 0):

    def _header(w: Work, length=length):
        path = w.model()
        f = path / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[:8] = length.to_bytes(8, "little")
        f.write_bytes(bytes(data))
        w.load(path)

    add(f"weights/header-length-{length}", r"model\.safetensors: cannot read safetensors header", _header)


@case("weights/truncated", r"model\.safetensors.*truncated")
def _(w: Work):
    path = w.model()
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    w.load(path)


for label, value in (("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf)):

    def _bad_weight(w: Work, value=value):
        from safetensors.torch import load_file, save_file

        path = w.model()
        tensors = load_file(str(path / "model.safetensors"))
        tensors["model.layers.1.self_attn.o_proj.weight"][0, 0] = value
        save_file(tensors, str(path / "model.safetensors"))
        w.load(path)

    add(f"weights/{label}", r"layers\.1\.self_attn\.o_proj\.weight has 1 NaN or infinite", _bad_weight)


@case("weights/overflow-in-float16", r"embed_tokens\.weight .*\(in float16\)")
def _(w: Work):
    from safetensors.torch import load_file, save_file

    path = w.model()
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.embed_tokens.weight"][0, 0] = 1e6
    save_file(tensors, str(path / "model.safetensors"))
    w.load(path, dtype="float16")


# ---- chat templates -------------------------------------------------------------------------------------

QWEN_LIKE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _template(template, where: str = "tokenizer_config.json"):
    def run(w: Work):
        from app.workloads import load_workloads

        path = w.model()
        if where == "tokenizer_config.json":
            (path / where).write_text(json.dumps({"chat_template": template}))
        else:
            (path / where).write_text(template)
        eng = w.load(path)
        prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
        assert prompt.startswith("<|im_start|>user\n"), prompt[:80]

    return run


TEMPLATES = [
    ("escape-mro", "{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("escape-globals", "{{ cycler.__init__.__globals__.os.system('true') }}", "SecurityError"),
    ("mutate-list", "{{ messages.append(1) }}", "SecurityError"),
    ("syntax", "{% for %}", "TemplateSyntaxError"),
    ("unknown-tag", "{% generation %}x{% endgeneration %}", "TemplateSyntaxError"),
    ("raise", "{{ raise_exception('only user and assistant roles') }}", "only user and assistant roles"),
    ("huge-string", "{{ 'a' * 1000000000 }}", "larger than"),
    ("huge-list", "{{ ([1] * 100000000)|length }}", "larger than"),
    ("huge-output", "{% for i in range(100000) %}{{ 'x' * 900 }}{% endfor %}", "output is larger"),
    (
        "doubling",
        "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "larger",
    ),
    ("center", "{{ 'a'|center(1000000000) }}", "larger than 100000"),
    ("percent-width", "{{ '%01000000000d' % 1 }}", "format width"),
    ("format-width", "{{ '{:>1000000000}'.format(1) }}", "format width"),
    ("power", "{{ 2 ** 100000000 }}", "power"),
    (
        "int-squaring",
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "larger",
    ),
    ("recursion", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(1) }}", "recurses too deeply"),
    ("nested-parens", "{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}", "nests or recurses|SyntaxError|MemoryError"),
    (
        "loop-forever",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "ran for more than",
    ),
    ("lipsum", "{{ lipsum(1000000000) }}", "UndefinedError|larger than"),
    ("undefined", "{{ nothing.here }}", "UndefinedError"),
]
for label, template, expected in TEMPLATES:
    add(f"template/{label}", r"tokenizer_config\.json: chat template failed.*" + expected, _template(template))
add(
    "template/jinja-file-loop",
    r"chat_template\.jinja: chat template failed.*ran for more",
    _template(TEMPLATES[-3][1], "chat_template.jinja"),
)
add(
    "template/list-form-default",
    "ok",
    _template([{"name": "tool_use", "template": "T"}, {"name": "default", "template": QWEN_LIKE}]),
)
add("template/list-form-no-default", "none named 'default'", _template([{"name": "tool_use", "template": "T"}]))
add("template/a-number", "chat_template must be a string or a list", _template(42))
add("template/plain-works", "ok", _template(QWEN_LIKE))


# ---- prompts and arguments ------------------------------------------------------------------------------


def _generate(*args, **kwargs):
    def run(w: Work):
        w.load().generate(*args, **kwargs)

    return run


for i, (prompt, pos) in enumerate(
    [("\ud800", 0), ("def f():\udcff", 8), ("x\U0001f600y\ud83d", 3), ("\udfff" * 100, 0)]
):
    add(f"prompt/lone-surrogate-{i}", f"not valid Unicode at character {pos}", _generate(prompt, 4))
for prompt in (None, 5, 3.5, b"def", {"text": "x"}, ("a", "b")):
    add(
        f"prompt/type-{type(prompt).__name__}",
        r"^prompt (must be text|token ids must be integers)",
        _generate(prompt, 4),
    )
for ids in ([1, True], [1, 2.0], ["1"], [10**9]):
    add(f"prompt/ids-{ids!r}"[:40], r"prompt token ids must be integers|out of range", _generate(ids, 4))
add("prompt/empty", "the prompt is empty", _generate("", 4))
add("prompt/too-long-text", "far more than the context", _generate("x" * 5_000_000, 4))
add("prompt/too-many-ids", "exceeds the context", _generate([1] * 5000, 4))
for value in (True, False, 4.0, "4", None, 0, -3):
    add(f"args/max_new_tokens={value!r}", "^max_new_tokens must be", _generate("def", value))
add("args/settings-a-dict", "^settings must be an EngineSettings", _generate("def", 4, {"draft_depth": 3}))
add("args/settings-a-string", "^settings must be an EngineSettings", _generate("def", 4, "chain"))
add("args/session-a-string", "^session must be a Session", _generate("def", 4, None, "default"))
for kwargs, name in (
    ({"model_dir": 5}, "model_dir"),
    ({"dtype": {"a": 1}}, "dtype"),
    ({"device": 0}, "device"),
    ({"gemm": None}, "gemm"),
    ({"devices": "cpu"}, "devices"),
    ({"max_context": True}, "max_context"),
    ({"max_context": 8}, "max_context"),
    ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"),
):
    add(
        f"args/load-{name}={list(kwargs.values())[0]!r}"[:48],
        f"{name}|{list(kwargs.values())[0]}",
        lambda w, kw=kwargs: w.load(**kw),
    )
add("args/model-path-with-nul", "not a usable path", lambda w: w.load(str(w.dir) + "/a\0b"))
add(
    "args/settings-depth-bool",
    "draft_depth must be an integer",
    lambda w: __import__("engine").EngineSettings(draft_depth=True),
)


@case("session/dropped-unstarted-stream-releases")
def _(w: Work):
    import gc

    eng = w.load()
    sess = eng.new_session()
    for _ in range(5):
        eng.stream("def", 4, session=sess)
    gc.collect()
    assert len(eng.generate("def", 4, session=sess).tokens) == 4


@case("session/dropped-midway-stream-releases")
def _(w: Work):
    import gc

    eng = w.load()
    s = eng.stream("def main", 16)
    next(s)
    del s
    gc.collect()
    assert len(eng.generate("def", 4).tokens) == 4


@case("cli/non-utf8-prompt-bytes", "ok")
def _(w: Work):
    proc = subprocess.run(
        [
            os.fsencode(sys.executable),
            b"-m",
            b"app",
            b"generate",
            b"--model",
            os.fsencode(w.model()),
            b"--prompt",
            b"ab\xff",
            b"-n",
            b"2",
        ],
        capture_output=True,
        cwd=under_test(),
        timeout=120,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err and "character 2" in err, err


@case("cli/non-utf8-model-path", "ok")
def _(w: Work):
    proc = subprocess.run(
        [
            os.fsencode(sys.executable),
            b"-m",
            b"app",
            b"generate",
            b"--model",
            b"/no/such/\xff\xfe",
            b"--prompt",
            b"x",
        ],
        capture_output=True,
        cwd=under_test(),
        timeout=120,
    )
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "Traceback" not in err and "does not exist" in err, err


# ---- profiles -------------------------------------------------------------------------------------------

GOOD = """\
version = 1
name = "other"

[settings]
speculative = true
draft_depth = 6
p_min = 0.1
chain = true
sub_vocab = 0
mirror_output = true
plan_pool = 8
"""
PROFILE_BYTES = [
    ("deep-arrays", (GOOD + "[bench]\nx = " + "[" * 200_000 + "]" * 200_000).encode(), "nested too deeply"),
    ("deep-tables", (GOOD + "[bench]\nx = " + "{a = " * 5000 + "1" + "}" * 5000).encode(), "nested too deeply"),
    ("deep-dotted", (GOOD + "[bench]\n" + ".".join(["a"] * 300_000) + " = 1").encode(), "took more than"),
    ("deep-dotted-bench", (GOOD + "[bench]\n" + ".".join(["a"] * 3000) + " = 1").encode(), "nested more than 8"),
    ("wide-bench", (GOOD + "[bench]\nx = [" + "1," * 20_000 + "]").encode(), "too many values"),
    ("not-utf8", b'version = 1\nname = "\xff\xfe"\n', "not UTF-8"),
    ("nul-bytes", b"\0" * 100, "not valid TOML"),
    ("random-bytes", bytes(range(256)) * 8, "not UTF-8|not valid TOML"),
    ("empty", b"", "empty file"),
    ("whitespace", b" \n\t\n", "empty file"),
    ("name-a-table", GOOD.replace('name = "other"', "name = {a = 1}").encode(), "field 'name' must be"),
    ("name-empty", GOOD.replace('name = "other"', 'name = "  "').encode(), "field 'name' must be"),
    ("name-5000", GOOD.replace('"other"', '"' + "n" * 5000 + '"').encode(), "at most 1000"),
    ("depth-a-string", GOOD.replace("draft_depth = 6", 'draft_depth = "6"').encode(), "draft_depth must be an integer"),
    ("depth-a-float", GOOD.replace("draft_depth = 6", "draft_depth = 6.0").encode(), "draft_depth must be an integer"),
    (
        "depth-huge",
        GOOD.replace("draft_depth = 6", "draft_depth = 9223372036854775807").encode(),
        "draft_depth must be in",
    ),
    (
        "depth-a-date",
        GOOD.replace("draft_depth = 6", "draft_depth = 1979-05-27").encode(),
        "draft_depth must be an integer",
    ),
    ("p-min-nan", GOOD.replace("p_min = 0.1", "p_min = nan").encode(), "p_min must be a number in 0..1"),
    ("p-min-inf", GOOD.replace("p_min = 0.1", "p_min = -inf").encode(), "p_min must be a number in 0..1"),
    ("chain-a-string", GOOD.replace("chain = true", 'chain = "yes"').encode(), "chain must be true or false"),
    ("settings-a-list", GOOD.replace("[settings]", "settings = [1]\n[x]").encode(), "unknown field|settings"),
    ("version-huge", GOOD.replace("version = 1", "version = 99999999999999999").encode(), "newer SpecDeck"),
    ("version-bool", GOOD.replace("version = 1", "version = true").encode(), "version' must be a positive integer"),
    ("version-missing", GOOD.replace("version = 1\n", "").encode(), "missing field 'version'"),
    (
        "bench-a-string",
        GOOD.replace('name = "other"', 'name = "other"\nbench = "fast"').encode(),
        "'bench' must be a table",
    ),
    ("fraction-nan", GOOD.replace("[settings]", "[settings]\nsub_vocab_fraction = nan").encode(), r"\(0, 1\]"),
    ("control-key", GOOD.replace("plan_pool = 8", 'plan_pool = 8\n"\\u0007\\n" = 1').encode(), "unknown setting"),
    ("many-unknown-keys", (GOOD + "\n".join(f"[t{i}]" for i in range(20_000))).encode(), "unknown field"),
    ("utf8-bom", b"\xef\xbb\xbf" + GOOD.encode(), "not valid TOML|ok"),
]
for label, data, expected in PROFILE_BYTES:
    add(f"profile/{label}", "ok", lambda w, d=data, e=expected: good_profile_survives(w, lambda p: p.write_bytes(d), e))


def _profile_special(how: str, expect: str):
    def write(p: Path):
        if how == "fifo":
            os.mkfifo(p)
        elif how == "folder":
            p.mkdir()
        elif how == "dangling":
            os.symlink(p.parent / "nowhere", p)
        elif how.startswith("/"):
            os.symlink(how, p)
        else:
            with open(p, "wb") as f:
                f.truncate(int(how))

    return lambda w: good_profile_survives(w, write, expect)


for how, expect in (
    ("fifo", "FIFO"),
    ("/dev/zero", "character device"),
    ("/dev/urandom", "character device"),
    ("/dev/null", "character device"),
    ("folder", "folder"),
    ("dangling", "no such file|not found"),
    (str(5 << 20), "larger than"),
    (str(1 << 34), "larger than"),
):
    add(f"profile/special-{how.strip('/').replace('/', '-')}", "ok", _profile_special(how, expect))


@case("profile/long-name-saves-with-a-short-file-name")
def _(w: Work):
    from app.profiles import Profile, read_profile_file
    from engine.settings import EngineSettings

    store = w.store()
    name = "A very long profile name, " * 30
    saved = store.save(Profile(name=name, settings=EngineSettings()))
    assert len(saved.path.name) <= 100 and read_profile_file(saved.path).name == name.strip()


@case("profile/name-too-long", "at most 1000 characters")
def _(w: Work):
    from app.profiles import Profile
    from engine.settings import EngineSettings

    w.store().save(Profile(name="n" * 100_000, settings=EngineSettings()))


@case("profile/name-lone-surrogate", "not valid Unicode")
def _(w: Work):
    from app.profiles import Profile
    from engine.settings import EngineSettings

    w.store().save(Profile(name="x\udcff", settings=EngineSettings()))


@case("profile/full-disk-keeps-the-old-file")
def _(w: Work):
    from app import profiles as P
    from engine.settings import EngineSettings

    store = w.store()
    path = store.directory / "good.toml"
    before = path.read_bytes()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    P.os.fsync = full
    try:
        store.save(P.Profile(name="good", settings=EngineSettings(draft_depth=9)))
    except P.ProfileError as exc:
        assert "good.toml" in str(exc) and "No space left" in str(exc) and "\n" not in str(exc), exc
    else:
        raise AssertionError("no error")
    assert path.read_bytes() == before and sorted(p.name for p in store.directory.iterdir()) == ["good.toml"]


@case("profile/read-only-folder", "cannot write .* in .*")
def _(w: Work):
    from app import profiles as P
    from engine.settings import EngineSettings

    store = w.store()

    def denied(*a, **k):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    import tempfile

    tempfile.mkstemp = denied  # where the profile's temp file would be made (engine/files.py)
    store.save(P.Profile(name="new one", settings=EngineSettings()))


@case("profile/concurrent-saves-lose-nothing")
def _(w: Work):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import time\n"
        "from app.profiles import Profile, ProfileStore; from engine.settings import EngineSettings\n"
        "s = ProfileStore(Path(sys.argv[2]), shipped_dir=None); k = int(sys.argv[3]); t = float(sys.argv[4])\n"
        "while time.time() < t: time.sleep(0.001)\n"
        "for i in range(12): s.save(Profile(name=(f'Race {i}' if k % 2 else f'race-{i}') + f' {k // 2}', settings=EngineSettings()))\n"
    )
    directory = w.dir / "race"
    start = time.time() + 2.0
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(under_test()), str(directory), str(k), str(start)])
        for k in range(4)
    ]
    assert all(p.wait(120) == 0 for p in procs)
    from app.profiles import ProfileStore

    profiles, problems = ProfileStore(directory, shipped_dir=None).list()
    assert len(profiles) == 48 and not problems, (len(profiles), problems)


def _last_used(data: bytes | None, how: str = ""):
    def run(w: Work):
        from app import profiles as P

        os.environ["SPECDECK_CONFIG_DIR"] = str(w.dir / "config")
        path = P.last_used_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        if how == "fifo":
            os.mkfifo(path)
        elif how:
            os.symlink(how, path)
        else:
            path.write_bytes(data)
        settings, notice = P.load_last_used()
        assert settings is None and notice.startswith("last used settings not restored") and "\n" not in notice, notice

    return run


for label, data, how in (
    ("garbage", b"\xff\xfe garbage", ""),
    ("deep", b"x = " + b"[" * 100_000, ""),
    ("bad-value", GOOD.replace("draft_depth = 6", 'draft_depth = "x"').encode(), ""),
    ("fifo", None, "fifo"),
    ("dev-zero", None, "/dev/zero"),
):
    add(f"state/last_used-{label}", "ok", _last_used(data, how))


def _window_ini(data: bytes | None, how: str = ""):
    def run(w: Work):
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
        config = w.dir / "config"
        os.environ["SPECDECK_CONFIG_DIR"] = str(config)
        config.mkdir(parents=True, exist_ok=True)
        if how == "fifo":
            os.mkfifo(config / "window.ini")
        elif how:
            os.symlink(how, config / "window.ini")
        else:
            (config / "window.ini").write_bytes(data)
        from PySide6.QtWidgets import QApplication

        from app.gui.window import MainWindow

        app = QApplication.instance() or QApplication(["battery"])
        window = MainWindow(model_dir=str(w.model()), sample_interval_s=1.0)
        window.show()
        app.processEvents()
        assert window.isVisible()
        window.shutdown()

    return run


for label, data, how in (
    ("bad-values", b"[window]\ngeometry=nope\n[run]\nmax_new_tokens=lots\ndtype=a, b\nmodel_dirs=5\n", ""),
    ("garbage", b"\xff\xfe\x00\n[[[[\n====\n", ""),
    ("overflow", b"[run]\nmax_new_tokens=99999999999999999999999\nmodel_dir=\\0\n", ""),
    ("fifo", None, "fifo"),
    ("dev-zero", None, "/dev/zero"),
):
    add(f"state/window.ini-{label}", "ok", _window_ini(data, how))


# ---- running ----------------------------------------------------------------------------------------------


def child(name: str, base: Path, work: Path) -> int:
    root = str(under_test())
    sys.path[:0] = [root, str(TESTS)]
    os.chdir(root)
    found = [c for c in CASES if c.name == name]
    work.mkdir(parents=True, exist_ok=True)
    try:
        found[0].run(Work(base, work))
        out = {"outcome": "ok"}
    except AssertionError as exc:
        out = {"outcome": "wrong", "type": "AssertionError", "message": str(exc)[:500]}
    except Exception as exc:  # judged by the parent
        out = {
            "outcome": "error",
            "type": type(exc).__name__,
            "mro": [k.__name__ for k in type(exc).__mro__],
            "message": str(exc),
        }
    sys.stdout.write("\n@@RESULT@@" + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: a case's threads or Qt objects cannot hang the exit


def judge(c: Case, out: dict) -> tuple[bool, str]:
    if out["outcome"] == "ok":
        return (c.expect == "ok" or "ok" in c.expect.split("|")), "ok"
    if out["outcome"] == "wrong":
        return False, f"wrong result: {out['message']}"
    msg, kinds = out["message"], set(out["mro"])
    clear = bool(kinds & {*CLEAR_ERRORS, "ValueError", "TypeError"}) and msg and "\n" not in msg and len(msg) < 1000
    if not clear:
        return False, f"not a clear error: {out['type']}: {msg[:300]!r}"
    if c.expect == "ok" or not re.search(c.expect, msg):
        return False, f"unexpected error: {out['type']}: {msg[:300]}"
    return True, f"{out['type']}: {msg[:160]}"


def _limits(mem_bytes: int):
    def apply():
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.setsid()

    return apply


def run_case(
    c: Case, base: Path, tmp: Path, timeout: float, mem_bytes: int, root: Path = ROOT
) -> tuple[Case, bool, str, float]:
    work = tmp / re.sub(r"[^A-Za-z0-9_.-]+", "_", c.name)[:80]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(TESTS)]), QT_QPA_PLATFORM="offscreen")
    env["SPECDECK_BATTERY_ROOT"] = str(root)
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", c.name, "--base", str(base), "--work", str(work)],
            capture_output=True,
            timeout=timeout,
            env=env,
            preexec_fn=_limits(mem_bytes),
        )
    except subprocess.TimeoutExpired:
        return c, False, f"hung: no answer within {timeout:g} s", time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.perf_counter() - t0
    text = proc.stdout.decode("utf-8", "replace")
    if "@@RESULT@@" not in text:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["(no output)"]
        return c, False, f"crashed (exit {proc.returncode}): {tail[0][:200]}", elapsed
    ok, why = judge(c, json.loads(text.rsplit("@@RESULT@@", 1)[1].strip().splitlines()[0]))
    return c, ok, why, elapsed


def prepare_models(base: Path) -> None:
    sys.path[:0] = [str(ROOT), str(TESTS)]
    from tiny_models import write_tiny_model

    write_tiny_model(base / "single", seed=0)
    write_tiny_model(base / "sharded", seed=1, shards=2)
    write_tiny_model(base / "nested", seed=2, nested=True)


def run_battery(
    cases: list[Case], jobs: int, timeout: float, mem_mb: int, verbose: bool = False, out=sys.stdout, root: Path = ROOT
) -> tuple[int, int, list[tuple[str, str]]]:
    tmp = Path(tempfile.mkdtemp(prefix="specdeck-battery-"))
    failures: list[tuple[str, str]] = []
    passed = 0
    try:
        prepare_models(tmp / "base")
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_case, c, tmp / "base", tmp, timeout, mem_mb << 20, root) for c in cases]
            for future in concurrent.futures.as_completed(futures):
                c, ok, why, elapsed = future.result()
                passed += ok
                if not ok:
                    failures.append((c.name, why))
                line = f"{'PASS' if ok else 'FAIL'}  {c.name:<58} {elapsed:5.1f}s"
                if verbose or not ok:
                    line += f"  {why}"
                print(line, file=out, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return passed, len(cases), failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", help="only the cases whose name contains this")
    p.add_argument("-j", "--jobs", type=int, default=max(1, (os.cpu_count() or 2)))
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    p.add_argument("--mem-mb", type=int, default=4096, help="address-space cap per case (default 4096 MiB)")
    p.add_argument("-v", "--verbose", action="store_true", help="print each case's error message")
    p.add_argument("--list", action="store_true")
    p.add_argument("--root", type=Path, default=ROOT, help="the SpecDeck checkout to test (default: this one)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child(a.child, Path(a.base), Path(a.work))
    cases = [c for c in CASES if not a.k or a.k in c.name]
    if a.list:
        for c in cases:
            print(f"{c.name:<60} expects {c.expect}")
        print(f"{len(cases)} cases")
        return 0
    t0 = time.perf_counter()
    passed, total, failures = run_battery(cases, a.jobs, a.timeout, a.mem_mb, a.verbose, root=a.root.resolve())
    print(f"\n{passed}/{total} passed, {total - passed} failed ({time.perf_counter() - t0:.0f} s)")
    for name, why in failures:
        print(f"  FAIL {name}: {why}")
    return 0 if passed == total else 1


if __name__ == "__main__":
    sys.exit(main())
