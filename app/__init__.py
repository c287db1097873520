"""SpecDeck's desktop window (PySide6 + pyqtgraph).

The engine (engine/) knows nothing of Qt; this package knows nothing of CUDA. It talks to the engine
only through Engine.load / stream / session.settings / session.cancel and the RoundEvent stats.

    main.py          run_app(argv) and screenshot(path): the entry points
    window.py        the main window: run panel, tabs, status, error banner
    controls.py      the run panel (model, device, dtype, workload) and the knob panel
    worker.py        the engine thread: loads, runs and benches off the GUI thread
    plots.py         live run plots redrawn from ring buffers on a timer
    output_view.py   the streamed text, accepted draft tokens highlighted
    monitor.py       NVML + /proc sampler on its own thread, and the GPU monitor tab
    profiles_view.py the profiles tab (files handled by app.profiles)
    bench_tab.py     A/B bench of two profiles (app.bench, the same code as `specdeck bench`)
    qt_compat.py     a guard against a PySide6 6.12.0 refcount bug on Python 3.11
"""

try:  # the window's guard; the command line's services (cli, profiles, bench, tune) also run without Qt
    import PySide6  # noqa: F401
except ImportError:
    pass
else:
    from app.qt_compat import guard_singleton_refcounts

    guard_singleton_refcounts()
