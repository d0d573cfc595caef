"""The project index: per-file summaries, root discovery, import resolution, the cross-file findings
of the fixture projects (fixtures/project/) when only one file is named, and the result cache
recomputing a finding when the other file's facts change."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from trainlint.cli import run
from trainlint.model.project import Project, dependency_key
from trainlint.model.stamps import find_root
from trainlint.model.summary import summarize

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = ROOT / "fixtures" / "project"


def facts(code: str) -> dict:
    summary = summarize(textwrap.dedent(code))
    assert summary is not None
    return summary


# -- summaries -----------------------------------------------------------------------------------------
def test_summary_finds_the_parameter_converted_through_apply() -> None:
    summary = facts(
        """
        def convert_weights(model, verbose=False):
            def to_fp16(layer):
                layer.weight.data = layer.weight.data.half()
            model.apply(to_fp16)

        def log_model(model):
            model.apply(print)
        """
    )
    functions = summary["functions"]
    assert list(functions["convert_weights"]["half"]) == ["model"]
    assert functions["convert_weights"]["params"] == [["model", None, None], ["verbose", False, None]]
    assert functions["log_model"]["half"] == {}


@pytest.mark.parametrize(
    ("line", "converted"),
    [
        ("m.half()", True),
        ("m.to(torch.float16)", True),
        ("m.to(device, dtype=torch.bfloat16)", True),
        ("m.to(device)", False),
        ("m.float()", False),
    ],
)
def test_summary_conversions(line: str, converted: bool) -> None:
    summary = facts(f"import torch\ndef f(m, device):\n    {line}\n")
    assert ("m" in summary["functions"]["f"]["half"]) is converted


def test_summary_backward_loss_and_factories() -> None:
    summary = facts(
        """
        import torch
        from torch.amp import GradScaler as GS

        class Trainer:
            def step(self, batch, scaler: GS):
                loss = self.model(batch)
                scaler.scale(loss).backward()
                return loss

        def get_grad_scaler():
            scaler = GS("cuda")
            return scaler

        def plain(batch):
            out = model(batch)
            out.backward()
            return batch
        """
    )
    step = summary["functions"]["Trainer.step"]
    assert step["params"][2] == ["scaler", None, "GS"]
    assert step["scaled_backward"][0] == 8
    assert step["returns_loss"][0] == 8
    assert summary["functions"]["get_grad_scaler"]["returns"][0] == "GS"
    assert "returns_loss" not in summary["functions"]["plain"]
    assert summary["imports"]["GS"] == "torch.amp.GradScaler"


def test_summary_returned_16_bit_modules_and_loss_parts() -> None:
    summary = facts(
        """
        def load(path, use_fp16=False):
            net, extra = build(path)
            if use_fp16:
                net.convert_to_fp16()
            return extra, net

        def load_half(path):
            net = build(path)
            net.half()
            return net

        def load_cast(path):
            net = build(path)
            copy = net.half()
            return copy

        def step(self, batch):
            total, parts = self.criterion(batch)
            self.scaler.scale(total).backward()
            return parts

        def step_other(self, batch):
            total, parts = self.criterion(batch)
            other = self.model(batch)
            total.backward()
            return other
        """
    )
    functions = summary["functions"]
    # position 1 of a 2-tuple, converted on line 5 under the `use_fp16` flag
    assert functions["load"]["returns_half"] == [[1, 2, 5, 9, "use_fp16"]]
    assert functions["load_half"]["returns_half"] == [[-1, 1, 10, 5, None]]
    assert "returns_half" not in functions["load_cast"]  # the returned name is not the converted one
    assert functions["step"]["returns_loss"][0] == 20
    assert "returns_loss" not in functions["step_other"]


def test_summary_class_submodules_and_forward_effects() -> None:
    summary = facts(
        """
        from torch import nn
        import torch.distributed as dist
        REGISTRY = {}

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.add_module("norm", nn.BatchNorm2d(8))
                self.frozen = nn.BatchNorm2d(8, track_running_stats=False)

            def forward(self, x):
                REGISTRY["last"] = x
                dist.all_reduce(x)
                return self.norm(x)
        """
    )
    block = summary["classes"]["Block"]
    assert block["submodules"]["norm"][0] == "nn.BatchNorm2d"
    assert block["submodules"]["frozen"][3] is False  # no running statistics
    effects = [what for what, *_ in block["forward_effects"]]
    assert effects == ["writes to `REGISTRY[...]`", "runs the collective `all_reduce`"]


def test_summary_relative_imports_and_unparsable_text() -> None:
    summary = facts("from ..utils import convert as c\nfrom . import helpers\nimport a.b\n")
    assert summary["imports"] == {"c": "..utils.convert", "helpers": ".helpers", "a": "a"}
    assert summarize("def broken(:\n") is None


# -- roots and resolution ------------------------------------------------------------------------------
def test_root_and_src_layout_resolution() -> None:
    project = PROJECTS / "fp16_helper"
    train = project / "src" / "trainer" / "bad_train.py"
    assert find_root(train) == project
    view = Project.for_file(str(train))
    assert view is not None
    relative = view.lookup(".convert.convert_weights")
    absolute = view.lookup("trainer.convert.convert_weights")
    assert relative is not None and absolute is not None
    assert relative.path == absolute.path == str(project / "src" / "trainer" / "convert.py")
    assert view.lookup("torch.nn.Linear") is None


def test_package_reexport_is_followed(tmp_path: Path) -> None:
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from .impl import helper\n")
    (tmp_path / "pkg" / "impl.py").write_text("def helper(m):\n    m.half()\n")
    (tmp_path / "main.py").write_text("from pkg import helper\n")
    view = Project.for_file(str(tmp_path / "main.py"))
    assert view is not None
    found = view.lookup("pkg.helper")
    assert found is not None and found.path.endswith("impl.py") and "m" in found.facts["half"]


def test_no_project_outside_a_root(tmp_path: Path) -> None:
    assert Project.for_file("<stdin>") is None
    assert dependency_key("<string>", "import x\n") == ""


# -- cross-file findings, naming only the one file (as pre-commit does) --------------------------------
@pytest.fixture
def copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A fixture project copied to a temporary folder, linted from there; returns a linting function."""

    def lint(name: str, target: str, *extra: str) -> list[dict]:
        destination = tmp_path / name
        if not destination.exists():
            shutil.copytree(PROJECTS / name, destination)
        monkeypatch.chdir(destination)
        capsys.readouterr()
        code = run(["--format", "json", *(extra or ("--no-cache",)), target])
        assert code in (0, 1)
        return json.loads(capsys.readouterr().out)["findings"]

    return lint


