"""SpecDeck's application, on top of the engine (engine/).

The services here import no Qt, so the command line, the bench and the tune run without PySide6:

    cli.py           the `specdeck` command (bare: opens the window, app.gui)
    profiles.py      profile files, the last used settings
    workloads.py     the fixed workloads (assets/workloads)
    bench.py         the A/B bench (`specdeck bench`, the Bench tab)
    tune.py          the staged autotune (`specdeck tune`, the Tune panel)
    threads.py       how many CPU threads the engine gets
    hardware.py      NVML and /proc readers: the GPU monitor's samples, a profile's hardware fingerprint
    history.py       RunHistory: a run's per-round figures, rolling statistics, markers, CSV

gui/ is the desktop window (PySide6 + pyqtgraph); it is imported only when the window opens.
"""
