"""Tuning profiles: named EngineSettings saved as small, versioned TOML files.

A profile file looks like this (every key but `notes`, `hardware` and `bench` is required):

    version = 1
    name = "chain"
    notes = "the seed's chain configuration"

    [settings]                 # EngineSettings.to_dict(), every field listed
    speculative = true
    draft_depth = 5
    ...
    sub_vocab_fraction = 0.2157   # optional: sub_vocab as a fraction of the model's vocabulary

    [hardware]                 # where it was tuned (hardware_fingerprint())
    [bench]                    # the last bench figures measured with it

User profiles live in `<config dir>/profiles/`, the config dir being
`platformdirs.user_config_dir("specdeck")` or `$SPECDECK_CONFIG_DIR`. Profiles shipped with SpecDeck
live in `assets/profiles/` and are read-only; a user profile with the same name shadows a shipped one.
The last used settings are kept in the same format in `<config dir>/last_used.toml`.

Loading never crashes on a bad file: `ProfileStore.list()` returns the good profiles and one
`ProfileProblem` per bad file, naming the file and the field. Writes are atomic (a temp file in
the same directory, fsync, os.replace), so a crash mid-save leaves the old file intact.

No Qt here: the CLI (`specdeck bench --profile NAME`) reads profiles through this module too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import platform
import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from engine.settings import EngineSettings

# Bump when the file layout changes in a way older readers would misread. Readers accept
# every version up to this one and refuse newer files with a message saying so.
PROFILE_FORMAT_VERSION = 1

CONFIG_DIR_ENV = "SPECDECK_CONFIG_DIR"
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent.parent / "assets" / "profiles"
LAST_USED_NAME = "last used"

_TOP_LEVEL_KEYS = {"version", "name", "notes", "settings", "hardware", "bench"}
_SETTING_KEYS = {f.name for f in dataclasses.fields(EngineSettings)}
# Not an EngineSettings field: a profile may give sub_vocab relative to the model's vocabulary,
# so one profile fits models of any vocabulary size (settings_for() turns it into a count).
SUB_VOCAB_FRACTION = "sub_vocab_fraction"


class ProfileError(ValueError):
    """A profile that cannot be read, written or found. The message names the file and field."""


@dataclass
class ProfileProblem:
    """One profile file that was skipped, and why."""

    path: Path
    message: str

    def __str__(self) -> str:
        return f"{self.path.name}: {self.message}"


@dataclass
class Profile:
    """A named set of engine settings, with where it was tuned and how it did."""

    name: str
    settings: EngineSettings
    notes: str = ""
    sub_vocab_fraction: float | None = None  # when set, overrides settings.sub_vocab per model
    hardware: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] = field(default_factory=dict)
    version: int = PROFILE_FORMAT_VERSION
    path: Path | None = None  # the file it was read from (None: not saved yet)
    shipped: bool = False  # from assets/profiles: read-only

    def settings_for(self, vocab_size: int) -> EngineSettings:
        """The settings for a model with this vocabulary size (sub_vocab_fraction scaled to it)."""
        if self.sub_vocab_fraction is None:
            if self.settings.sub_vocab > vocab_size:
                # A count tuned on a bigger model: the whole vocabulary is the closest meaning.
                return self.settings.replace(sub_vocab=0)
            return self.settings
        sub_vocab = max(1, round(self.sub_vocab_fraction * vocab_size))
        if sub_vocab >= vocab_size:
            sub_vocab = 0  # 0 means "the whole vocabulary"
        return self.settings.replace(sub_vocab=sub_vocab)

    def to_toml_dict(self) -> dict[str, Any]:
        settings = self.settings.to_dict()
        if self.sub_vocab_fraction is not None:
            settings[SUB_VOCAB_FRACTION] = self.sub_vocab_fraction
        data: dict[str, Any] = {
            "version": PROFILE_FORMAT_VERSION,
            "name": self.name,
            "notes": self.notes,
            "settings": settings,
        }
        # TOML has no null: drop empty readings rather than writing zeros in their place.
        if self.hardware:
            data["hardware"] = _drop_none(self.hardware)
        if self.bench:
            data["bench"] = _drop_none(self.bench)
        return data

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_toml_dict())


# ---------------------------------------------------------------------------------------------
# Reading and validating


def parse_profile(data: dict[str, Any], source: str = "<profile>") -> Profile:
    """Validate a parsed TOML mapping. Raises ProfileError naming `source` and the bad field."""

    def fail(message: str) -> ProfileError:
        return ProfileError(f"{source}: {message}")

    version = data.get("version")
    if version is None:
        raise fail("missing field 'version' (a profile starts with `version = 1`)")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise fail(f"field 'version' must be a positive integer, got {version!r}")
    if version > PROFILE_FORMAT_VERSION:
        raise fail(
            f"written by a newer SpecDeck (format version {version}; this one reads up to "
            f"{PROFILE_FORMAT_VERSION}): update SpecDeck to use it"
        )
    unknown = sorted(set(data) - _TOP_LEVEL_KEYS)
    if unknown:
        raise fail(
            f"unknown field(s) {', '.join(repr(k) for k in unknown)}; known: {', '.join(sorted(_TOP_LEVEL_KEYS))}"
        )

    name = data.get("name")
    if name is None:
        raise fail("missing field 'name'")
    if not isinstance(name, str) or not name.strip():
        raise fail(f"field 'name' must be a non-empty string, got {name!r}")
    notes = data.get("notes", "")
    if not isinstance(notes, str):
        raise fail(f"field 'notes' must be a string, got {notes!r}")
    for table in ("hardware", "bench"):
        if table in data and not isinstance(data[table], dict):
            raise fail(f"field '{table}' must be a table")

    raw_settings = data.get("settings")
    if raw_settings is None:
        raise fail("missing table [settings]")
    if not isinstance(raw_settings, dict):
        raise fail("field 'settings' must be a table")
    raw_settings = dict(raw_settings)
    fraction = raw_settings.pop(SUB_VOCAB_FRACTION, None)
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise fail(f"field 'settings.{SUB_VOCAB_FRACTION}' must be a number, got {fraction!r}")
        if not 0.0 < float(fraction) <= 1.0:
            raise fail(f"field 'settings.{SUB_VOCAB_FRACTION}' must be in (0, 1], got {fraction}")
        fraction = float(fraction)
        # The fraction decides sub_vocab; a count beside it would be ambiguous, so it may be absent.
        raw_settings.setdefault("sub_vocab", 0)
    unknown = sorted(set(raw_settings) - _SETTING_KEYS)
    if unknown:
        raise fail(
            f"unknown setting(s) {', '.join('settings.' + k for k in unknown)}; known: "
            f"{', '.join(sorted(_SETTING_KEYS | {SUB_VOCAB_FRACTION}))}"
        )
    # Every setting must be listed: a profile filled in from today's defaults would silently
    # mean something else once a default changes.
    missing = sorted(_SETTING_KEYS - set(raw_settings))
    if missing:
        raise fail(f"incomplete: missing setting(s) {', '.join('settings.' + k for k in missing)}")
    try:
        settings = EngineSettings.from_dict(raw_settings)
    except ValueError as exc:
        # EngineSettings names the field ("draft_depth must be in 1..16, got 40").
        raise fail(f"settings.{exc}") from None
    except TypeError as exc:
        raise fail(f"[settings]: {exc}") from None

    return Profile(
        name=name.strip(),
        settings=settings,
        notes=notes,
        sub_vocab_fraction=fraction,
        hardware=dict(data.get("hardware", {})),
        bench=dict(data.get("bench", {})),
        version=version,
    )


def read_profile_file(path: str | os.PathLike[str], shipped: bool = False) -> Profile:
    """Read and validate one profile file. Raises ProfileError naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such file") from None
    except OSError as exc:
        raise ProfileError(f"{path.name}: cannot be read ({exc.strerror or exc})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProfileError(f"{path.name}: not a text file (not UTF-8)") from None
    if not text.strip():
        raise ProfileError(f"{path.name}: empty file (perhaps cut short by a crash)")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path.name}: corrupt, not valid TOML ({exc})") from None
    profile = parse_profile(data, source=path.name)
    profile.path = path
    profile.shipped = shipped
    return profile


