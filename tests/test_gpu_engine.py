"""The GPU path (CUDA kernels + captured plans): lossless, one host sync per round, knobs that act.

Marked `gpu`: skipped without CUDA; run on the device machine.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from app.workloads import load_workloads
from engine import Engine, EngineSettings

pytestmark = pytest.mark.gpu
N_NEW = 40


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The tiny random model, and the bundled model when it is there (it drafts well: many accept paths)."""
    dirs = {"tiny": tiny_model_dir}
    try:
        from engine import bundled_model_dir

        dirs["bundled"] = bundled_model_dir()
    except Exception:
        pass
    return dirs


@pytest.fixture(scope="module")
def cuda_engines(models):
    return {name: Engine.load(path, device="cuda", dtype="float32") for name, path in models.items()}


def test_cuda_kernels_are_in_use(cuda_engines):
    for eng in cuda_engines.values():
        assert eng.info["kernels"] == "CUDA kernels"


@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_lossless_fp32_all_workloads_depths_chain(cuda_engines, which):
    if which not in cuda_engines:
        pytest.skip("no bundled model")
    eng = cuda_engines[which]
    sess = eng.new_session()
    for name, w in load_workloads().items():
        prompt = w.prompt_for(eng.tokenizer)
        ref = eng.generate(prompt, N_NEW, EngineSettings(speculative=False, plan_pool=0), sess).tokens
        for depth, chain in itertools.product(range(1, 9), (True, False)):
            out = eng.generate(prompt, N_NEW, EngineSettings(draft_depth=depth, chain=chain, plan_pool=8), sess)
            assert out.tokens == ref, (which, name, depth, chain)


def test_gpu_matches_cpu(models, cuda_engines):
    cpu = Engine.load(models["tiny"])
    prompt = load_workloads()["code_gen"].prompt
    a = cpu.generate(prompt, N_NEW, EngineSettings(speculative=False)).tokens
    b = (
        cuda_engines["tiny"]
        .generate(prompt, N_NEW, EngineSettings(speculative=False), cuda_engines["tiny"].new_session())
        .tokens
    )
    assert a == b


def test_plans_hit_and_pool_size_matters(cuda_engines):
    eng = cuda_engines.get("bundled", cuda_engines["tiny"])
    prompt = load_workloads()["code_echo"].prompt_for(eng.tokenizer)
    small = eng.generate(prompt, 64, EngineSettings(draft_depth=5, plan_pool=1), eng.new_session()).stats
    sess = eng.new_session()  # held: the memory breakdown counts the plans of live sessions
    big = eng.generate(prompt, 64, EngineSettings(draft_depth=5, plan_pool=6), sess).stats
    assert big["plan_hits"] > 0
    assert big["plan_misses"] <= small["plan_misses"]
    assert eng.memory()["graph_pools"] > 0


def test_auto_depth_keeps_the_plans_of_every_depth_it_moves_between(cuda_engines):
    """draft_depth "auto" with the default pool (8 plans, fewer than 2 for each of 8 depths): once a first run
    has visited every depth, a second run on the session captures nothing (its pool is raised to hold them:
    a plan captured again mid-run costs milliseconds a time), and the text is still greedy."""
    eng = cuda_engines.get("bundled", cuda_engines["tiny"])
    prompt = load_workloads()["code_edit"].prompt_for(eng.tokenizer)
    sess = eng.new_session()
    ref = eng.generate(prompt, 128, EngineSettings(speculative=False), sess).tokens
    auto = EngineSettings(draft_depth="auto", max_draft_depth=8)
    assert auto.plan_pool == 8 < auto.auto_plan_pool
    sess.reset()
    eng.generate(prompt, 256, auto, sess)  # the controller's sweep: every depth captured once
    sess.reset()
    out = eng.generate(prompt, 128, auto, sess)
    assert out.tokens == ref
    assert out.stats["plan_misses"] == 0, out.stats["round_cost_by_depth"]


