"""How kernels/cuda.py loads its CuPy modules, with CuPy faked (runs on the CPU): a module is compiled once per
device and dtype (the gemv module likewise, the sampling module once per device), each kernel function is looked
up once and kept, and a decode module that fails to compile with the CUDA half headers is compiled again with its
own 2-byte types."""

from __future__ import annotations

import contextlib
import types

import pytest

import kernels.cuda as kc


class FakeModule:
    def __init__(self, code: str, log: list, fail_half_headers: bool) -> None:
        self.code, self.log, self.fail = code, log, fail_half_headers

    def compile(self) -> None:
        if self.fail and not self.code.startswith("#define SPECDECK_OWN_HALF"):
            raise RuntimeError("cuda_fp16.h clashes")
        self.log.append(("compile", self.code.splitlines()[0]))

    def get_function(self, name: str):
        self.log.append(("function", name))
        return types.SimpleNamespace(kernel=("kernel", name, self.code.splitlines()[0]))


@pytest.fixture
def fake_cupy(monkeypatch):
    log: list = []
    state = {"fail": False}
    fake = types.SimpleNamespace(
        RawModule=lambda code, options: FakeModule(code, log, state["fail"]),
        cuda=types.SimpleNamespace(Device=lambda dev: contextlib.nullcontext()),
    )
    monkeypatch.setattr(kc, "_cp", fake)
    for cache in ("_modules", "_functions", "_gemv_modules", "_gemv_fns", "_sampling_modules", "_sampling_fns"):
        monkeypatch.setattr(kc, cache, {})
    return log, state


def test_each_module_is_compiled_once_and_each_function_looked_up_once(fake_cupy):
    log, _ = fake_cupy
    a = kc._function(0, 1, "rmsnorm_ws")
    assert kc._function(0, 1, "rmsnorm_ws") is a
    kc._function(0, 1, "silu_mul")
    kc._function(0, 0, "silu_mul")  # another dtype: another module
    kc._function(1, 1, "silu_mul")  # another device: another module
    kc._gemv_function(0, 1, "gemv_combine")
    kc._gemv_function(0, 1, "gemv_combine")
    kc._sampling_function(0, "sample_probs_k")
    kc._sampling_function(0, "spec_accept_k")
    compiles = [entry[1] for entry in log if entry[0] == "compile"]
    assert compiles.count("#define SCALAR_KIND 1") == 3  # decode dev 0, decode dev 1, gemv dev 0
    assert compiles.count("#define SCALAR_KIND 0") == 1
    assert len(compiles) == 5  # + the sampling module, once for two kernels
    functions = [entry[1] for entry in log if entry[0] == "function"]
    assert functions.count("rmsnorm_ws") == 1 and functions.count("gemv_combine") == 1
    assert a == ("kernel", "rmsnorm_ws", "#define SCALAR_KIND 1")


def test_a_decode_module_that_fails_with_the_half_headers_is_built_with_its_own_types(fake_cupy):
    log, state = fake_cupy
    state["fail"] = True
    kernel = kc._function(0, 1, "rmsnorm_ws")
    assert kernel[2] == "#define SPECDECK_OWN_HALF 1"
    assert [entry for entry in log if entry[0] == "compile"] == [("compile", "#define SPECDECK_OWN_HALF 1")]
