"""Tensor parallelism, one process per device on torch.distributed (gloo on the CPU here, NCCL on GPUs):
logits equal to one process, speculative output identical to plain greedy for every multi-device knob,
more ranks than KV heads, settings changed mid-run, and a lost worker reported in one line."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from tiny_models import write_tiny_model

from engine import Engine, EngineError, EngineSettings
from engine.parallel import head_split, split_ranges

L, F = "linear_attention", "full_attention"
SPLITTABLE = dict(
    layer_types=[L, F, L, F],
    num_attention_heads=12,
    num_key_value_heads=6,
    head_dim=8,
    linear_num_key_heads=6,
    linear_num_value_heads=12,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    intermediate_size=96,
    tie_word_embeddings=False,
)
PROMPT = "def main():\n    for i in range(10):\n        print(i)\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "m", seed=3, **SPLITTABLE)


@pytest.fixture(scope="module")
def single(model_dir):
    return Engine.load(model_dir)


@pytest.fixture(scope="module")
def greedy(single):
    return single.generate(PROMPT, 24, EngineSettings(speculative=False), single.new_session()).tokens


def test_split_ranges_cover_everything_once():
    for n_items in (6, 7, 320):
        for n in (1, 2, 3):
            r = split_ranges(n_items, n)
            assert r[0][0] == 0 and r[-1][1] == n_items
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            assert max(hi - lo for lo, hi in r) - min(hi - lo for lo, hi in r) <= 1


@pytest.mark.parametrize("heads,kv,world", [(12, 6, 2), (12, 6, 4), (4, 2, 3), (16, 4, 8), (32, 16, 3), (8, 1, 5)])
def test_every_head_on_exactly_one_rank_with_its_kv_head(heads, kv, world):
    group = heads // kv
    owners = []
    for rank in range(world):
        h_lo, h_hi, kv_lo, kv_hi = head_split(heads, kv, rank, world, "attention")
        assert h_hi > h_lo, "a rank without a head"
        owners += range(h_lo, h_hi)
        # every head's KV head is held by the same rank, and locally the grouping is uniform
        assert all(kv_lo <= h // group < kv_hi for h in range(h_lo, h_hi))
        local_group = (h_hi - h_lo) // (kv_hi - kv_lo)
        assert [(h - h_lo) // local_group + kv_lo for h in range(h_lo, h_hi)] == [h // group for h in range(h_lo, h_hi)]
    assert sorted(owners) == list(range(heads))


def test_more_ranks_than_heads_is_refused():
    with pytest.raises(EngineError, match="would hold no head; use at most 4 devices"):
        head_split(4, 2, 0, 5, "attention")


def _close(eng):
    eng.close()
    assert all(not p.is_alive() for p in eng.cluster.procs)  # no zombie: joined (reaped) on close


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_equal_one_process_for_every_knob(model_dir, single, greedy, n):
    ids = list(range(1, 41))
    ref = single.logits(ids)
    tp = Engine.load(model_dir, devices=["cpu"] * n)
    try:
        assert tp.info["devices"] == [f"cpu (rank {r})" for r in range(n)]
        assert len(tp.cluster.procs) == n - 1 and all(p.is_alive() for p in tp.cluster.procs)
        got = tp.logits(ids)  # mirror off until a run configures it: the gathered vocabulary slices
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
        cases = [
            dict(),
            dict(mirror_output=False),
            dict(mirror_output=False, sub_vocab=200),
            dict(mirror_output=True, sub_vocab=200),
            dict(chain=False, mirror_output=False),
            dict(chain=False),
            dict(draft_depth=1),
            dict(p_min=0.5, mirror_output=False),
            dict(speculative=False, mirror_output=False),
        ]
        for case in cases:
            settings = EngineSettings(draft_depth=4).replace(**case)
            out = tp.generate(PROMPT, 24, settings, tp.new_session())
            assert out.tokens == greedy, case
            assert out.stats["devices"] == n
        # Mirror on -> off -> on re-makes the head: a plan captured under the first "on" read tensors that
        # are gone, so the plan key (plan_tag) must differ and no such plan can be replayed.
        tags = []
        for mirror in (True, False, True):
            tp.generate(PROMPT, 4, EngineSettings(draft_depth=2, mirror_output=mirror), tp.new_session())
            tags.append(tp.model.plan_tag)
        assert len(set(tags)) == 3, tags
        # Synthetic acceptance: every rank draws the same counts (seed and position only), so the ranks
        # emit what one process emits, mirrored output or not.
        synthetic = EngineSettings(draft_depth=4, synthetic_rates=(0.8, 0.5))
        one = single.generate(PROMPT, 24, synthetic, single.new_session()).tokens
        for mirror in (True, False):
            out = tp.generate(PROMPT, 24, synthetic.replace(mirror_output=mirror), tp.new_session())
            assert out.tokens == one and out.stats["synthetic"], mirror
        tp.set_model_option("combine", "gather")  # the "before": whole logit rows cross between ranks
        assert tp.generate(PROMPT, 24, EngineSettings(mirror_output=False), tp.new_session()).tokens == greedy
        tp.set_model_option("combine", "argmax")
        assert ((tp.logits(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-5  # mirrored now
    finally:
        _close(tp)


def test_a_sub_vocab_order_on_three_ranks(model_dir, single, greedy, tmp_path):
    """The model folder's subvocab.json is read once and set on every rank. Mirror off, each rank scores the
    order's ids that fall in its vocabulary slice (a distributed argmax over the first N of the order; a rank
    may hold none of them); mirror on, every rank holds all K rows. The text is plain greedy in every case, and
    a sampled run draws what one process with the same order draws."""
    import json
    import shutil

    from engine import SamplingParams

    folder = shutil.copytree(model_dir, tmp_path / "ordered")
    order = torch.randperm(320, generator=torch.Generator().manual_seed(4))[:200].tolist()
    (folder / "subvocab.json").write_text(json.dumps({"version": 1, "vocab_size": 320, "ids": order}))
    one = Engine.load(folder)
    tp = Engine.load(folder, devices=["cpu"] * 3)
    try:
        assert tp.info["sub_vocab_order"]["size"] == 200
        for case in (
            dict(mirror_output=False, sub_vocab=150),
            dict(mirror_output=False, sub_vocab=1),  # two of the three ranks score nothing
            dict(mirror_output=True, sub_vocab=150),
            dict(mirror_output=False, sub_vocab=250),  # past the order: the first 250 ids, as without one
            dict(mirror_output=False, sub_vocab=150, chain=False),
        ):
            settings = EngineSettings(draft_depth=4).replace(**case)
            out = tp.generate(PROMPT, 24, settings, tp.new_session())
            assert out.tokens == greedy, case
            used = settings.chain and settings.sub_vocab <= 200
            assert out.stats["remap_rounds"] == (out.stats["rounds"] if used else 0), case
        tp.set_model_option("combine", "gather")
        assert (
            tp.generate(PROMPT, 24, EngineSettings(mirror_output=False, sub_vocab=150), tp.new_session()).tokens
            == greedy
        )
        tp.set_model_option("combine", "argmax")
        sp = SamplingParams(temperature=4.0, top_p=0.95, seed=3)
        for mirror in (False, True):
            settings = EngineSettings(draft_depth=3, sub_vocab=150, mirror_output=mirror)
            want = one.generate(PROMPT, 24, settings, one.new_session(), sampling=sp)
            got = tp.generate(PROMPT, 24, settings, tp.new_session(), sampling=sp)
            assert got.tokens == want.tokens and got.stats["remap_rounds"] == got.stats["rounds"], mirror
    finally:
        _close(tp)


def test_a_frequency_order_drafts_the_same_on_two_ranks(tmp_path):
    """The bundled model (it drafts well) with an order built from the workloads' text, set on a running
    two-rank engine: mirror on or off, the ranks draft what one process drafts through the same order (the
    same tokens accepted), more than the first N ids in id order give."""
    from app.workloads import load_workloads
    from engine import bundled_model_dir
    from engine.subvocab import build_file

    sample = tmp_path / "workloads.txt"
    sample.write_text("\n".join(w.prompt for w in load_workloads().values()))
    _, order = build_file(bundled_model_dir(), [sample], out=tmp_path / "subvocab.json")
    prompt = load_workloads()["code_gen"].prompt
    one = Engine.load()
    one.set_sub_vocab_order(order.ids)
    tp = Engine.load(devices=["cpu", "cpu"])
    try:
        tp.set_sub_vocab_order(order.ids, order.source)
        for mirror in (False, True):
            settings = EngineSettings(draft_depth=4, sub_vocab=1024, mirror_output=mirror)
            want = one.generate(prompt, 32, settings, one.new_session())
            got = tp.generate(prompt, 32, settings, tp.new_session())
            assert got.tokens == want.tokens and got.stats["remap_rounds"] == got.stats["rounds"]
            assert got.stats["accepted"] == want.stats["accepted"], mirror
        tp.set_sub_vocab_order(None)
        prefix = tp.generate(prompt, 32, settings, tp.new_session())
        assert prefix.tokens == want.tokens and prefix.stats["remap_rounds"] == 0
        assert prefix.stats["accepted"] < want.stats["accepted"]
    finally:
        _close(tp)


def test_two_kv_heads_on_three_ranks(tiny_model_dir):
    """The default tiny model has 2 KV heads and 2 delta-net key heads: on 3 ranks they are replicated."""
    one = Engine.load(tiny_model_dir)
    greedy = one.generate(PROMPT, 24, EngineSettings(speculative=False)).tokens
    tp = Engine.load(tiny_model_dir, devices=["cpu"] * 3)
    try:
        assert tp.model.cfg.num_key_value_heads == 1  # rank 0 holds one KV head, shared with rank 1
        for mirror in (True, False):
            out = tp.generate(PROMPT, 24, EngineSettings(draft_depth=3, mirror_output=mirror), tp.new_session())
            assert out.tokens == greedy, mirror
        ids = list(range(5, 45))
        ref = one.logits(ids)
        assert ((tp.logits(ids) - ref).abs().max() / ref.abs().max()).item() < 1e-5
    finally:
        _close(tp)


@pytest.mark.parametrize("overlap", [False, True], ids=["in-turn", "overlapped"])
def test_settings_changed_mid_run_apply_on_every_rank(model_dir, greedy, overlap):
    """Also with rank 0 queueing each round before it hands the previous event over (Engine.overlap_rounds):
    the workers run the rounds in the order rank 0 sends them either way."""
    tp = Engine.load(model_dir, devices=["cpu", "cpu"])
    tp.overlap_rounds = overlap
    try:
        sess = tp.new_session(EngineSettings(draft_depth=2))
        changes = [
            EngineSettings(draft_depth=5, mirror_output=False),
            EngineSettings(draft_depth=3, chain=False),
            EngineSettings(speculative=False),
            EngineSettings(draft_depth=4, sub_vocab=100, mirror_output=False),
        ]
        tokens, seen = [], []
        for i, ev in enumerate(tp.stream(PROMPT, 24, session=sess)):
            tokens += ev.tokens
            seen.append(ev.settings)
            if i < len(changes):
                sess.settings = changes[i]
        assert tokens == greedy
        assert [s for s in changes if s in seen] == changes  # every change took effect at a boundary
        # a cancel reaches every rank at the same boundary, and the engine keeps working after it
        it = tp.stream(PROMPT, 24, session=sess)
        next(it)
        sess.cancel()
        assert [ev.stop_reason for ev in it][-1] == "cancelled"
        assert tp.generate(PROMPT, 24, EngineSettings(), tp.new_session()).tokens == greedy
        # a stream dropped half-way leaves every rank ready for the next run
        it = tp.stream(PROMPT, 24, session=sess)
        next(it)
        del it
        assert tp.generate(PROMPT, 24, EngineSettings(), sess).tokens == greedy
    finally:
        _close(tp)


def test_memory_from_every_rank_and_mirror_cost(model_dir):
    tp = Engine.load(model_dir, devices=["cpu", "cpu"])
    try:
        off = tp.generate(PROMPT, 4, EngineSettings(mirror_output=False), tp.new_session()).stats
        on = tp.generate(PROMPT, 4, EngineSettings(mirror_output=True), tp.new_session()).stats
        assert set(off["memory_by_device"]) == {"cpu (rank 0)", "cpu (rank 1)"}
        head = 320 * 64 * 4
        for rank in ("cpu (rank 0)", "cpu (rank 1)"):  # the whole output layer once more on every rank
            assert on["memory_by_device"][rank]["weights"] - off["memory_by_device"][rank]["weights"] == head
            assert on["memory_by_device"][rank]["kv_cache"] > 0
    finally:
        _close(tp)


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_worker_is_one_line_within_ten_seconds_and_the_engine_loads_again(model_dir, greedy, how):
    tp = Engine.load(model_dir, devices=["cpu", "cpu"])
    worker = tp.cluster.procs[0]
    tp.generate(PROMPT, 8, EngineSettings(), tp.new_session())
    os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineError) as err:
            tp.generate(PROMPT, 24, EngineSettings(), tp.new_session())
        waited = time.monotonic() - t0
        message = str(err.value)
        assert "\n" not in message and "worker rank 1" in message and "load the model again" in message
        assert waited < 10.0, waited
    finally:
        if how == "stop" and worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
    worker.join(5)
    assert not worker.is_alive()  # ended and reaped: no zombie left behind
    with pytest.raises(EngineError, match="was closed"):
        tp.generate(PROMPT, 4, EngineSettings(), tp.new_session())
    again = Engine.load(model_dir, devices=["cpu", "cpu"])
    try:
        assert again.generate(PROMPT, 24, EngineSettings(), again.new_session()).tokens == greedy
    finally:
        _close(again)


def fails_in_workers(device, model_dir):
    """A model factory that works in the caller's process and fails in every worker process."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("specdeck-rank"):
        raise OSError("disk read error on shard 2 (simulated)")
    from engine.config import ModelConfig
    from engine.loader import load_weights

    cfg = ModelConfig.from_file(model_dir / "config.json")
    weights, has_mtp = load_weights(model_dir, cfg, device, torch.float32)
    return cfg, weights, has_mtp


