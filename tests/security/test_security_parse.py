"""Memory within the size limit: files under 2 MiB built to make the parser take gigabytes (one-letter
lines, long runs of tiny tokens) are TL902 before any parser sees them, and the run goes on."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from trainlint.files import MAX_SOURCE_BYTES

GOOD_BAD = "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)\n"
CROWDED = {
    "lines.py": "a\n" * 990_000,  # 1.98 MB: 8 GB in libcst
    "tokens.py": "x = [" + "a," * 900_000 + "]\n",  # one line, ~1.8 million tokens
}


@pytest.mark.parametrize("name", sorted(CROWDED))
def test_a_crowded_file_is_tl902_and_the_run_goes_on(tmp_path: Path, name: str) -> None:
    text = CROWDED[name]
    assert len(text.encode()) < MAX_SOURCE_BYTES
    (tmp_path / name).write_text(text)
    (tmp_path / "other.py").write_text(GOOD_BAD)

    def bounded() -> None:  # today's code would parse it until this limit, then abort
        resource.setrlimit(resource.RLIMIT_AS, (3 * 1024**3, 3 * 1024**3))

    done = subprocess.run(
        [sys.executable, "-m", "trainlint", "--no-cache", "--jobs", "1", "--format", "json", "."],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        preexec_fn=bounded,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    found = {(f["path"], f["rule"]): f["message"] for f in json.loads(done.stdout)["findings"]}
    assert ("other.py", "TL201") in found
    assert "over the" in found[(name, "TL902")] and "limit for one file" in found[(name, "TL902")]
