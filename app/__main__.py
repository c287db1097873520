"""`python -m app` opens the window (same as `specdeck`)."""

import sys

from app.main import run_app

sys.exit(run_app(sys.argv))
