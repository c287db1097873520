"""The bookkeeping of gemm modes "cupy" and "auto" (engine/gemm.py GemvProducts) on the CPU, with the kernel
side and the device measurement faked: what is measured, when, what is cached and reused, what a graph capture
gets, and which product each call runs. The real kernels and timings: tests/test_gemv_engine_gpu.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine import gemm
from engine.gemm import GemvProducts
from kernels import ops


@pytest.fixture
def fake(monkeypatch):
    """Kernels that 'load', a device called Fake GPU, measurements that pick tc1.w8.s1 for N > 64 else cuBLAS."""
    calls = {"gemv": [], "measure": [], "capturing": False}
    monkeypatch.setattr(ops, "gemv_kernels", lambda device, dtype: (True, "fake"))
    monkeypatch.setattr(ops, "gemv_version", lambda: "abcdef012345")
    monkeypatch.setattr(ops, "gemv_takes", lambda x, w: x.dim() == 2 and 1 <= x.shape[0] <= 17)
    monkeypatch.setattr(ops, "gemv_default", lambda m, n, k, dtype, device: "simt2.w4.s1" if m <= 4 else "simt1.w4.s1")

    def fake_gemv(x, w, variant=None):
        calls["gemv"].append(variant)
        return F.linear(x, w)

    monkeypatch.setattr(ops, "gemv", fake_gemv)

    def fake_gemv_silu_mul(x, w, variant=None):
        calls["gemv"].append(("silu", variant))
        return ops.silu_mul(F.linear(x, w))

    monkeypatch.setattr(ops, "gemv_silu_mul", fake_gemv_silu_mul)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: calls["capturing"])

    def measure(self, m, n, k, weights, epilogue=None):
        calls["measure"].append((m, n, k, len(weights)) + ((epilogue,) if epilogue else ()))
        best = "tc1.w8.s1" if n > 64 else "cublas"
        return best, {"cublas": 10.0, "tc1.w8.s1": 5.0 if n > 64 else 20.0}

    monkeypatch.setattr(GemvProducts, "_measure", measure)
    return calls


def products(mode, path=None):
    return GemvProducts(mode, torch.device("cpu"), torch.float32, path)


def test_auto_measures_every_shape_and_bucket_once_and_caches(fake, tmp_path):
    path = tmp_path / "gemm_tune.json"
    wide, narrow = torch.randn(128, 32), torch.randn(64, 32)
    p = products("auto", path)
    p.tune({(128, 32): [wide, wide.clone()], (64, 32): [narrow]})
    assert p.measured == 8 and len(fake["measure"]) == 8
    assert (17, 128, 32, 2) in fake["measure"]  # a bucket is measured at its largest row count, all weights
    assert p.labels == {
        **{f"64x32 {b}": "cublas" for b in ("m1", "m2-4", "m5-8", "m9-17")},
        **{f"128x32 {b}": "tc1.w8.s1" for b in ("m1", "m2-4", "m5-8", "m9-17")},
    }
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 8 and all(key.startswith("Fake GPU|") for key in entries)

    again = products("auto", path)
    again.tune({(128, 32): [wide], (64, 32): [narrow]})
    assert again.measured == 0 and again.labels == p.labels and len(fake["measure"]) == 8


def test_each_call_runs_its_choice(fake, tmp_path):
    p = products("auto", tmp_path / "c.json")
    wide, narrow = torch.randn(128, 32), torch.randn(64, 32)
    p.tune({(128, 32): [wide], (64, 32): [narrow]})
    x = torch.randn(6, 32)
    assert torch.equal(p(x, wide), F.linear(x, wide)) and fake["gemv"] == ["tc1.w8.s1"]
    p(x, narrow)  # cuBLAS chosen: no kernel call
    p(torch.randn(18, 32), wide)  # prefill-sized: cuBLAS, nothing chosen
    assert fake["gemv"] == ["tc1.w8.s1"]
    assert p.takes(x, wide) and not p.takes(torch.randn(18, 32), wide)


def test_the_mlp_gate_up_shape_is_measured_and_run_with_its_activation(fake, tmp_path):
    """A shape named as an activation product (the packed gate|up) is timed as product + silu_mul, cached under
    its own key (not reusable for a plain product of that shape), and its calls run the one-launch form when a
    gemv kernel won, cuBLAS then silu_mul when cuBLAS did."""
    path = tmp_path / "c.json"
    gate_up, narrow = torch.randn(128, 32), torch.randn(64, 32)
    p = products("auto", path)
    p.tune({(128, 32): [gate_up], (64, 32): [narrow]}, activation={(128, 32)})
    assert sorted(set(fake["measure"])) == sorted(
        [(hi, 128, 32, 1, "silu") for hi in (1, 4, 8, 17)] + [(hi, 64, 32, 1) for hi in (1, 4, 8, 17)]
    )
    keys = json.loads(path.read_text())["entries"]
    assert sum(key.endswith(" silu") for key in keys) == 4 and len(keys) == 8
    x = torch.randn(3, 32)
    out = p.silu_mul(x, gate_up)
    assert fake["gemv"] == [("silu", "tc1.w8.s1")]
    torch.testing.assert_close(out, ops.silu_mul(F.linear(x, gate_up)))
    torch.testing.assert_close(p.silu_mul(x, narrow), ops.silu_mul(F.linear(x, narrow)))  # cuBLAS won: two ops
    assert fake["gemv"] == [("silu", "tc1.w8.s1")]
    plain = products("auto", path)  # the same shape as a plain product: its own measurement
    plain.tune({(128, 32): [gate_up]})
    assert (1, 128, 32, 1) in fake["measure"]


def test_a_shape_met_in_a_capture_gets_the_default_and_is_measured_later(fake, tmp_path):
    path = tmp_path / "c.json"
    p = products("auto", path)
    head_rows = torch.randn(200, 32)  # e.g. a sub-vocab slice of the LM head, first seen inside a capture
    fake["capturing"] = True
    p(torch.randn(1, 32), head_rows)
    assert fake["gemv"] == ["simt2.w4.s1"] and fake["measure"] == [] and p.labels == {}
    fake["capturing"] = False
    p(torch.randn(1, 32), head_rows)  # the next eager use measures it and writes the cache at once
    assert fake["gemv"][-1] == "tc1.w8.s1" and len(fake["measure"]) == 1
    assert p.labels == {"200x32 m1": "tc1.w8.s1"}
    p.labels.clear()  # a caller's copy (the run stats hold it): the next read is whole again
    assert p.labels == {"200x32 m1": "tc1.w8.s1"}
    assert len(json.loads(path.read_text())["entries"]) == 1


def test_another_gpu_measures_again(fake, tmp_path, monkeypatch):
    path = tmp_path / "c.json"
    w = torch.randn(128, 32)
    products("auto", path).tune({(128, 32): [w]})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Other GPU")
    other = products("auto", path)
    other.tune({(128, 32): [w]})
    assert other.measured == 4
    keys = json.loads(path.read_text())["entries"]
    assert sum(k.startswith("Fake GPU|") for k in keys) == 4 and sum(k.startswith("Other GPU|") for k in keys) == 4


def test_a_failed_measurement_is_cublas_with_a_warning(fake, tmp_path, monkeypatch):
    def broken(self, m, n, k, weights):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(GemvProducts, "_measure", broken)
    p = products("auto", tmp_path / "c.json")
    with pytest.warns(UserWarning, match="measuring 128x32 m1 failed.*using cuBLAS"):
        assert p.choice(1, torch.randn(128, 32)) == "cublas"


def test_cupy_uses_the_default_launches_and_measures_nothing(fake, tmp_path):
    p = products("cupy")
    w = torch.randn(128, 32)
    p.tune({(128, 32): [w]})
    assert p.labels == {
        "128x32 m1": "simt2.w4.s1",
        "128x32 m2-4": "simt2.w4.s1",
        "128x32 m5-8": "simt1.w4.s1",
        "128x32 m9-17": "simt1.w4.s1",
    }
    p(torch.randn(3, 32), w)
    assert fake["measure"] == [] and fake["gemv"] == ["simt2.w4.s1"] and p.cache is None
    assert list(tmp_path.iterdir()) == []


def test_kernels_that_cannot_run_leave_cublas_with_a_notice(fake, monkeypatch, capsys):
    monkeypatch.setattr(ops, "gemv_kernels", lambda device, dtype: (False, "NVRTC said no"))
    p = products("auto")
    assert not p.ok and "NVRTC said no" in p.notice and "cuBLAS" in p.notice
    assert capsys.readouterr().err.count("specdeck: notice:") == 1
    w = torch.randn(128, 32)
    p.tune({(128, 32): [w]})
    x = torch.randn(2, 32)
    assert torch.equal(p(x, w), F.linear(x, w)) and fake["gemv"] == [] and p.labels == {}


def test_a_corrupt_cache_notice_reaches_the_products(fake, tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text("nope")
    p = products("auto", path)
    assert "rebuilt" in p.notice
    capsys.readouterr()


def test_only_the_gemv_modes_make_products():
    with pytest.raises(ValueError):
        GemvProducts("cublas", torch.device("cpu"), torch.float32, None)
    assert gemm.bucket_index(17) == 3


def test_exact_runs_one_row_invariant_variant_per_shape_for_every_row_count(fake, monkeypatch):
    """Mode "exact": whatever the row count (a one-row step, a verify of depth + 1 rows), a shape's products go
    through the one variant whose rows do not depend on the row count; nothing is measured or cached."""
    monkeypatch.setattr(ops, "gemv_row_invariant", lambda n, k, dtype, device: f"simt2.w4.s{1 + (k > 32)}")
    p = products("exact")
    wide, deep = torch.randn(128, 32), torch.randn(64, 64)
    p.tune({(128, 32): [wide], (64, 64): [deep]})
    assert p.labels == {
        **{f"128x32 {b}": "simt2.w4.s1" for b in ("m1", "m2-4", "m5-8", "m9-17")},
        **{f"64x64 {b}": "simt2.w4.s2" for b in ("m1", "m2-4", "m5-8", "m9-17")},
    }
    assert fake["measure"] == [] and p.cache is None
    fake["capturing"] = True  # inside a capture too: the same variant, not the default launch
    for m in (1, 4, 17):
        p(torch.randn(m, 64), deep)
    assert fake["gemv"] == ["simt2.w4.s2"] * 3


def test_exact_needs_cuda_like_the_other_kernel_modes():
    from engine.errors import EngineError

    with pytest.raises(EngineError, match="gemm='exact' needs a CUDA device"):
        gemm.check_mode("exact", torch.device("cpu"))


def test_the_pick_keeps_the_one_launch_activation_form_unless_cublas_is_clearly_faster():
    """gate|up + silu_mul: cuBLAS and a second launch against a gemv variant's single launch. A timing of a
    candidate repeats it back to back, which hides the second launch's cost, so a tie (within 1%) goes to the
    single launch; a plain product takes the fastest whatever it is."""
    tie = {"cublas": 50.0, "simt2.w4.s1": 50.4, "tc2.w8.s1": 51.0}
    assert gemm.pick(tie, epilogue="silu") == "simt2.w4.s1"
    assert gemm.pick(tie, epilogue=None) == "cublas"
    clear = {"cublas": 50.0, "simt2.w4.s1": 50.6}
    assert gemm.pick(clear, epilogue="silu") == "cublas"
    faster = {"cublas": 50.0, "tc2.w8.s1": 48.0}
    assert gemm.pick(faster, epilogue="silu") == "tc2.w8.s1"
    assert gemm.pick({"cublas": 50.0}, epilogue="silu") == "cublas"  # no variant measured (all refused)
    split = {"cublas": 50.0, "simt2.w4.s2": 50.1, "tc2.w8.s1": 50.4}  # a K split is not one launch
    assert gemm.pick(split, epilogue="silu") == "tc2.w8.s1"
    assert gemm.pick({"cublas": 50.0, "simt2.w4.s2": 50.2}, epilogue="silu") == "cublas"
    assert gemm.pick({"cublas": 50.0, "simt2.w4.s2": 49.0}, epilogue="silu") == "simt2.w4.s2"  # fastest
    # a K split is two launches (the product, then its split sum with silu_mul): a one-launch form within 1% is kept
    near = {"cublas": 52.0, "simt2.w4.s2": 50.0, "simt2.w4.s1": 50.4}
    assert gemm.pick(near, epilogue="silu") == "simt2.w4.s1"
    assert gemm.pick({**near, "simt2.w4.s1": 50.6}, epilogue="silu") == "simt2.w4.s2"
    # where a K split is one launch too (the "_ss" form; kernels/cuda.py gemv_silu_one_launch), it competes as one
    split_one = lambda c: True  # noqa: E731
    assert gemm.pick(split, epilogue="silu", one_launch=split_one) == "simt2.w4.s2"
    assert gemm.pick({"cublas": 50.0, "simt2.w4.s2": 50.4}, epilogue="silu", one_launch=split_one) == "simt2.w4.s2"


def test_the_pick_keeps_the_one_launch_norm_form_whatever_its_k_splits():
    """A projection + residual add + norm: every gemv variant's fused form is one launch (its split sum inside it),
    so a variant that splits K is kept too unless cuBLAS + add_rmsnorm is more than 1% faster."""
    assert gemm.pick({"cublas": 50.0, "simt2.w4.s2": 50.2, "tc2.w8.s1": 51.0}, "norm") == "simt2.w4.s2"
    assert gemm.pick({"cublas": 50.0, "simt2.w4.s2": 50.2}, "silu") == "cublas"  # the same times, split K
    assert gemm.pick({"cublas": 50.0, "tc1.w4.s4": 50.7}, "norm") == "cublas"  # clearly slower: two launches
    assert gemm.pick({"cublas": 50.0, "tc1.w4.s4": 50.2}, None) == "cublas"  # a plain product: the fastest


def test_the_pick_of_a_norm_shape_with_several_rows_needs_a_clear_lead():
    """With several rows the fused add + norm form ends in a tail (its last blocks norm the rows) that the
    back-to-back timing hides, so it is kept only when clearly faster than cuBLAS + add_rmsnorm; one row keeps the
    one-launch rule."""
    near = {"cublas": 16.0, "tc1.w8.s2": 15.5, "simt2.w4.s2": 17.0}
    assert gemm.pick(near, "norm", rows=1) == "tc1.w8.s2"
    assert gemm.pick(near, "norm", rows=4) == "cublas"
    assert gemm.pick({**near, "tc1.w8.s2": 16.1}, "norm", rows=1) == "tc1.w8.s2"  # within 1%: one launch
    assert gemm.pick({"cublas": 20.0, "tc1.w8.s2": 15.0, "simt2.w4.s2": 16.0}, "norm", rows=6) == "tc1.w8.s2"
    assert gemm.pick({"cublas": 16.0, "tc1.w8.s2": 14.0}, "norm", rows=17) == "cublas"  # 12.5% is not enough
    assert gemm.pick({"cublas": 16.0, "tc1.w8.s2": 15.5}, None, rows=6) == "tc1.w8.s2"  # no epilogue: the fastest


def test_the_projections_that_join_the_residual_are_measured_with_the_add_and_norm(fake, tmp_path):
    """A shape named as a norm product (o_proj, out_proj, down_proj: add_rmsnorm follows) is timed with its
    epilogue and cached under its own key; an activation shape stays an activation shape."""
    path = tmp_path / "c.json"
    down, gate_up, head = torch.randn(64, 32), torch.randn(128, 32), torch.randn(96, 32)
    p = products("auto", path)
    p.tune({(64, 32): [down], (128, 32): [gate_up], (96, 32): [head]}, activation={(128, 32)}, norm={(64, 32)})
    assert sorted(set(fake["measure"])) == sorted(
        [(hi, 64, 32, 1, "norm") for hi in (1, 4, 8, 17)]
        + [(hi, 128, 32, 1, "silu") for hi in (1, 4, 8, 17)]
        + [(hi, 96, 32, 1) for hi in (1, 4, 8, 17)]
    )
    keys = json.loads(path.read_text())["entries"]
    assert sum(key.endswith(" norm") for key in keys) == 4 and sum(key.endswith(" silu") for key in keys) == 4
    assert len(keys) == 12
    again = products("auto", path)  # the same epilogues: all from the cache
    again.tune({(64, 32): [down], (128, 32): [gate_up], (96, 32): [head]}, activation={(128, 32)}, norm={(64, 32)})
    assert again.measured == 0 and len(fake["measure"]) == 12


def test_the_pick_rule_is_part_of_the_cache_key(fake, tmp_path):
    """Choices cached under an older rule are measured again, not reused."""
    p = products("auto", tmp_path / "c.json")
    p.tune({(128, 32): [torch.randn(128, 32)]})
    keys = json.loads((tmp_path / "c.json").read_text())["entries"]
    assert keys and all(gemm._PICK_RULE in key for key in keys)


def test_the_delta_step_takes_the_fused_launch_only_for_large_weights_and_says_so(fake, monkeypatch):
    """The delta-net's in_proj product + step: a gemv choice for a weight of at least _RULE_MIN_BYTES goes to the
    one-launch form with its tensor-core variant (and `labels` shows that variant beside the choice), a smaller
    weight or mode "exact" to the choice then the step, a cuBLAS choice to F.linear then the step."""
    fused, steps = [], []
    monkeypatch.setattr(ops, "gemv_conv_delta_rule_norm", lambda x, w, *step: fused.append(step[-2:]) or "one")
    monkeypatch.setattr(ops, "in_proj_step", lambda prod, *step: steps.append(prod.shape) or "two")
    monkeypatch.setattr(gemm, "_RULE_MIN_BYTES", 128 * 32 * 4)
    step = (None,) * 9
    x = torch.randn(1, 32)
    p = products("cupy")
    assert p.conv_delta_rule_norm(x, torch.randn(128, 32), *step) == "one"
    assert fused == [(gemm._RULE_VARIANT, None)]  # x normed (no x_eps)
    assert p.labels["128x32 m1"] == f"{gemm._RULE_VARIANT} with the delta step (simt2.w4.s1 alone)"
    assert p.conv_delta_rule_norm(x, torch.randn(64, 32), *step) == "two"  # under the size: the two launches
    assert fake["gemv"][-1] == "simt2.w4.s1" and p.labels["64x32 m1"] == "simt2.w4.s1"
    exact = products("cupy")
    exact.mode = "exact"
    exact.choices[(128, 32, 0)] = "simt2.w4.s1"
    assert exact.conv_delta_rule_norm(x, torch.randn(128, 32), *step) == "two" and len(fused) == 1
    p.choices[(96, 32, 0)] = "cublas"
    assert p.conv_delta_rule_norm(x, torch.randn(96, 32), *step) == "two" and len(fused) == 1
    assert steps == [(1, 64), (1, 128), (1, 96)]


def test_the_fused_step_kernels_are_loaded_at_load_only_where_they_will_run(fake, monkeypatch):
    """prepare_rule (Model.set_gemm) compiles the in_proj + step kernels for the model's key head dim when an
    in_proj weight is large enough for the fused launch, and not for small models or mode "exact"."""
    loaded = []
    monkeypatch.setattr(ops, "gemv_rule_kernels", lambda device, dtype, dk: loaded.append(dk) or True)
    monkeypatch.setattr(gemm, "_RULE_MIN_BYTES", 128 * 32 * 4)
    products("cupy").prepare_rule([torch.randn(64, 32), torch.randn(128, 32)], 128)
    assert loaded == [128]
    products("cupy").prepare_rule([torch.randn(64, 32)], 64)
    exact = products("cupy")
    exact.mode = "exact"
    exact.prepare_rule([torch.randn(128, 32)], 64)
    assert loaded == [128]


@pytest.fixture
def fake_mlp(fake, monkeypatch):
    """The one-launch MLP faked on top of `fake`: it fits one row; its calls recorded (the variant); "auto"'s
    measurement picks simt2.w8.s4 for an activation wider than 64 columns, else the separate launches."""
    monkeypatch.setattr(ops, "gemv_mlp_fits", lambda x, gu, down, variant: x.shape[0] == 1)

    def one_launch(x, gu, down, r, nw, eps, variant=None):
        fake["gemv"].append(("mlp", variant))
        return ops.add_rmsnorm(F.linear(ops.silu_mul(F.linear(x, gu)), down), r, nw, eps)

    monkeypatch.setattr(ops, "gemv_mlp_add_rmsnorm", one_launch)

    def measure(self, pairs):
        fake["measure"].append(("mlp", len(pairs)))
        wide = pairs[0][0].shape[0] // 2 > 64
        times = {"cublas": 10.0, "simt2.w8.s4": 8.0 if wide else 11.0}
        return gemm.pick_mlp(times), times

    monkeypatch.setattr(GemvProducts, "_measure_mlp", measure)
    return fake


def _mlp_operands(i: int):
    g = torch.Generator().manual_seed(i)
    gu, down = torch.randn(2 * i, 32, generator=g), torch.randn(48, i, generator=g)
    return gu, down, torch.randn(48, generator=g), torch.randn(48, generator=g) * 0.1


def test_the_mlp_of_one_row_takes_one_launch_where_chosen(fake_mlp, monkeypatch):
    """Mode "cupy": the one-launch MLP's default variant for one row, the separate launches (gate|up with its
    activation, down with the add + norm) for more rows, the same numbers either way, and the choice in the labels.
    Mode "exact": always the separate launches."""
    gu, down, r, nw = _mlp_operands(96)
    p = products("cupy")
    p.tune_mlp([(gu, down)])
    assert p.labels["48x96 m1 mlp"] == f"{gemm._MLP_DEFAULT} one launch with gate|up"
    for rows in (1, 3):
        x, res = torch.randn(rows, 32), r.expand(rows, 48).contiguous()
        fake_mlp["gemv"].clear()
        y, s = p.mlp_add_rmsnorm(x, gu, down, res, nw, 1e-6)
        if rows > 1:  # the separate launches as GemvProducts composes them (the one launch is the fixture's)
            want_y, want_s = ops.add_rmsnorm(F.linear(ops.silu_mul(F.linear(x, gu)), down), res, nw, 1e-6)
            assert torch.allclose(y, want_y, atol=1e-5) and torch.allclose(s, want_s, atol=1e-5)
        one = [c for c in fake_mlp["gemv"] if isinstance(c, tuple) and c[0] == "mlp"]
        assert one == ([("mlp", gemm._MLP_DEFAULT)] if rows == 1 else []), rows
    monkeypatch.setattr(ops, "gemv_row_invariant", lambda n, k, dtype, device: "simt2.w4.s1")
    exact = products("exact")
    exact.tune_mlp([(gu, down)])
    fake_mlp["gemv"].clear()
    exact.mlp_add_rmsnorm(torch.randn(1, 32), gu, down, r[None], nw, 1e-6)
    assert not any(isinstance(c, tuple) and c[0] == "mlp" for c in fake_mlp["gemv"])
    assert not any(label.endswith(" mlp") for label in exact.labels)


def test_auto_measures_the_mlp_once_caches_it_and_keeps_separate_launches_where_they_win(fake_mlp, tmp_path):
    path = tmp_path / "gemm_tune.json"
    wide, narrow = _mlp_operands(96), _mlp_operands(40)
    pairs = [(wide[0], wide[1]), (wide[0].clone(), wide[1].clone()), (narrow[0], torch.randn(40, 40))]
    p = products("auto", path)
    p.tune_mlp(pairs)
    assert fake_mlp["measure"] == [("mlp", 2), ("mlp", 1)]  # one measurement per down shape, with its pairs
    assert p.labels["48x96 m1 mlp"] == "simt2.w8.s4 one launch with gate|up"
    assert p.labels["40x40 m1 mlp"] == "separate launches"
    again = products("auto", path)
    again.tune_mlp(pairs)
    assert again.measured == 0 and len(fake_mlp["measure"]) == 2 and again.labels == p.labels
    fake_mlp["gemv"].clear()
    again.mlp_add_rmsnorm(torch.randn(1, 32), narrow[0], pairs[2][1], torch.randn(1, 40), torch.randn(40), 1e-6)
    assert not any(isinstance(c, tuple) and c[0] == "mlp" for c in fake_mlp["gemv"])  # separate launches
    again.mlp_add_rmsnorm(torch.randn(1, 32), wide[0], wide[1], wide[2][None], wide[3], 1e-6)
    assert ("mlp", "simt2.w8.s4") in fake_mlp["gemv"]


def test_the_one_launch_mlp_must_win_by_its_margin():
    """auto keeps the separate launches unless the one-launch MLP times _MLP_MARGIN faster (its back-to-back timing
    flatters it against a decode step), and where nothing one-launch was timed."""
    margin = gemm._MLP_MARGIN
    assert gemm.pick_mlp({"cublas": 10.0, "simt2.w8.s4": 10.0 * (1 - margin) - 0.01, "tc1.w8.s2": 9.5}) == "simt2.w8.s4"
    assert gemm.pick_mlp({"cublas": 10.0, "simt2.w8.s4": 10.0 * (1 - margin / 2)}) == "cublas"
    assert gemm.pick_mlp({"cublas": 10.0}) == "cublas"
    # a resident variant has its own margin, negative (decode favoured it where its timing was a tie): taken even a
    # little slower than the separate launches, ahead of a faster per-launch form that misses its own margin, but not
    # beyond that margin, and never without the separate launches' timing
    res = gemm._RESIDENT_MLP_MARGIN
    assert res < 0 < margin
    times = {"cublas": 10.0, "res2.w8.s1": 10.0 * (1 - res) - 0.01, "simt2.w8.s4": 10.0 * (1 - margin) + 0.01}
    assert gemm.pick_mlp(times) == "res2.w8.s1"
    assert gemm.pick_mlp({"cublas": 10.0, "res2.w8.s1": 10.0 * (1 - res / 2)}) == "res2.w8.s1"
    assert gemm.pick_mlp({"cublas": 10.0, "res2.w8.s1": 10.0 * (1 - res) + 0.01}) == "cublas"
    assert gemm.pick_mlp({"cublas": 10.0, "res2.w8.s1": 9.0, "simt2.w8.s4": 8.5}) == "simt2.w8.s4"
    assert gemm.pick_mlp({"res2.w8.s1": 1.0}) == "cublas"  # nothing to compare with


def test_resident_mlp_variants_are_timed_only_for_a_large_mlp():
    """auto times the resident one-launch MLP only where the MLP's weights reach _RESIDENT_MIN_BYTES (a small one's
    resident launch is mostly its blocks waiting for one another); the per-launch variants always."""
    small = (torch.empty(2 * 1024, 384), torch.empty(384, 1024))  # the bundled model's MLP in fp32, 4.7 MB
    rows = gemm._RESIDENT_MIN_BYTES // (3 * 4096 * 2) + 1
    large = (torch.empty(2 * rows, 4096, dtype=torch.bfloat16), torch.empty(4096, rows, dtype=torch.bfloat16))
    per_launch = [v for v in gemm._MLP_VARIANTS if not v.startswith("res")]
    assert list(gemm.mlp_candidates(*small)) == per_launch
    assert set(gemm.mlp_candidates(*large)) == set(gemm._MLP_VARIANTS) and len(per_launch) < len(gemm._MLP_VARIANTS)


def test_auto_measures_the_mlp_only_outside_a_capture(fake_mlp, tmp_path):
    """An MLP shape auto meets first inside a graph capture runs its separate launches there, unmeasured and
    uncached; the next eager call measures it and takes its choice."""
    gu, down, r, nw = _mlp_operands(96)
    p = products("auto", tmp_path / "c.json")
    x = torch.randn(1, 32)
    fake_mlp["capturing"] = True
    assert p.mlp_choice(x, gu, down) == "cublas" and not p.mlp_choices
    assert not any(c[0] == "mlp" for c in fake_mlp["measure"] if isinstance(c, tuple))
    fake_mlp["capturing"] = False
    assert p.mlp_choice(x, gu, down) == "simt2.w8.s4" and p.mlp_choices == {(48, 96): "simt2.w8.s4"}
    assert fake_mlp["measure"] == [("mlp", 1)]
    assert p.mlp_choice(torch.randn(2, 32), gu, down) == "cublas"  # more rows: the separate launches


def test_the_norm_before_a_resident_mlp_of_one_row_is_left_to_it(fake, monkeypatch):
    """add_mlp_add_rmsnorm (Model.out_mlp): where the norm's weight is folded into gate|up, the MLP of one row is
    the resident launch and a gemv kernel makes the projection before it, the projection stores only the residual
    stream (gemv_add, its variant) and the MLP norms it itself (x_norm); unfolded, for more rows, another MLP form,
    or cuBLAS making the projection, the projection's fused norm then the MLP as before. The same numbers every
    way."""
    calls = []
    monkeypatch.setattr(ops, "gemv_mlp_fits", lambda x, gu, down, variant: x.shape[0] == 1)

    def gemv_add(x, w, residual, variant=None):
        calls.append(("add", variant))
        return F.linear(x, w) + residual

    def mlp(x, gu, down, r, nw, eps, variant=None, x_norm=False):
        calls.append(("mlp", variant, x_norm))
        if x_norm:
            x = ops.rmsnorm(x, torch.zeros(x.shape[-1]), eps)
        return ops.add_rmsnorm(F.linear(ops.silu_mul(F.linear(x, gu)), down), r, nw, eps)

    def add_rmsnorm(x, w, residual, weight, eps, variant=None):
        calls.append(("add+norm", variant))
        return ops.add_rmsnorm(F.linear(x, w), residual, weight, eps)

    monkeypatch.setattr(ops, "gemv_add", gemv_add)
    monkeypatch.setattr(ops, "gemv_mlp_add_rmsnorm", mlp)
    monkeypatch.setattr(ops, "gemv_add_rmsnorm", add_rmsnorm)
    g = torch.Generator().manual_seed(3)
    w_out, gu, down = (
        torch.randn(32, 40, generator=g),
        torch.randn(192, 32, generator=g),
        torch.randn(32, 96, generator=g),
    )
    post, nxt = torch.zeros(32), torch.randn(32, generator=g) * 0.1  # post folded into gu (any gu will do)
    p = products("cupy")
    p.mlp_choices[(32, 96)] = "res2.w8.s1"

    def run(rows, folded=True):
        a, r = torch.randn(rows, 40, generator=g), torch.randn(rows, 32, generator=g)
        calls.clear()
        got = p.add_mlp_add_rmsnorm(a, w_out, r, post, gu, down, nxt, 1e-6, folded)
        h, s = ops.add_rmsnorm(F.linear(a, w_out), r, post, 1e-6)
        want = ops.add_rmsnorm(F.linear(ops.silu_mul(F.linear(h, gu)), down), s, nxt, 1e-6)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(got, want, strict=True)), rows
        return list(calls)

    assert run(1) == [("add", "simt2.w4.s1"), ("mlp", "res2.w8.s1", True)]
    assert run(1, folded=False) == [("add+norm", "simt2.w4.s1"), ("mlp", "res2.w8.s1", False)]
    assert ("add", "simt2.w4.s1") not in run(3) and ("add+norm", "simt2.w4.s1") in run(3)
    p.mlp_choices[(32, 96)] = "simt2.w8.s4"  # a per-launch form: the projection norms
    assert run(1) == [("add+norm", "simt2.w4.s1"), ("mlp", "simt2.w8.s4", False)]
    p.mlp_choices[(32, 96)] = "res2.w8.s1"
    p.choices[(32, 40, 0)] = "cublas"  # cuBLAS makes the projection: add_rmsnorm after it, then the MLP
    assert run(1) == [("mlp", "res2.w8.s1", False)]


def test_folding_the_norm_before_a_resident_mlp_keeps_the_model_and_is_done_once(tiny_model_dir):
    """Model.fold_norms (set_gemm, where the MLP of one row is resident): each such MLP's gate|up takes its norm's
    weight (W (1 + w) columnwise) and the norm's weight becomes zero, and so does the input norm of each delta-net
    layer after such an MLP whose fused in_proj launch norms its input (GemvProducts.rule_norms: into its in_proj),
    and of each attention layer after one whose qkv product norms its input (product_norms: into its qkv);
    the model's hidden states stay within fp32 rounding of the unfolded model's; a second call changes nothing; an
    MLP auto did not make resident, a layer after an MLP left as it was, an attention layer whose qkv product does not
    norm, or mode "exact", is left as it was."""
    from engine import Engine

    eng = Engine.load(tiny_model_dir, device="cpu", dtype="float32")
    m = eng.model
    ids = torch.tensor([3, 17, 5, 9, 2])
    before = m.forward_layers(ids, eng.new_session().state, 0, False).clone()
    gate_ups = {n: t.clone() for n, t in m.w.items() if n.endswith("mlp.gate_up_packed")}
    assert len(gate_ups) >= 2

    class Resident:  # what fold_norms asks of GemvProducts: the one-row MLP's choice per (gate|up, down)
        mode = "auto"

        def __init__(self, resident, qkv_norms=frozenset()):
            self.resident, self.qkv_norms = resident, qkv_norms

        def mlp_choice(self, row, gu, down):
            return "res2.w8.s1" if gu.data_ptr() in self.resident else "cublas"

        def rule_norms(self, row, w_in):  # every in_proj's fused launch norms its input
            return row.shape == (1, w_in.shape[1])

        def product_norms(self, row, w_in):  # the qkv products named norm their input in their launch
            return row.shape == (1, w_in.shape[1]) and w_in.data_ptr() in self.qkv_norms

    in_projs = {n: t.clone() for n, t in m.w.items() if n.endswith("in_proj_packed")}
    inputs = {n: t.clone() for n, t in m.w.items() if n.endswith("input_layernorm.weight")}
    first = next(iter(gate_ups))
    m._gemv = Resident({m.w[first].data_ptr()})
    m._gemv.mode = "exact"
    m.fold_norms()
    assert all(torch.equal(m.w[n], t) for n, t in gate_ups.items())  # exact: nothing folded
    m._gemv.mode = "auto"
    m.fold_norms()
    p = first[: -len("mlp.gate_up_packed")]
    assert m.w[p + "post_attention_layernorm.weight"].count_nonzero() == 0
    assert not torch.equal(m.w[first], gate_ups[first])
    others = [n for n in gate_ups if n != first]
    assert all(torch.equal(m.w[n], gate_ups[n]) for n in others)  # not resident: as it was
    layer = int(first.split(".")[1])  # the layer after the folded MLP: its in_proj folded if it is a delta-net
    after_first = {f"layers.{layer + 1}.linear_attn.in_proj_packed"} & set(in_projs)
    assert m._folded_in == {layer + 1 for _ in after_first}
    for n, t in in_projs.items():
        assert torch.equal(m.w[n], t) != (n in after_first), n
    types = m.cfg.layer_types
    attn = [i for i in range(1, len(types)) if types[i] == "full_attention"]
    assert len(attn) >= 2
    qkvs = {n: t.clone() for n, t in m.w.items() if n.endswith("qkv_packed")}
    norming = attn[1:]  # the first attention layer's qkv product cannot norm its input (a K-split choice, say)
    qkv_norms = {m.w[f"layers.{i}.self_attn.qkv_packed"].data_ptr() for i in norming}
    m._gemv = Resident({t.data_ptr() for n, t in m.w.items() if n.endswith("mlp.gate_up_packed")}, qkv_norms)
    m.fold_norms()
    folded = {n: m.w[n].clone() for n in gate_ups}
    m.fold_norms()  # once a layer
    assert all(torch.equal(m.w[n], folded[n]) for n in gate_ups)
    assert all(t.count_nonzero() == 0 for n, t in m.w.items() if n.endswith("post_attention_layernorm.weight"))
    delta_after = {i for i in range(1, len(types)) if types[i] != "full_attention"}
    # every delta-net layer but the first, and the attention layers whose qkv product norms its input
    assert m._folded_in == delta_after | set(norming) and delta_after
    for n, t in inputs.items():
        i = int(n.split(".")[1]) if n.startswith("layers.") else -1
        assert (m.w[n].count_nonzero() == 0) == (i in m._folded_in), n  # the others, layer 0, the MTP head: as it was
        assert i in m._folded_in or torch.equal(m.w[n], t), n
    for n, t in qkvs.items():
        i = int(n.split(".")[1]) if n.startswith("layers.") else -1
        assert torch.equal(m.w[n], t) != (i in norming), n
    m._gemv = None
    after = m.forward_layers(ids, eng.new_session().state, 0, False)
    assert torch.allclose(after, before, atol=1e-5, rtol=1e-4)
