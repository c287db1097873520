"""`python -m app` is the `specdeck` command (bare: the window)."""

import sys

from app.cli import main

sys.exit(main())
