"""What a kernel that only streams a weight can reach, per launch, timed as the gemv table times a product
(bench/gpu_bench.py section gemv, engine/gemm.py _graph_seconds: a CUDA graph of launches over distinct buffers past
L2, the fastest of 3 replays, divided by the launches): the ceiling a gemv of that many bytes can be held to.

The kernel reads its buffer with 16-byte loads past L1 (each thread U loads in flight, a grid-stride loop), adds
them and stores one word per block (so nothing is optimised away); with PDL its first loads are issued before
griddepcontrol.wait, as the gemv kernels do. Rows: buffer size (the 9B-like weights: 32, 64, 96, 192 MiB), blocks
per SM, loads in flight, launches per graph, PDL off/on; % of the device's copy bandwidth (bench/timing.py).

    PYTHONPATH=$PWD python3 bench/read_ceiling.py [--rows]    (--rows: the access-pattern table only)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy as cp
import numpy as np
import torch

from bench.timing import copy_bandwidth
from engine.gemm import _graph_seconds
from kernels import pdl

SRC = r"""
extern "C" __global__ void __launch_bounds__(256) stream_read(const uint4* __restrict__ p, long long nvec,
                                                              float* __restrict__ out) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    uint4 v[U];
    bool first = true;
    for (; i + (U - 1) * stride < nvec; i += U * stride) {
#pragma unroll
        for (int u = 0; u < U; ++u)
            asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(p + i + u * stride));
        if (first) {
            asm volatile("griddepcontrol.wait;" ::: "memory");
            first = false;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (first) asm volatile("griddepcontrol.wait;" ::: "memory");
    for (; i < nvec; i += stride) acc += p[i].x;
    if (acc == 0x9e3779b9u) out[blockIdx.x] = (float)acc;  // almost never: keeps the loads
}

