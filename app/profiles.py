"""Tuning profiles: named EngineSettings saved as small, versioned TOML files.

A profile file looks like this (every key but `notes`, `hardware` and `bench` is required):

    version = 1
    name = "chain"
    notes = "the seed's chain configuration"
    kind = "bench"             # optional: only a bench profile may set settings.synthetic_rates

    [settings]                 # EngineSettings.to_dict(), every field listed
    speculative = true
    draft_depth = 5
    ...
    sub_vocab_fraction = 0.2157   # optional: sub_vocab as a fraction of the model's vocabulary
    synthetic_rates = [0.87, 0.78] # optional, bench profiles only: synthetic acceptance (a measurement mode)

    [sampling]                 # optional: SamplingParams.to_dict(), every field listed; absent: the profile
                               # says nothing about sampling (greedy unless set elsewhere)
    temperature = 0.7
    ...

    [hardware]                 # where it was tuned (hardware_fingerprint())
    [bench]                    # the last bench figures measured with it

User profiles live in `<config dir>/profiles/`, the config dir being
`platformdirs.user_config_dir("specdeck")` or `$SPECDECK_CONFIG_DIR`. Profiles shipped with SpecDeck
live in `assets/profiles/` and are read-only; a user profile with the same name shadows a shipped one.
The last used settings are kept in the same format in `<config dir>/last_used.toml`.

Loading never crashes on a bad file: `ProfileStore.list()` returns the good profiles and one
`ProfileProblem` per bad file, naming the file and the field. Writes are atomic (a temp file in
the same directory, fsync, os.replace), so a crash mid-save leaves the old file intact.

Synthetic acceptance (`settings.synthetic_rates`) makes a run's text something other than the model's output,
so a profile that sets it must say it is a bench profile (`kind = "bench"`): any other profile file setting it is
refused with a message saying so, and the last used settings never hold it. Only the bench uses those rates.

No Qt here: the CLI (`specdeck bench --profile NAME`) reads profiles through this module too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import os
import platform
import re
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from engine.files import fsync_dir, move_into_place, write_temp_beside
from engine.sampling import SamplingParams
from engine.settings import EngineSettings
from engine.untrusted import MiB, OutOfTime, exists, one_line, read_capped, time_limit

# Bump when the file layout changes in a way older readers would misread. Readers accept
# every version up to this one and refuse newer files with a message saying so.
PROFILE_FORMAT_VERSION = 1

CONFIG_DIR_ENV = "SPECDECK_CONFIG_DIR"
MAX_PROFILE_BYTES = 4 * MiB  # a profile is a few hundred bytes; notes may be long, not this long
PARSE_SECONDS = 2.0  # tomllib is pure Python, and slow on some shapes (long dotted keys)
MAX_NAME_CHARS = 1000  # a profile's name; its file name is shortened further (file_name_for)
MAX_SLUG_CHARS = 80  # file names stay far below the 255-byte limit, with room for "-NN.toml" and temp names
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent.parent / "assets" / "profiles"
LAST_USED_NAME = "last used"

_TOP_LEVEL_KEYS = {"version", "name", "notes", "kind", "settings", "sampling", "hardware", "bench"}
# A profile's kind: "tuning" (the default, written as no `kind` key) or "bench", the only kind that may set
# settings.synthetic_rates (synthetic acceptance, a measurement mode whose text is not the model's output).
PROFILE_KINDS = ("tuning", "bench")
SYNTHETIC_RATES = "synthetic_rates"
_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
_SETTING_KEYS = {f.name for f in dataclasses.fields(EngineSettings)}
# Not an EngineSettings field: a profile may give sub_vocab relative to the model's vocabulary,
# so one profile fits models of any vocabulary size (settings_for() turns it into a count).
SUB_VOCAB_FRACTION = "sub_vocab_fraction"


class ProfileError(ValueError):
    """A profile that cannot be read, written or found. The message names the file and field."""


class ProfileWriteError(ProfileError, OSError):
    """A profile that could not be written (a full disk, a read-only folder): a ProfileError, and an OSError
    for callers that catch those. The old file, if any, is unchanged."""


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
    sampling: SamplingParams | None = None  # None: no [sampling] table (sampling left as it is; greedy by default)
    kind: str = "tuning"  # "bench": may set synthetic acceptance rates (PROFILE_KINDS)

    def settings_for(self, vocab_size: int) -> EngineSettings:
        """The settings for a model with this vocabulary size (EngineSettings.fitted_to, the one rule)."""
        return self.settings.fitted_to(vocab_size, self.sub_vocab_fraction)

    def to_toml_dict(self) -> dict[str, Any]:
        if self.settings.synthetic and self.kind != "bench":
            raise ProfileError(_synthetic_not_bench(f"profile {self.name!r}"))
        settings = self.settings.to_dict()
        rates = settings.pop(SYNTHETIC_RATES)
        if rates:  # written only when set, so every other profile file reads as before
            settings[SYNTHETIC_RATES] = list(rates)
        if self.sub_vocab_fraction is not None:
            settings[SUB_VOCAB_FRACTION] = self.sub_vocab_fraction
        data: dict[str, Any] = {
            "version": PROFILE_FORMAT_VERSION,
            "name": self.name,
            "notes": self.notes,
            **({"kind": self.kind} if self.kind != "tuning" else {}),
            "settings": settings,
        }
        if self.sampling is not None:
            data["sampling"] = self.sampling.to_dict()
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


# Settings that profiles saved before they existed do not list, each with the value the engine used then
# (not today's default, which may change): such a profile still means what it meant.
SETTINGS_ADDED_LATER = {"prefill_chunk": 2048}


def _check_keys(raw: dict, known: set[str], table: str, noun: str, fail, shown_known: set[str] | None = None) -> None:
    """A [table] lists exactly the known keys: unknown ones and missing ones are each one error naming them."""
    unknown = sorted(set(raw) - known)
    if unknown:
        raise fail(
            f"unknown {noun}(s) {', '.join(f'{table}.' + _short(k)[1:-1] for k in unknown[:5])}; known: "
            f"{', '.join(sorted(shown_known or known))}"
        )
    missing = sorted(known - set(raw))
    if missing:
        raise fail(f"incomplete: missing {noun}(s) {', '.join(f'{table}.' + k for k in missing)}")


def parse_profile(data: dict[str, Any], source: str = "<profile>") -> Profile:
    """Validate a parsed TOML mapping. Raises ProfileError naming `source` and the bad field."""

    def fail(message: str) -> ProfileError:
        return ProfileError(f"{source}: {message}")

    version = data.get("version") if isinstance(data, dict) else None
    if not isinstance(data, dict):
        raise fail("not a TOML table")
    if version is None:
        raise fail("missing field 'version' (a profile starts with `version = 1`)")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise fail(f"field 'version' must be a positive integer, got {_short(version)}")
    if version > PROFILE_FORMAT_VERSION:
        raise fail(
            f"written by a newer SpecDeck (format version {version}; this one reads up to "
            f"{PROFILE_FORMAT_VERSION}): update SpecDeck to use it"
        )
    unknown = sorted(set(data) - _TOP_LEVEL_KEYS)
    if unknown:
        raise fail(
            f"unknown field(s) {', '.join(_short(k) for k in unknown[:5])}; known: {', '.join(sorted(_TOP_LEVEL_KEYS))}"
        )

    name = data.get("name")
    if name is None:
        raise fail("missing field 'name'")
    if not isinstance(name, str) or not name.strip():
        raise fail(f"field 'name' must be a non-empty string, got {_short(name)}")
    if len(name) > MAX_NAME_CHARS:
        raise fail(f"field 'name' is {len(name)} characters long; at most {MAX_NAME_CHARS}")
    notes = data.get("notes", "")
    if not isinstance(notes, str):
        raise fail(f"field 'notes' must be a string, got {_short(notes)}")
    kind = data.get("kind", "tuning")
    if kind not in PROFILE_KINDS:
        raise fail(f"field 'kind' must be one of {', '.join(map(repr, PROFILE_KINDS))}, got {_short(kind)}")
    for table in ("hardware", "bench"):
        if table in data and not isinstance(data[table], dict):
            raise fail(f"field '{table}' must be a table")
        if table in data and _too_deep(data[table]):
            raise fail(f"table [{table}] is nested more than {MAX_TABLE_DEPTH} levels deep or holds too many values")

    raw_settings = data.get("settings")
    if raw_settings is None:
        raise fail("missing table [settings]")
    if not isinstance(raw_settings, dict):
        raise fail("field 'settings' must be a table")
    raw_settings = dict(raw_settings)
    fraction = raw_settings.pop(SUB_VOCAB_FRACTION, None)
    if fraction is not None:
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise fail(f"field 'settings.{SUB_VOCAB_FRACTION}' must be a number, got {_short(fraction)}")
        if not 0.0 < float(fraction) <= 1.0:  # NaN fails this too
            raise fail(f"field 'settings.{SUB_VOCAB_FRACTION}' must be in (0, 1], got {fraction}")
        fraction = float(fraction)
        # The fraction decides sub_vocab; a count beside it would be ambiguous, so it may be absent.
        raw_settings.setdefault("sub_vocab", 0)
    if raw_settings.get("draft_depth") != "auto":
        # The deepest an adaptive depth may go acts only with draft_depth = "auto" (and profiles from
        # before it existed do not list it).
        raw_settings.setdefault("max_draft_depth", EngineSettings().max_draft_depth)
    for key, before in SETTINGS_ADDED_LATER.items():  # a profile from before a setting: the value it ran with
        raw_settings.setdefault(key, before)
    raw_settings.setdefault(SYNTHETIC_RATES, [])  # absent: off (only bench profiles list it)
    # Every setting must be listed: a profile filled in from today's defaults would silently
    # mean something else once a default changes.
    _check_keys(
        raw_settings, _SETTING_KEYS, "settings", "setting", fail, shown_known=_SETTING_KEYS | {SUB_VOCAB_FRACTION}
    )
    try:
        settings = EngineSettings.from_dict(raw_settings)
    except ValueError as exc:
        # EngineSettings names the field ("draft_depth must be in 1..16, got 40").
        raise fail(f"settings.{one_line(exc)}") from None
    except TypeError as exc:
        raise fail(f"[settings]: {one_line(exc)}") from None
    if settings.synthetic and kind != "bench":
        raise fail(_synthetic_not_bench("this profile"))

    sampling = None
    raw_sampling = data.get("sampling")
    if raw_sampling is not None:
        if not isinstance(raw_sampling, dict):
            raise fail("field 'sampling' must be a table")
        _check_keys(raw_sampling, _SAMPLING_KEYS, "sampling", "sampling setting", fail)
        try:
            sampling = SamplingParams.from_dict(raw_sampling)
        except ValueError as exc:  # names the field ("top_p must be a number in (0, 1] ...")
            raise fail(f"sampling.{exc}") from None

    return Profile(
        sampling=sampling,
        kind=kind,
        name=name.strip(),
        settings=settings,
        notes=notes,
        sub_vocab_fraction=fraction,
        hardware=dict(data.get("hardware", {})),
        bench=dict(data.get("bench", {})),
        version=version,
    )


def _synthetic_not_bench(what: str) -> str:
    return (
        f"{what} sets settings.synthetic_rates (synthetic acceptance: a measurement mode whose text is not the "
        "model's output), which only a bench profile may do; remove synthetic_rates for a normal profile, or add "
        '`kind = "bench"` at the top of the file to keep it for `specdeck bench`'
    )


def read_profile_file(path: str | os.PathLike[str], shipped: bool = False) -> Profile:
    """Read and validate one profile file. Raises ProfileError naming the file.

    The file is untrusted (hand-edited, copied from elsewhere): it must be a regular file (a FIFO or a
    link to a device is refused from os.stat, never opened), of at most MAX_PROFILE_BYTES, UTF-8 TOML."""
    path = Path(path)
    if not exists(path):
        raise ProfileError(f"{path}: no such file")
    try:
        raw = read_capped(path, MAX_PROFILE_BYTES, "the file", _Unreadable)
    except _Unreadable as exc:
        raise ProfileError(f"{path.name}: {_without_prefix(str(exc), str(path))}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path.name}: not a text file (not UTF-8 at byte {exc.start})") from None
    if not text.strip():
        raise ProfileError(f"{path.name}: empty file (perhaps cut short by a crash)")
    try:
        with time_limit(PARSE_SECONDS):
            data = tomllib.loads(text)
    except OutOfTime:
        raise ProfileError(f"{path.name}: not read: parsing it took more than {PARSE_SECONDS:g} s") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path.name}: corrupt, not valid TOML ({one_line(exc)})") from None
    except RecursionError:
        raise ProfileError(f"{path.name}: corrupt, not valid TOML (nested too deeply)") from None
    except (ValueError, MemoryError) as exc:
        raise ProfileError(f"{path.name}: corrupt, not valid TOML ({type(exc).__name__}: {one_line(exc)})") from None
    profile = parse_profile(data, source=path.name)
    profile.path = path
    profile.shipped = shipped
    return profile


class _Unreadable(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Where files live


def config_dir() -> Path:
    """SpecDeck's user config directory ($SPECDECK_CONFIG_DIR overrides, e.g. for tests)."""
    override = os.environ.get(CONFIG_DIR_ENV)
    if override:
        return Path(override)
    import platformdirs

    return Path(platformdirs.user_config_dir("specdeck"))


