"""The frozen entry point of the SpecDeck bundle (PyInstaller runs this file as `specdeck`).

It does what the `specdeck = app.cli:main` console script does, nothing more: bare `specdeck` opens
the window, `specdeck --version`, `specdeck screenshot PATH`, `specdeck generate ...`, `specdeck bench ...`.
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
