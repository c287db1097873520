"""`specdeck` command line: the window (bare), generate, bench, screenshot, --version.

Every subcommand goes through the engine's public API. Errors the user can act on print one line
(`specdeck: error: ...`) and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__
from .errors import EngineError
from .sampling import SamplingParams
from .settings import EngineSettings

KNOB_KEYS = {
    "speculative": bool,
    "draft_depth": int,
    "depth": int,
    "p_min": float,
    "chain": bool,
    "sub_vocab": int,
    "mirror_output": bool,
    "plan_pool": int,
}
# Sampling keys an arm may change too ('temperature=0.7,seed=3'); temperature 0 = greedy.
SAMPLING_KEYS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "seed": int}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the bundled model)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N, or several comma-separated (cuda:0,cuda:1: tensor parallel) (default: cpu)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument(
        "--gemm",
        default="cublas",
        choices=["cublas", "autotune"],
        help="one-token GEMMs: cublas, or autotune (torch.compile max-autotune; large models on CUDA)",
    )


def _add_knob_args(p: argparse.ArgumentParser) -> None:
    d = EngineSettings()
    p.add_argument("--no-spec", action="store_true", help="plain greedy decoding (no drafting)")
    p.add_argument("--depth", type=int, default=d.draft_depth, help="draft depth 1..16")
    p.add_argument("--p-min", type=float, default=d.p_min, help="stop drafting below this draft probability")
    p.add_argument("--chain", action=argparse.BooleanOptionalAction, default=d.chain, help="chained drafting")
    p.add_argument("--sub-vocab", type=int, default=d.sub_vocab, help="draft over the first N ids (0 = all)")
    p.add_argument("--plan-pool", type=int, default=d.plan_pool, help="CUDA graphs kept (0 = none)")
    p.add_argument("--mirror-output", action=argparse.BooleanOptionalAction, default=d.mirror_output)
    s = SamplingParams()
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=s.top_k, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=s.top_p, help="nucleus: smallest set reaching this mass (1 = off)")
    p.add_argument("--min-p", type=float, default=s.min_p, help="drop tokens below min_p x the top one (0 = off)")
    p.add_argument("--seed", type=int, default=s.seed, help="random seed: same seed + settings = same text")


def _sampling_from_args(a: argparse.Namespace) -> SamplingParams | None:
    """None for greedy (temperature 0), else the validated SamplingParams (ValueError names the field)."""
    sp = SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed)
    return None if sp.greedy else sp


def parse_arm_sampling(spec: str, base: SamplingParams | None) -> SamplingParams | None:
    """The sampling of an arm: base changed by the sampling keys of a 'key=value,...' spec, or a saved
    profile's [sampling] part (a profile without one samples like base)."""
    if "=" not in spec:
        from .profiles import load_profile

        profile = load_profile(spec)
        return profile.sampling if profile.sampling is not None else base
    changes: dict[str, object] = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key in SAMPLING_KEYS:
            try:
                changes[key] = SAMPLING_KEYS[key](value.strip())
            except ValueError:
                raise ValueError(f"{key} must be a {SAMPLING_KEYS[key].__name__}, got {value!r}") from None
    if not changes:
        return base
    sp = (base or SamplingParams(temperature=0.0)).replace(**changes)
    return None if sp.greedy else sp


def _settings_from_args(a: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        speculative=not a.no_spec,
        draft_depth=a.depth,
        p_min=a.p_min,
        chain=a.chain,
        sub_vocab=a.sub_vocab,
        mirror_output=a.mirror_output,
        plan_pool=a.plan_pool,
    )


def parse_arm(spec: str, vocab_size: int, base: EngineSettings) -> tuple[str, EngineSettings]:
    """An arm is a saved profile (name or .toml path) or knobs as 'key=value,...' on top of `base`."""
    if "=" in spec:
        changes: dict[str, object] = {}
        for part in spec.split(","):
            key, _, value = part.partition("=")
            key = key.strip().replace("-", "_")
            if key in SAMPLING_KEYS:
                continue  # parse_arm_sampling reads those
            if key not in KNOB_KEYS:
                known = ", ".join(sorted(KNOB_KEYS | SAMPLING_KEYS.keys()))
                raise ValueError(f"unknown knob {key!r} in {spec!r}; known: {known}")
            kind = KNOB_KEYS[key]
            key = "draft_depth" if key == "depth" else key
            v = value.strip().lower()
            if kind is bool:
                if v not in ("1", "0", "on", "off", "true", "false", "yes", "no"):
                    raise ValueError(f"{key} must be on/off, got {value!r}")
                changes[key] = v in ("1", "on", "true", "yes")
            else:
                try:
                    changes[key] = kind(v)
                except ValueError:
                    raise ValueError(f"{key} must be a {kind.__name__}, got {value!r}") from None
        return spec, base.replace(**changes)
    from .profiles import load_profile

    profile = load_profile(spec)
    return profile.name, profile.settings_for(vocab_size)


