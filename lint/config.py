"""Configuration: ``[tool.trainlint]`` in the nearest pyproject.toml, or a trainlint.toml beside it.

Unknown keys, unknown rule ids and values of the wrong type are errors (``ConfigError``), never ignored.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainlint.rule import Severity, registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


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
    ids = registry().ids()
    out = []
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected rule ids as strings, got {value!r}")
        v = value.strip().upper()
        if v != "ALL" and not any(i.startswith(v) for i in ids):
            raise ConfigError(f"{where}: unknown rule id or prefix {value!r} (see `trainlint --list-rules`)")
        out.append(v)
    return out


def select_rules(select: list[str] | None, extend_select: Iterable[str], ignore: Iterable[str]) -> list[str]:
    """Rule ids enabled by these selectors (no ``select`` means every rule)."""
    ids = registry().ids()
    chosen = set(ids) if select is None or "ALL" in select else {i for i in ids if matches(i, select)}
    extra = list(extend_select)
    chosen |= set(ids) if "ALL" in extra else {i for i in ids if matches(i, extra)}
    ignored = list(ignore)
    return sorted(i for i in chosen if not matches(i, ignored))


def find_config(start: Path) -> Path | None:
    """The nearest trainlint.toml, or pyproject.toml holding ``[tool.trainlint]``, at or above start."""
    start = start.resolve()
    for folder in (start, *start.parents):
        candidate = folder / "trainlint.toml"
        if candidate.is_file():
            return candidate
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
                raise ConfigError(f"{candidate}: cannot parse TOML: {exc}") from None
            if "trainlint" in data.get("tool", {}):
                return candidate
    return None


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
    return list(value)


def load_config(path: Path | None) -> Config:
    """Read and validate a configuration file; ``None`` gives the defaults rooted at the cwd."""
    if path is None:
        return Config()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: cannot parse TOML: {exc}") from None
    if path.name == "pyproject.toml":
        table = data.get("tool", {}).get("trainlint", {})
        prefix = "[tool.trainlint]"
    else:
        table = data.get("tool", {}).get("trainlint", data)
        prefix = path.name
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {prefix} must be a table")
    where = f"{path}: {prefix}"
    unknown = sorted(set(table) - TOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(TOP_KEYS))})")
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
    if "per-file-ignores" in table:
        pfi = table["per-file-ignores"]
        if not isinstance(pfi, dict):
            raise ConfigError(f"{where} per-file-ignores: expected a table of glob = [ids]")
        for glob, ids in pfi.items():
            key = f"{where} per-file-ignores.{glob!r}"
            cfg.per_file_ignores[glob] = check_selectors(_str_list(ids, key), key)
    if "severity" in table:
        sev = table["severity"]
        if not isinstance(sev, dict):
            raise ConfigError(f"{where} severity: expected a table of rule id = severity")
        for rule_id, level in sev.items():
            if registry().get(rule_id) is None:
                raise ConfigError(f"{where} severity: unknown rule id {rule_id!r}")
            try:
                cfg.severity[rule_id.upper()] = Severity(level)
            except ValueError:
                raise ConfigError(
                    f"{where} severity.{rule_id}: expected error, warning or info, got {level!r}"
                ) from None
    if "verify" in table:
        verify = table["verify"]
        if not isinstance(verify, dict):
            raise ConfigError(f"{where} verify: expected a table")
        unknown = sorted(set(verify) - VERIFY_KEYS)
        if unknown:
            raise ConfigError(f"{where}.verify: unknown key {unknown[0]!r} (known: device, timeout)")
        if "device" in verify:
            if verify["device"] not in DEVICES:
                raise ConfigError(f"{where}.verify device: expected one of {', '.join(DEVICES)}")
            cfg.verify_device = verify["device"]
        if "timeout" in verify:
            timeout = verify["timeout"]
            if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
                raise ConfigError(f"{where}.verify timeout: expected a positive number of seconds")
            cfg.verify_timeout = float(timeout)
    return cfg


def ignored_for_file(cfg: Config, rel_path: str) -> list[str]:
    """Rule selectors that ``per-file-ignores`` turns off for a path relative to the config root."""
    out: list[str] = []
    name = rel_path.rsplit("/", 1)[-1]
    for glob, ids in cfg.per_file_ignores.items():
        if fnmatch.fnmatch(rel_path, glob) or fnmatch.fnmatch(name, glob):
            out.extend(ids)
    return out
