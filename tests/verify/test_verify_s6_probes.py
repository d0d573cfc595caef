"""The programs the TL504 and TL507 probes build, checked without running them (no child, no torch, no
DeepSpeed), so that the shapes that once came back ``not-executable`` while the probe was built stay
covered where DeepSpeed is not installed: the division that is the whole loss expression the loop
builder replaces, a config the file never builds, the division in another function (Megatron), and
the module inside the DistributedDataParallel wrapper called through its ``.module``. What the programs
do when run is checked in ``test_verify_s5_rules.py`` on a real gloo pair (and a real DeepSpeed engine
where it is installed)."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from trainlint.engine import lint_source
from trainlint.model import FileModel
from trainlint.rules.distributed.tl504_deepspeed_double_scaling import DeepspeedDoubleScaling
from trainlint.rules.distributed.tl507_wrapped_model_bypassed import WrappedModelBypassed
from trainlint.verify.harness import build_probe
from trainlint.verify.source import Tree


def _probe(rule: str, code: str) -> dict:
    text = textwrap.dedent(code).lstrip("\n")
    (finding,) = lint_source(text, "example.py", [rule])
    model = FileModel(cst.parse_module(text), "example.py", text)
    return {"finding": finding, "text": text, **build_probe(finding, model, Tree(model))}


def _divisor(text: str, finding) -> str:
    """The text right of the `/` (or `/=`) of the division the rule labelled."""
    (rel,) = [r for r in finding.related if r.label == DeepspeedDoubleScaling.DIVISION]
    assert rel.end_line == rel.line
    division = text.splitlines()[rel.line - 1][rel.column - 1 : rel.end_column - 1]
    return division.rpartition("/")[2].lstrip("= ")


@pytest.mark.parametrize("index", range(len(DeepspeedDoubleScaling.invalid)))
def test_tl504_every_example_runs_its_division_as_written_only(index: int) -> None:
    probe = _probe("TL504", DeepspeedDoubleScaling.invalid[index].code)
    divisor = _divisor(probe["text"], probe["finding"])
    as_written, reference = probe["programs"]["as_written"], probe["programs"]["reference"]
    # in the loop (the set-up may bind the divisor's names in both)
    assert divisor in as_written.partition("for __tl_step__")[2], (divisor, as_written)
    assert divisor not in reference.partition("for __tl_step__")[2], (divisor, reference)
    # the engine both variants run is DeepSpeed's own, configured with the count the notes give
    assert all("__import__('deepspeed').initialize(" in p for p in (as_written, reference))
    assert probe["accumulation"] == 4


def test_tl504_a_config_the_file_never_builds_is_a_dict_named_in_the_notes() -> None:
    (code,) = [e.code for e in DeepspeedDoubleScaling.invalid if "cfg[" in e.code]
    probe = _probe("TL504", code)
    assert "__tl__.Unbound('cfg')" not in probe["programs"]["as_written"]
    assert any(n.startswith("`cfg` is not built in the file") for n in probe["notes"]), probe["notes"]


def test_tl504_the_division_in_another_function_is_applied_before_the_switched_backward() -> None:
    (code,) = [e.code for e in DeepspeedDoubleScaling.invalid if "def forward_step" in e.code]
    probe = _probe("TL504", code)
    as_written = probe["programs"]["as_written"]
    # the DeepSpeed switch is on, and the loss is divided before the backward it selects
    assert "args.deepspeed = True" in as_written
    assert as_written.index("/ (get_num_microbatches())") < as_written.index("model.backward(loss)")
    assert "get_num_microbatches = " in as_written  # bound, not left to fail


@pytest.mark.parametrize(
    "code",
    [e.code for e in WrappedModelBypassed.invalid if ".module" in e.code]
    + [
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "model = DDP(net)\nfor x in loader:\n    model.module(x).sum().backward()\n    opt.step()\n"
    ],
)
def test_tl507_the_module_inside_the_wrapper_is_the_real_wrappers(code: str) -> None:
    probe = _probe("TL507", code)
    # as written the loss goes through the wrapper's own `.module`; fixed, through the wrapper
    assert "__tl_loss_module__ = __tl_ddp__.module" in probe["programs"]["as_written"]
    assert "__tl_loss_module__ = __tl_ddp__\n" in probe["programs"]["fixed"]