def _load_engine(a: argparse.Namespace):
    from .engine import Engine

    devices = [d.strip() for d in a.device.split(",") if d.strip()]
    return Engine.load(
        a.model,
        device=devices[0] if devices else a.device,
        dtype=a.dtype,
        max_context=a.max_context,
        gemm=a.gemm,
        devices=devices if len(devices) > 1 else None,
    )


def cmd_generate(a: argparse.Namespace) -> int:
    settings = _settings_from_args(a)
    sampling = _sampling_from_args(a)
    eng = _load_engine(a)
    if a.json:
        res = eng.generate(a.prompt, a.n, settings, sampling=sampling)
        print(json.dumps({"tokens": res.tokens, "text": res.text, "stats": res.stats}, indent=2))
        return 0
    for ev in eng.stream(a.prompt, a.n, settings, sampling=sampling):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        last = ev
    sys.stdout.write("\n")
    s = last.run
    print(
        f"[{s['generated']} tokens, {s['tokens_per_second']:.1f} t/s, accepted length {s['mean_accepted_length']:.2f}, "
        f"acceptance {100 * s['acceptance_rate']:.0f}%]",
        file=sys.stderr,
    )
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import BenchArm, run_bench

    eng = _load_engine(a)
    base = _settings_from_args(a)
    sampling = _sampling_from_args(a)
    if a.profile:
        name, first = parse_arm(a.profile, eng.cfg.vocab_size, base)
        sampling = parse_arm_sampling(a.profile, sampling)
    else:
        name, first = "A (flags)", base
    arms = [BenchArm(name, first, sampling)]
    if a.vs:
        vs_name, second = parse_arm(a.vs, eng.cfg.vocab_size, first)
        vs_sampling = parse_arm_sampling(a.vs, sampling)
        arms.append(BenchArm(vs_name if vs_name != name else vs_name + " (B)", second, vs_sampling))
    workloads = [w.strip() for w in a.workloads.split(",")] if a.workloads else None

    def progress(done: int, total: int, msg: str) -> None:
        print(f"[{done}/{total}] {msg}", file=sys.stderr)

    report = run_bench(eng, arms, workloads, rounds=a.rounds, max_new_tokens=a.n, progress=progress)
    print(report.format_tables())
    if a.json:
        Path(a.json).write_text(report.to_json(), encoding="utf-8")
    if a.csv:
        Path(a.csv).write_text(report.to_csv(), encoding="utf-8")
    return 0


def cmd_screenshot(a: argparse.Namespace) -> int:
    from app.main import screenshot

    screenshot(a.path, model=a.model, tokens=a.n)
    print(a.path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdeck", description="Live tuning of MTP speculative decoding.")
    p.add_argument("--version", action="version", version=f"specdeck {__version__}")
    sub = p.add_subparsers(dest="command")

    g = sub.add_parser("generate", help="generate text (greedy by default; speculation never changes it)")
    _add_model_args(g)
    _add_knob_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("-n", type=int, default=64, help="new tokens")
    g.add_argument("--json", action="store_true", help="print tokens, text and stats as JSON")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="A/B benchmark on the fixed workloads (the seed's tables)")
    _add_model_args(b)
    _add_knob_args(b)
    b.add_argument("--profile", help="arm A: a saved profile (name or path) or 'key=value,...'")
    b.add_argument("--vs", help="arm B: a saved profile or 'key=value,...' changes to arm A")
    b.add_argument("--workloads", help="comma list (default: code_gen,code_edit,code_echo,prose)")
    b.add_argument("--rounds", type=int, default=2)
    b.add_argument("-n", type=int, default=128, help="new tokens per run")
    b.add_argument("--json", help="write the report as JSON here")
    b.add_argument("--csv", help="write the rows as CSV here")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("screenshot", help="render the window offscreen after a short run, save a PNG")
    s.add_argument("path")
    s.add_argument("--model")
    s.add_argument("-n", type=int, default=48)
    s.set_defaults(func=cmd_screenshot)

    w = sub.add_parser("gui", help="open the window (the default)")
    w.add_argument("--model")
    w.set_defaults(func=None)
    return p


def gui_main() -> int:
    from app.main import run_app

    return run_app(sys.argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None or a.func is None:
        from app.main import run_app

        return run_app([sys.argv[0], *argv[1:]] if a.command else [sys.argv[0]])
    try:
        return a.func(a)
    except (EngineError, ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"specdeck: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