_RESERVED = {"con", "prn", "aux", "nul", *(f"com{i}" for i in range(10)), *(f"lpt{i}" for i in range(10))}


def file_name_for(name: str) -> str:
    """A safe file name for a profile name: 'My chain, 5 deep' -> 'my-chain-5-deep.toml'. A long name is
    cut to MAX_SLUG_CHARS and told apart by a short hash of the whole name."""
    slug = re.sub(r"[^a-z0-9_]+", "-", name.lower()).strip("-") or "profile"
    if len(slug) > MAX_SLUG_CHARS:
        digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        slug = f"{slug[: MAX_SLUG_CHARS - 9].rstrip('-')}-{digest}"
    if slug in _RESERVED:  # names Windows keeps for devices
        slug = f"profile-{slug}"
    return slug + ".toml"


def _write_error(path: Path, exc: OSError) -> ProfileWriteError:
    """One line for a failed write: which file, why, and what to do."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        todo = "free some space on that disk; the old file, if any, is unchanged"
    else:
        todo = f"make that folder writable or point {CONFIG_DIR_ENV} at one that is"
    return ProfileWriteError(f"cannot write {path.name} in {path.parent} ({reason}); {todo}")


def _write_temp(path: Path, text: str) -> str:
    """Write `text` to a new temp file beside `path` and fsync it; returns its name."""
    try:
        data = text.encode("utf-8")  # before any file exists
    except UnicodeEncodeError as exc:
        raise ProfileError(
            f"cannot write {path.name}: the profile holds text that is not valid Unicode (character {exc.start} "
            "of the file); fix the name or notes"
        ) from None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return write_temp_beside(path, data)
    except OSError as exc:  # a read-only folder, a full disk: say where and what to do
        raise _write_error(path, exc) from None


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never half
    (engine/files.py). Any failure (a full disk, a read-only folder) is one ProfileError naming the file,
    and the old file is left as it was."""
    tmp_name = _write_temp(path, text)
    try:
        move_into_place(tmp_name, path)
    except OSError as exc:
        raise _write_error(path, exc) from None


