"""A project's declared version requirements for one package, read from its files (never by importing
the package): ``requirements*.txt`` (and ``requirements/*.txt``, with ``-r`` includes inside the
project), ``pyproject.toml`` (``[project]`` dependencies and optional dependencies, Poetry's
dependencies), ``setup.cfg`` (``install_requires``, ``extras_require``) and ``setup.py``
(``install_requires=``/``extras_require=`` given as literal lists, or names bound to them at module
level). The project is the folder the index finds (``project_root``).

A rule asks ``lowest_allowed_at_least(path, package, version)``: whether every requirement the project
declares for ``package`` excludes the releases before ``version``. A missing requirement, a bare name,
a URL or a specifier without a lower bound allows them, and so does a pre-release lower bound below
the release (``>=5.0.0rc1`` admits ``5.0.0rc1``).
"""

from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainlint.model.stamps import project_root

_MAX_BYTES = 1_000_000  # a requirements file larger than this is not read
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*)$")
_CLAUSE = re.compile(r"^\s*(===|==|~=|>=|<=|!=|>|<|\^|~)?\s*([0-9][0-9A-Za-z.*+!-]*)\s*$")
_RELEASE = re.compile(r"^(?:\d+!)?(\d+(?:\.\d+)*)(\.\*)?(.*)$")


@dataclass(frozen=True)
class Pin:
    """One requirement of the package: the file it is in and its specifier text (``>=5.0``, ``""``)."""

    file: str
    spec: str


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> tuple[tuple[int, ...], bool] | None:
    """(release numbers, final) of a version: ``5.0.0rc1`` -> ((5, 0, 0), False); ``5.*`` -> ((5,), True)."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    numbers = tuple(int(n) for n in match.group(1).split("."))
    tail = match.group(3).lstrip(".-_").lower()
    final = not tail or tail.startswith(("post", "+"))
    return numbers, final


def _at_least(version: str, bound: tuple[int, ...]) -> bool:
    """The version is ``bound`` or a later final release (a pre-release of ``bound`` is earlier)."""
    parsed = _release(version)
    if parsed is None:
        return False
    numbers, final = parsed
    width = max(len(numbers), len(bound))
    padded, wanted = numbers + (0,) * (width - len(numbers)), bound + (0,) * (width - len(bound))
    return padded > wanted or (padded == wanted and final)


def excludes_before(spec: str, bound: tuple[int, ...]) -> bool:
    """Whether the specifier admits no release before ``bound``: one of its clauses is a lower bound
    (``>=``, ``>``, ``==``, ``~=``, Poetry's ``^``/``~``) at or above it."""
    spec = spec.split(";", 1)[0].strip()
    if not spec or spec.startswith("@") or "@" in spec:
        return False
    for clause in spec.replace("(", "").replace(")", "").split(","):
        match = _CLAUSE.match(clause)
        if match is None:
            continue
        operator, version = match.group(1) or "==", match.group(2)
        if operator in ("<", "<=", "!="):
            continue
        if (
            _at_least(version.replace(".*", ""), bound)
            if operator in ("==", "===")
            else _at_least(version, bound)
        ):
            return True
    return False


def _requirement(line: str, package: str) -> str | None:
    """The specifier of a PEP 508 requirement of ``package`` (``""`` for a bare name), else None."""
    line = line.split("#", 1)[0].strip()
    match = _NAME.match(line)
    if match is None or _normal(match.group(1)) != package:
        return None
    return match.group(3).strip()


def _read(path: Path) -> str | None:
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > _MAX_BYTES:
            return None
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _from_requirements(path: Path, root: Path, package: str, seen: set[Path]) -> list[Pin]:
    if path in seen or len(seen) > 32:
        return []
    seen.add(path)
    text = _read(path)
    if text is None:
        return []
    out: list[Pin] = []
    for raw in text.splitlines():
        line = raw.strip()
        include = re.match(r"^(?:-r|--requirement)[\s=]+(\S+)", line)
        if include:
            target = (path.parent / include.group(1)).resolve()
            if target.is_relative_to(root.resolve()):  # an include outside the project is not read
                out.extend(_from_requirements(target, root, package, seen))
            continue
        spec = _requirement(line, package)
        if spec is not None:
            out.append(Pin(str(path.relative_to(root)) if path.is_relative_to(root) else path.name, spec))
    return out


def _table(data: object, *keys: str) -> dict:
    """``data[k1][k2]...`` where each level is a table, else an empty one."""
    for key in keys:
        data = data.get(key) if isinstance(data, dict) else None
    return data if isinstance(data, dict) else {}


def _from_pyproject(root: Path, package: str) -> list[Pin]:
    text = _read(root / "pyproject.toml")
    if text is None:
        return []
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):
        return []
    project = _table(data, "project")
    lines = project.get("dependencies")
    lines = list(lines) if isinstance(lines, list) else []
    for extra in _table(project, "optional-dependencies").values():
        lines.extend(extra if isinstance(extra, list) else [])
    out = [
        Pin("pyproject.toml", spec)
        for line in lines
        if isinstance(line, str) and (spec := _requirement(line, package)) is not None
    ]
    poetry = _table(data, "tool", "poetry")
    groups = [_table(g, "dependencies") for g in _table(poetry, "group").values()]
    for table in (_table(poetry, "dependencies"), *groups):
        for name, value in table.items():
            if _normal(name) == package:
                spec = value.get("version", "") if isinstance(value, dict) else value
                out.append(Pin("pyproject.toml", "" if spec in ("*", None) else str(spec)))
    return out