@pytest.mark.parametrize(
    "rates,depth,overlap",
    [((), 4, False), ((0.873, 0.778, 0.675), 4, False), ((), "auto", False), ((), 4, True), ((), 0, True)],
    ids=["real", "synthetic", "auto", "overlapped", "overlapped-target"],
)
def test_one_host_sync_per_round(cuda_engines, rates, depth, overlap, monkeypatch):
    """Rounds run under sync debug mode "error": any hidden host synchronisation raises, except the one
    read of the emitted tokens (engine.spec.allowed_sync). Synthetic acceptance too (its rates are staged
    by scalar fills, its draws made on the device), and an adaptive depth (its decision is worked out
    inside the round, while the host waits for that one read)."""
    eng = cuda_engines.get("bundled", cuda_engines["tiny"])
    monkeypatch.setattr(eng, "overlap_rounds", overlap)  # overlapped: the next round queued before each event
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    settings = EngineSettings(
        speculative=depth != 0, draft_depth=depth or 1, chain=True, plan_pool=16, synthetic_rates=rates
    )
    sess = eng.new_session()
    # capture every plan the run below needs (auto: long enough for its sweep over every depth)
    eng.generate(prompt, 48 if depth != "auto" else 200, settings, sess)
    sess.reset()
    rounds = 0
    stream = eng.stream(prompt, 48, settings, sess)
    next(stream)  # prefill and the first round (plans warm)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in stream:
            rounds += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rounds > 3


def test_synthetic_acceptance_on_the_gpu(cuda_engines):
    """Captured plans and the kernel: rate 0 gives the target-only text; a synthetic run's plans replay what
    its eager run does (the rates and seed are read in place); no synthetic_accept call fell back."""
    from kernels import ops

    eng = cuda_engines["tiny"]
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    target = eng.generate(prompt, N_NEW, EngineSettings(speculative=False, plan_pool=8), eng.new_session()).tokens
    zero = EngineSettings(draft_depth=4, plan_pool=8, synthetic_rates=(0.0,))
    assert eng.generate(prompt, N_NEW, zero, eng.new_session()).tokens == target
    before = ops.fallbacks().get("synthetic_accept", 0)
    settings = EngineSettings(draft_depth=4, plan_pool=8, synthetic_rates=(0.873, 0.778, 0.675))
    graphs = eng.generate(prompt, N_NEW, settings, eng.new_session())
    eager = eng.generate(prompt, N_NEW, settings.replace(plan_pool=0), eng.new_session())
    assert graphs.tokens == eager.tokens and graphs.stats["accepted"] == eager.stats["accepted"]
    assert graphs.stats["synthetic"] and graphs.stats["plan_hits"] > 0
    assert 0 < graphs.stats["accepted"] < graphs.stats["drafted"]
    assert ops.fallbacks().get("synthetic_accept", 0) == before


def test_graphs_equal_eager(cuda_engines):
    eng = cuda_engines["tiny"]
    prompt = load_workloads()["prose"].prompt
    eager = eng.generate(prompt, N_NEW, EngineSettings(draft_depth=3, plan_pool=0), eng.new_session()).tokens
    graphs = eng.generate(prompt, N_NEW, EngineSettings(draft_depth=3, plan_pool=8), eng.new_session()).tokens
    assert eager == graphs


def test_memory_breakdown_on_gpu(cuda_engines):
    """Per-component memory counts the live sessions' buffers and plan pools, and drops them with the session."""
    import gc

    eng = cuda_engines["tiny"]
    sess = eng.new_session()
    eng.generate(load_workloads()["prose"].prompt, 8, EngineSettings(draft_depth=3, plan_pool=4), sess)
    mem = eng.memory()
    assert mem["weights"] > 0 and mem["kv_cache"] > 0 and mem["snapshot_planes"] > 0 and mem["graph_pools"] > 0
    counted = sum(v for k, v in mem.items() if k != "graph_pools")  # pools are reserved, not allocated
    assert counted <= torch.cuda.memory_allocated() + 1
    del sess
    gc.collect()
    after = eng.memory()
    assert after["weights"] == mem["weights"]
    assert after["kv_cache"] == 0 and after["snapshot_planes"] == 0 and after["graph_pools"] == 0


def test_autotuned_gemm_backend(models):
    """gemm='autotune' (torch.compile max-autotune for one-token products): its target-only tokens equal the
    cuBLAS engine's on every workload, speculation stays lossless against it, and plans capture the compiled
    kernels (graphs equal eager)."""
    pytest.importorskip("triton")
    path = models.get("bundled", models["tiny"])
    base = Engine.load(path, device="cuda", dtype="float32")
    tuned = Engine.load(path, device="cuda", dtype="float32", gemm="autotune")
    assert tuned.info["gemm"] == "autotune"
    target = EngineSettings(speculative=False, plan_pool=8)
    for w in load_workloads().values():
        ref = base.generate(w.prompt, 24, target, base.new_session()).tokens
        assert tuned.generate(w.prompt, 24, target, tuned.new_session()).tokens == ref, w.name
        spec = tuned.generate(w.prompt, 24, EngineSettings(draft_depth=4, plan_pool=8), tuned.new_session())
        assert spec.tokens == ref, w.name
    eager = tuned.generate("def f(x):", 24, EngineSettings(speculative=False, plan_pool=0), tuned.new_session())
    assert eager.tokens == tuned.generate("def f(x):", 24, target, tuned.new_session()).tokens