CASES = [
    # (project, the file named, rule, line, the other file of the related location, look-alike)
    ("checkpoint_bn", "bad_model.py", "TL203", 16, "nets/blocks.py", "good_model.py"),
    # the checkpointed layer is a parameter; the file builds its layers from names (`globals()[name]`)
    ("layers_by_name", "bad_tasks.py", "TL203", 26, "nets/modules.py", "good_tasks.py"),
    (
        "fp16_helper",
        "src/trainer/bad_train.py",
        "TL105",
        12,
        "src/trainer/convert.py",
        "src/trainer/good_train.py",
    ),
    # the model's constructor converts a submodule through an imported helper; built by a classmethod,
    # returned by a builder, trained by a project Optimizer subclass built in a function it is passed to
    ("fp16_init", "bad_train.py", "TL105", 18, "nets/model.py", "good_train.py"),
    # a loader that converts the module it returns when its flag is passed on; the look-alike leaves it off
    ("fp16_loader", "bad_train.py", "TL105", 8, "loader.py", "good_train.py"),
    ("amp_updater", "engine/bad_updater.py", "TL101", 9, "engine/trainer.py", "engine/good_updater.py"),
    ("amp_updater", "engine/bad_factory_train.py", "TL102", 15, None, "engine/good_factory_train.py"),
    ("step_helper", "bad_loop.py", "TL302", 11, "steps.py", "good_loop.py"),
    # a method of the same class runs the scaled backward and returns the loss parts
    ("self_step", "bad_solver.py", "TL302", 25, "bad_solver.py", "good_solver.py"),
    # the look-alike detaches the backpropagated entry of the dict before keeping the dict
    ("self_step", "bad_collect.py", "TL302", 8, None, "good_collect.py"),
    ("ckpt_rng", "bad_blocks.py", "TL204", 25, "utils/checkpointing.py", "good_blocks.py"),
    # the dropout is in an nn.Sequential(*layers) handed to a helper by the checkpointed method
    ("ckpt_rng", "bad_sequential.py", "TL204", 24, "utils/checkpointing.py", "good_sequential.py"),
    ("two_method", "bad_trainer.py", "TL301", 15, None, "good_trainer.py"),
]


@pytest.mark.parametrize(("project", "bad", "rule", "line", "other", "good"), CASES)
def test_cross_file_case_reported_alone_and_look_alike_silent(
    copied, project: str, bad: str, rule: str, line: int, other: str | None, good: str
) -> None:
    found = [f for f in copied(project, bad) if f["rule"] == rule]
    assert [(f["path"], f["line"]) for f in found] == [(bad, line)]
    if other is not None:
        assert other in {r["path"] for r in found[0]["related"]}
    assert [f for f in copied(project, good) if f["rule"] == rule] == []


def test_cross_file_finding_needs_the_other_file(copied, tmp_path: Path) -> None:
    """Without the helper's facts (the helper file gone) the same file is silent: the finding rests on
    the index, not on this file's text."""
    assert copied("fp16_helper", "src/trainer/bad_train.py")
    (tmp_path / "fp16_helper" / "src" / "trainer" / "convert.py").unlink()
    assert [f for f in copied("fp16_helper", "src/trainer/bad_train.py") if f["rule"] == "TL105"] == []


