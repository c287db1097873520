"""Tensor parallel split over several "virtual devices" on the CPU (and two shards of one GPU): logits
equal to one device, speculative output identical to plain greedy, mirror_output on and off."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_model

from engine import Engine, EngineError, EngineSettings
from engine.tp import split_ranges
from engine.workloads import load_workloads

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tp") / "m", seed=3, **SPLITTABLE)


@pytest.fixture(scope="module")
def single(model_dir):
    return Engine.load(model_dir)


def test_split_ranges_cover_everything_once():
    for n_items in (6, 7, 320):
        for n in (1, 2, 3):
            r = split_ranges(n_items, n)
            assert r[0][0] == 0 and r[-1][1] == n_items
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            assert max(hi - lo for lo, hi in r) - min(hi - lo for lo, hi in r) <= 1


def _check(devices, model_dir, single):
    ids = list(range(1, 41))
    ref = single.logits(ids)
    prompt = load_workloads()["code_gen"].prompt
    greedy = single.generate(prompt, 24, EngineSettings(speculative=False), single.new_session()).tokens
    tp = Engine.load(model_dir, devices=devices)
    assert tp.info["devices"] == [str(torch.device(d)) for d in devices]
    for mirror in (True, False):
        for combine in ("argmax", "gather"):
            tp.model.combine = combine
            settings = EngineSettings(draft_depth=4, mirror_output=mirror)
            tp.model.configure(settings)
            got = tp.logits(ids).cpu()
            assert (got - ref).abs().max().item() < 1e-5, (mirror, combine)
            out = tp.generate(prompt, 24, settings, tp.new_session()).tokens
            assert out == greedy, (mirror, combine)
    return tp


@pytest.mark.parametrize("n", [2, 3])
def test_split_over_virtual_cpu_devices(model_dir, single, n):
    tp = _check(["cpu"] * n, model_dir, single)
    assert tp.model.reduce.calls > 0
    prompt = load_workloads()["prose"].prompt
    tp.generate(prompt, 24, EngineSettings(draft_depth=4), tp.new_session())
    builds = tp.model.split_plan_builds
    tp.generate(prompt, 24, EngineSettings(draft_depth=4), tp.new_session())
    assert tp.model.split_plan_builds == builds  # every step shape's split was remembered and reused


def test_mirror_costs_memory(model_dir):
    tp = Engine.load(model_dir, devices=["cpu", "cpu"])
    tp.model.configure(EngineSettings(mirror_output=False))
    off = tp.memory()["weights"]
    tp.model.configure(EngineSettings(mirror_output=True))
    on = tp.memory()["weights"]
    head = 320 * 64 * 4
    assert on - off == 2 * head  # one whole output layer per device


def test_cannot_split_more_ways_than_heads(tiny_model_dir):
    with pytest.raises(EngineError, match="cannot split"):
        Engine.load(tiny_model_dir, devices=["cpu"] * 3)


@pytest.mark.gpu
def test_two_shards_on_one_gpu(model_dir, single):
    _check(["cuda:0", "cuda:0"], model_dir, single)