def test_a_sub_vocab_order_in_graphs_with_one_sync(cuda_engines):
    """A sub-vocab order (engine/subvocab.py) on the GPU: greedy and sampled drafts through it run inside the
    captured draft plan (the pick mapped back to its token id on the device, sampled q rows scattered to token-id
    columns), the text stays the target's greedy text, and a round still makes one host synchronisation."""
    from engine import SamplingParams
    from engine.subvocab import build_order, count_ids

    eng = cuda_engines.get("bundled", cuda_engines["tiny"])
    texts = [w.prompt for w in load_workloads().values()]
    vocab = eng.cfg.vocab_size
    order = build_order(count_ids(eng.tokenizer.encode, texts), vocab, vocab // 4, sorted(eng.tokenizer.eos_token_ids))
    prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
    ref = eng.generate(prompt, N_NEW, EngineSettings(speculative=False, plan_pool=0), eng.new_session()).tokens
    eng.set_sub_vocab_order(order)
    try:
        for sampling in (None, SamplingParams(temperature=0.8, seed=1)):
            settings = EngineSettings(draft_depth=4, sub_vocab=vocab // 8, plan_pool=16)
            sess = eng.new_session()
            first = eng.generate(prompt, N_NEW, settings, sess, sampling=sampling)  # captures the plans
            assert first.stats["remap_rounds"] == first.stats["rounds"]
            if sampling is None:
                assert first.tokens == ref
                eager = eng.generate(prompt, N_NEW, settings.replace(plan_pool=0), eng.new_session())
                assert eager.stats["accepted"] == first.stats["accepted"]  # graphs draft what eager drafts
            sess.reset()
            stream = eng.stream(prompt, N_NEW, settings, sess, sampling=sampling)
            tokens = list(next(stream).tokens)
            torch.cuda.set_sync_debug_mode("error")
            try:
                for ev in stream:
                    tokens += ev.tokens
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert tokens == first.tokens  # replayed plans: the same text (the same draws when sampled)
    finally:
        eng.set_sub_vocab_order(None)


def test_overlapped_rounds_are_lossless_on_every_workload(cuda_engines, force_depths):
    """Engine.overlap_rounds on a GPU (fp32): target-only, depth 5 chain and auto give the same tokens with the
    next round queued ahead after each read as without, on every workload; and pipelined (the default: rounds
    queued before the one ahead is read, their inputs taken on the device) the same tokens, sampled ones the same
    draws, and at a static depth the same acceptance. Then depths forced to change every round, shallower and
    deeper (plans captured while a round is queued): pipelined, the same tokens and the same acceptance per draft
    position as unpipelined."""
    from engine import SamplingParams

    eng = cuda_engines.get("bundled", cuda_engines["tiny"])
    was = eng.overlap_rounds
    try:
        for name, w in load_workloads().items():
            prompt = w.prompt_for(eng.tokenizer)
            for settings, sampling in (
                (EngineSettings(speculative=False, plan_pool=8), None),
                (EngineSettings(draft_depth=5, chain=True, plan_pool=8), None),
                (EngineSettings(draft_depth="auto", max_draft_depth=6, chain=True), None),
                (EngineSettings(draft_depth=3, chain=True, plan_pool=8), SamplingParams(temperature=0.8, seed=3)),
            ):
                eng.overlap_rounds = False
                plain = eng.generate(prompt, N_NEW, settings, eng.new_session(), sampling=sampling)
                want = plain.tokens
                eng.overlap_rounds, eng.pipeline_rounds = True, False
                queued = eng.generate(prompt, N_NEW, settings, eng.new_session(), sampling=sampling)
                assert queued.tokens == want, (name, settings)
                eng.pipeline_rounds = None
                got = eng.generate(prompt, N_NEW, settings, eng.new_session(), sampling=sampling)
                assert got.tokens == want and got.stats["pipelined_rounds"] > 0, (name, settings)
                if not settings.adaptive:
                    assert got.stats["accepted"] == plain.stats["accepted"], (name, settings)
        calls = force_depths((3, 6, 1, 5, 2, 2, 4, 6, 1))
        auto = EngineSettings(draft_depth="auto", max_draft_depth=6, chain=True)
        prompt = load_workloads()["code_gen"].prompt_for(eng.tokenizer)
        eng.overlap_rounds = False
        plain = eng.generate(prompt, N_NEW, auto, eng.new_session())
        calls.clear()
        eng.overlap_rounds = True
        got = eng.generate(prompt, N_NEW, auto, eng.new_session())
        assert got.tokens == plain.tokens and got.stats["pipelined_rounds"] >= got.stats["rounds"] - 4
        assert got.stats["per_position_acceptance"] == plain.stats["per_position_acceptance"]
        assert got.stats["accepted"] == plain.stats["accepted"] > 0
    finally:
        eng.overlap_rounds = was
        eng.pipeline_rounds = None


def test_a_pipelined_target_only_round_advances_and_copies_inside_its_plan(cuda_engines):
    """A target-only round queued behind another takes its input token and position, and copies its results to the
    host, inside its own captured plan (one per host buffer), so the device goes from plan to plan; the tokens are
    those of unpipelined rounds, and those of the same work launched outside the plans (spec.ADVANCE_IN_PLAN off)."""
    from engine import spec

    eng = cuda_engines["tiny"]
    settings = EngineSettings(speculative=False, plan_pool=8)
    prompt = load_workloads()["code_gen"].prompt
    try:
        eng.pipeline_rounds = False
        want = eng.generate(prompt, 24, settings, eng.new_session()).tokens
        eng.pipeline_rounds = None
        sess = eng.new_session()
        eng.generate(prompt, 24, settings, sess)  # plans captured
        sess.reset()
        got = eng.generate(prompt, 24, settings, sess)
        assert got.tokens == want and got.stats["pipelined_rounds"] >= 20
        behind = sorted(k[-1] for k in sess.plans.graphs if k[0] == "verify" and k[-2] == "behind")
        assert behind == [0, 1], list(sess.plans.graphs)
        assert got.stats["plan_misses"] == 0  # every round replayed a plan
        spec.ADVANCE_IN_PLAN = False
        outside = eng.generate(prompt, 24, settings, eng.new_session())
        assert outside.tokens == want and outside.stats["pipelined_rounds"] >= 20
    finally:
        spec.ADVANCE_IN_PLAN = True
        eng.pipeline_rounds = None


def test_a_target_only_token_spends_no_launch_on_bookkeeping(cuda_engines):
    """Outside the layers and the LM head, a target-only token is three launches: the embedding gather with the
    first norm, the hidden row saved at the device-side start, and the argmax with the acceptance (its parts
    merged by the last part, whose row's last block accepts and sets the cache length from start itself). No index
    kernels, no argmax_combine or separate greedy_accept, no copy of start, no add for the row's place (issue 20:
    launches per token)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    eng = cuda_engines["tiny"]
    settings = EngineSettings(speculative=False, plan_pool=8)
    sess = eng.new_session()
    prompt = load_workloads()["prose"].prompt
    eng.generate(prompt, 12, settings, sess)  # every plan captured

    def kernels(n: int) -> Counter:
        sess.reset()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.generate(prompt, n, settings, sess)
            torch.cuda.synchronize()
        return Counter(
            e.name for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memcpy")
        )

    few, many = kernels(1), kernels(11)
    per_token = {name: (many[name] - few[name]) / 10 for name in many}

    def count(prefix: str) -> float:
        return sum(v for name, v in per_token.items() if name.startswith(prefix))

    assert count("embed_rmsnorm") == 1 and count("argmax_accept") == 1
    assert count("store_rows") == 1 and count("greedy_accept") == 0 and count("argmax_partial") == 0
    assert count("argmax_combine") == 0 and count("rmsnorm_w") == 0  # the first norm is in embed_rmsnorm
    assert not [name for name in per_token if "index" in name.lower() and per_token[name]]
    # a pipelined round's input token is copied from the round before inside its plan, where the driver runs the
    # device-to-device copy as its own small kernel (memcpy32_post): that one, and no other copy kernel
    copies = {name: v for name, v in per_token.items() if "memcpy" in name.lower() and v}
    assert set(copies) <= {"memcpy32_post"} and sum(copies.values()) <= 1, copies
