"""SpecDeck's `kernels` package against another top-level package of the same name found first on the path (Hugging
Face's `kernels`, which transformers 5.25 and later install): `import engine` makes `kernels` SpecDeck's own, and the
engine runs. Each case in a fresh interpreter, outside the checkout, with a stand-in for the other package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, path: list[Path], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in path))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def _shadow(tmp_path: Path) -> Path:
    """A folder holding another package called `kernels` (no `ops`, a marker instead)."""
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("OTHER = True\n")
    return other.parent


def test_another_kernels_package_first_on_the_path_does_not_replace_specdecks(tmp_path):
    site = _shadow(tmp_path)
    code = "import kernels as first\nprint('before', getattr(first, 'OTHER', False))\n"
    seen = _python(code, [site, REPO], tmp_path)
    assert seen.returncode == 0 and "before True" in seen.stdout, seen.stderr  # the stand-in really comes first
    code = (
        "import engine, kernels\n"
        "from kernels import ops\n"
        "print('kernels', kernels.__file__)\n"
        "print('ops', ops.__file__)\n"
        "print('other', getattr(kernels, 'OTHER', False))\n"
        "from engine import Engine, EngineSettings\n"
        "eng = Engine.load(engine.bundled_model_dir())\n"
        "out = eng.generate('def fib(n):', 4, EngineSettings(draft_depth=2), eng.new_session())\n"
        "print('tokens', len(out.tokens))\n"
    )
    run = _python(code, [site, REPO], tmp_path)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines() if " " in line)
    assert Path(lines["kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(lines["ops"]).resolve() == REPO / "kernels" / "ops.py"
    assert lines["other"] == "False" and lines["tokens"] == "4"


def test_ours_is_loaded_by_path_only_where_another_comes_first(tmp_path):
    site = _shadow(tmp_path)
    code = (  # own_kernels.py alone (importing it through `engine` would run it first)
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('probe', {str(REPO / 'engine' / 'own_kernels.py')!r})\n"
        "probe = importlib.util.module_from_spec(spec); spec.loader.exec_module(probe)\n"
        "loaded = probe.ensure()\n"
        "print(loaded, 'kernels' in sys.modules)\n"
        "import kernels; print(kernels.__file__)\n"
    )
    # SpecDeck's first: nothing loaded by path; the other first: ours loaded under the name; `kernels` ours either way
    for path, flags_want in (([REPO, site], "False False"), ([site, REPO], "True True")):
        run = _python(code, path, tmp_path)
        assert run.returncode == 0, run.stderr
        flags, where = run.stdout.splitlines()
        assert flags == flags_want and Path(where).resolve() == REPO / "kernels" / "__init__.py", path
