"""Cheap checks of packaging/: the desktop entry, the AppStream metainfo, the build and install scripts, the
PyInstaller spec and entry point. The build itself (packaging/build.sh, minutes) is never run here."""

from __future__ import annotations

import ast
import configparser
import os
import shutil
import subprocess
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "packaging"
DESKTOP = PKG / "specdeck.desktop"
METAINFO = PKG / "io.specdeck.SpecDeck.metainfo.xml"
ICONS = ROOT / "assets" / "icons"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _desktop_entry() -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive in .desktop files
    parser.read_string(DESKTOP.read_text(encoding="utf-8"), source=str(DESKTOP))
    assert parser.sections()[0] == "Desktop Entry"
    return parser["Desktop Entry"]


def _console_script() -> str:
    (name,) = [k for k, v in PYPROJECT["project"]["scripts"].items() if v == "app.cli:main"]
    return name


# ---- the .desktop entry -------------------------------------------------------------------------
def test_desktop_entry_fields():
    entry = _desktop_entry()
    assert entry["Type"] == "Application"
    assert entry["Name"] == "SpecDeck"
    assert entry["Comment"].strip()
    assert entry["Terminal"] == "false"
    categories = entry["Categories"]
    assert categories.endswith(";")
    assert {"Development", "Utility"} <= set(filter(None, categories.split(";")))
    assert len([k for k in entry["Keywords"].split(";") if k]) >= 3


def test_desktop_entry_runs_the_console_script():
    entry = _desktop_entry()
    script = _console_script()
    assert entry["Exec"].split()[0] == script == "specdeck"
    assert entry.get("TryExec", script) == script