def _from_setup_cfg(root: Path, package: str) -> list[Pin]:
    text = _read(root / "setup.cfg")
    if text is None:
        return []
    import configparser  # here, not at the top: only a project with a setup.cfg needs it

    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error:
        return []
    values = [parser.get("options", "install_requires", fallback="")]
    if parser.has_section("options.extras_require"):
        values.extend(parser["options.extras_require"].values())
    return [
        Pin("setup.cfg", spec)
        for value in values
        for line in value.splitlines()
        if (spec := _requirement(line, package)) is not None
    ]


def _from_setup_py(root: Path, package: str) -> list[Pin]:
    text = _read(root / "setup.py")
    if text is None:
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    bound = {
        t.id: node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    lists: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("install_requires", "extras_require"):
                    value = bound.get(kw.value.id, kw.value) if isinstance(kw.value, ast.Name) else kw.value
                    lists.extend(value.values if isinstance(value, ast.Dict) else [value])
    out: list[Pin] = []
    for value in lists:
        value = bound.get(value.id, value) if isinstance(value, ast.Name) else value
        for element in getattr(value, "elts", []):
            if isinstance(element, ast.Constant) and isinstance(element.value, str):
                spec = _requirement(element.value, package)
                if spec is not None:
                    out.append(Pin("setup.py", spec))
    return out


def _candidates(root: Path) -> list[Path]:
    found = sorted(root.glob("requirements*.txt")) + sorted((root / "requirements").glob("*.txt"))
    return found + [root / n for n in ("pyproject.toml", "setup.cfg", "setup.py")]


def _stamps(root: Path) -> tuple[tuple[str, int, int], ...]:
    out = []
    for path in _candidates(root):
        try:
            info = os.stat(path)
        except OSError:
            continue
        out.append((str(path), info.st_mtime_ns, info.st_size))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _pins(root: str, package: str, stamps: tuple[tuple[str, int, int], ...]) -> tuple[Pin, ...]:
    del stamps  # part of the cache key only: an edited file is read again
    base = Path(root)
    seen: set[Path] = set()
    out: list[Pin] = []
    for path in _candidates(base):
        if path.name.endswith(".txt"):
            out.extend(_from_requirements(path, base, package, seen))
    out.extend(_from_pyproject(base, package))
    out.extend(_from_setup_cfg(base, package))
    out.extend(_from_setup_py(base, package))
    return tuple(out)


def project_pins(path: str, package: str) -> tuple[Pin, ...]:
    """Every requirement of ``package`` the project of the file at ``path`` declares (empty for a
    file outside a project, or a path that is not a file on disk)."""
    root = project_root(path)
    if root is None:
        return ()
    return _pins(str(root), _normal(package), _stamps(root))


def pins_stamp(path: str) -> str:
    """The stamps of the files pins are read from, for a result cache key (empty outside a project)."""
    root = project_root(path)
    return ";".join(f"{p},{m},{s}" for p, m, s in _stamps(root)) if root is not None else ""


def lowest_allowed_at_least(
    path: str, package: str, version: tuple[int, ...]
) -> tuple[bool, tuple[Pin, ...]]:
    """(whether the project declares ``package`` and every declaration excludes the releases before
    ``version``, the declarations found)."""
    pins = project_pins(path, package)
    return bool(pins) and all(excludes_before(p.spec, version) for p in pins), pins
