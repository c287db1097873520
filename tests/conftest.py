"""Shared fixtures: tiny random models (written once per test session), GPU marker handling, and
a test session that never touches the user's own settings.

Before anything imports the app or app.profiles, every place SpecDeck (and Qt) keeps settings
is pointed into a temp dir for the whole session: SPECDECK_CONFIG_DIR, XDG_CONFIG_HOME (platformdirs
and Qt's native settings on Linux) and QSettings' paths; the gemm autotune cache too (SPECDECK_CACHE_DIR,
XDG_CACHE_HOME). An audit hook records any file this
process writes, renames or creates under the user's real config dir; the session fails if there
is one (see pytest_sessionfinish).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import pytest


def _real_config_dir() -> Path:
    try:
        import platformdirs
    except ImportError:  # a GPU image without the app's dependencies: the rule app.profiles falls back to
        base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        return (Path(base) / "specdeck").resolve()
    return Path(platformdirs.user_config_dir("specdeck")).resolve()


if importlib.util.find_spec("PySide6") is None:  # a GPU image without the GUI: its tests cannot be collected
    collect_ignore_glob = ["test_app_*.py"]

REAL_CONFIG_DIR = _real_config_dir()  # resolved before the environment below changes it
TEST_ROOT = Path(tempfile.mkdtemp(prefix="specdeck-tests-")).resolve()
os.environ["SPECDECK_CONFIG_DIR"] = str(TEST_ROOT / "config")
os.environ["XDG_CONFIG_HOME"] = str(TEST_ROOT / "xdg-config")
# the gemm autotune cache (engine/gemm_cache.py) too: GPU tests of gemm="auto" never write the user's cache
os.environ["SPECDECK_CACHE_DIR"] = str(TEST_ROOT / "cache")
os.environ["XDG_CACHE_HOME"] = str(TEST_ROOT / "xdg-cache")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent))

WRITES_TO_REAL_CONFIG: list[str] = []
_REAL_PREFIX = str(REAL_CONFIG_DIR)
_WRITE_EVENTS = {"os.rename", "os.replace", "os.mkdir", "os.remove", "os.rmdir", "shutil.copyfile", "shutil.move"}


def _audit(event: str, args: tuple) -> None:
    if event == "open":
        path, mode, flags = args[0], args[1], args[2]
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        paths = [path] if writing else []
    elif event in _WRITE_EVENTS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
    else:
        return
    for path in paths:
        try:
            text = os.fsdecode(os.fspath(path)) if not isinstance(path, int) else ""
        except TypeError:
            continue
        if text and os.path.abspath(text).startswith(_REAL_PREFIX):
            WRITES_TO_REAL_CONFIG.append(f"{event} {text}")


sys.addaudithook(_audit)

try:  # Qt's own settings files (QSettings without a path) go to the temp dir too
    from PySide6.QtCore import QSettings

    for _format in (QSettings.Format.IniFormat, QSettings.Format.NativeFormat):
        QSettings.setPath(_format, QSettings.Scope.UserScope, str(TEST_ROOT / "qsettings"))
except ImportError:
    pass


def pytest_sessionfinish(session, exitstatus):
    if WRITES_TO_REAL_CONFIG:
        sys.stderr.write(
            f"\nFAILED: the test suite wrote under the user's real config dir {REAL_CONFIG_DIR}:\n  "
            + "\n  ".join(sorted(set(WRITES_TO_REAL_CONFIG)))
            + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


from tiny_models import write_tiny_model  # noqa: E402


def _keep_transformers_off_specdeck_kernels() -> None:
    """transformers 5.25 and later require Hugging Face's `kernels` package and, finding it installed, import its API
    under the name `kernels`, which in this checkout is SpecDeck's own package (first on the path): every model of
    the oracle then fails to import (`cannot import name 'CUDAProperties' from 'kernels'`). The oracle uses none of
    the hub's kernels (nor may a test fetch one), so transformers is told they are off (USE_HUB_KERNELS, which 5.25
    reads at from_pretrained) and not there (is_kernels_available, read when its modules load), before anything
    imports a model."""
    if importlib.util.find_spec("transformers") is None:
        return
    os.environ["USE_HUB_KERNELS"] = "NO"
    import transformers.utils as utils
    from transformers.utils import import_utils

    def unavailable(*_args, **_kwargs) -> bool:
        return False

    for module in (import_utils, utils):
        if hasattr(module, "is_kernels_available"):
            module.is_kernels_available = unavailable


_keep_transformers_off_specdeck_kernels()

try:  # the tests' models are tiny: one thread is as fast, and immune to oversubscribed cores
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5-hybrid model with an MTP head (text-only layout)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from engine import Engine

    return Engine.load(tiny_model_dir)


@pytest.fixture(scope="module")
def eng(tiny_model_dir):
    """The tiny model, loaded once per test module (a module may change it: sub-vocab orders, settings)."""
    from engine import Engine

    return Engine.load(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(eng) -> dict[str, list[int]]:
    """The workloads' prompts as token ids of `eng` (a module may define its own `eng`)."""
    from app.workloads import load_workloads

    return {name: eng.tokenizer.encode(w.prompt) for name, w in load_workloads().items()}


@pytest.fixture
def force_depths(monkeypatch):
    """force_depths(depths) -> calls: adaptive rounds then take `depths` in turn (capped at the controller's
    max_depth), one DepthController.choose a round, pipelined or not, so an unpipelined run of the same settings
    drafts at the same depth round by round; `calls.clear()` starts the turn again."""
    from engine import adaptive

    def force(depths):
        calls = []

        def choose(self):
            calls.append(1)
            self.last_choice = min(depths[(len(calls) - 1) % len(depths)], self.max_depth)
            return self.last_choice

        monkeypatch.setattr(adaptive.DepthController, "choose", choose)
        return calls

    return force
