"""Every CUDA kernel's typed launch builder (kernels/launch_args.py) matches the kernel's parameter list in
kernels/cuda_src/*.cu: the same names, in the same order, with the same C types. Runs on the CPU: it parses
the sources (expanding the macros that stamp out kernel families) and never compiles them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernels import launch_args as la

SRC = Path(__file__).resolve().parent.parent / "kernels" / "cuda_src"
_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*)?(\w+)\s*\(([^)]*)\)'
)
_DEFINE = re.compile(r"^#define\s+(\w+)\(([^)]*)\)(.*)$", re.M)


def _expand(text: str) -> str:
    """The source with every kernel-defining macro's uses expanded (##-pasting included) and the
    definitions themselves dropped; enough of a preprocessor for `extern "C"` signatures."""
    text = re.sub(r"\\\n", " ", text)
    macros = {}
    for m in _DEFINE.finditer(text):
        if "__global__" in m.group(3):
            macros[m.group(1)] = ([p.strip() for p in m.group(2).split(",")], m.group(3))
    body = _DEFINE.sub(lambda m: "" if m.group(1) in macros else m.group(0), text)
    out = [body]
    for name, (params, template) in macros.items():
        for use in re.finditer(rf"^{name}\(([^)]*)\)", body, re.M):
            args = [a.strip() for a in use.group(1).split(",")]
            assert len(args) == len(params), name
            expanded = template
            for p, a in zip(params, args, strict=True):
                expanded = re.sub(rf"\b{p}\b", a, expanded)
            out.append(re.sub(r"\s*##\s*", "", expanded))
    return "\n".join(out)


def _ctype(decl: str) -> tuple[str, type]:
    words = [w for w in re.sub(r"\*", " * ", decl).split() if w not in ("const", "__restrict__")]
    name, ctype = words[-1], " ".join(words[:-1])
    if "*" in ctype:
        return name, la.Ptr
    return name, la.CTYPES[ctype]


def cuda_signatures() -> dict[str, list[tuple[str, type]]]:
    sigs: dict[str, list[tuple[str, type]]] = {}
    for path in sorted(SRC.glob("*.cu")):
        for m in _KERNEL.finditer(_expand(path.read_text())):
            assert m.group(1) not in sigs, f"kernel {m.group(1)} defined twice"
            sigs[m.group(1)] = [_ctype(p) for p in m.group(2).split(",")]
    return sigs


SIGS = cuda_signatures()


def test_the_parser_sees_every_kernel_family():
    assert len(SIGS) >= 40
    assert {"rmsnorm_ws", "gated_rmsnorm_wf_gs", "attn_tile_e8", "conv_update_k8_wf", "gdr_dk128_bf"} <= set(SIGS)
    assert {"sample_probs_rows", "sample_token_rows", "spec_accept_k"} <= set(SIGS)
    assert {"gemv_simt_m1_c1", "gemv_simt_m17_c2", "gemv_tc_t1_c1", "gemv_tc_t3_c2", "gemv_combine"} <= set(SIGS)


def test_every_kernel_has_a_builder_and_every_builder_a_kernel():
    assert sorted(set(SIGS) - set(la.BUILDERS)) == []
    assert sorted(set(la.BUILDERS) - set(SIGS)) == []


@pytest.mark.parametrize("kernel", sorted(SIGS))
def test_builder_fields_match_the_kernel_parameters(kernel):
    assert la.field_types(la.BUILDERS[kernel]) == SIGS[kernel]


def test_the_cuda_module_launches_only_described_kernels():
    import kernels.cuda as kc

    assert set(kc._KERNELS_PER_DTYPE) <= set(la.BUILDERS)
    assert set(kc._SAMPLING_KERNELS) <= set(la.BUILDERS)
    assert {*kc._GEMV_SIMT, *kc._GEMV_TC, "gemv_combine"} <= set(la.BUILDERS)


def test_pack_orders_converts_and_refuses_a_foreign_kernel():
    import numpy as np
    import torch

    t = torch.zeros(4)
    args = la.GreedyAcceptArgs(drafts=t, probs=None, target=la.NULL, p_min=0.5, cache_len=t, out=t, n=3, start=None)
    packed = la.pack("greedy_accept", args)
    u, f, i = np.uint64, np.float64, np.int32
    assert [type(v) for v in packed] == [u, u, u, f, u, u, i, u]
    assert packed[0] == t.data_ptr() and packed[1] == 0 and packed[6] == 3 and packed[7] == 0
    with pytest.raises(TypeError, match="does not describe"):
        la.pack("argmax_combine", args)
    with pytest.raises(TypeError):
        la.GreedyAcceptArgs(drafts=t, probs=t, target=t, p_min=0.5, cache_len=t, out=t, start=t)  # n missing


def test_a_reordered_parameter_would_fail():
    """The check has teeth: swapping two parameters in a signature is seen."""
    src = 'extern "C" __global__ void silu_mul(const float* x, long long xs, float* y, int I, int T) {}'
    ((name, params),) = [(m.group(1), m.group(2)) for m in _KERNEL.finditer(_expand(src))]
    assert [_ctype(p) for p in params.split(",")] != la.field_types(la.BUILDERS[name])


def test_every_kernel_opens_with_pdl_enter():
    """With programmatic dependent launch a kernel may be scheduled before the one before it has finished; only
    its PDL_ENTER() (griddepcontrol.wait) makes that safe, so it must come before anything else in every kernel,
    including the ones stamped out by macros. The gemv products alone open with PDL_TRIGGER() instead: they load
    their first W vectors (weights, which no kernel writes) before their PDL_WAIT(), and nothing else: before
    the first wait in each of their bodies there is no read of x and no store. The one-launch MLP forms take
    their block's ticket (an atomic on their launch site's own counter) before PDL_TRIGGER(), and nothing else."""
    missing, triggered, ticketed = [], [], []
    # the one-launch MLP takes its ticket first (gemv_kernels.cu says why), then triggers; nothing else before
    ticket = r"\s*\{\s*__shared__ int s_ticket;\s*if \(threadIdx.x == 0\) s_ticket = atomicAdd\(mcnt, 1\)[^;]*;\s*"
    ticket += r"__syncthreads\(\);\s*PDL_TRIGGER\(\);"
    for path in sorted(SRC.glob("*.cu")):
        text = _expand(path.read_text())
        for m in _KERNEL.finditer(text):
            if path.name == "gemv_kernels.cu" and m.group(1).endswith("_mlp"):
                if re.match(ticket, text[m.end() :]):
                    ticketed.append(m.group(1))
                else:
                    missing.append(f"{path.name}:{m.group(1)} (the MLP form: the ticket, then PDL_TRIGGER)")
            elif re.match(r"\s*\{\s*PDL_TRIGGER\(\);", text[m.end() :]):
                triggered.append(m.group(1))
                if path.name != "gemv_kernels.cu" or not m.group(1).startswith(("gemv_simt_", "gemv_tc_")):
                    missing.append(f"{path.name}:{m.group(1)} (PDL_TRIGGER outside the gemv products)")
            elif not re.match(r"\s*\{\s*PDL_ENTER\(\);", text[m.end() :]):
                missing.append(f"{path.name}:{m.group(1)}")
    assert not missing, f"kernels that do not open with PDL_ENTER(): {missing}"
    assert len(SIGS) > 40  # the parser saw the kernel families, not a handful
    assert {"gemv_simt_m1_c2", "gemv_tc_t1_c1_an", "gemv_tc_t3_c2_sm", "gemv_simt_m17_c2_sm"} <= set(triggered)
    assert set(ticketed) == {"gemv_simt_m1_c1_mlp", "gemv_simt_m1_c2_mlp"}
    gemv = (SRC / "gemv_kernels.cu").read_text()
    for fn in ("gv_simt_cols(", "gv_tc("):
        body = gemv[gemv.index("void " + fn) :]
        before = body[: body.index("PDL_WAIT();")]
        for touch in ("gv_ld_x", "gv_store", "out[", "part[", "cnt", "gv_add_norm", "xb["):
            assert touch not in before, (fn, touch)
        assert "gv_ld_w" in before, fn  # the prefetch is there


def test_the_pdl_launch_structures_have_the_driver_layout():
    """kernels/pdl.py passes CUlaunchConfig / CUlaunchAttribute to cuLaunchKernelEx by pointer: their sizes and
    offsets are those of cuda.h on a 64-bit host, and the kernel parameters point at values of the C types."""
    import ctypes

    import numpy as np

    from kernels import pdl

    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.value.offset == 8
    cfg = pdl.LaunchConfig
    assert (cfg.sharedMemBytes.offset, cfg.hStream.offset, cfg.attrs.offset, cfg.numAttrs.offset) == (24, 32, 40, 48)
    params, values = pdl.kernel_params((np.uint64(2**40 + 3), np.int32(-7), np.float32(0.25), np.int64(-(2**35))))
    got = [ctypes.cast(params[i], ctypes.POINTER(type(v))).contents.value for i, v in enumerate(values)]
    assert got == [2**40 + 3, -7, 0.25, -(2**35)]
    with pytest.raises(TypeError, match="cannot pass a float"):
        pdl.kernel_params((1.5,))


def test_a_launch_config_carries_the_attributes_asked_for():
    """pdl.launch_config: PDL alone (a captured plan's launches), cooperative alone (a resident kernel launched
    eagerly), both (a resident kernel in a plan with PDL), or neither; each attribute's value 1, the grid and block
    padded to three dimensions."""
    import ctypes

    from kernels import pdl

    for programmatic, cooperative in ((True, False), (False, True), (True, True), (False, False)):
        cfg, attrs = pdl.launch_config((264,), (256,), 24576, 0x1234, programmatic, cooperative)
        want = [pdl.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION] * programmatic
        want += [pdl.CU_LAUNCH_ATTRIBUTE_COOPERATIVE] * cooperative
        assert cfg.numAttrs == len(want)
        assert [cfg.attrs[i].id for i in range(cfg.numAttrs)] == want
        for i in range(cfg.numAttrs):
            value = ctypes.c_int.from_address(ctypes.addressof(cfg.attrs[i]) + pdl.LaunchAttribute.value.offset).value
            assert value == 1
        assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimZ) == (264, 1, 1, 256, 1)
        assert cfg.sharedMemBytes == 24576 and cfg.hStream == 0x1234
        assert ctypes.addressof(cfg.attrs.contents) == ctypes.addressof(attrs)  # the array the caller keeps alive


def test_a_refused_resident_launch_says_why_and_what_to_do():
    """pdl.launch_error: the driver's refusal of a cooperative grid (the resident MLP on a GPU another process
    shares) names the block count, the error and the --gemm choice that avoids it; the same code from a plain
    launch, and any other code, stay the bare CUresult."""
    from kernels import pdl

    msg = pdl.launch_error(pdl.CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE, (264,), True)
    assert "264 blocks" in msg and "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE" in msg and "--gemm cublas" in msg
    assert pdl.launch_error(720, (264,), False) == "cuLaunchKernelEx failed with CUresult 720"
    assert pdl.launch_error(1, (264,), True) == "cuLaunchKernelEx failed with CUresult 1"


def test_the_pdl_model_option_is_off_on_the_cpu_and_takes_only_a_bool(tiny_engine):
    tiny_engine.set_model_option("pdl", True)
    assert tiny_engine.model.pdl is False  # nothing to launch with it on the CPU: plans keep their key
    assert "pdl" not in tiny_engine.model.plan_tag
    with pytest.raises(ValueError, match="pdl takes True or False"):
        tiny_engine.set_model_option("pdl", "yes")
