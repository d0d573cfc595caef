"""A committed configuration with a huge list of exclude patterns: the patterns still mean what
``fnmatch`` says, the pyproject.toml holding them is parsed once per run rather than once per folder,
and lists that no index could make cheap are a configuration error. (What they cost: bench/excludes.py.)"""

from __future__ import annotations

import fnmatch
import json
import random
from pathlib import Path

import pytest

import trainlint.config
from trainlint.cli import main

BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"


def reference(rel: str, patterns: list[str]) -> bool:
    """The documented meaning, one pattern at a time: the path or a folder above it matches, or a
    pattern without ``/`` matches one part."""
    for pattern in patterns:
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(rel, pattern + "/*"):
            return True
        if "/" not in pattern and any(fnmatch.fnmatchcase(part, pattern) for part in rel.split("/")):
            return True
    return False


def test_the_indexed_patterns_match_exactly_what_fnmatch_matches() -> None:
    from trainlint.files import ExcludeMatcher

    rng = random.Random(18)
    for _ in range(4000):
        patterns = ["".join(rng.choices("ab/*?[]!.", k=rng.randint(0, 8))) for _ in range(rng.randint(1, 5))]
        rel = "".join(rng.choices("ab/.[]", k=rng.randint(1, 10)))
        assert ExcludeMatcher(patterns).matches(rel) == reference(rel, patterns), (patterns, rel)


def test_one_matcher_asked_many_paths_answers_each_as_fnmatch_does() -> None:
    """A matcher keeps its answers for folders (every file of a folder asks them again): those kept
    answers must be the ones each path would get afresh."""
    from trainlint.files import ExcludeMatcher

    rng = random.Random(20)
    for _ in range(400):
        patterns = ["".join(rng.choices("ab/*?[]!.", k=rng.randint(0, 8))) for _ in range(rng.randint(1, 5))]
        matcher = ExcludeMatcher(patterns)
        for _ in range(30):
            rel = "".join(rng.choices("ab/.[]", k=rng.randint(1, 12)))
            assert matcher.matches(rel) == reference(rel, patterns), (patterns, rel)


def test_the_indexed_per_file_ignores_match_exactly_what_fnmatch_matches() -> None:
    from trainlint.files import GlobSet

    rng = random.Random(19)
    for _ in range(4000):
        patterns = ["".join(rng.choices("ab/*?[]!.", k=rng.randint(0, 8))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choices("ab/.[]", k=rng.randint(1, 10)))
        expected = sorted(p for p in patterns if fnmatch.fnmatchcase(text, p))
        assert sorted(GlobSet(patterns).matching(text)) == expected, (patterns, text)


def _write_config(root: Path, patterns: list[str]) -> None:
    (root / "pyproject.toml").write_text("[tool.trainlint]\nextend-exclude = " + json.dumps(patterns) + "\n")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    monkeypatch.chdir(root)
    return root


def test_fifty_thousand_patterns_exclude_what_they_name_and_nothing_else(repo, capsys) -> None:
    kept = ["src/pkg1/a.py", "src/gen_x/b.py", "src/t3/c.py", "data/s4x/d.py", "e_7.pyc.py"]
    dropped = ["src/g17/a.py", "data/s42/x/b.py", "src/t9_y/c.py", "src/pkg2/m_11.py", "sub/ab9cd/e.py"]
    for name in kept + dropped:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(BAD)
    patterns = []
    for i in range(10_000):  # five kinds: names, paths, prefix and suffix globs, fixed text inside
        patterns += [f"g{i}", f"data/s{i}", f"t{i}_*", f"*_{i}.py", f"*b{i}c*"]
    _write_config(repo, patterns)
    assert main(["--no-cache", "--format", "json", "."]) == 1
    linted = {f["path"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert linted == set(kept)


def test_a_pyproject_is_parsed_once_for_the_whole_tree(repo, monkeypatch, capsys) -> None:
    """Each folder used to parse the project's pyproject.toml again on its way up: with a megabyte of
    patterns that was a minute per run."""
    for i in range(20):
        (repo / f"pkg{i}").mkdir()
        (repo / f"pkg{i}" / "m.py").write_text(BAD)
    _write_config(repo, [f"g{i}" for i in range(100)])
    parsed: list[Path] = []
    read = trainlint.config._read_toml

    def counting(path: Path) -> dict:
        parsed.append(path)
        return read(path)

    monkeypatch.setattr(trainlint.config, "_read_toml", counting)
    assert main(["--no-cache", "-j1", "."]) == 1
    assert "20 files" in capsys.readouterr().out
    assert len(parsed) <= 2  # the run's own lookup, then the resolver's


def test_forty_thousand_per_file_ignores_apply_where_they_match(repo, capsys) -> None:
    for name in ("src/keep.py", "src/gen/a.py", "tests/test_x.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(BAD)
    globs = {f"p{i}/*": ["TL2"] for i in range(40_000)} | {"src/gen/*": ["TL201"], "test_*.py": ["TL2"]}
    table = ", ".join(f"{json.dumps(glob)} = {json.dumps(ids)}" for glob, ids in globs.items())
    (repo / "pyproject.toml").write_text(f"[tool.trainlint]\nper-file-ignores = {{ {table} }}\n")
    assert main(["--no-cache", "--format", "json", "."]) == 1
    assert {f["path"] for f in json.loads(capsys.readouterr().out)["findings"]} == {"src/keep.py"}


@pytest.mark.parametrize(
    ("pattern", "fixed"),
    [("*a*[{i}]", "share no fixed text but 'a'"), ("*[{i}]?", "have no fixed text")],
)
def test_thousands_of_patterns_alike_are_a_config_error(repo, capsys, pattern, fixed) -> None:
    from trainlint.files import MAX_ALIKE_PATTERNS

    (repo / "m.py").write_text(BAD)
    _write_config(repo, [pattern.format(i=i) for i in range(MAX_ALIKE_PATTERNS + 1)])
    assert main(["--no-cache", "."]) == 2
    err = capsys.readouterr().err
    assert "exclude patterns" in err and fixed in err and "internal error" not in err
    _write_config(repo, [pattern.format(i=i) for i in range(MAX_ALIKE_PATTERNS)])
    assert main(["--no-cache", "."]) == 1


def test_thousands_of_per_file_ignores_alike_are_a_config_error(repo, capsys) -> None:
    from trainlint.files import MAX_ALIKE_PATTERNS

    (repo / "m.py").write_text(BAD)
    table = ", ".join(f'"*a*[{i}]" = ["TL2"]' for i in range(MAX_ALIKE_PATTERNS + 1))
    (repo / "pyproject.toml").write_text(f"[tool.trainlint]\nper-file-ignores = {{ {table} }}\n")
    assert main(["--no-cache", "."]) == 2
    err = capsys.readouterr().err
    assert "per-file-ignores" in err and "share no fixed text but 'a'" in err