# ---------------------------------------------------------------------------------------------
# Where files live


def config_dir() -> Path:
    """SpecDeck's user config directory ($SPECDECK_CONFIG_DIR overrides, e.g. for tests)."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_config_dir("specdeck"))


def file_name_for(name: str) -> str:
    """A safe file name for a profile name: 'My chain, 5 deep' -> 'my-chain-5-deep.toml'."""
    slug = re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-")
    return (slug or "profile") + ".toml"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never half.

    The temp file is in the same directory (os.replace is atomic only within one file system),
    is fsynced before the rename, and the directory is fsynced after it so the rename survives
    a power cut.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:  # a read-only folder, a full disk: say where and what to do
        raise ProfileError(
            f"cannot write {path.name} in {path.parent} ({exc.strerror or exc}); make that folder writable "
            f"or point {CONFIG_DIR_ENV} at one that is"
        ) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a directory; the rename is still done
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------------------------------------
# The store: list, save, rename, duplicate, delete, import, export


class ProfileStore:
    """The user's profiles (a directory of TOML files) plus the shipped, read-only ones."""

    def __init__(self, directory: Path | None = None, shipped_dir: Path | None = SHIPPED_PROFILES_DIR):
        self.directory = Path(directory) if directory is not None else config_dir() / "profiles"
        self.shipped_dir = shipped_dir

    # -- reading --

    def list(self) -> tuple[list[Profile], list[ProfileProblem]]:
        """Every good profile (user ones shadow shipped ones of the same name), sorted by name,
        and one problem per file that was skipped."""
        problems: list[ProfileProblem] = []
        by_name: dict[str, Profile] = {}
        sources = [(self.shipped_dir, True), (self.directory, False)]
        for directory, shipped in sources:
            if directory is None or not directory.is_dir():
                continue
            for path in sorted(directory.glob("*.toml")):
                try:
                    profile = read_profile_file(path, shipped=shipped)
                except ProfileError as exc:
                    problems.append(ProfileProblem(path, _without_prefix(str(exc), path.name)))
                    continue
                key = profile.name.casefold()
                if key in by_name and by_name[key].shipped == shipped:
                    problems.append(
                        ProfileProblem(
                            path,
                            f"name {profile.name!r} is also used by {by_name[key].path.name}; this file is skipped",
                        )
                    )
                    continue
                by_name[key] = profile  # user profiles come second and win
        return sorted(by_name.values(), key=lambda p: p.name.casefold()), problems

    def names(self) -> list[str]:
        return [p.name for p in self.list()[0]]

    def find(self, name: str) -> Profile | None:
        key = name.strip().casefold()
        for profile in self.list()[0]:
            if profile.name.casefold() == key:
                return profile
        return None

    def find_by_name_or_file(self, text: str) -> Profile | None:
        """A profile by its display name ('best known') or its file name ('best-known' or
        'best-known.toml'); the display name wins when both could match."""
        profile = self.find(text)
        if profile is not None:
            return profile
        key = text.strip().casefold()
        stem = key[:-5] if key.endswith(".toml") else key
        profiles = self.list()[0]
        for candidate in reversed(profiles):  # user files first, as they shadow shipped ones
            if candidate.path is not None and candidate.path.stem.casefold() == stem:
                return candidate
        return None

    def get(self, name: str) -> Profile:
        profile = self.find_by_name_or_file(name)
        if profile is None:
            skipped = self.skip_reason(name)
            if skipped is not None:
                raise ProfileError(f"profile {name!r} was skipped because of a bad value: {skipped}")
            known = ", ".join(self.names()) or "none"
            raise ProfileError(f"no profile named {name!r} (profiles: {known})")
        return profile

    def skip_reason(self, name: str) -> ProfileProblem | None:
        """The problem of the skipped file that is this name (by file name, or by the name written
        in it), or None when no skipped file matches."""
        key = name.strip().casefold()
        stem = key[:-5] if key.endswith(".toml") else key
        for problem in self.list()[1]:
            if problem.path.stem.casefold() in (stem, file_name_for(name)[:-5]):
                return problem
            try:
                written = tomllib.loads(problem.path.read_text(encoding="utf-8")).get("name")
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
                continue
            if isinstance(written, str) and written.strip().casefold() == key:
                return problem
        return None

    def _user_profile(self, name: str) -> Profile:
        profile = self.get(name)
        if profile.shipped:
            raise ProfileError(f"{name!r} is shipped with SpecDeck and cannot be changed; duplicate it first")
        return profile

    # -- writing --

    def _path_for_new(self, name: str) -> Path:
        base = file_name_for(name)
        path = self.directory / base
        counter = 2
        while path.exists():
            path = self.directory / f"{base[:-5]}-{counter}.toml"
            counter += 1
        return path

    def save(self, profile: Profile, overwrite: bool = True) -> Profile:
        """Write a user profile (new, or replacing the user profile of the same name)."""
        name = profile.name.strip()
        if not name:
            raise ProfileError("a profile needs a name")
        existing = self.find(name)
        if existing is not None and not existing.shipped:
            if not overwrite:
                raise ProfileError(f"a profile named {name!r} already exists")
            path = existing.path
        else:
            path = self._path_for_new(name)
        saved = dataclasses.replace(profile, name=name, path=path, shipped=False, version=PROFILE_FORMAT_VERSION)
        write_atomically(path, saved.to_toml())
        return saved

    def rename(self, old_name: str, new_name: str) -> Profile:
        profile = self._user_profile(old_name)
        new_name = new_name.strip()
        if not new_name:
            raise ProfileError("a profile needs a name")
        clash = self.find(new_name)
        if clash is not None and clash.path != profile.path:
            raise ProfileError(f"a profile named {new_name!r} already exists")
        new_path = self._path_for_new(new_name) if file_name_for(new_name) != profile.path.name else profile.path
        renamed = dataclasses.replace(profile, name=new_name, path=new_path)
        write_atomically(new_path, renamed.to_toml())
        if new_path != profile.path:
            profile.path.unlink(missing_ok=True)
        return renamed

    def duplicate(self, name: str, new_name: str | None = None) -> Profile:
        profile = self.get(name)
        new_name = (new_name or self.unique_name(f"{profile.name} copy")).strip()
        if self.find(new_name) is not None:
            raise ProfileError(f"a profile named {new_name!r} already exists")
        return self.save(dataclasses.replace(profile, name=new_name, path=None, shipped=False))

    def delete(self, name: str) -> None:
        profile = self._user_profile(name)
        profile.path.unlink(missing_ok=True)

    def import_file(self, path: str | os.PathLike[str]) -> Profile:
        """Validate a profile file from anywhere and add it; a taken name gets ' 2', ' 3', ..."""
        profile = read_profile_file(path)
        profile.name = self.unique_name(profile.name)
        return self.save(dataclasses.replace(profile, path=None, shipped=False))

    def export(self, name: str, path: str | os.PathLike[str]) -> Path:
        path = Path(path)
        write_atomically(path, self.get(name).to_toml())
        return path

    def unique_name(self, name: str) -> str:
        taken = {n.casefold() for n in self.names()}
        if name.casefold() not in taken:
            return name
        counter = 2
        while f"{name} {counter}".casefold() in taken:
            counter += 1
        return f"{name} {counter}"


