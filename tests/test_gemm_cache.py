"""The gemm autotune cache (engine/gemm_cache.py) and the gemm modes' CPU-side rules (engine/gemm.py): a round
trip, a corrupt file rebuilt with a one-line notice (never an error), entries of the wrong types skipped, keys
that name the GPU, atomic writes, and nothing written outside the test's own folders. The measuring itself
runs on a GPU (tests/test_gemv_engine_gpu.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine import gemm_cache as gc
from engine.errors import EngineError
from engine.gemm import GEMM_MODES, ROW_BUCKETS, bucket_index, bucket_label, check_mode
from engine.gemm_cache import TuneCache, cache_file, cache_key

KEY = cache_key("NVIDIA H200", torch.bfloat16, 4096, 4096, "m1", "0123456789ab")


def test_the_default_folder_is_the_tests_own(monkeypatch, tmp_path):
    """conftest.py points SPECDECK_CACHE_DIR into the session's temp dir; without it the platform's cache folder
    is used, never the config folder, and the application is not imported."""
    here = gc.default_cache_dir().resolve()
    assert "specdeck-tests-" in str(here)
    monkeypatch.setenv(gc.CACHE_DIR_ENV, str(tmp_path / "c"))
    assert cache_file() == tmp_path / "c" / "gemm_tune.json"
    assert cache_file(tmp_path / "d") == tmp_path / "d" / "gemm_tune.json"
    monkeypatch.delenv(gc.CACHE_DIR_ENV)
    assert gc.default_cache_dir().name == "specdeck"
    assert "config" not in gc.default_cache_dir().name


def test_round_trip(tmp_path, capsys):
    path = tmp_path / "sub" / "gemm_tune.json"
    cache = TuneCache(path)
    assert cache.entries == {} and cache.notice == ""
    cache.put(KEY, "tc1.w8.s1", {"cublas": 12.5, "tc1.w8.s1": 9.75})
    cache.put(KEY.replace("m1", "m2-4"), "cublas")
    cache.save()
    assert sorted(os.listdir(path.parent)) == ["gemm_tune.json"]  # no temporary file left behind
    again = TuneCache(path)
    assert again.get(KEY) == "tc1.w8.s1"
    assert again.entries[KEY]["us"] == {"cublas": 12.5, "tc1.w8.s1": 9.75}
    assert again.get(KEY.replace("m1", "m2-4")) == "cublas"
    assert again.get(KEY.replace("m1", "m9-17")) is None
    assert capsys.readouterr().err == ""


def test_a_save_merges_with_what_another_process_wrote(tmp_path):
    path = tmp_path / "gemm_tune.json"
    a, b = TuneCache(path), TuneCache(path)
    a.put(KEY, "tc1.w4.s2")
    a.save()
    b.put(KEY.replace("m1", "m5-8"), "simt1.w4.s1")
    b.save()
    both = TuneCache(path)
    assert both.get(KEY) == "tc1.w4.s2" and both.get(KEY.replace("m1", "m5-8")) == "simt1.w4.s1"


def test_the_key_names_the_gpu_versions_shape_bucket_and_dtype(tmp_path):
    other_gpu = cache_key("NVIDIA A100-SXM4-80GB", torch.bfloat16, 4096, 4096, "m1", "0123456789ab")
    assert other_gpu != KEY and "NVIDIA H200" in KEY and torch.__version__ in KEY
    assert cache_key("NVIDIA H200", torch.float16, 4096, 4096, "m1", "0123456789ab") != KEY
    assert cache_key("NVIDIA H200", torch.bfloat16, 4096, 12288, "m1", "0123456789ab") != KEY
    assert cache_key("NVIDIA H200", torch.bfloat16, 4096, 4096, "m5-8", "0123456789ab") != KEY
    assert cache_key("NVIDIA H200", torch.bfloat16, 4096, 4096, "m1", "ffffffffffff") != KEY  # new kernels
    path = tmp_path / "gemm_tune.json"
    cache = TuneCache(path)
    cache.put(other_gpu, "tc2.w8.s1")
    cache.save()
    assert TuneCache(path).get(KEY) is None  # another GPU's choice is not this one's


@pytest.mark.parametrize(
    "content,why",
    [
        (b"\x00\xff garbage", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"[1, 2]", "not a SpecDeck gemm autotune cache"),
        (b'{"format": "other", "version": 1, "entries": {}}', "not a SpecDeck gemm autotune cache"),
        (b'{"format": "specdeck-gemm-tune", "version": 99, "entries": {}}', "another version"),
        (b'{"format": "specdeck-gemm-tune", "version": true, "entries": {}}', "another version"),
        (b'{"format": "specdeck-gemm-tune", "version": 1, "entries": []}', "not a table"),
        (b'{"format": "specdeck-gemm-tune", "version": 1, "entries": {"a": NaN}}', "not valid JSON"),
        (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    ],
)
def test_a_corrupt_file_is_rebuilt_with_one_notice_line(tmp_path, capsys, content, why):
    path = tmp_path / "gemm_tune.json"
    path.write_bytes(content)
    cache = TuneCache(path)
    assert cache.entries == {}
    assert why in cache.notice and "rebuilt" in cache.notice and "\n" not in cache.notice
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specdeck: notice: ") and str(path) in err
    cache.put(KEY, "tc1.w8.s1")
    cache.save()
    assert TuneCache(path).get(KEY) == "tc1.w8.s1"  # the file was replaced by a good one
    assert json.loads(path.read_text())["format"] == "specdeck-gemm-tune"


def test_too_large_or_not_a_file_is_not_read(tmp_path, capsys, monkeypatch):
    path = tmp_path / "gemm_tune.json"
    monkeypatch.setattr(gc, "MAX_BYTES", 64)
    path.write_text(json.dumps({"format": "specdeck-gemm-tune", "version": 1, "entries": {KEY: {"choice": "cublas"}}}))
    cache = TuneCache(path)
    assert cache.entries == {} and "larger than" in cache.notice
    path.unlink()
    path.mkdir()
    cache = TuneCache(path)
    assert cache.entries == {} and "a folder" in cache.notice
    cache.put(KEY, "cublas")
    cache.save()  # cannot replace a folder: a notice, no exception
    assert "cannot be written" in cache.notice
    assert path.is_dir() and [p.name for p in tmp_path.iterdir()] == ["gemm_tune.json"]
    capsys.readouterr()


def test_entries_of_the_wrong_types_are_skipped_silently(tmp_path, capsys):
    good = {"choice": "tc1.w8.s1", "us": {"cublas": 10, "tc1.w8.s1": 8.5, "bogus": 1, "tc2.w4.s1": "fast"}}
    entries = {
        KEY: good,
        KEY + "x": {"choice": 5},
        KEY + "y": {"choice": "fastest"},
        KEY + "z": "cublas",
        KEY + "w": {"choice": "cublas", "us": [1, 2]},
        KEY + "v": {"choice": "tc1.w8.s1", "us": {"cublas": -1.0, "tc1.w8.s1": True}},
        "k" * 401: {"choice": "cublas"},
        "bad\nkey": {"choice": "cublas"},
    }
    path = tmp_path / "gemm_tune.json"
    path.write_text(json.dumps({"format": "specdeck-gemm-tune", "version": 1, "entries": entries}))
    cache = TuneCache(path)
    assert cache.notice == "" and capsys.readouterr().err == ""
    assert cache.get(KEY) == "tc1.w8.s1" and cache.entries[KEY]["us"] == {"cublas": 10.0, "tc1.w8.s1": 8.5}
    assert cache.get(KEY + "w") == "cublas" and "us" not in cache.entries[KEY + "w"]
    assert cache.get(KEY + "v") == "tc1.w8.s1" and "us" not in cache.entries[KEY + "v"]
    assert set(cache.entries) == {KEY, KEY + "w", KEY + "v"}
    with pytest.raises(ValueError):
        cache.put(KEY, "fastest")


def test_an_in_memory_cache_writes_nothing(tmp_path):
    cache = TuneCache(None)
    cache.put(KEY, "cublas")
    cache.save()
    assert cache.get(KEY) == "cublas" and list(tmp_path.iterdir()) == []


def test_modes_and_buckets():
    assert GEMM_MODES == ("cublas", "autotune", "cupy", "auto", "exact")
    assert [bucket_index(m) for m in range(1, 18)] == [0] + [1] * 3 + [2] * 4 + [3] * 9
    assert [bucket_label(i) for i in range(len(ROW_BUCKETS))] == ["m1", "m2-4", "m5-8", "m9-17"]
    for mode in ("cupy", "auto", "autotune", "exact"):
        with pytest.raises(EngineError, match=f"gemm='{mode}' needs a CUDA device.*use gemm='cublas'"):
            check_mode(mode, torch.device("cpu"))
    check_mode("cublas", torch.device("cpu"))
    with pytest.raises(EngineError, match="use one of cublas, autotune, cupy, auto, exact"):
        check_mode("fast", torch.device("cuda"))


def test_the_engine_refuses_the_gpu_modes_on_the_cpu(tiny_model_dir):
    from engine import Engine

    for mode in ("cupy", "auto"):
        with pytest.raises(EngineError, match=f"gemm='{mode}' needs a CUDA device"):
            Engine.load(tiny_model_dir, device="cpu", gemm=mode)


def test_the_command_line_offers_the_modes():
    from app.cli import build_parser

    parser = build_parser()
    for mode in GEMM_MODES:
        assert parser.parse_args(["generate", "--gemm", mode, "--prompt", "x"]).gemm == mode
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--gemm", "fast", "--prompt", "x"])


def test_cpu_engine_info_has_no_choices(tiny_engine):
    assert tiny_engine.info["gemm_choices"] == {} and tiny_engine.info["gemm_notice"] == ""
    assert tiny_engine.generate("def", 2).stats["gemm_choices"] == {}


def test_the_module_does_not_import_the_application():
    text = Path(gc.__file__).read_text()
    assert "import app" not in text and "from app" not in text
