"""The checkpoint probe finds the factory's return through TL201's label constant, not a copy of its
text: renaming the label on the rule class keeps the probe working."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from trainlint.engine import lint_source
from trainlint.model import FileModel
from trainlint.rules.checkpoint.tl201_checkpoint_use_reentrant import CheckpointUseReentrant
from trainlint.verify.context import ProbeContext
from trainlint.verify.probes.checkpoint import _checkpoint_site

FACTORY_CODE = textwrap.dedent(
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def get_checkpoint_fn():
        return torch_checkpoint

    def run(block, x):
        checkpoint = get_checkpoint_fn()
        return checkpoint(block, x)
    """
)


def test_the_probe_follows_the_rules_factory_label(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CheckpointUseReentrant, "FACTORY", "renamed-factory")
    (finding,) = lint_source(FACTORY_CODE, "m.py", ["TL201"])
    assert [r.label for r in finding.related] == ["renamed-factory"]
    site = _checkpoint_site(ProbeContext(finding, FileModel.from_source(FACTORY_CODE, "m.py"), None))
    assert (
        isinstance(site.node, cst.Call) and cst.Module([]).code_for_node(site.node) == "checkpoint(block, x)"
    )