def test_a_failing_worker_load_is_one_line_naming_the_worker(model_dir, single):
    """A split that cannot work is refused before any worker starts; a worker that fails to load is
    reported with its own message, and its process is gone."""
    with pytest.raises(EngineError, match="would hold no head"):
        Engine.load(model_dir, devices=["cpu"] * 13)
    with pytest.raises(EngineError) as err:
        Engine.from_factory(fails_in_workers, (model_dir,), single.tokenizer, model_dir, 256, [torch.device("cpu")] * 2)
    message = str(err.value)
    assert "worker rank 1" in message and "disk read error on shard 2" in message and "\n" not in message
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specdeck-rank")]


def test_the_command_line_splits_over_comma_separated_devices(model_dir, greedy, capsys):
    from app.cli import main

    args = ["generate", "--model", str(model_dir), "--device", "cpu,cpu", "-n", "24", "--json"]
    assert main([*args, "--prompt", PROMPT]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == greedy and out["stats"]["devices"] == 2


@pytest.mark.gpu
def test_two_gpus_equal_one(model_dir, single, greedy):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    ids = list(range(1, 41))
    ref = single.logits(ids)
    tp = Engine.load(model_dir, devices=["cuda:0", "cuda:1"])
    try:
        assert ((tp.logits(ids).cpu() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        for case in (dict(), dict(mirror_output=False), dict(mirror_output=False, sub_vocab=200), dict(chain=False)):
            settings = EngineSettings(draft_depth=4, plan_pool=8).replace(**case)
            sess = tp.new_session()
            for _ in range(2):  # the second run replays the captured graphs (all-reduces inside)
                sess.reset()
                out = tp.generate(PROMPT, 24, settings, sess)
                assert out.tokens == greedy, case
            assert out.stats["plan_hits"] > 0 or not settings.chain
    finally:
        _close(tp)


def test_a_process_group_that_cannot_be_set_up_is_one_line_naming_it(monkeypatch):
    import torch.distributed as dist

    from engine.workers import init_group

    def refuse(*args, **kwargs):
        raise RuntimeError("connect() timed out.\nmore detail")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    with pytest.raises(EngineError) as err:
        init_group(0, 2, 1, torch.device("cpu"), 100)
    message = str(err.value)
    assert "gloo process group of 2 devices could not be set up on rank 0" in message
    assert "connect() timed out" in message and "\n" not in message


def test_close_releases_the_captured_plans_before_the_process_group_goes(model_dir, monkeypatch):
    """Graphs with all-reduces captured in them hold NCCL's communicator; destroying the group under them can
    wait forever (seen on two H200s). Whatever the plans hold when the engine closes is gone by the time the
    group is destroyed."""
    import torch.distributed as dist

    tp = Engine.load(model_dir, devices=["cpu", "cpu"])
    sess = tp.new_session()
    tp.generate(PROMPT, 4, EngineSettings(draft_depth=3), sess)
    sess.plans.graphs["a captured plan"] = (object(), None, 0)  # on the CPU nothing is captured: stand in
    seen = []
    real = dist.destroy_process_group

    def destroy(*args, **kwargs):
        seen.append(len(sess.plans.graphs))
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    _close(tp)
    assert seen == [0]
    assert not dist.is_initialized()


_TWICE = """
import sys
from engine import Engine, EngineSettings
for _ in range(2):
    eng = Engine.load(sys.argv[1], devices=["cuda:0", "cuda:1"])
    sess = eng.new_session()
    for _ in range(2):  # the second run replays plans with the all-reduces captured inside
        sess.reset()
        eng.generate(sys.argv[2], 16, EngineSettings(draft_depth=3, plan_pool=8), sess)
    eng.close()
    print("closed", flush=True)
"""


@pytest.mark.gpu
def test_two_gpu_engines_one_after_another_in_one_process_both_close(model_dir):
    """What the app does when the model is loaded again on two GPUs: load, run, close, twice, in one process.
    A hang is a failure here (the child is given 240 s), not a stuck test session."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run(
            [sys.executable, "-c", _TWICE, str(model_dir), PROMPT],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("loading, running and closing a two-GPU engine twice in one process did not finish in 240 s")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("closed") == 2