def write_new(directory: Path, file_name: str, text: str) -> Path:
    """Write `text` under `file_name` in `directory`, or `stem-2.toml`, `stem-3.toml`, ... when taken, never
    replacing a file: the whole file is written to a temp name first, then hard-linked to the first free
    name (a link fails if the name exists, so two processes never take the same one). Where hard links
    are not supported, the name is reserved with an exclusive create and then replaced."""
    stem = file_name[:-5] if file_name.endswith(".toml") else file_name
    tmp_name = _write_temp(directory / file_name, text)
    try:
        for counter in range(1, 10_000):
            path = directory / (file_name if counter == 1 else f"{stem}-{counter}.toml")
            try:
                os.link(tmp_name, path)
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                    raise _write_error(path, exc) from None
                try:  # no hard links here: reserve the name, then move the whole file onto it
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
                except FileExistsError:
                    continue
                except OSError as exc2:
                    raise _write_error(path, exc2) from None
                try:
                    os.replace(tmp_name, path)
                except OSError as exc2:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise _write_error(path, exc2) from None
            fsync_dir(directory)
            return path
        raise ProfileError(f"cannot find a free file name for {file_name} in {directory}")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)


@contextlib.contextmanager
def _store_lock(directory: Path, seconds: float = 10.0):
    """Serialise the store's check-then-write steps across processes: an flock on the folder itself (no lock
    file to leave behind). Where there is no fcntl, or no lock can be had, writes are still atomic and a new
    file still never replaces another (write_new), just not serialised."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield  # the write itself will say what is wrong
        return
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ProfileError(
                        f"{directory}: another SpecDeck is still saving profiles here; try again"
                    ) from None
                time.sleep(0.01)
            except OSError:
                break  # a file system without locks
        yield
    finally:
        os.close(fd)  # closing releases the lock


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
            try:
                paths = sorted(directory.glob("*.toml"))
            except OSError as exc:  # an unreadable folder: say so, keep the other source
                problems.append(ProfileProblem(directory, f"folder cannot be read ({exc.strerror or exc})"))
                continue
            for path in paths:
                try:
                    profile = read_profile_file(path, shipped=shipped)
                except ProfileError as exc:
                    problems.append(ProfileProblem(path, _without_prefix(str(exc), path.name)))
                    continue
                except Exception as exc:  # whatever one file does, the others still load
                    problems.append(ProfileProblem(path, f"cannot be read ({type(exc).__name__}: {one_line(exc)})"))
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

    def save(self, profile: Profile, overwrite: bool = True) -> Profile:
        """Write a user profile (new, or replacing the user profile of the same name). Safe against another
        process saving at the same time: the store is locked, and a new file never replaces another."""
        name = _check_name(profile.name)
        with _store_lock(self.directory):
            existing = self.find(name)
            if existing is not None and not existing.shipped:
                if not overwrite:
                    raise ProfileError(f"a profile named {name!r} already exists")
                saved = dataclasses.replace(
                    profile, name=name, path=existing.path, shipped=False, version=PROFILE_FORMAT_VERSION
                )
                write_atomically(existing.path, saved.to_toml())
                return saved
            saved = dataclasses.replace(profile, name=name, shipped=False, version=PROFILE_FORMAT_VERSION)
            saved.path = write_new(self.directory, file_name_for(name), saved.to_toml())
            return saved

    def rename(self, old_name: str, new_name: str) -> Profile:
        new_name = _check_name(new_name)
        with _store_lock(self.directory):
            profile = self._user_profile(old_name)
            clash = self.find(new_name)
            if clash is not None and clash.path != profile.path:
                raise ProfileError(f"a profile named {new_name!r} already exists")
            renamed = dataclasses.replace(profile, name=new_name)
            if file_name_for(new_name) == profile.path.name:
                write_atomically(profile.path, renamed.to_toml())
            else:
                renamed.path = write_new(self.directory, file_name_for(new_name), renamed.to_toml())
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
    """The settings the app restores at its next start: never synthetic acceptance (a bench's measurement)."""
    profile = Profile(name=LAST_USED_NAME, settings=settings.replace(synthetic_rates=()), notes=notes)
    write_atomically(last_used_path(), profile.to_toml())


def load_last_used() -> tuple[EngineSettings | None, str | None]:
    """(settings, None), or (None, a message) when the file is missing or bad."""
    path = last_used_path()
    if not exists(path):
        return None, None
    try:
        return read_profile_file(path).settings, None
    except ProfileError as exc:
        return None, f"last used settings not restored: {exc}"
    except Exception as exc:  # whatever is in the file, the window still opens
        return None, f"last used settings not restored: {path.name}: {type(exc).__name__}: {one_line(exc)}"


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
        from app.hardware import gpu_names_and_driver

        gpu_names, driver = gpu_names_and_driver()
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


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_drop_none(v) for v in value if v is not None]
    return value


