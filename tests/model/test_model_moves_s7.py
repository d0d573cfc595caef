"""Facts that moved from rules into the model in session 7, asked directly: which project classes a
module handed to a wrapper may hold (``trainlint.model.module_classes``, TL204's) and how a training
file's helpers, backwards and Accelerate-prepared models are found (``trainlint.model.training``,
TL501's and TL503's)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst

from trainlint.model import FileModel, Scope, Site
from trainlint.model.module_classes import (
    candidate_classes,
    container_modules,
    is_ruled_out,
    ruled_out_classes,
    submodule_classes,
    walked_classes,
)
from trainlint.model.project import Project
from trainlint.model.training import (
    accelerate_prepare_calls,
    backward_sites,
    helper_scopes,
    mentions_sync_control,
    prepared_models,
    sites_doing,
)

BLOCKS = """
from torch import nn

class Plain(nn.Module):
    pass

class Dropped(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)

class DroppedMore(Dropped):
    pass

class Nested(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.stream = Dropped(p)
        self.proj = nn.Linear(4, 4)
"""

WRAP = """
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from blocks import Plain, Dropped, DroppedMore, Nested

class Net(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.blocks = %s

    def wrap(self):
        for i, block in enumerate(self.blocks.values()):
            %s
            block = checkpoint_wrapper(block)
"""


def _project_model(tmp_path: Path, built: str, guard: str) -> FileModel:
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "blocks.py").write_text(BLOCKS)
    main = tmp_path / "main.py"
    text = WRAP % (built, guard)
    main.write_text(text)
    model = FileModel.from_source(text, path=str(main))
    model.project = Project.for_file(str(main), text)
    assert model.project is not None
    return model


def _wrapper_site(model: FileModel) -> tuple[Site, cst.BaseExpression]:
    (site,) = [s for s in model.calls if model.code(s.node.func) == "checkpoint_wrapper"]  # type: ignore[attr-defined]
    return site, site.node.args[0].value  # type: ignore[attr-defined]


def _names(facts: object) -> list[str]:
    return sorted(f.name for f in facts)  # type: ignore[attr-defined]


def test_a_class_ruled_out_by_isinstance_raise_and_its_subclass(tmp_path: Path) -> None:
    guard = "if isinstance(block, Dropped):\n                raise ValueError('no')"
    model = _project_model(tmp_path, "cfg.build_blocks()", guard)
    site, passed = _wrapper_site(model)
    ruled_out = ruled_out_classes(model, passed, site)
    assert _names(ruled_out) == ["Dropped"]
    imported = {f.name: f for f in candidate_classes(model, passed, site)}
    # the blocks' classes are not known: every imported class but Dropped and its subclass
    assert sorted(imported) == ["Nested", "Plain"]
    assert not is_ruled_out(model, imported["Plain"], ruled_out)
    # the one submodule of another project class (nn.Linear is none)
    assert [(label, f.name) for label, f in submodule_classes(model, imported["Nested"])] == [
        ("stream", "Dropped")
    ]


def test_an_isinstance_test_that_does_not_raise_rules_nothing_out(tmp_path: Path) -> None:
    guard = "if isinstance(block, Dropped):\n                print('dropped')"
    model = _project_model(tmp_path, "cfg.build_blocks()", guard)
    site, passed = _wrapper_site(model)
    assert ruled_out_classes(model, passed, site) == []
    assert _names(candidate_classes(model, passed, site)) == ["Dropped", "DroppedMore", "Nested", "Plain"]


def test_the_classes_a_looped_over_container_is_built_from(tmp_path: Path) -> None:
    model = _project_model(tmp_path, "nn.ModuleDict({str(i): DroppedMore(0.1) for i in range(4)})", "pass")
    site, passed = _wrapper_site(model)
    assert _names(walked_classes(model, passed, site.scope)) == ["DroppedMore"]
    # known classes win over the imported ones
    assert _names(candidate_classes(model, passed, site)) == ["DroppedMore"]


LAYERS = """
import torch
from torch import nn

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        layers = [nn.Linear(4, 4)]
        layers += [nn.ReLU()]
        layers.append(nn.Dropout(0.1))
        self.mlp = nn.Sequential(*layers)
        layers.append(nn.GELU())
        self.listed = nn.ModuleList([nn.LayerNorm(4), nn.Dropout1d(0.2)])
        self.plain = nn.Linear(4, 4)

    def forward(self, x):
        return self.mlp(x) + self.listed[0](x) + self.plain(x)
"""


def _scope(model: FileModel, name: str) -> Scope:
    (scope,) = [s for s in model.scopes if s.name == name]
    return scope


def _attr(model: FileModel, code: str) -> cst.BaseExpression:
    (node,) = [s.node.func for s in model.calls if model.code(s.node.func) == code]  # type: ignore[attr-defined]
    return node


def test_a_containers_element_classes() -> None:
    model = FileModel.from_source(textwrap.dedent(LAYERS))
    forward = _scope(model, "forward")
    # the list as it stood when the container was built: literal, `+=` and `append` (not the later one)
    assert list(container_modules(model, _attr(model, "self.mlp"), forward)) == [
        "torch.nn.Linear",
        "torch.nn.ReLU",
        "torch.nn.Dropout",
    ]
    listed = cst.parse_expression("self.listed")
    assert list(container_modules(model, listed, forward)) == ["torch.nn.LayerNorm", "torch.nn.Dropout1d"]
    assert list(container_modules(model, _attr(model, "self.plain"), forward)) == []


PREPARED = """
from accelerate import Accelerator

class Trainer:
    def setup(self, net, opt, loader):
        self.accelerator = Accelerator()
        prepared = self.accelerator.prepare(net, opt)
        self.model = prepared[0]
        model, optimizer = accelerator.prepare(net, opt)
        data = loader.prepare(net)
"""


def test_accelerate_prepared_models() -> None:
    model = FileModel.from_source(textwrap.dedent(PREPARED))
    calls = [model.code(s.node) for s in accelerate_prepare_calls(model)]  # type: ignore[arg-type]
    assert calls == ["self.accelerator.prepare(net, opt)", "accelerator.prepare(net, opt)"]
    assert prepared_models(model) == {"prepared", "self.model", "model", "optimizer"}
    # Accelerate set up for DeepSpeed: its engine owns the accumulation, nothing counts as prepared
    deepspeed = PREPARED.replace("Accelerator()", "Accelerator(deepspeed_plugin=plugin)")
    assert prepared_models(FileModel.from_source(textwrap.dedent(deepspeed))) == set()


TRAINER = """
class Trainer:
    def backward_step(self, loss):
        loss.backward()

    def optimizer_step(self):
        self.optimizer.step()

    def train(self, loader):
        for i, batch in enumerate(loader):
            self.backward_step(self.model(batch))
            if (i + 1) % 4 == 0:
                self.optimizer_step()
            self.log(i)

    def log(self, i):
        print(i)

    def synced(self, loader):
        with self.model.no_sync():
            self.backward_step(self.model(loader))
"""


def test_a_helpers_backward_and_step_are_found() -> None:
    model = FileModel.from_source(textwrap.dedent(TRAINER))
    train = _scope(model, "train")
    assert [s.name for s in helper_scopes(model, train)] == ["backward_step", "optimizer_step", "log"]
    doing = sites_doing(model, train, "backward", "scaled_backward")
    assert [model.code(s.node) for s in doing] == ["self.backward_step(self.model(batch))"]
    steps = sites_doing(model, train, "step")
    assert [model.code(s.node) for s in steps] == ["self.optimizer_step()"]
    found = sorted((s.scope.name, model.code(s.node)) for s in backward_sites(model))
    assert found == [
        ("backward_step", "loss.backward()"),
        ("synced", "self.backward_step(self.model(loader))"),
        ("train", "self.backward_step(self.model(batch))"),
    ]
    assert mentions_sync_control(_scope(model, "synced"))
    assert not mentions_sync_control(train)
