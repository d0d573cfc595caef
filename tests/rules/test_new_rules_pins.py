"""TL205 reads the project's transformers requirement (transformers 5.0.0 made the non-reentrant
variant the default): every declaration excluding the releases before 5.0.0 -> silent; none, or one
that admits them -> reported, with the boundary and the declaration in the message."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainlint import cli
from trainlint.engine import lint_source

TRAIN = """
from peft import LoraConfig, get_peft_model
model = get_peft_model(model, LoraConfig(r=8))
model.gradient_checkpointing_enable()
"""
ARGS = """
from transformers import TrainingArguments
from peft import LoraConfig
args = TrainingArguments(output_dir="out", gradient_checkpointing=True)
"""


def _project(tmp_path: Path, files: dict[str, str], code: str = TRAIN) -> str:
    (tmp_path / ".git").mkdir(parents=True)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    path = tmp_path / "src" / "train.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(code).lstrip("\n"), encoding="utf-8")
    return str(path)


def _findings(path: str) -> list:
    return lint_source(Path(path).read_text(encoding="utf-8"), path, ["TL205"])


SILENT = {
    "poetry_group": {
        "pyproject.toml": '[tool.poetry.group.train.dependencies]\ntransformers = { version = ">=5.1" }\n'
    },
    "requirements": {"requirements.txt": "torch>=2.1\ntransformers>=5.0.0\npeft\n"},
    "requirements_extras_markers": {
        "requirements-train.txt": "transformers[torch]>=5.1 ; python_version >= '3.10'\n"
    },
    "include": {
        "requirements.txt": "-r requirements/base.txt\n",
        "requirements/base.txt": "transformers~=5.2\n",
    },
    "pyproject": {"pyproject.toml": '[project]\nname = "x"\ndependencies = ["transformers>=5.1,<6"]\n'},
    "poetry": {"pyproject.toml": '[tool.poetry.dependencies]\npython = "^3.10"\ntransformers = "^5.0"\n'},
    "setup_py": {
        "setup.py": 'from setuptools import setup\nREQUIRED = ["transformers==5.3.0"]\nsetup(name="x", install_requires=REQUIRED)\n'
    },
    "setup_cfg": {"setup.cfg": "[options]\ninstall_requires =\n    torch\n    transformers>=5\n"},
    "wildcard": {"requirements.txt": "transformers==5.*\n"},
}
REPORTED = {
    # tables where tables are expected are not: no requirement read, no crash
    "malformed_pyproject": ({"pyproject.toml": 'tool = 3\nproject = "x"\n'}, None),
    "no_requirement": ({"pyproject.toml": '[project]\nname = "x"\ndependencies = ["torch"]\n'}, None),
    "old_pin": ({"requirements.txt": "transformers==4.46.0\n"}, "`transformers==4.46.0` (requirements.txt)"),
    "lower_bound_below": (
        {"pyproject.toml": '[project]\nname = "x"\ndependencies = ["transformers>=4.40"]\n'},
        "`transformers>=4.40` (pyproject.toml)",
    ),
    "bare_name": ({"requirements.txt": "transformers\n"}, "`transformers` (requirements.txt)"),
    "release_candidate": ({"requirements.txt": "transformers>=5.0.0rc1\n"}, "`transformers>=5.0.0rc1`"),
    "upper_bound_only": ({"requirements.txt": "transformers<6\n"}, "`transformers<6`"),
    # every declaration must exclude the old releases
    "one_of_two_allows": (
        {
            "requirements.txt": "transformers>=5.0\n",
            "setup.py": 'setup(install_requires=["transformers>=4.30"])\n',
        },
        "`transformers>=4.30` (setup.py)",
    ),
}


@pytest.mark.parametrize("case", sorted(SILENT))
def test_tl205_silent_where_the_project_requires_transformers_5(tmp_path: Path, case: str) -> None:
    assert _findings(_project(tmp_path, SILENT[case])) == []
    assert _findings(_project(tmp_path / "args", SILENT[case], ARGS)) == []


@pytest.mark.parametrize("case", sorted(REPORTED))
def test_tl205_reported_where_the_project_admits_earlier_releases(tmp_path: Path, case: str) -> None:
    files, shown = REPORTED[case]
    (finding,) = _findings(_project(tmp_path, files))
    assert "before 5.0.0" in finding.message
    if shown is not None:
        assert shown in finding.message
    assert len(_findings(_project(tmp_path / "args", files, ARGS))) == 1


def test_tl205_a_snippet_outside_any_project_is_reported() -> None:
    (finding,) = lint_source(textwrap.dedent(TRAIN), "<stdin>", ["TL205"])
    assert "before 5.0.0" in finding.message


def test_tl205_cached_result_follows_an_edited_requirement(tmp_path: Path, monkeypatch, capsys) -> None:
    path = _project(tmp_path, {"requirements.txt": "transformers==4.46.0\n"})
    monkeypatch.chdir(tmp_path)
    args = [
        "--select",
        "TL205",
        "--format",
        "json",
        "--jobs",
        "1",
        "--cache-dir",
        str(tmp_path / "cache"),
        path,
    ]
    assert cli.run(args) == 1
    capsys.readouterr()
    (tmp_path / "requirements.txt").write_text("transformers>=5.0.0\n", encoding="utf-8")
    assert cli.run(args) == 0
