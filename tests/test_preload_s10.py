"""Before workers are forked, the engine loads libcst, the file model and the active rules of the files
the result cache's lookups kept (each worker would otherwise import them again, ~0.3 s of libcst each);
a run whose kept files need none of it loads none of it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

# The lookups of a run with a cache (``outcome_needs_no_project``) on the given texts, then the load.
PROGRAM = """
import sys
from trainlint import engine
from trainlint.results import LintOptions
from trainlint.rule import rule_ids
options = LintOptions(tuple(rule_ids()))
for path in sys.argv[1:]:
    engine.outcome_needs_no_project(open(path).read(), options)
before = sorted(m for m in ("libcst", "trainlint.model.filemodel") if m in sys.modules)
engine.load_for_kept_verdicts()
rules = sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("trainlint.rules.") and "_tl" not in m)
print(before, "libcst" in sys.modules, [r for r in rules if r.startswith("tl")])
"""


def _loaded(*paths: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, *map(str, paths)], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_kept_files_rules_and_libcst_load_once_before_the_workers() -> None:
    out = _loaded(FIXTURES / "bad_gpt_amp.py")
    before, _, after = out.partition("] ")
    assert before == "[" and after.startswith("True ")  # not loaded by the lookups, loaded by the call
    assert "tl201_checkpoint_use_reentrant" in after


def test_files_no_rule_can_run_on_load_nothing(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("import os\n\ndef join(a, b):\n    return os.path.join(a, b)\n")
    assert _loaded(plain) == "[] False []"
