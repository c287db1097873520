"""gemm modes "cupy" and "auto" (engine/gemm.py) on the GPU: speculation stays lossless (fp32: the speculative
text is the plain greedy text), the choices are visible in Engine.info and the run stats, captured plans equal
eager runs, and "auto" measures once per GPU (a second load reads the cache; a corrupt cache is rebuilt).

Marked `gpu`: skipped without CUDA.

    QT_QPA_PLATFORM=offscreen PYTHONPATH=$PWD python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gemv_engine_gpu.py
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from app.workloads import load_workloads
from engine import Engine, EngineSettings
from kernels import ops

pytestmark = pytest.mark.gpu
N_NEW = 32


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    try:
        from engine import bundled_model_dir

        return bundled_model_dir()
    except Exception:
        return tiny_model_dir


@pytest.fixture(scope="module")
def base(path):
    return Engine.load(path, device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def cupy_engine(path):
    eng = Engine.load(path, device="cuda", dtype="float32", gemm="cupy")
    if eng.info["gemm_notice"]:
        pytest.fail(eng.info["gemm_notice"])
    return eng


def _valid(choices: dict[str, str]) -> bool:
    """Every product's choice is cuBLAS or a gemv variant; every MLP's ("... m1 mlp") its separate launches or a
    variant's one launch."""
    products = [c for label, c in choices.items() if not label.endswith(" mlp")]
    mlps = [c for label, c in choices.items() if label.endswith(" mlp")]
    one = " one launch with gate|up"
    return (
        bool(products)
        and all(c == "cublas" or ops.parse_gemv_variant(c) for c in products)
        and all(c == "separate launches" or (c.endswith(one) and ops.parse_gemv_variant(c[: -len(one)])) for c in mlps)
    )


def test_cupy_speculative_output_is_the_greedy_output_fp32(base, cupy_engine):
    target = EngineSettings(speculative=False, plan_pool=8)
    for w in load_workloads().values():
        prompt = w.prompt_for(cupy_engine.tokenizer)
        ref = cupy_engine.generate(prompt, N_NEW, target, cupy_engine.new_session()).tokens
        assert base.generate(prompt, N_NEW, target, base.new_session()).tokens == ref, w.name
        for depth, chain in itertools.product((1, 3, 5, 8, 16), (True, False)):
            settings = EngineSettings(draft_depth=depth, chain=chain, plan_pool=8)
            out = cupy_engine.generate(prompt, N_NEW, settings, cupy_engine.new_session())
            assert out.tokens == ref, (w.name, depth, chain)
    eager = cupy_engine.generate("def f(x):", 24, EngineSettings(speculative=False, plan_pool=0))
    assert eager.tokens == cupy_engine.generate("def f(x):", 24, target).tokens


def test_cupy_choices_are_visible_and_nothing_fell_back(cupy_engine):
    before = ops.fallbacks().get("gemv", 0)
    before_fused = ops.fallbacks().get("gemv_add_rmsnorm", 0)
    out = cupy_engine.generate("def main():", 16, EngineSettings(draft_depth=4, plan_pool=8))
    choices = out.stats["gemm_choices"]
    assert _valid(choices) and choices == cupy_engine.info["gemm_choices"]
    assert all(c != "cublas" for c in choices.values())  # mode cupy: every 1..17-row product is a kernel
    h = cupy_engine.cfg.hidden_size
    assert any(label.startswith(f"{cupy_engine.cfg.vocab_size}x{h} ") for label in choices)  # the LM head
    # the MLP of one row in one launch (the layers' and the MTP head's: one down shape)
    inter = cupy_engine.model.w["layers.0.mlp.down_proj.weight"].shape[1]
    assert choices[f"{h}x{inter} m1 mlp"] == "simt2.w8.s2 one launch with gate|up"
    assert ops.fallbacks().get("gemv", 0) == before
    assert ops.fallbacks().get("gemv_add_rmsnorm", 0) == before_fused  # the fused projection + add + norm ran


def test_cupy_bf16_runs_and_stays_close_to_cublas(path):
    """bf16: the tensor-core kernels in the whole decode; speculation against the same engine's target-only
    text (bf16 may differ from cuBLAS's text at near-ties, so only the first tokens are compared to it)."""
    eng = Engine.load(path, device="cuda", dtype="bfloat16", gemm="cupy")
    ref = Engine.load(path, device="cuda", dtype="bfloat16")
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    target = EngineSettings(speculative=False, plan_pool=8)
    a = eng.generate(prompt, N_NEW, target).tokens
    b = ref.generate(prompt, N_NEW, target).tokens
    assert a[:4] == b[:4]
    assert all(c.startswith(("tc", "simt")) for c in eng.info["gemm_choices"].values())