MAX_TABLE_DEPTH = 8  # [hardware] / [bench] hold a few readings; shown and re-saved by recursive code
MAX_TABLE_VALUES = 10_000


def _too_deep(value: Any) -> bool:
    """True when `value` nests tables/arrays more than MAX_TABLE_DEPTH deep or holds more than
    MAX_TABLE_VALUES values (checked without recursion: a long dotted key builds a deep table cheaply)."""
    stack, seen = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > MAX_TABLE_DEPTH or seen > MAX_TABLE_VALUES:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def _check_name(name: object) -> str:
    if not isinstance(name, str):
        raise ProfileError(f"a profile name must be text, got {type(name).__name__}")
    name = name.strip()
    if not name:
        raise ProfileError("a profile needs a name")
    if len(name) > MAX_NAME_CHARS:
        raise ProfileError(f"a profile name is at most {MAX_NAME_CHARS} characters; this one has {len(name)}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ProfileError(f"the profile name is not valid Unicode at character {exc.start}") from None
    return name


def _short(value: Any, limit: int = 60) -> str:
    """ascii() of a value read from a file, cut short (it may hold anything)."""
    text = ascii(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _without_prefix(message: str, file_name: str) -> str:
    prefix = f"{file_name}: "
    return message[len(prefix) :] if message.startswith(prefix) else message