# -- the result cache follows the other file's facts -----------------------------------------------------
def test_warm_runs_follow_the_helper_edited_in_another_file(copied, tmp_path: Path) -> None:
    cache = ["--cache-dir", str(tmp_path / "cache")]
    helper = tmp_path / "fp16_helper" / "src" / "trainer" / "convert.py"
    target = "src/trainer/bad_train.py"

    def tl105() -> list[int]:
        return [f["line"] for f in copied("fp16_helper", target, *cache) if f["rule"] == "TL105"]

    assert tl105() == [12]  # cold: the finding, now cached
    original = helper.read_text()
    helper.write_text(original.replace("layer.weight.data.half()", "layer.weight.data.float()"))
    assert tl105() == []  # warm, only the helper changed: recomputed, gone
    helper.write_text(original + "\n# a comment changes the text, not the facts\n")
    assert tl105() == [12]  # warm again: back
    assert list((tmp_path / "cache").rglob("*.json"))


def test_sarif_related_location_carries_the_other_file(tmp_path: Path, monkeypatch, capsys) -> None:
    shutil.copytree(PROJECTS / "checkpoint_bn", tmp_path / "p")
    monkeypatch.chdir(tmp_path / "p")
    assert run(["--no-cache", "--format", "sarif", "bad_model.py"]) == 1
    (result,) = json.loads(capsys.readouterr().out)["runs"][0]["results"]
    (related,) = result["relatedLocations"]
    location = related["physicalLocation"]
    assert location["artifactLocation"]["uri"].endswith("nets/blocks.py")
    assert location["region"]["startLine"] == 10


def test_dependency_key_follows_facts_not_text(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    helper = tmp_path / "helpers.py"
    helper.write_text("def convert(m):\n    m.half()\n")
    main = tmp_path / "main.py"
    text = "from helpers import convert\n"
    main.write_text(text)
    first = dependency_key(str(main), text)
    helper.write_text("def convert(m):\n    m.half()\n# a comment\n")
    assert dependency_key(str(main), text) == first  # same facts: the cached findings still hold
    helper.write_text("# a comment\ndef convert(m):\n    m.half()\n")
    moved = dependency_key(str(main), text)
    assert moved != first  # lines are facts too: a related location points at them
    helper.write_text("def convert(m):\n    m.float()\n")
    assert dependency_key(str(main), text) not in ("", first)


def test_dependency_key_from_the_manifest_in_a_new_process(tmp_path: Path) -> None:
    """A warm run digests an imported file's facts from the journal by its modification time and
    size; a damaged journal line costs nothing but speed; a changed file is digested afresh."""
    from trainlint.model.project import forget_indexes, index_for

    project, store = tmp_path / "p", tmp_path / "store"
    project.mkdir()
    (project / "pyproject.toml").write_text("")
    helper = project / "helpers.py"
    helper.write_text("def convert(m):\n    m.half()\n")
    main = project / "main.py"
    text = "from helpers import convert\n"
    main.write_text(text)
    first = dependency_key(str(main), text, store)
    (journal,) = store.glob("manifest-*.jsonl")
    assert str(helper) in journal.read_text()
    forget_indexes()  # as a new process: only the store is left
    with journal.open("a") as extra:
        extra.write('["garbled\n')
    index = index_for(str(project), str(store))
    assert index.facts_digest(helper) and index._by_stat == {}  # no file was read for it
    assert dependency_key(str(main), text, store) == first
    helper.write_text("def convert(m):\n    m.float()\n")
    assert dependency_key(str(main), text, store) not in ("", first)


def test_a_module_that_links_out_of_the_project_is_not_read(tmp_path: Path) -> None:
    project, outside = tmp_path / "p", tmp_path / "elsewhere"
    (project / "pkg").mkdir(parents=True)
    outside.mkdir()
    (project / "pyproject.toml").write_text("")
    (outside / "helpers.py").write_text("def convert(m):\n    m.half()\n")
    (project / "helpers.py").symlink_to(outside / "helpers.py")
    (project / "pkg" / "inner.py").write_text("")
    (project / "linked").symlink_to(project / "pkg")  # a link that stays inside is followed
    view = Project.for_file(str(project / "pkg" / "inner.py"))
    assert view is not None
    assert view.index.module_file("helpers", project / "main.py") is None
    assert view.index.module_file("linked.inner", project / "main.py") is not None


def test_import_test_tells_project_imports_from_others(tmp_path: Path) -> None:
    (tmp_path / "setup.cfg").write_text("")
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "train.py").write_text("")
    view = Project.for_file(str(tmp_path / "train.py"))
    assert view is not None
    assert view.imports_from_project("import torch\nfrom pkg.x import y\n")
    assert view.imports_from_project("from .sibling import y\n")
    assert not view.imports_from_project("import torch\nfrom torch import nn\n")
