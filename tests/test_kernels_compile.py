"""Every CUDA source compiles, for every activation dtype, for Hopper (sm_90: what the H200 runs, with
programmatic dependent launch) and Ampere (sm_80: the oldest the tensor-core kernels serve), with nvcc where the
machine has one (no GPU needed); without nvcc (CI) it is skipped. A kernel edit made without a GPU at hand is
at least compiled before it reaches one. NVRTC compiles the same text at run time (kernels/cuda.py), with the
same `#define SCALAR_KIND k` in front."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "kernels" / "cuda_src"
NVCC = shutil.which("nvcc")
# (source, dtype kind, arch, extra defines): the gemv source also as the modules of its fused in_proj forms, one per
# rule size (GV_DR_DK, kernels/cuda.py _gemv_function)
BUILDS = [(src, "") for src in sorted(SRC.glob("*.cu"))]
BUILDS += [(SRC / "gemv_kernels.cu", f"#define GV_DR_DK {dk}\n") for dk in (64, 128)]
CASES = [(src, kind, arch, extra) for src, extra in BUILDS for kind, arch in ((0, 90), (1, 90), (2, 90), (1, 80))]


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
def test_every_cuda_source_compiles_for_every_dtype(tmp_path):
    def build(case):
        src, kind, arch, extra = case
        unit = tmp_path / f"{src.stem}{'_dr' + extra.split()[-1] if extra else ''}_k{kind}_sm{arch}.cu"
        unit.write_text(f"#define SCALAR_KIND {kind}\n" + extra + src.read_text())
        out = str(unit.with_suffix(".cubin"))
        cmd = [NVCC, "-std=c++17", f"-arch=sm_{arch}", f"-I{SRC}", "-cubin", "-o", out, str(unit)]  # the .cuh headers
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        warnings = [line for line in done.stderr.splitlines() if "warning" in line]
        return case, done.returncode, done.stderr[-3000:], warnings

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(build, CASES))
    failed = [
        f"{src.name} {extra}kind {kind} sm_{arch}:\n{err}" for (src, kind, arch, extra), rc, err, _ in results if rc
    ]
    assert not failed, "\n".join(failed)
    warned = [
        f"{src.name} {extra}kind {kind} sm_{arch}: {w}" for (src, kind, arch, extra), _, _, ws in results for w in ws
    ]
    assert not warned, "\n".join(warned)
