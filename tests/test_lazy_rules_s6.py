"""A run on one file imports only the modules of the rules that run on it (pre-commit's case, issue
13): rules are loaded by id through their module's name, and the whole registry stays for the rest."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from trainlint.rule import _rule_modules, registry

# Runs trainlint's CLI in this process, then prints the rule modules (``tlNNN_*``) it imported and
# whether the registry of every rule was loaded.
DRIVER = textwrap.dedent(
    """
    import json, sys
    from trainlint.cli import main
    from trainlint.rule import registry

    code = main(sys.argv[1:])
    mods = sorted(m for m in sys.modules if m.rpartition(".")[2].startswith("tl"))
    print(json.dumps({"code": code, "modules": mods, "registry": registry.cache_info().currsize}))
    """
)

CHECKPOINTED = textwrap.dedent(
    """
    import torch
    from torch.utils.checkpoint import checkpoint


    def forward(block, x):
        return checkpoint(block, x)
    """
)


def _run(tmp_path: Path, text: str) -> dict:
    source = tmp_path / "train.py"
    source.write_text(text, encoding="utf-8")
    argv = ["--no-cache", "--exit-zero", "--format", "json", "train.py"]
    done = subprocess.run(
        [sys.executable, "-P", "-c", DRIVER, *argv], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    report, _, last = done.stdout.strip().rpartition("\n")  # the driver's line comes last
    out = json.loads(last)
    out["findings"] = json.loads(report)["findings"]
    return out


def test_one_file_run_imports_only_the_rules_that_run(tmp_path: Path) -> None:
    out = _run(tmp_path, CHECKPOINTED)
    every = set(_rule_modules().values())
    assert {f["rule"] for f in out["findings"]} == {"TL201"}
    assert "trainlint.rules.checkpoint.tl201_checkpoint_use_reentrant" in out["modules"]
    assert set(out["modules"]) < every
    # the gates let few rules through a file that only checkpoints: most modules stay unread
    assert len(out["modules"]) < len(every) / 2
    assert out["registry"] == 0


def test_every_rule_is_found_by_its_module_name() -> None:
    assert _rule_modules() == {rule.id: rule.__module__ for rule in registry()}


def test_rules_loaded_one_by_one_are_the_registry_classes() -> None:
    # a fresh process: the registry is not loaded yet, so every id goes through its module's name
    probe = textwrap.dedent(
        """
        from trainlint.rule import load_rule, registry, rule_ids
        loaded = {i: load_rule(i) for i in rule_ids()}
        fresh = registry.cache_info().currsize == 0
        print(fresh, all(loaded[i] is registry().get(i) for i in rule_ids()), len(loaded))
        print(load_rule("tl201").id, load_rule("TL999"))
        """
    )
    done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True)
    first, second = done.stdout.split("\n")[:2]
    assert first == f"True True {len(registry().ids())}"
    assert second == "TL201 None"
