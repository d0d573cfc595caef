"""``--verify`` details of ``not-executable`` name the one thing the probe could not build: the synthetic
sizes that did not fit the code (before the error they caused), and the user's thing a stand-in stood
for (never a class of the harness)."""

from __future__ import annotations

import pytest
from conftest import Snippets

from trainlint.model import FileModel
from trainlint.rule import Finding, Related, Severity
from trainlint.verify import torch_available
from trainlint.verify.context import ProbeContext
from trainlint.verify.source import NotExecutable, call_site_at

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL201",)
VERIFY_FIXTURES = ()
VERIFY_TIMEOUT = 60

SNIPPETS = Snippets()

# a reshape that fits no synthetic input: nothing the probe chose by name is involved
SNIPPETS.add(
    "tl201_no_shape_fits",
    "TL201",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(7, 7)

        def forward(self, x):
            return checkpoint(self.proj, x.view(-1, 7))
    """,
)
# windows of 7 over a feature map whose (H, W) the file does not give: the probe chooses it by name
SNIPPETS.add(
    "tl201_chosen_size_does_not_fit",
    "TL201",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Net(nn.Module):
        def __init__(self, dim, input_resolution):
            super().__init__()
            self.input_resolution = input_resolution
            self.proj = nn.Linear(dim, dim)

        def forward(self, x):
            H, W = self.input_resolution
            x = x.view(-1, H // 7, 7, W // 7, 7, x.shape[-1])
            return checkpoint(self.proj, x)
    """,
)


def _detail(verified, name: str) -> str:
    verify = verified.one(name).verify
    assert verify["status"] == "not-executable", verify
    return verify["detail"]


def test_a_shape_error_leads_with_the_synthetic_input_and_the_shapes_tried(verified) -> None:
    detail = _detail(verified, "tl201_no_shape_fits")
    assert detail.startswith("no shape tried for the synthetic input `x` fits the code: ("), detail
    # every shape tried is named, each once, and the error comes after them, as raised
    lead, _, error = detail.partition("; the first raises ")
    shapes = lead.split(": ", 1)[1].split(", (")
    assert len(shapes) >= 3 and len(set(shapes)) == len(shapes), lead
    assert error.startswith("RuntimeError: shape '[-1, 7]' is invalid for input of size"), detail


def test_a_shape_error_leads_with_the_size_chosen_by_name(verified) -> None:
    detail = _detail(verified, "tl201_chosen_size_does_not_fit")
    # not "uses `self.input_resolution`" (a stand-in built from use): the size chosen did not fit
    assert detail.startswith("no size tried for `input_resolution` fits the code: `input_resolution` = ("), (
        detail
    )
    assert "chosen by name or use, with the synthetic input `x` shaped (" in detail
    assert "the first raises RuntimeError: shape '[-1, " in detail


@pytest.fixture(scope="module")
def child():
    import torch

    from trainlint.verify.child import capture, sandbox, standins

    yield torch, sandbox, standins
    capture.stood_in.clear()  # what the stand-ins used here recorded: no later detail names them
    capture.sized_by_pattern.clear()


def test_a_missing_name_used_as_a_module_is_named_as_the_users_import(child) -> None:
    torch, sandbox, standins = child
    norm_act = standins.missing("NormAct", "timm.layers.NormAct")
    with pytest.raises(TypeError) as raised:
        torch.nn.ModuleList([norm_act(8)])  # what a constructor of the missing library returned
    detail = sandbox.describe_exception(raised.value)
    assert detail.startswith(
        "`timm.layers.NormAct(...)` (a stand-in for what cannot be imported: `timm`, not installed here) "
        "was used as a module: TypeError: "
    ), detail
    assert "Missing" not in detail and sandbox.__package__ not in detail


def test_a_harness_object_missing_an_attribute_is_named_as_the_program_names_it(child) -> None:
    _, sandbox, _ = child
    program = """
class Trainer:
    def __init__(self):
        self.accelerator = __tl__.Backward()

    def step(self):
        return self.accelerator.get_grad_buffer()


Trainer().step()
"""
    with pytest.raises(sandbox.VariantFailed) as raised:
        sandbox.exec_program(program, "reference")
    detail = str(raised.value)
    assert detail.startswith("`self.accelerator` (a stand-in the probe built"), detail
    assert "`get_grad_buffer`" in detail and "Backward" not in detail


def test_an_error_that_names_no_harness_class_is_kept_as_raised(child) -> None:
    torch, sandbox, _ = child
    with pytest.raises(RuntimeError) as raised:
        torch.zeros(6).view(-1, 4)
    assert sandbox.describe_exception(raised.value) == (
        "RuntimeError: shape '[-1, 4]' is invalid for input of size 6"
    )


# -- the two "not-executable" details that named the harness's own terms (session 5's real-code table)

WRAPPED = (
    "import torch\n\ndef wrap(block):\n    return ptd_checkpoint_wrapper(block, preserve_rng_state=False)\n"
)


def _finding(path: str, line: int, column: int, end_line: int, end_column: int, related=()) -> Finding:
    return Finding("TL204", "x", Severity.WARNING, path, line, column, end_line, end_column, "m", related)


def test_a_flagged_call_the_probe_does_not_run_is_named() -> None:
    model = FileModel.from_source(WRAPPED, "m.py")
    # the finding spans the whole wrapper call (line 4, columns 12 to 67); the probe accepts no call
    finding = _finding("m.py", 4, 12, 4, 12 + len("ptd_checkpoint_wrapper(block, preserve_rng_state=False)"))
    with pytest.raises(NotExecutable) as caught:
        call_site_at(model, finding, accept=lambda site: False)
    assert (
        str(caught.value)
        == "the flagged call `ptd_checkpoint_wrapper(...)` at line 4 is not a call this probe runs"
    )


def test_a_related_location_in_another_file_is_named_with_its_place(tmp_path) -> None:
    model = FileModel.from_source(WRAPPED, str(tmp_path / "m.py"))
    elsewhere = Related(str(tmp_path / "engine.py"), 425, 9, "scaled here", "scaled-backward")
    finding = _finding(str(tmp_path / "m.py"), 4, 12, 4, 20, (elsewhere,))
    context = ProbeContext(finding, model, None)
    with pytest.raises(NotExecutable) as caught:
        context.related("scaled-backward")
    assert "scaled backward this finding rests on is in another file" in str(caught.value)
    assert f"({tmp_path / 'engine.py'}, line 425)" in str(caught.value)
