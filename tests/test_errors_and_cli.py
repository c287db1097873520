"""Bad input gets one line naming the file or field and what to do; the CLI prints text and JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import write_tiny_model

from app.cli import main
from engine import Engine, EngineError, EngineSettings, ModelLoadError


@pytest.fixture()
def model_copy(tiny_model_dir, tmp_path) -> Path:
    dst = tmp_path / "m"
    shutil.copytree(tiny_model_dir, dst)
    return dst


def _load_error(path: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        Engine.load(path)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing_directory(tmp_path):
    assert "does not exist" in _load_error(tmp_path / "nope")


def test_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "empty" in _load_error(tmp_path / "empty")


def test_not_a_model_directory(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("hi")
    msg = _load_error(tmp_path / "x")
    assert "config.json" in msg and "not found" in msg


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{ not json")
    msg = _load_error(model_copy)
    assert "config.json" in msg and "not valid JSON" in msg


def test_unsupported_model_type(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (model_copy / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(model_copy)
    assert "'llama'" in msg and "not supported" in msg


def test_missing_config_field(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    assert "hidden_size" in _load_error(model_copy)


def _rewrite_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_tensor(model_copy):
    _rewrite_tensors(model_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    msg = _load_error(model_copy)
    assert "layers.1.self_attn.k_proj.weight" in msg and "missing" in msg


def test_wrong_shape(model_copy):
    import torch

    def edit(t):
        t["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(3, 3)

    _rewrite_tensors(model_copy, edit)
    msg = _load_error(model_copy)
    assert "in_proj_z" in msg and "shape" in msg and "model.safetensors" in msg


def test_wrong_dtype(model_copy):
    import torch

    def edit(t):
        t["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)

    _rewrite_tensors(model_copy, edit)
    msg = _load_error(model_copy)
    assert "norm.weight" in msg and "dtype" in msg


def test_truncated_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = _load_error(model_copy)
    assert "model.safetensors" in msg and "truncated" in msg


def test_missing_shard(tmp_path):
    path = write_tiny_model(tmp_path / "sh", shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    msg = _load_error(path)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg


def test_no_tokenizer(model_copy):
    (model_copy / "tokenizer.json").unlink()
    assert "tokenizer.json" in _load_error(model_copy)


def test_bad_prompts(tiny_engine):
    with pytest.raises(EngineError, match="empty"):
        tiny_engine.generate("", 4)
    with pytest.raises(EngineError, match="exceeds the context"):
        tiny_engine.generate([1] * 4090, 10)


@pytest.mark.parametrize(
    "field,value,allowed",
    [("draft_depth", 0, "1..16"), ("draft_depth", 100, "1..16"), ("p_min", 1.5, "0..1"), ("plan_pool", -1, "0..64")],
)
def test_settings_out_of_range(field, value, allowed):
    with pytest.raises(ValueError) as info:
        EngineSettings(**{field: value})
    assert field in str(info.value) and allowed in str(info.value)


def test_sub_vocab_larger_than_vocabulary(tiny_engine):
    with pytest.raises(EngineError, match="sub_vocab"):
        tiny_engine.generate("def", 4, EngineSettings(sub_vocab=10**6))


def test_cuda_where_there_is_none(tiny_model_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(EngineError, match="CUDA is not available"):
        Engine.load(tiny_model_dir, device="cuda")


def test_gemm_backend_errors(tiny_model_dir, tiny_engine):
    """An unknown GEMM backend, or autotune on the CPU, is refused at load with what to use instead; the
    engine already loaded keeps working."""
    with pytest.raises(EngineError, match="gemm 'fast' is not known; use one of cublas, autotune"):
        Engine.load(tiny_model_dir, gemm="fast")
    with pytest.raises(EngineError, match="gemm='autotune' needs a CUDA device.*use gemm='cublas'"):
        Engine.load(tiny_model_dir, device="cpu", gemm="autotune")
    assert tiny_engine.info["gemm"] == "cublas"
    assert len(tiny_engine.generate("def", 4).tokens) == 4


# ---- CLI --------------------------------------------------------------------------------------------


def test_cli_generate_text(tiny_model_dir, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "def main", "-n", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()  # the generated text
    assert "t/s" in out.err


def test_cli_generate_json_matches_engine(tiny_model_dir, tiny_engine, capsys):
    assert main(["generate", "--model", str(tiny_model_dir), "--prompt", "def main", "-n", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens"] == tiny_engine.generate("def main", 8, EngineSettings(speculative=False)).tokens
    assert data["stats"]["generated"] == 8 and "acceptance_rate" in data["stats"]


def test_cli_bad_model_is_one_line_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "app", "generate", "--model", str(tmp_path / "none"), "--prompt", "x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_version():
    proc = subprocess.run([sys.executable, "-m", "app", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("specdeck ")


def test_cli_bench_prints_the_seed_tables(tiny_model_dir, tmp_path, capsys):
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    args = ["bench", "--model", str(tiny_model_dir), "--rounds", "1", "-n", "8", "--vs", "depth=5,chain=off"]
    assert main([*args, "--json", str(js), "--csv", str(cs)]) == 0
    out = capsys.readouterr().out
    for needle in ("Round results", "Mean", "Category", "Change", "mixed avg", "code_echo", "Output hash"):
        assert needle in out
    assert "outputs identical across arms" in out
    report = json.loads(js.read_text())
    assert report["arms_agree"] and len(report["rows"]) == 8
    assert cs.read_text().count("\n") == 9


def test_workloads_use_the_chat_template_when_the_model_has_one(model_copy):
    from app.workloads import load_workloads

    template = (  # the shape of Qwen's template
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    (model_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    eng = Engine.load(model_copy)
    w = load_workloads()["code_gen"]
    prompt = w.prompt_for(eng.tokenizer)
    assert prompt.startswith("<|im_start|>user\n" + w.chat) and prompt.endswith("<|im_start|>assistant\n")
    assert eng.tokenizer.chat_template == template
    (model_copy / "tokenizer_config.json").unlink()
    (model_copy / "chat_template.jinja").write_text(template)  # newer checkpoints keep it here
    assert Engine.load(model_copy).tokenizer.chat_template == template
    (model_copy / "chat_template.jinja").unlink()
    plain = load_workloads()["prose"]
    assert plain.prompt_for(Engine.load(model_copy).tokenizer) == plain.prompt
