"""Configuration: ``[tool.trainlint]`` in the nearest pyproject.toml, or a trainlint.toml beside it.

Unknown keys, unknown rule ids and values of the wrong type are errors (``ConfigError``), never ignored.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlint.files import DEFAULT_EXCLUDES, ExcludePatterns, GlobSet, physical_path
from trainlint.rule import Severity, rule_ids


class ConfigError(Exception):
    """A configuration problem, with a message meant for the user."""


TOP_KEYS = frozenset(
    {
        "select",
        "ignore",
        "extend-select",
        "exclude",
        "extend-exclude",
        "per-file-ignores",
        "severity",
        "verify",
    }
)
VERIFY_KEYS = frozenset({"device", "timeout"})
# Where a configuration search stops: the root of the repository being linted.
REPOSITORY_MARKERS = (".git", ".hg", ".svn")
MAX_CONFIG_BYTES = 1024 * 1024
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class Config:
    root: Path = field(default_factory=Path.cwd)
    source: Path | None = None
    select: list[str] | None = None
    ignore: list[str] = field(default_factory=list)
    extend_select: list[str] = field(default_factory=list)
    exclude: list[str] | None = None
    extend_exclude: list[str] = field(default_factory=list)
    per_file_ignores: dict[str, list[str]] = field(default_factory=dict)
    severity: dict[str, Severity] = field(default_factory=dict)
    verify_device: str = "auto"
    verify_timeout: float = 60.0
    _excludes: ExcludePatterns | None = field(default=None, init=False, repr=False, compare=False)
    _ignore_globs: GlobSet | None = field(default=None, init=False, repr=False, compare=False)

    def excludes(self) -> ExcludePatterns:
        """The exclude patterns: ``exclude`` (default: tool and environment folders) + ``extend-exclude``.
        Built once (a configuration is complete when loaded): each file of a run asks for them."""
        if self._excludes is None:
            base = self.exclude if self.exclude is not None else DEFAULT_EXCLUDES
            self._excludes = ExcludePatterns((*base, *self.extend_exclude))
        return self._excludes

    def ignore_globs(self) -> GlobSet:
        """The globs of ``per-file-ignores``, indexed once (each file of a run is matched)."""
        if self._ignore_globs is None:
            self._ignore_globs = GlobSet(self.per_file_ignores)
        return self._ignore_globs

    def fingerprint(self) -> str:
        """Everything that changes findings, as a stable string (the result cache keys on it)."""
        return repr(
            (
                self.select,
                sorted(self.ignore),
                sorted(self.extend_select),
                sorted(self.per_file_ignores.items()),
                sorted((k, v.value) for k, v in self.severity.items()),
            )
        )


def matches(rule_id: str, selectors: Iterable[str]) -> bool:
    return any(rule_id.startswith(s.upper()) for s in selectors)


def check_selectors(values: Iterable[str], where: str) -> list[str]:
    """Each selector must be ``ALL`` or an id/prefix of at least one rule."""
    ids = rule_ids()
    out = []
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected rule ids as strings, got {value!r}")
        v = value.strip().upper()
        if not v:
            raise ConfigError(f"{where}: empty rule id (an empty selector would match every rule)")
        if v != "ALL" and not any(i.startswith(v) for i in ids):
            raise ConfigError(f"{where}: unknown rule id or prefix {value!r} (see `trainlint --list-rules`)")
        out.append(v)
    return out


def flag_selectors(value: str | None, flag: str) -> list[str]:
    """A command-line selector flag's rule ids (comma-separated); given but empty (``--select ""``, a
    shell variable that was not set) is an error rather than a silent "every rule" or "no rule"."""
    values = [v.strip() for v in value.split(",") if v.strip()] if value else []
    if value is not None and not values:
        raise ConfigError(f"{flag}: no rule id given (an empty value selects nothing)")
    return check_selectors(values, flag)


def select_rules(select: list[str] | None, extend_select: Iterable[str], ignore: Iterable[str]) -> list[str]:
    """Rule ids enabled by these selectors (no ``select`` means every rule)."""
    ids = rule_ids()
    chosen = set(ids) if select is None or "ALL" in select else {i for i in ids if matches(i, select)}
    extra = list(extend_select)
    chosen |= set(ids) if "ALL" in extra else {i for i in ids if matches(i, extra)}
    ignored = list(ignore)
    return sorted(i for i in chosen if not matches(i, ignored))


def find_config(
    start: Path,
    found: dict[Path, Path | None] | None = None,
    parsed: dict[Path, dict[str, Any]] | None = None,
) -> Path | None:
    """The nearest trainlint.toml, or pyproject.toml holding ``[tool.trainlint]``, at or above start.

    ``found`` (the answer for each folder looked at) and ``parsed`` (each pyproject.toml read) are a
    resolver's memory for one run: without them, each folder of a tree would parse the same
    pyproject.toml again, and a committed one can hold a megabyte of patterns."""
    found = {} if found is None else found
    visited: list[Path] = []
    answer = None
    for folder in (resolved := start.resolve(), *resolved.parents):
        if folder in found:
            answer = found[folder]
            break
        visited.append(folder)
        answer = _config_in(folder, parsed if parsed is not None else {})
        if answer is not None or any(os.path.lexists(folder / marker) for marker in REPOSITORY_MARKERS):
            break  # a repository's code is never configured from above its root
    for folder in visited:
        found[folder] = answer
    return answer


def _config_in(folder: Path, parsed: dict[Path, dict[str, Any]]) -> Path | None:
    candidate = folder / "trainlint.toml"
    if candidate.is_file():
        return candidate
    candidate = folder / "pyproject.toml"
    if candidate.is_file():
        data = parsed[candidate] = _read_toml(candidate)
        tool = data.get("tool")
        if isinstance(tool, dict) and "trainlint" in tool:
            return candidate
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = _read_capped(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: cannot read: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {(exc.strerror or type(exc).__name__).lower()}") from None
    if sys.version_info >= (3, 11):  # imported here: most runs find no configuration file to read
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: cannot parse TOML: {exc}") from None
    except (RecursionError, MemoryError):  # tomllib recurses once per nested table or array
        raise ConfigError(f"{path}: cannot parse TOML: nested too deeply") from None


def _read_capped(path: Path) -> bytes:
    """A configuration file's bytes: a regular file of at most ``MAX_CONFIG_BYTES`` (a committed
    ``pyproject.toml -> /dev/zero`` must not eat the memory); raises ``OSError`` otherwise."""
    with open(path, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        data = handle.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise OSError(errno.EFBIG, f"too large (over {MAX_CONFIG_BYTES} bytes)")
    return data


def _settings_table(data: dict[str, Any], path: Path) -> tuple[Any, str]:
    """The trainlint settings in a parsed file, and how to name them in messages."""
    tool = data.get("tool")
    if path.name == "pyproject.toml" or (isinstance(tool, dict) and "trainlint" in tool):
        if tool is None:
            return {}, "[tool.trainlint]"
        if not isinstance(tool, dict):
            raise ConfigError(f"{path}: [tool] must be a table, got {tool!r}")
        return tool.get("trainlint", {}), "[tool.trainlint]"
    return data, path.name


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    return list(value)


def load_config(path: Path | None, data: dict[str, Any] | None = None) -> Config:
    """Read and validate a configuration file (``data``: its contents if already parsed); ``None``
    gives the defaults rooted at the cwd."""
    if path is None:
        return Config()
    table, prefix = _settings_table(_read_toml(path) if data is None else data, path)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {prefix} must be a table, got {table!r}")
    where = f"{path}: {prefix}" if prefix.startswith("[") else str(path)
    unknown = sorted(set(table) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(TOP_KEYS))})")
    cfg = Config(root=path.parent.resolve(), source=path)
    if "select" in table:
        cfg.select = check_selectors(_str_list(table["select"], f"{where} select"), f"{where} select")
    if "ignore" in table:
        cfg.ignore = check_selectors(_str_list(table["ignore"], f"{where} ignore"), f"{where} ignore")
    if "extend-select" in table:
        key = f"{where} extend-select"
        cfg.extend_select = check_selectors(_str_list(table["extend-select"], key), key)
    if "exclude" in table:
        cfg.exclude = _str_list(table["exclude"], f"{where} exclude")
    if "extend-exclude" in table:
        cfg.extend_exclude = _str_list(table["extend-exclude"], f"{where} extend-exclude")
    if "exclude" in table or "extend-exclude" in table:
        alike = cfg.excludes().matcher.too_alike()
        if alike is not None:  # a committed configuration must not make every path check slow
            raise ConfigError(f"{where} exclude patterns: {alike}")
    if "per-file-ignores" in table:
        _set_per_file_ignores(cfg, table["per-file-ignores"], where)
    if "severity" in table:
        _set_severity(cfg, table["severity"], where)
    if "verify" in table:
        vwhere = f"{path}: {prefix[:-1]}.verify]" if prefix.startswith("[") else f"{where} [verify]"
        _set_verify(cfg, table["verify"], where, vwhere)
    return cfg


def _set_per_file_ignores(cfg: Config, pfi: Any, where: str) -> None:
    if not isinstance(pfi, dict):
        raise ConfigError(f"{where} per-file-ignores: expected a table of glob = [ids]")
    for glob, ids in pfi.items():
        key = f"{where} per-file-ignores.{glob!r}"
        cfg.per_file_ignores[glob] = check_selectors(_str_list(ids, key), key)
    alike = cfg.ignore_globs().too_alike()
    if alike is not None:  # each file is matched against every glob
        raise ConfigError(f"{where} per-file-ignores: {alike}")


def _set_severity(cfg: Config, sev: Any, where: str) -> None:
    if not isinstance(sev, dict):
        raise ConfigError(f"{where} severity: expected a table of rule id = severity")
    for rule_id, level in sev.items():
        if rule_id.upper() not in rule_ids():
            raise ConfigError(
                f"{where} severity: unknown rule id {rule_id!r} (a full id such as TL101; "
                "see `trainlint --list-rules`)"
            )
        try:
            cfg.severity[rule_id.upper()] = Severity(level)
        except ValueError:
            raise ConfigError(
                f"{where} severity.{rule_id}: expected error, warning or info, got {level!r}"
            ) from None


def _set_verify(cfg: Config, verify: Any, where: str, vwhere: str) -> None:
    if not isinstance(verify, dict):
        raise ConfigError(f"{where} verify: expected a table, got {verify!r}")
    unknown = sorted(set(verify) - VERIFY_KEYS)
    if unknown:
        raise ConfigError(
            f"{vwhere}: unknown key {unknown[0]!r} (known keys: {', '.join(sorted(VERIFY_KEYS))})"
        )
    if "device" in verify:
        device = verify["device"]
        if not isinstance(device, str) or device not in DEVICES:
            raise ConfigError(f"{vwhere} device: expected one of {', '.join(DEVICES)}, got {device!r}")
        cfg.verify_device = device
    if "timeout" in verify:
        timeout = verify["timeout"]
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ConfigError(f"{vwhere} timeout: expected a positive number of seconds, got {timeout!r}")
        cfg.verify_timeout = float(timeout)


def ignored_for_file(cfg: Config, rel_path: str) -> list[str]:
    """Rule selectors that ``per-file-ignores`` turns off for a path relative to the config root: those
    of each glob that matches the path or its file name (as ``fnmatch.fnmatch`` matches)."""
    if not cfg.per_file_ignores:
        return []
    globs = cfg.ignore_globs()
    name = rel_path.rsplit("/", 1)[-1]
    matched = {*globs.matching(rel_path), *globs.matching(name)}
    return [i for glob in matched for i in cfg.per_file_ignores[glob]]


class ConfigResolver:
    """The configuration of each file, as Ruff finds it: the closest ``trainlint.toml`` or
    ``pyproject.toml`` with ``[tool.trainlint]`` above the file, or the one ``--config`` pins. Files and
    folders are looked up once each: a run over a big tree reads each configuration file once."""

    def __init__(self, pinned: Path | None = None) -> None:
        self._pinned = load_config(pinned) if pinned is not None else None
        self._by_folder: dict[Path, Config] = {}
        self._by_source: dict[Path | None, Config] = {}
        self._found: dict[Path, Path | None] = {}
        self._parsed: dict[Path, dict[str, Any]] = {}

    def for_folder(self, folder: Path) -> Config:
        if self._pinned is not None:
            return self._pinned
        folder = folder.absolute()
        config = self._by_folder.get(folder)
        if config is None:
            source = find_config(folder, self._found, self._parsed)
            config = self._by_source.get(source)
            if config is None:
                data = self._parsed.get(source) if source is not None else None
                config = self._by_source[source] = load_config(source, data)
            self._by_folder[folder] = config
        return config

    def for_path(self, path: Path) -> Config:
        """The configuration of a file (its folder's) or of a folder itself."""
        path = path.absolute()
        return self.for_folder(path if path.is_dir() else path.parent)


def rule_ids_for_file(config: Config, base: list[str], display: str) -> tuple[str, ...]:
    """The rule ids of ``base`` that ``per-file-ignores`` leaves on for the file shown as ``display``."""
    if not config.per_file_ignores:
        return tuple(base)
    ignored = ignored_for_file(config, _relative_to_root(config, display))
    return tuple(i for i in base if not any(i.startswith(p) for p in ignored))


def _relative_to_root(config: Config, display: str) -> str:
    for resolve in (os.path.abspath, lambda d: physical_path(d, os.getcwd())):
        try:
            return Path(resolve(display)).relative_to(config.root).as_posix()
        except ValueError:
            continue
    return display
