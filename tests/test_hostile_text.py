"""Invalid text and wrong argument types: one clear error naming the position or the parameter, never a
silent reinterpretation; a stream dropped before it starts never leaves its session locked."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

from engine import Engine, EngineError, EngineSettings


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and len(msg) < 400
    return msg


@pytest.mark.parametrize(
    "prompt,position",
    [("\ud800", 0), ("def f():\udcff", 8), ("ok " * 10 + "\udfff tail", 30), ("a\U0001f600b\ud83d", 3)],
)
def test_a_prompt_with_a_lone_surrogate_names_the_position(tiny_engine, prompt, position):
    with pytest.raises(EngineError) as info:
        tiny_engine.generate(prompt, 4)
    msg = one_line(info.value)
    assert f"at character {position}" in msg and "not valid Unicode" in msg


@pytest.mark.parametrize("prompt", [None, 5, 3.5, b"def f", {"text": "x"}, object()])
def test_a_prompt_of_the_wrong_type_is_a_type_error_naming_prompt(tiny_engine, prompt):
    with pytest.raises(TypeError) as info:
        tiny_engine.generate(prompt, 4)
    assert one_line(info.value).startswith("prompt must be text")


@pytest.mark.parametrize("ids,what", [([1, True, 3], "bool"), ([1, 2.0], "float"), (["1"], "str")])
def test_token_ids_of_the_wrong_type(tiny_engine, ids, what):
    with pytest.raises(TypeError) as info:
        tiny_engine.generate(ids, 4)
    msg = one_line(info.value)
    assert "prompt token ids must be integers" in msg and what in msg


@pytest.mark.parametrize("value", [True, False, 4.0, "4", None])
def test_max_new_tokens_must_be_an_integer_not_a_bool(tiny_engine, value):
    with pytest.raises(TypeError) as info:
        tiny_engine.generate("def", value)
    assert one_line(info.value).startswith("max_new_tokens must be an integer")


def test_settings_as_a_dict_is_a_type_error_naming_settings(tiny_engine):
    with pytest.raises(TypeError) as info:
        tiny_engine.generate("def", 4, {"draft_depth": 3})
    msg = one_line(info.value)
    assert msg.startswith("settings must be an EngineSettings") and "from_dict" in msg
    with pytest.raises(TypeError, match="session must be a Session"):
        tiny_engine.generate("def", 4, EngineSettings(), session="default")


def test_type_errors_are_engine_errors_too(tiny_engine):
    """Callers that catch EngineError (the app's worker, the CLI) see argument errors as well."""
    with pytest.raises(EngineError):
        tiny_engine.generate(None, 4)


def test_a_prompt_far_longer_than_the_context_is_refused_before_tokenising(tiny_engine):
    with pytest.raises(EngineError, match="characters, far more than the context"):
        tiny_engine.generate("x" * (1024 * tiny_engine.max_context + 1), 4)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"model_dir": 5}, "model_dir"),
        ({"dtype": {"a": 1}}, "dtype"),
        ({"device": 0}, "device"),
        ({"gemm": None}, "gemm"),
        ({"devices": "cpu"}, "devices"),
        ({"max_context": True}, "max_context"),
    ],
)
def test_engine_load_argument_types(tiny_model_dir, kwargs, name):
    kwargs = {"model_dir": tiny_model_dir} | kwargs
    with pytest.raises(TypeError) as info:
        Engine.load(**kwargs)
    assert one_line(info.value).startswith(name)


def test_a_model_path_with_a_nul_byte_is_one_line(tmp_path):
    with pytest.raises(EngineError, match="not a usable path"):
        Engine.load(str(tmp_path) + "/a\0b")


# ---- the session lock --------------------------------------------------------------------------------


def test_a_stream_created_and_dropped_unstarted_releases_the_session(tiny_engine):
    sess = tiny_engine.new_session()
    stream = tiny_engine.stream("def", 4, session=sess)
    assert sess.busy.locked()
    del stream
    gc.collect()
    assert not sess.busy.locked()
    assert len(tiny_engine.generate("def", 4, session=sess).tokens) == 4


def test_a_stream_closed_unstarted_or_dropped_midway_releases_the_session(tiny_engine):
    sess = tiny_engine.new_session()
    tiny_engine.stream("def", 4, session=sess).close()
    assert not sess.busy.locked()
    stream = tiny_engine.stream("def main", 16, EngineSettings(draft_depth=1), session=sess)
    next(stream)
    assert sess.busy.locked()
    with pytest.raises(EngineError, match="already generating"):
        tiny_engine.stream("def", 4, session=sess)
    del stream
    gc.collect()
    assert not sess.busy.locked()
    assert len(tiny_engine.generate("def", 4, session=sess).tokens) == 4


def test_many_dropped_streams_never_wedge_the_default_session(tiny_engine):
    for _ in range(20):
        tiny_engine.stream("def", 2)
    gc.collect()
    assert len(tiny_engine.generate("def", 2).tokens) == 2


# ---- the command line ------------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="bytes on the command line")
def test_non_utf8_bytes_on_the_command_line_are_one_clear_line(tiny_model_dir):
    """A prompt byte that is not UTF-8 reaches Python as a lone surrogate (surrogateescape): the CLI says
    where, in one line, with no traceback."""
    args = [os.fsencode(sys.executable), b"-m", b"app", b"generate", b"--model", os.fsencode(tiny_model_dir)]
    env = dict(os.environ, PYTHONPATH=os.getcwd(), LC_ALL="C.UTF-8")
    proc = subprocess.run([*args, b"--prompt", b"def f\xff():", b"-n", b"4"], capture_output=True, env=env, timeout=120)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "not valid Unicode at character 5" in err
    proc = subprocess.run([*args[:-1], b"/nonexistent/\xff\xfe", b"--prompt", b"x"], capture_output=True, env=env)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 2 and "Traceback" not in err and "does not exist" in err, err
