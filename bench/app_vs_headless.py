"""Tokens/s inside the app (through the engine worker, with the window drawing) vs the headless
engine, same model, settings and workload. Prints both and their ratio; the target is >= 0.97.

    python bench/app_vs_headless.py                       # bundled model, CPU, the 'chain' profile
    python bench/app_vs_headless.py --model DIR --device cuda:0 --dtype bfloat16 --profile control

The two sides alternate (headless, app, headless, app, ...) so drift on the machine hits both,
each run starts from a reset session, and one untimed run of each side warms up first. Reported:
the engine's own decode tokens/s (generated / time in rounds: the figure `specdeck bench` uses)
and wall tokens/s (generated / time from asking for the run to its last event, as a user waits).
The window is shown (offscreen unless a display is there) on its Live tab, so plots and text
redraw during the app's runs exactly as in use.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the bundled model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--profile", default="chain", help="profile name or .toml path")
    parser.add_argument("--workload", default="code_gen")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads for both sides (default: what the app "
        "uses on the CPU, one core fewer than the machine has)",
    )
    args = parser.parse_args(argv)

    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    import torch

    from app.threads import cpu_threads_for_the_engine

    # The same thread count on both sides: it is part of "the same settings" (the app would
    # otherwise set its own when it loads on the CPU).
    threads = args.threads or (cpu_threads_for_the_engine() if args.device == "cpu" else torch.get_num_threads())
    os.environ["SPECDECK_CPU_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    from PySide6.QtCore import QEventLoop
    from PySide6.QtWidgets import QApplication

    import app.gui  # noqa: F401 (applies the PySide6 6.12.0 guard before any signal is emitted)
    from app.profiles import load_profile
    from app.workloads import load_workloads
    from engine import Engine

    qt_app = QApplication.instance() or QApplication(sys.argv[:1])  # noqa: F841 (kept alive while the window lives)
    from app.gui.window import MainWindow

    engine = Engine.load(args.model, device=args.device, dtype=args.dtype)
    profile = load_profile(args.profile)
    settings = profile.settings_for(engine.info["vocab_size"])
    prompt = load_workloads()[args.workload].prompt_for(engine.tokenizer)
    session = engine.new_session()

    def headless_run() -> tuple[float, float]:
        session.reset()
        t0 = time.perf_counter()
        stats = {}
        for ev in engine.stream(prompt, args.tokens, settings=settings, session=session):
            stats = ev.run
        wall = time.perf_counter() - t0
        return stats["tokens_per_second"], stats["generated"] / wall

    window = MainWindow(model_dir=args.model, remember=False)
    window.run_panel.device_combo.addItem(args.device, args.device) if window.run_panel.device_combo.findData(
        args.device
    ) < 0 else None
    window.run_panel.device_combo.setCurrentIndex(window.run_panel.device_combo.findData(args.device))
    window.run_panel.dtype_combo.setCurrentText(args.dtype)
    window.run_panel.select_workload(args.workload)
    window.run_panel.max_new_tokens.setValue(args.tokens)
    window.run_panel.repeat.setChecked(False)
    window.knobs.set_settings(settings, emit=True)
    window.resize(1440, 900)
    window.show()
    window.tabs.setCurrentIndex(0)
    finished: list = []
    window.run_finished.connect(finished.append)
    # Wait in a real event loop, as the app does: a loop of processEvents() + sleep() would wake
    # the GUI thread a thousand times a second and take the GIL from the engine each time.
    loop = QEventLoop()
    window.run_finished.connect(loop.quit)

    def app_run() -> tuple[float, float]:
        finished.clear()
        window.start_run()  # the same prompt again: the engine resets the worker's session
        loop.exec()
        result = finished[0]
        if result.stop_reason not in ("length", "eos"):
            raise RuntimeError(f"app run ended with {result.stop_reason}: {window.last_error}")
        return result.stats["tokens_per_second"], result.generated / result.wall_s

    print(
        f"model {engine.info['name']} on {args.device} ({args.dtype}, {threads} CPU threads), "
        f"profile {profile.name!r}: "
        f"{settings}\nworkload {args.workload}, {args.tokens} tokens, {args.repeats} runs per side"
    )
    headless_run()  # warm-up: first-call costs (allocations, kernel selection) out of the timing
    app_run()
    headless: list[tuple[float, float]] = []
    in_app: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        headless.append(headless_run())
        in_app.append(app_run())
    window.shutdown()

    def median(runs: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in runs)

    for label, i in (("engine decode tok/s", 0), ("wall tok/s", 1)):
        h, a = median(headless, i), median(in_app, i)
        print(f"{label:<20} headless {h:9.1f}   app {a:9.1f}   app/headless {a / h:.3f}")
    decode = median(in_app, 0) / median(headless, 0)
    wall = median(in_app, 1) / median(headless, 1)
    verdict = "within" if min(decode, wall) >= 0.97 else "NOT within"
    print(f"RATIO decode {decode:.3f}, wall {wall:.3f} ({verdict} 3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