def test_desktop_entry_names_an_existing_icon():
    icon = _desktop_entry()["Icon"]
    assert icon == "specdeck"
    assert "/" not in icon and "." not in icon  # a theme name, not a path
    found = sorted(p.name for p in ICONS.glob(f"{icon}*") if p.suffix in (".svg", ".png"))
    assert (ICONS / f"{icon}.svg").is_file() or found, f"no {icon}.svg or {icon}-SIZE.png in {ICONS}"
    # install.sh puts specdeck-N.png in hicolor/NxN/apps: the size must be in the name
    for name in found:
        if name.endswith(".png"):
            assert name.removeprefix(f"{icon}-").removesuffix(".png").isdigit(), name


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_file_validate():
    res = subprocess.run(["desktop-file-validate", str(DESKTOP)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "error:" not in res.stdout


# ---- AppStream metainfo -------------------------------------------------------------------------
def test_metainfo_required_fields():
    root = ET.parse(METAINFO).getroot()
    assert root.tag == "component"
    assert root.get("type") == "desktop-application"
    assert root.findtext("id") == "io.specdeck.SpecDeck" == METAINFO.name.removesuffix(".metainfo.xml")
    assert root.findtext("name") == "SpecDeck"
    summary = root.findtext("summary")
    assert summary and len(summary) < 80 and not summary.endswith(".")
    assert root.findtext("metadata_license") == "CC0-1.0"
    assert root.findtext("project_license") == PYPROJECT["project"]["license"]["text"]
    assert root.find("description/p") is not None
    launchable = root.find("launchable")
    assert launchable is not None and launchable.get("type") == "desktop-id"
    assert launchable.text == DESKTOP.name
    assert root.findtext("provides/binary") == _console_script()
    assert root.find("content_rating") is not None
    assert root.find("content_rating").get("type", "").startswith("oars-")
    url = root.find("url[@type='homepage']")
    assert url is not None and url.text.startswith("https://")
    assert (root.findtext("developer/name") or "").strip()


def test_metainfo_release_is_the_project_version():
    import engine

    releases = ET.parse(METAINFO).getroot().findall("releases/release")
    assert releases, "no <release>"
    newest = releases[0]
    assert newest.get("version") == PYPROJECT["project"]["version"] == engine.__version__
    date = newest.get("date", "")
    assert len(date) == 10 and date[4] == "-" and date[7] == "-", date


@pytest.mark.skipif(shutil.which("appstreamcli") is None, reason="appstream not installed")
def test_appstreamcli_validate():
    res = subprocess.run(["appstreamcli", "validate", "--no-net", str(METAINFO)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- the scripts, the spec, the entry point -----------------------------------------------------
@pytest.mark.parametrize("name", ["build.sh", "install.sh"])
def test_scripts_are_strict_executable_bash(name):
    path = PKG / name
    assert os.access(path, os.X_OK), f"{path} is not executable (chmod +x)"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    code = [ln.strip() for ln in lines[1:] if ln.strip() and not ln.lstrip().startswith("#")]
    assert code[0] == "set -euo pipefail", f"{name}: the first command must be `set -euo pipefail`"
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_build_script_takes_the_cpu_torch_first_and_builds_outside_the_app():
    text = (PKG / "build.sh").read_text(encoding="utf-8")
    torch_at = text.index('pip_install "$TORCH_REQ"')
    project_at = text.index('pip_install "$SRC" "$PYINSTALLER_REQ"')
    assert torch_at < project_at
    assert "SPECDECK_TORCH:-torch==2.13.0" in text
    assert 'VENV="$BUILD/venv"' in text and 'BUILD="$HERE/build"' in text  # never inside dist/
    assert "specdeck.spec" in text


def test_build_dirs_are_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text(encoding="utf-8").split()
    assert "/packaging/build/" in ignored and "/packaging/dist/" in ignored


def test_entry_point_calls_the_cli():
    tree = ast.parse((PKG / "entry.py").read_text(encoding="utf-8"))
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert any(n.module == "app.cli" and any(a.name == "main" for a in n.names) for n in imports)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "main"]
    assert calls


def test_spec_bundles_assets_where_the_engine_looks():
    spec = (PKG / "specdeck.spec").read_text(encoding="utf-8")
    compile(spec, "specdeck.spec", "exec")
    assert '(str(SRC / "assets"), "assets")' in spec
    assert '"entry.py"' in spec
    for name in ("tkinter", "pytest", "transformers", "cupy"):
        assert f'"{name}"' in spec
    # The engine finds assets next to its own package; in the bundle that is sys._MEIPASS/assets.
    import app.workloads
    import engine.engine

    engine_dir = Path(engine.engine.__file__).resolve().parent
    assets = engine_dir.parent / "assets"
    assert assets == engine.engine.ASSETS
    assert assets / "workloads" == app.workloads.WORKLOAD_DIR


def test_every_package_is_installed_and_every_module_bundled():
    """Subpackages (app.gui) are listed in pyproject.toml's packages, and the spec names every module as a
    hidden import (the window is imported inside a function, which PyInstaller's analysis does not follow)."""
    packages = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("app", "engine", "kernels")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert "app.gui" in found and found <= packages
    spec = ast.parse((PKG / "specdeck.spec").read_text(encoding="utf-8"))
    (function,) = [n for n in spec.body if isinstance(n, ast.FunctionDef) and n.name == "_modules"]
    namespace = {"SRC": ROOT, "Path": Path}
    exec(compile(ast.Module(body=[function], type_ignores=[]), "specdeck.spec", "exec"), namespace)
    named = set(namespace["_modules"]("app"))
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "app").rglob("*.py")}
    modules = {m.removesuffix(".__init__") for m in modules if not m.endswith("__main__")}
    assert {"app.cli", "app.gui", "app.gui.window", "app.gui.main"} <= named and named == modules


def test_built_bundle_layout_if_present():
    """Only where packaging/build.sh has run (never in CI): the assets sit where the engine looks."""
    app = PKG / "dist" / "specdeck"
    if not (app / "specdeck").exists():
        pytest.skip("no bundle built (bash packaging/build.sh)")
    internal = app / "_internal"
    assert sorted(p.name for p in (internal / "assets" / "workloads").glob("*.toml"))
    assert (internal / "assets" / "profiles").is_dir() and (internal / "assets" / "models").is_dir()
    assert (internal / "kernels" / "cuda_src" / "decode_kernels.cu").is_file()
    assert list(internal.glob("**/platforms/libqoffscreen.so")), "the offscreen Qt platform plugin is missing"
    assert not (internal / "tkinter").exists() and not (internal / "transformers").exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck():
    scripts = [str(PKG / "build.sh"), str(PKG / "install.sh")]
    res = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
