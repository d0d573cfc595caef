"""The layout README's "How the code is laid out" promises, checked on the source tree: one rule per
file, what a rule may import, a model layer that imports nothing above it, verify that uses only public
rule names, and modules and functions short enough to read."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainlint.rule import Rule, registry

ROOT = Path(__file__).resolve().parent.parent
LINT, RULES = ROOT / "lint", ROOT / "rules"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80
GENERATED = frozenset({"gates_data.py"})


def _sources() -> list[Path]:
    return sorted(p for folder in (LINT, RULES) for p in folder.rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) for every import in the file, relative imports made absolute."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                package = _module_name(path).split(".")
                base = package[: len(package) - node.level]
                module = ".".join(base + ([module] if module else []))
            out.append((module, tuple(alias.name for alias in node.names)))
    return out


def _module_name(path: Path) -> str:
    if path.is_relative_to(RULES):
        parts = ["trainlint", "rules", *path.relative_to(RULES).with_suffix("").parts]
    else:
        parts = ["trainlint", *path.relative_to(LINT).with_suffix("").parts]
    return ".".join(parts)


def _trainlint_imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    return [(m, names) for m, names in _imports(path) if m == "trainlint" or m.startswith("trainlint.")]


TESTS = sorted((ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", _sources() + TESTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_are_short(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    # generated data (one record per rule, written by ``python -m trainlint.gates``) grows with the rules
    assert len(text.splitlines()) <= MAX_MODULE_LINES or path.name in GENERATED
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long


RULE_FILES = sorted(p for p in RULES.rglob("*.py") if p.name != "__init__.py")


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_rule_imports_only_the_api_the_model_and_its_family(path: Path) -> None:
    family = path.parent.relative_to(RULES).parts
    own = "trainlint.rules." + ".".join(family) + "." if family else "trainlint.rules."
    for module, _names in _trainlint_imports(path):
        allowed = (
            module == "trainlint.api"
            or module == "trainlint.model"
            or module.startswith("trainlint.model.")
            or (module.startswith(own) and module[len(own) :].startswith("_"))
        )
        assert allowed, f"{path.name} imports {module}"


def test_each_rule_file_holds_one_rule_named_after_it() -> None:
    files: dict[Path, list[type[Rule]]] = {}
    for rule in registry():
        module = __import__(rule.__module__, fromlist=["_"])
        files.setdefault(Path(module.__file__).resolve(), []).append(rule)
    for path, rules in files.items():
        assert len(rules) == 1, f"{path.name}: {[r.id for r in rules]}"
        rule = rules[0]
        assert path.name == f"{rule.id.lower()}_{rule.name.replace('-', '_')}.py"


@pytest.mark.parametrize("path", sorted((LINT / "model").rglob("*.py")), ids=lambda p: p.name)
def test_the_model_imports_nothing_above_it(path: Path) -> None:
    for module, _names in _trainlint_imports(path):
        assert module.startswith("trainlint.model"), f"{path.name} imports {module}"


@pytest.mark.parametrize("path", sorted((LINT / "verify").rglob("*.py")), ids=lambda p: p.name)
def test_verify_uses_only_public_rule_names(path: Path) -> None:
    for module, names in _trainlint_imports(path):
        if not module.startswith("trainlint.rules"):
            continue
        assert not any(part.startswith("_") for part in module.split(".")), f"{path.name}: {module}"
        assert not [n for n in names if n.startswith("_")], f"{path.name}: {module} {names}"


def test_the_layout_checks_see_the_whole_tree() -> None:
    """The checks above must not pass by looking at nothing."""
    assert len([p for p in RULE_FILES if p.name.startswith("tl")]) == len(list(registry()))
    assert (LINT / "model").is_dir() and len(list((LINT / "model").glob("*.py"))) >= 5
    assert _imports(RULES / "amp" / "tl101_clip_before_unscale.py")


def test_every_package_folder_is_installed() -> None:
    """pyproject lists packages by hand (``package-dir`` maps two folders): a new folder left out would
    work in an editable checkout and be missing from a real install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        _module_name(init).removesuffix(".__init__")
        for folder in (LINT, RULES)
        for init in folder.rglob("__init__.py")
    }
    assert found == listed