# ---------------------------------------------------------------------------------------------
# The last used settings (restored when the app starts)


def last_used_path() -> Path:
    return config_dir() / "last_used.toml"


def save_last_used(settings: EngineSettings, notes: str = "") -> None:
    profile = Profile(name=LAST_USED_NAME, settings=settings, notes=notes)
    write_atomically(last_used_path(), profile.to_toml())


def load_last_used() -> tuple[EngineSettings | None, str | None]:
    """(settings, None), or (None, a message) when the file is missing or bad."""
    path = last_used_path()
    if not path.exists():
        return None, None
    try:
        return read_profile_file(path).settings, None
    except ProfileError as exc:
        return None, f"last used settings not restored: {exc}"


# ---------------------------------------------------------------------------------------------
# Module-level helpers for the CLI


def load_profile(name_or_path: str | os.PathLike[str]) -> Profile:
    """A profile by name (user ones, then shipped ones) or by the path of a .toml file."""
    text = os.fspath(name_or_path)
    path = Path(text)
    if os.sep in text or path.is_file():
        return read_profile_file(path)
    return ProfileStore().get(text)  # a display name, or a file name with or without .toml


def list_profiles() -> tuple[list[Profile], list[ProfileProblem]]:
    return ProfileStore().list()


def hardware_fingerprint(gpu_names: list[str] | None = None) -> dict[str, Any]:
    """Where a profile was tuned: OS, CPU, GPUs and driver (NVML when present), and the time."""
    fingerprint: dict[str, Any] = {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "python": platform.python_version(),
        "saved_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }
    if gpu_names is None:
        gpu_names, driver = _nvml_gpus()
        if driver:
            fingerprint["nvidia_driver"] = driver
    fingerprint["gpus"] = list(gpu_names)
    return fingerprint


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _nvml_gpus() -> tuple[list[str], str | None]:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return [], None
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        driver = pynvml.nvmlSystemGetDriverVersion()
        return names, driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:
        return [], None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value if v is not None]
    return value


def _without_prefix(message: str, file_name: str) -> str:
    prefix = f"{file_name}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