def test_auto_measures_once_caches_and_stays_lossless(path, tmp_path, monkeypatch, base, capsys):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path))
    first = Engine.load(path, device="cuda", dtype="float32", gemm="auto")
    assert first.info["gemm"] == "auto" and first.info["gemm_notice"] == ""
    choices = first.info["gemm_choices"]
    assert _valid(choices)
    assert first.model._gemv.measured == len(choices) > 0
    data = json.loads((tmp_path / "gemm_tune.json").read_text())
    assert len(data["entries"]) == len(choices)
    assert all(torch.cuda.get_device_name() in key for key in data["entries"])

    second = Engine.load(path, device="cuda", dtype="float32", gemm="auto")
    assert second.model._gemv.measured == 0 and second.info["gemm_choices"] == choices

    target = EngineSettings(speculative=False, plan_pool=8)
    for w in load_workloads().values():
        prompt = w.prompt_for(second.tokenizer)
        ref = second.generate(prompt, N_NEW, target, second.new_session()).tokens
        assert base.generate(prompt, N_NEW, target, base.new_session()).tokens == ref, w.name
        for depth in (2, 5, 9):
            out = second.generate(prompt, N_NEW, EngineSettings(draft_depth=depth, plan_pool=8), second.new_session())
            assert out.tokens == ref, (w.name, depth)

    (tmp_path / "gemm_tune.json").write_text("{ not json")
    capsys.readouterr()
    third = Engine.load(path, device="cuda", dtype="float32", gemm="auto")
    assert "rebuilt" in third.info["gemm_notice"]
    assert "specdeck: notice:" in capsys.readouterr().err
    assert third.model._gemv.measured == len(choices)
    assert json.loads((tmp_path / "gemm_tune.json").read_text())["format"] == "specdeck-gemm-tune"


