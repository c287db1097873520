"""The bundled model (launch-bound) with gemm cublas against gemm auto, interleaved in one process: issue 20 asks that
the gemv kernels leave it no slower. Target-only and speculative (depth 5, chained), bf16, the first workload's
prompt; each run also says whether its tokens are cuBLAS's.

    python bench/bundled_gemm_ab.py [--n 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import workload_prompts  # noqa: E402

from engine import Engine, EngineSettings, bundled_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    eng = Engine.load(bundled_model_dir(), device="cuda", dtype="bfloat16")
    prompt = workload_prompts(eng)[0]
    runs = (
        ("target-only", EngineSettings(speculative=False, plan_pool=8)),
        ("spec depth 5 chain", EngineSettings(draft_depth=5, chain=True, plan_pool=8)),
    )
    for name, settings in runs:
        first: dict[str, list[int]] = {}
        for _ in range(a.rounds):
            for mode in ("cublas", "auto"):
                eng.model.set_gemm(mode, cache_dir=tempfile.mkdtemp(prefix="specdeck-gemm-"))
                sess = eng.new_session()
                eng.generate(prompt, 16, settings, sess)  # captures this session's plans
                sess.reset()
                out = eng.generate(prompt, a.n, settings, sess)
                first.setdefault(mode, out.tokens)
                same = out.tokens == first["cublas"]
                print(
                    f"bundled {name}, gemm {mode}: {out.stats['tokens_per_second']:.1f} t/s (tokens as cublas's: {same})"
                )


if __name__ == "__main__":
    main()
