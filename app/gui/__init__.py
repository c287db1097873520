"""SpecDeck's desktop window (PySide6 + pyqtgraph), on top of the services in app/.

The engine (engine/) knows nothing of Qt; this package knows nothing of CUDA. It talks to the engine
only through Engine.load / stream / session.settings / session.cancel and the RoundEvent stats.

    main.py          run_app(argv) and screenshot(path): the entry points (app.cli calls them)
    window.py        the main window: run panel, tabs, status, error banner; saves and restores its panels
    controls.py      the run panel (model, device, dtype, workload), the knob panel (made from
                     EngineSettings' knob metadata) and the sampling panel
    worker.py        the engine thread: loads, runs and benches off the GUI thread
    plots.py         live run plots, drawn from an app.history.RunHistory on a timer
    output_view.py   the streamed text, accepted draft tokens highlighted
    monitor.py       the sampler thread (app.hardware's readers) and the GPU monitor tab
    profiles_view.py the profiles tab (files handled by app.profiles)
    bench_tab.py     A/B bench of two profiles (app.bench, the same code as `specdeck bench`)
    tune_panel.py    the staged autotune (app.tune) on the engine thread
    theme.py         light / dark / the system's palette, for widgets and plots
    startup_check.py before Qt starts: are the X11 plugin's system libraries there?
    qt_compat.py     a guard against a PySide6 6.12.0 refcount bug on Python 3.11
"""

from app.gui.qt_compat import guard_singleton_refcounts

guard_singleton_refcounts()
