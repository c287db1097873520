"""`specdeck` command line: the window (bare), generate, bench, tune, subvocab, screenshot, --version.

Every subcommand goes through the engine's public API. Errors the user can act on print one line
(`specdeck: error: ...`) and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from engine import __version__
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.settings import EngineSettings, knobs


def depth_value(text: str) -> int | str:
    """A draft depth on the command line: an integer, or "auto" (the engine picks it every round)."""
    text = str(text).strip().lower()
    if text == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"draft_depth must be an integer in 1..16 or 'auto', got {text!r}") from None


depth_value.__name__ = "depth"

KNOB_KEYS = {
    "speculative": bool,
    "draft_depth": depth_value,
    "depth": depth_value,
    "max_draft_depth": int,
    "max_depth": int,
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
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="positions a session holds (default: the model's trained length, where a quarter of the free memory holds it)",
    )
    p.add_argument(
        "--gemm",
        default="cublas",
        choices=["cublas", "autotune", "cupy", "auto", "exact"],
        help=(
            "decode-sized GEMMs: cublas; autotune (torch.compile max-autotune); cupy (SpecDeck's gemv kernels for "
            "1..17 rows); auto (per shape the fastest of cuBLAS and the gemv kernels, measured once per GPU and "
            "cached in $SPECDECK_CACHE_DIR or the user cache folder); exact (row-invariant kernels: speculative output equals "
            "greedy bit for bit in bf16 too, at some speed). All but cublas need CUDA"
        ),
    )
    _add_threads_arg(p)


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="PyTorch CPU threads (default: $SPECDECK_CPU_THREADS, else the usable cores minus one)",
    )


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


def _add_knob_args(p: argparse.ArgumentParser, on_top_of: str | None = None) -> None:
    """The knob flags, one per EngineSettings field, made from the fields' descriptions (`knobs()`): a switch
    is --flag/--no-flag, a number takes its type (the draft depth also 'auto'). on_top_of names what they
    change (bench: arm A's profile); then an unset flag changes nothing."""
    for knob in knobs():
        default = argparse.SUPPRESS if on_top_of else knob.default
        dest = knob.name
        text = knob.help.replace("%", "%%")
        if knob.type is bool:
            p.add_argument(knob.flag, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            kind = depth_value if knob.name == "draft_depth" else knob.type
            metavar = knob.flag.removeprefix("--").upper().replace("-", "_")
            p.add_argument(knob.flag, dest=dest, type=kind, default=default, help=text, metavar=metavar)
    sp = SamplingParams()
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=sp.top_k, help="sample from the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=sp.top_p, help="nucleus: smallest set reaching this mass (1 = off)")
    p.add_argument("--min-p", type=float, default=sp.min_p, help="drop tokens below min_p x the top one (0 = off)")
    p.add_argument("--seed", type=int, default=sp.seed, help="random seed: same seed + settings = same text")


def _knob_changes(a: argparse.Namespace) -> dict[str, object]:
    """The knobs given on the command line, as EngineSettings fields."""
    return {k.name: getattr(a, k.name) for k in knobs() if hasattr(a, k.name)}


def _settings_from_args(a: argparse.Namespace, base: EngineSettings | None = None) -> EngineSettings:
    return (base or EngineSettings()).replace(**_knob_changes(a))


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
            key = {"depth": "draft_depth", "max_depth": "max_draft_depth"}.get(key, key)
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


# Engine messages name Python arguments (device='cpu', max_context); the CLI's user names flags.
_WORDING = [
    (re.compile(r"\b(device|dtype|gemm)='([^']*)'"), lambda m: f"--{m.group(1)} {m.group(2)}"),
    (re.compile(r"^(device|dtype|gemm) '([^']*)'"), lambda m: f"--{m.group(1)} {m.group(2)}"),
    (re.compile(r"(?<![.\w])max_context\b"), lambda m: "--max-context"),
    (re.compile(r"(?<![.\w])max_new_tokens\b"), lambda m: "-n"),
    (re.compile(r"^draft_depth\b"), lambda m: "--depth"),
    (re.compile(r"^(p_min|sub_vocab|plan_pool)\b"), lambda m: "--" + m.group(1).replace("_", "-")),
]


def user_wording(message: str) -> str:
    """An engine error in the command line's words: `--device cpu`, not `device='cpu'`."""
    for pattern, replacement in _WORDING:
        message = pattern.sub(replacement, message)
    return message


def _apply_threads(a: argparse.Namespace) -> tuple[int, str]:
    from .threads import apply_cpu_threads

    return apply_cpu_threads(getattr(a, "threads", None))


def _load_engine(a: argparse.Namespace):
    from engine.engine import Engine

    devices = [d.strip() for d in a.device.split(",") if d.strip()]
    return Engine.load(
        a.model,
        device=devices[0] if devices else a.device,
        dtype=a.dtype,
        max_context=a.max_context,
        gemm=a.gemm,
        devices=devices if len(devices) > 1 else None,
    )


def _thread_text(threads: int) -> str:
    return f"{threads} CPU thread{'s' if threads != 1 else ''}"


def cmd_generate(a: argparse.Namespace) -> int:
    settings = _settings_from_args(a)
    sampling = _sampling_from_args(a)
    threads, _ = _apply_threads(a)
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
    remap = f", sub-vocab order of {s['remap_size']:,} ids" if s.get("remap_rounds") else ""
    print(
        f"[{s['generated']} tokens, {s['tokens_per_second']:.1f} t/s, accepted length {s['mean_accepted_length']:.2f}, "
        f"acceptance {100 * s['acceptance_rate']:.0f}%{remap}, {_thread_text(threads)}]",
        file=sys.stderr,
    )
    return 0


def cmd_subvocab(a: argparse.Namespace) -> int:
    """Build or show the draft's sub-vocabulary order (subvocab.json next to the model; engine/subvocab.py)."""
    from engine.subvocab import build_file, describe

    if a.action == "build":
        path, order = build_file(a.model, a.text, a.size, a.out, a.force)
        print(f"wrote {path}: {order.size:,} ids, most frequent first ({order.source})")
        return 0
    from engine.engine import bundled_model_dir

    print(describe(a.model or bundled_model_dir(), a.file, a.first))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from .bench import SYNTHETIC_BANNER, BenchArm, parse_synthetic_rates, rates_text, run_bench

    rates = parse_synthetic_rates(a.synthetic_rates) if a.synthetic_rates is not None else None
    threads, source = _apply_threads(a)
    eng = _load_engine(a)
    # Arm A: --profile (a saved profile or knobs on top of the defaults), else the shipped
    # control; knob flags given on the command line change it.
    name, first = parse_arm(a.profile or "control", eng.cfg.vocab_size, EngineSettings())
    flags = _knob_changes(a)
    if flags:
        changed = first.replace(**flags)
        if changed != first:
            name = f"{name} + " + ",".join(f"{k}={new}" for k, (_, new) in first.diff(changed).items())
            first = changed
    sampling = _sampling_from_args(a)
    if a.profile:
        sampling = parse_arm_sampling(a.profile, sampling)
    if rates is not None:  # every arm measures at these rates (a bench profile's own rates are replaced)
        first = first.replace(synthetic_rates=rates)
    arms = [BenchArm(name, first, sampling)]
    if a.vs:
        vs_name, second = parse_arm(a.vs, eng.cfg.vocab_size, first)
        if rates is not None:
            second = second.replace(synthetic_rates=rates)
        if second == first and parse_arm_sampling(a.vs, sampling) == sampling:
            print(
                f"specdeck: note: {vs_name!r} has the same settings as {name!r}; the two arms measure the same thing",
                file=sys.stderr,
            )
        vs_sampling = parse_arm_sampling(a.vs, sampling)
        arms.append(BenchArm(vs_name if vs_name != name else vs_name + " (B)", second, vs_sampling))
    workloads = [w.strip() for w in a.workloads.split(",")] if a.workloads else None

    def progress(done: int, total: int, msg: str) -> None:
        print(f"[{done}/{total}] {msg}", file=sys.stderr)

    print(f"[{_thread_text(threads)} ({source})]", file=sys.stderr)
    for arm in arms:
        if arm.settings.synthetic:
            print(f"{SYNTHETIC_BANNER} ({arm.name}: rates {rates_text(arm.settings.synthetic_rates)})", file=sys.stderr)
    report = run_bench(eng, arms, workloads, rounds=a.rounds, max_new_tokens=a.n, progress=progress)
    report.meta["cpu_threads_source"] = source
    print(report.format_tables())
    if a.json:
        Path(a.json).write_text(report.to_json(), encoding="utf-8")
    if a.csv:
        Path(a.csv).write_text(report.to_csv(), encoding="utf-8")
    return 0


def cmd_tune(a: argparse.Namespace) -> int:
    """Staged autotune: search, confirm the best three beside the baseline, report with the spread,
    save the winner as a profile (figures + hardware)."""
    from .profiles import ProfileStore
    from .tune import run_tune, winner_profile

    threads, source = _apply_threads(a)
    eng = _load_engine(a)
    _, baseline = parse_arm(a.profile or "control", eng.cfg.vocab_size, EngineSettings())
    if baseline.synthetic:
        raise ValueError(
            f"the profile {a.profile!r} sets synthetic acceptance rates (a bench profile); tune measures real "
            "acceptance: use it with `specdeck bench`, or give a profile without synthetic_rates"
        )
    workloads = [w.strip() for w in a.workloads.split(",")] if a.workloads else None
    print(f"[{_thread_text(threads)} ({source}); budget {a.budget_s:g} s]", file=sys.stderr)

    def progress(fraction: float, message: str, _cell) -> None:
        print(f"[{100 * fraction:3.0f}%] {message}", file=sys.stderr)

    try:
        report = run_tune(eng, baseline, workloads, a.budget_s, a.n, progress=progress)
    except KeyboardInterrupt:
        print("specdeck: tune interrupted", file=sys.stderr)
        return 130
    print(report.format())
    if a.save:
        store = ProfileStore()
        profile = store.save(winner_profile(report, store.unique_name(a.save), eng.info.get("name", "")))
        print(f"saved the winner as the profile {profile.name!r} ({profile.path})")
    return 0


def cmd_screenshot(a: argparse.Namespace) -> int:
    from app.gui.main import screenshot

    _apply_threads(a)
    size = _size(a.size)
    screenshot(a.path, model=a.model, tokens=a.n, size=size, theme=a.theme, quiet=True)
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

    b = sub.add_parser(
        "bench",
        help="A/B benchmark on the fixed workloads (llama.cpp PR #27173 table format), with the spread of its rounds",
    )
    _add_model_args(b)
    _add_knob_args(b, on_top_of="--profile")
    b.add_argument(
        "--profile",
        help="arm A: a profile (display name, file name or .toml path) or 'key=value,...' (default: control); "
        "knob flags change it",
    )
    b.add_argument("--vs", help="arm B: a profile, or 'key=value,...' changes to arm A (e.g. chain=on)")
    b.add_argument("--workloads", help="comma list (default: code_gen,code_edit,code_echo,prose)")
    b.add_argument("--rounds", type=int, default=3, help="repeats; their spread decides 'no clear difference'")
    b.add_argument("-n", type=int, default=128, help="new tokens per run")
    b.add_argument(
        "--synthetic-rates",
        metavar="R1,R2,...",
        help="synthetic acceptance, a measurement mode: every arm drafts and verifies as usual but accepts draft "
        "position i with probability Ri (the last rate continues deeper), e.g. 0.87,0.78,0.68; the figures "
        "measure speed only, the text is not the model's output (greedy only)",
    )
    b.add_argument("--json", help="write the report as JSON here")
    b.add_argument("--csv", help="write the rows as CSV here")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("tune", help="staged autotune: find the fastest settings here, report them with their spread")
    _add_model_args(t)
    t.add_argument("--profile", help="the baseline (a profile or 'key=value,...'; default: control)")
    t.add_argument("--workloads", help="comma list (default: code_gen,code_edit,code_echo,prose)")
    t.add_argument("--budget-s", type=float, default=120.0, help="wall time for the whole tune (default 120)")
    t.add_argument("-n", type=int, default=64, help="new tokens per run")
    t.add_argument("--save", metavar="NAME", help="save the winner as a profile of this name")
    t.set_defaults(func=cmd_tune)

    v = sub.add_parser(
        "subvocab",
        help="the draft's sub-vocab order: which ids a --sub-vocab draft scores, most frequent first (subvocab.json)",
    )
    vsub = v.add_subparsers(dest="action", required=True)
    vb = vsub.add_parser("build", help="count the ids of a text sample with the model's tokenizer, write the order")
    vb.add_argument("--model", required=True, help="the model directory (its tokenizer; the file goes there)")
    vb.add_argument("--text", required=True, action="append", help="a text sample to count (repeat for several)")
    vb.add_argument("--size", type=int, help="ids kept (default: 32768, or the whole vocabulary if smaller)")
    vb.add_argument("--out", help="where to write (default: MODEL/subvocab.json, which Engine.load reads)")
    vb.add_argument("--force", action="store_true", help="replace an existing file")
    vb.set_defaults(func=cmd_subvocab)
    vs = vsub.add_parser("show", help="describe a model's sub-vocab order: size, source, the first ids decoded")
    vs.add_argument("--model", help="the model directory (default: the bundled model)")
    vs.add_argument("--file", help="an order file elsewhere (default: MODEL/subvocab.json)")
    vs.add_argument("--first", type=int, default=20, help="how many of the first ids to list (default 20)")
    vs.set_defaults(func=cmd_subvocab)

    s = sub.add_parser("screenshot", help="render the window offscreen after a short run, save a PNG")
    s.add_argument("path")
    s.add_argument("--model")
    s.add_argument("-n", type=int, default=48)
    s.add_argument("--size", default="1440x900", help="window size WIDTHxHEIGHT (default 1440x900)")
    s.add_argument("--theme", choices=["system", "light", "dark"], default="light")
    _add_threads_arg(s)
    s.set_defaults(func=cmd_screenshot)

    w = sub.add_parser("gui", help="open the window (the default)")
    w.add_argument("--model")
    _add_threads_arg(w)
    w.set_defaults(func=None)
    return p


def _size(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"--size must be WIDTHxHEIGHT, e.g. 1280x800, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def gui_main() -> int:
    from app.gui.main import run_app

    return run_app(sys.argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.command is None or a.func is None:
        from app.gui.main import run_app

        return run_app([sys.argv[0], *argv[1:]] if a.command else [sys.argv[0]])
    try:
        return a.func(a)
    except (EngineError, ValueError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else repr(exc)
        print(f"specdeck: error: {user_wording(msg)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