// The gemv's access pattern, reads only: a warp owns C rows of W [N, K] (K / 8 vectors a row) and a K split
// (blockIdx.y of S), lanes read vectors v, v + 32, ... of each row, UR per row in flight (UR * C loads).
// PERSIST: the grid is a whole number of blocks per SM and each warp takes units (C rows x one split) in turn.
template <int C, int UR, bool PERSIST>
__device__ __forceinline__ void rows_read(const uint4* __restrict__ w, int N, int KV, int kvchunk, float* out) {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int S = (KV + kvchunk - 1) / kvchunk;
    const long long units = (long long)(N / C) * S;
    long long unit = PERSIST ? (long long)blockIdx.x * nw + (threadIdx.x >> 5)
                             : ((long long)blockIdx.x * nw + (threadIdx.x >> 5)) * S + blockIdx.y;
    const long long step = PERSIST ? (long long)gridDim.x * nw : units;
    unsigned int acc = 0;
    bool first = true;
    for (; unit < units; unit += step) {
        const long long n0 = (unit / S) * C;
        const int s = (int)(unit % S);
        const int v0 = s * kvchunk, v1 = min(KV, v0 + kvchunk);
        for (int v = v0 + lane; v + (UR - 1) * 32 < v1; v += UR * 32) {
            uint4 r[UR][C];
#pragma unroll
            for (int u = 0; u < UR; ++u)
#pragma unroll
                for (int c = 0; c < C; ++c)
                    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                                 : "=r"(r[u][c].x), "=r"(r[u][c].y), "=r"(r[u][c].z), "=r"(r[u][c].w)
                                 : "l"(w + (n0 + c) * KV + v + u * 32));
            if (first) {
                asm volatile("griddepcontrol.wait;" ::: "memory");
                first = false;
            }
#pragma unroll
            for (int u = 0; u < UR; ++u)
#pragma unroll
                for (int c = 0; c < C; ++c) acc += r[u][c].x ^ r[u][c].y ^ r[u][c].z ^ r[u][c].w;
        }
    }
    if (first) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (acc == 0x9e3779b9u) out[blockIdx.x] = (float)acc;
}
extern "C" __global__ void __launch_bounds__(256) rows_c2_u2(const uint4* w, int N, int KV, int kvchunk, float* out) {
    rows_read<2, 2, false>(w, N, KV, kvchunk, out);
}
extern "C" __global__ void __launch_bounds__(256) rows_c2_u4(const uint4* w, int N, int KV, int kvchunk, float* out) {
    rows_read<2, 4, false>(w, N, KV, kvchunk, out);
}
extern "C" __global__ void __launch_bounds__(256) prows_c2_u2(const uint4* w, int N, int KV, int kvchunk, float* out) {
    rows_read<2, 2, true>(w, N, KV, kvchunk, out);
}
extern "C" __global__ void __launch_bounds__(256) prows_c2_u4(const uint4* w, int N, int KV, int kvchunk, float* out) {
    rows_read<2, 4, true>(w, N, KV, kvchunk, out);
}
"""

SHAPES = {
    "4096x4096": (4096, 4096),
    "4096x8192": (4096, 8192),
    "4096x12288": (4096, 12288),
    "12352x4096": (12352, 4096),
}


def rows_table(bw: float, sms: int, l2: int, out: torch.Tensor) -> None:
    """The gemv's access pattern (reads only) against the grid-stride read, per 9B-like shape."""
    mods = {u: cp.RawModule(code=SRC, options=("-std=c++17", f"-DU={u}")) for u in (4,)}
    stride_read = mods[4].get_function("stream_read").kernel
    fns = {
        name: mods[4].get_function(name).kernel for name in ("rows_c2_u2", "rows_c2_u4", "prows_c2_u2", "prows_c2_u4")
    }
    print()
    print(
        "== the gemv's access pattern, reads only (C = 2 rows a warp, U vectors of each in flight), PDL on, 8 launches =="
    )
    print(f"{'shape':>11} {'kernel':>12} {'warps':>5} {'S':>2} {'grid':>10} {'us':>7} {'%bw':>4}")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        count = max(2, min(8, -(-3 * l2 // nbytes)))
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(count)]
        kv = k // 8
        rows = [("stride u4", stride_read, 8, 1, (sms * 8, 1), None)]
        for kern in ("rows_c2_u2", "rows_c2_u4"):
            for warps, splits in ((4, 1), (4, 2), (8, 1), (8, 2), (4, 4)):
                chunk = -(-kv // splits)
                rows.append((kern, fns[kern], warps, splits, (-(-n // (warps * 2)), splits), chunk))
        for kern in ("prows_c2_u2", "prows_c2_u4"):
            for warps, per_sm, splits in ((8, 4, 1), (8, 8, 1), (8, 4, 2), (8, 8, 2), (4, 8, 2)):
                chunk = -(-kv // splits)
                rows.append((f"{kern}/{per_sm}", fns[kern], warps, splits, (sms * per_sm, 1), chunk))
        for label, fn, warps, splits, grid, chunk in rows:
            if chunk is None:
                t = time_chain(fn, bufs, 8, grid[0], out, True)
            else:
                t = time_chain(fn, bufs, 8, grid, out, True, block=warps * 32, extra=(n, kv, chunk))
            print(
                f"{name:>11} {label:>12} {warps:>5} {splits:>2} {str(grid):>10} {t * 1e6:>7.2f} {100 * nbytes / t / bw:>3.0f}%"
            )
        del bufs
        torch.cuda.empty_cache()


def main() -> int:
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, props.L2_cache_size
    print(f"device: {props.name}, {sms} SMs, L2 {l2 >> 20} MiB, copy bandwidth {bw / 1e12:.2f} TB/s")
    mods = {u: cp.RawModule(code=SRC, options=("-std=c++17", f"-DU={u}")) for u in (2, 4, 8)}
    kern = {u: mods[u].get_function("stream_read").kernel for u in mods}
    out = torch.zeros(1 << 16, device=dev)
    if "--rows" in sys.argv:  # the access-pattern table only
        rows_table(bw, sms, l2, out)
        return 0
    print(
        f"{'MiB':>5} {'blocks/SM':>9} {'U':>2} {'launches':>8} {'PDL off us':>10} {'%bw':>4} {'PDL on us':>9} {'%bw':>4}"
    )
    for mib in (32, 64, 96, 192):
        nbytes = mib << 20
        count = max(2, min(8, -(-3 * l2 // nbytes)))
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255) for _ in range(count)]
        for per_sm in (2, 4, 8):
            for u in (2, 4, 8):
                for launches in (8, 32):
                    cells = []
                    for with_pdl in (False, True):
                        t = time_chain(kern[u], bufs, launches, sms * per_sm, out, with_pdl)
                        cells.append(f"{t * 1e6:>9.2f} {100 * nbytes / t / bw:>3.0f}%")
                    print(f"{mib:>5} {per_sm:>9} {u:>2} {launches:>8} {cells[0]:>15} {cells[1]:>14}")
        del bufs
        torch.cuda.empty_cache()
    rows_table(bw, sms, l2, out)
    return 0


def time_chain(fn, bufs, launches: int, blocks, out: torch.Tensor, with_pdl: bool, block=256, extra=None) -> float:
    """Seconds per launch of `launches` back-to-back reads cycling over `bufs`, timed by gemm "auto"'s own graph
    timing (engine/gemm.py _graph_seconds); `extra` (N, KV, kvchunk): a rows_* kernel, grid `blocks` (x, y)."""
    nvec = bufs[0].numel() // 16
    grid = (*blocks, 1) if isinstance(blocks, tuple) else (blocks, 1, 1)

    def run():
        ptr = torch.cuda.current_stream().cuda_stream
        cstream = cp.cuda.ExternalStream(ptr)
        for i in range(launches):
            p = np.uint64(bufs[i % len(bufs)].data_ptr())
            if extra is None:
                args = (p, np.int64(nvec), np.uint64(out.data_ptr()))
            else:
                args = (p, *(np.int32(v) for v in extra), np.uint64(out.data_ptr()))
            if with_pdl:
                pdl.launch(fn.ptr, grid, (block, 1, 1), args, 0, ptr)
            else:
                fn(grid, (block, 1, 1), args, 0, cstream)

    return _graph_seconds(run, torch.device("cuda")) / launches


if __name__ == "__main__":
    raise SystemExit(main())