def test_auto_sub_vocab_head_slices_are_chosen_at_first_eager_use(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDECK_CACHE_DIR", str(tmp_path))
    eng = Engine.load(path, device="cuda", dtype="float32", gemm="auto")
    before = set(eng.info["gemm_choices"])
    n = max(8, eng.cfg.vocab_size // 4)
    eng.generate("def f(x):", 12, EngineSettings(draft_depth=3, sub_vocab=n, plan_pool=8))
    added = set(eng.info["gemm_choices"]) - before
    assert any(label.startswith(f"{n}x") for label in added), added


def test_the_norm_deferred_to_a_resident_mlp_keeps_the_greedy_text_fp32(path, base, monkeypatch):
    """Where the MLP of one row is the resident launch, the weight of the norm before it is folded into its gate|up
    and each layer's output projection leaves that norm to it (Model.out_mlp -> gemv_add, then the MLP scaling its
    sums by it): the projection's launch is the "_an" form without the norm, nothing falls back, every post-attention
    norm weight is zero, and the greedy text is cuBLAS's on the unfolded model, speculative or not, eager or
    captured; with the deferral off the same text."""
    import kernels.cuda as kc

    eng = Engine.load(path, device="cuda", dtype="float32", gemm="cupy")
    g = eng.model._gemv
    g.mlp_choices = {key: "res2.w8.s1" for key in g.mlp_choices}  # what auto takes for a large MLP
    eng.model.fold_norms()  # as set_gemm does where the MLP is resident: the norms' weights into gate|up
    row = torch.zeros((1, eng.cfg.hidden_size), dtype=torch.float32, device="cuda")
    gu, down = eng.model.w["layers.0.mlp.gate_up_packed"], eng.model.w["layers.0.mlp.down_proj.weight"]
    if not ops.gemv_mlp_fits(row, gu, down, "res2.w8.s1"):
        pytest.skip("the bundled model's MLP does not take the resident form")
    launched, real = [], kc._launch_gemv

    def record(name, dtype, device, grid, block, args, *rest, **kw):
        deferred = name.endswith("_an") and args.y is None  # gemv_add: the "_an" form storing s only
        launched.append("deferred" if deferred else name)
        return real(name, dtype, device, grid, block, args, *rest, **kw)

    monkeypatch.setattr(kc, "_launch_gemv", record)
    before = dict(ops.fallbacks())
    target = EngineSettings(speculative=False, plan_pool=8)
    plain = EngineSettings(speculative=False, plan_pool=0)
    for defer in (True, False):
        eng.model.defer_norm = defer
        launched.clear()
        assert eng.generate("def f(x):", 8, plain).tokens == base.generate("def f(x):", 8, plain).tokens, defer
        resident = launched.count("gemv_simt_m1_c2_rmlp")
        assert resident > 0 and launched.count("deferred") == (resident if defer else 0), (defer, launched)
    assert ops.fallbacks() == before
    posts = [t for name, t in eng.model.w.items() if name.endswith("post_attention_layernorm.weight")]
    assert posts and all(t.count_nonzero().item() == 0 for t in posts)
    for w in list(load_workloads().values())[:2]:
        prompt = w.prompt_for(eng.tokenizer)
        want = base.generate(prompt, N_NEW, target, base.new_session()).tokens
        for defer in (True, False):
            eng.model.defer_norm = defer
            assert eng.generate(prompt, N_NEW, target, eng.new_session()).tokens == want, (w.name, defer)
            spec = EngineSettings(draft_depth=3, chain=True, plan_pool=8)
            assert eng.generate(prompt, N_NEW, spec, eng.new_session()).tokens == want, (w.name, defer)
    eng.model.defer_norm = True
    eng.close()


def test_the_norm_after_a_resident_mlp_deferred_into_the_next_fused_in_proj_bf16(path, monkeypatch):
    """Where a resident MLP of one row is followed by a delta-net layer whose fused in_proj launch norms its input
    (here for any in_proj size), that layer's input norm is folded into its in_proj (its weight zero) and the MLP
    stores the residual stream only, the in_proj launch scaling its sums by the norm (x_eps); likewise an attention
    layer whose qkv product norms its input in its launch (gemv_norm), with Model.defer_attn: a one-token forward
    launches each such MLP with no norm and each such in_proj or qkv with its norm, nothing falls back, and the
    hidden state is within bf16 rounding of the same folded model with the norm made in the MLP and of the unfolded
    model's; a captured plan gives the eager tokens."""
    import kernels.cuda as kc
    from engine import gemm

    monkeypatch.setattr(gemm, "_RULE_MIN_BYTES", 0)
    plain = Engine.load(path, device="cuda", dtype="bfloat16", gemm="cupy")
    eng = Engine.load(path, device="cuda", dtype="bfloat16", gemm="cupy")
    g = eng.model._gemv
    g.mlp_choices = {key: "res2.w8.s1" for key in g.mlp_choices}
    eng.model.fold_norms()
    folded_in = sorted(eng.model._folded_in)
    if not folded_in:
        pytest.skip("the bundled model's MLP or in_proj does not take the resident / fused forms")
    for i in folded_in:
        assert eng.model.w[f"layers.{i}.input_layernorm.weight"].count_nonzero().item() == 0
    launched, real = [], kc._launch_gemv

    def record(name, dtype, device, grid, block, args, *rest, **kw):
        if name.endswith("_rmlp") and args.y is None:
            launched.append("mlp, no norm")
        elif "_dr" in name and args.xnorm:
            launched.append("in_proj with its norm")
        elif name.endswith("_nx"):
            launched.append("qkv with its norm")
        return real(name, dtype, device, grid, block, args, *rest, **kw)

    monkeypatch.setattr(kc, "_launch_gemv", record)
    before = dict(ops.fallbacks())
    ids = torch.tensor([11], device="cuda")
    hidden = {}
    kinds = eng.model.cfg.layer_types
    # (defer_next, defer_attn): the attention layers' deferral needs both
    for defer, attn in ((True, True), (True, False), (False, True)):
        eng.model.defer_next, eng.model.defer_attn = defer, attn
        launched.clear()
        hidden[defer, attn] = eng.model.forward(ids, eng.new_session().state).float()
        want = []
        for i in folded_in if defer else ():
            if kinds[i] != "full_attention":
                want += ["mlp, no norm", "in_proj with its norm"]
            elif attn:
                want += ["mlp, no norm", "qkv with its norm"]
        assert launched == want, (defer, attn, launched)
    eng.model.defer_next, eng.model.defer_attn = True, True
    assert ops.fallbacks() == before
    unfolded = plain.model.forward(ids, plain.new_session().state).float()
    for got in (hidden[True, True], hidden[True, False]):
        for want, what in ((hidden[False, True], "the norm in the MLP"), (unfolded, "unfolded")):
            torch.testing.assert_close(got, want, rtol=5e-2, atol=3e-2 * want.abs().max().item(), msg=what)
    prompt = "def f(x):"
    for attn in (True, False):
        eng.model.defer_attn = attn
        eager = eng.generate(prompt, 16, EngineSettings(speculative=False, plan_pool=0)).tokens
        assert eng.generate(prompt, 16, EngineSettings(speculative=False, plan_pool=8)).tokens == eager, attn
    eng.model.defer_attn = True
    eng.close()
    plain.close()
