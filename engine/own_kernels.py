"""SpecDeck's `kernels` package under its own name, even where another package called `kernels` comes first.

Hugging Face's `kernels` package, which transformers 5.25 and later require, is a top-level package of the same name:
in an environment that has it (a `pip install -e ".[test]"` brings it), `import kernels` finds it before SpecDeck's
(an editable install's finder comes after site-packages), so its `__init__` would run in our place and our modules
would load only through the finder's fallback for submodules. `ensure()`, run by `engine/__init__.py` before the
engine imports anything from `kernels`, loads SpecDeck's package under that name first when another one would be
found. It changes nothing where ours is found (the usual case), where the package is not a plain folder of files (a
frozen app), or where another `kernels` was imported already (replacing a module someone holds would break them;
ours then still loads through the fallback, as before).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OURS = Path(__file__).resolve().parent.parent / "kernels"


def _is_ours(origin: str | None) -> bool:
    return origin is not None and Path(origin).resolve().parent == OURS


def ensure() -> bool:
    """Make `import kernels` give SpecDeck's package; True where it had to load it by path (another came first)."""
    init = OURS / "__init__.py"
    if "kernels" in sys.modules or not init.is_file():
        return False
    try:
        found = importlib.util.find_spec("kernels")
    except (ImportError, ValueError):
        found = None
    if found is not None and _is_ours(found.origin):
        return False
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(OURS)])
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise
    return True
