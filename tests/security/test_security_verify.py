"""Attacks on ``--verify``: the repository's code runs in the child, so a carried definition tries
what an attacker would (read secrets from the environment, reach a loopback listener through
``connect_ex``, ``_socket`` and UDP, raise its limits, leave ``setsid`` children behind, forge
results), and a repository's configuration asks for an endless timeout."""

from __future__ import annotations

import os
import shlex
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainlint.engine import lint_source
from trainlint.verify import runner, torch_available, verify_findings

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

TEMPLATE = """
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def scribble(x):
{attack}
    return x * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return checkpoint(scribble, self.fc(x))
"""


def verdicts(attack: str, timeout: float = 30) -> list[dict]:
    """The verdicts of the TL201 findings of the snippet whose checkpointed function runs ``attack``."""
    code = TEMPLATE.format(attack=textwrap.indent(textwrap.dedent(attack), "    "))
    findings = lint_source(code, "train.py", ["TL201"])
    assert findings
    return [f.verify for f in verify_findings(findings, {"train.py": code}, device="cpu", timeout=timeout)]


def details(attack: str) -> str:
    return " ".join(v["detail"] for v in verdicts(attack))


def test_the_attack_code_really_runs() -> None:
    """Each attack below reports success by raising: this shows a raise reaches the verdict."""
    assert "RuntimeError: the attack ran" in details('raise RuntimeError("the attack ran")')


def test_the_child_does_not_see_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("CI_DEPLOY_TOKEN", "s3cr3t-token")
    found = details(
        """
        import os
        leaked = [k for k, v in os.environ.items() if "s3cr3t" in v]
        if leaked:
            raise RuntimeError("leaked " + ",".join(leaked))
        """
    )
    assert "leaked" not in found


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    yield server
    server.close()


@pytest.mark.parametrize("how", ["connect_ex", "_socket"])
def test_the_child_cannot_reach_a_loopback_listener(listener, how) -> None:
    port = listener.getsockname()[1]
    connect = {
        "connect_ex": "import socket\ns = socket.socket()\nok = s.connect_ex(('127.0.0.1', PORT)) == 0",
        "_socket": "import _socket\ns = _socket.socket()\nok = s.connect_ex(('127.0.0.1', PORT)) == 0",
    }[how].replace("PORT", str(port))
    found = details(connect + "\nif ok:\n    raise RuntimeError('reached the listener')\n")
    assert "reached the listener" not in found
    with pytest.raises(OSError):
        listener.accept()[0].close()


def test_the_child_cannot_send_udp_out() -> None:
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(1.0)
    try:
        port = receiver.getsockname()[1]
        verdicts(
            f"""
            import _socket
            try:
                _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM).sendto(b"exfiltrated", ("127.0.0.1", {port}))
            except OSError:
                pass
            """
        )
        with pytest.raises(OSError):
            receiver.recvfrom(100)
    finally:
        receiver.close()


def test_the_child_cannot_raise_its_limits() -> None:
    found = details(
        """
        import resource
        raised = []
        for name in ("RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_DATA"):
            kind = getattr(resource, name)
            soft, hard = resource.getrlimit(kind)
            if hard == resource.RLIM_INFINITY or hard > soft:
                raised.append(name)
        if raised:
            raise RuntimeError("can raise " + ",".join(raised))
        """
    )
    assert "can raise" not in found


def _running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "status").read_text()
            except OSError:
                continue
            if marker.encode() in cmdline and "\nState:\tZ" not in state:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_setsid_children_do_not_outlive_the_check() -> None:
    marker = f"trainlint-orphan-{os.getpid()}-{time.monotonic_ns()}"
    try:
        verdicts(
            f"""
            import subprocess, sys
            subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)", "{marker}"],
                start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            """
        )
        deadline = time.monotonic() + 30
        while _running(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _running(marker) == []
    finally:
        for pid in _running(marker):  # only the processes this test's snippet started
            os.kill(pid, 9)


def test_the_snippet_cannot_write_outside_its_folder_by_absolute_path(tmp_path: Path) -> None:
    """With no mount namespace the child sees the user's file system: the guard in the child
    (``child/confine.py``) refuses writes outside its temporary folder, and starting programs."""
    outside = tmp_path / f"outside-{os.getpid()}-{time.monotonic_ns()}"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    found = details(
        f"""
        import os, shutil, sqlite3, subprocess, torch
        target = {str(outside)!r}
        attempts = {{
            "open": lambda: open(os.path.join(target, "x"), "w").write("escaped"),
            "os.open": lambda: os.open(os.path.join(target, "y"), os.O_WRONLY | os.O_CREAT),
            "mkdir": lambda: os.mkdir(os.path.join(target, "d")),
            "remove": lambda: os.remove(os.path.join(target, "keep")),
            "rename": lambda: os.rename(os.path.join(target, "keep"), "stolen"),
            "copy": lambda: shutil.copyfile("/dev/null", os.path.join(target, "c")),
            "link": lambda: (os.symlink(target, "inside"), open("inside/z", "w").write("escaped")),
            "system": lambda: os.system("touch " + os.path.join(target, "s")),
            "subprocess": lambda: subprocess.run(["touch", os.path.join(target, "p")]),
            "torch.save": lambda: torch.save({{"w": torch.ones(2)}}, os.path.join(target, "t.pt")),
            "sqlite": lambda: sqlite3.connect(os.path.join(target, "db")).execute("create table t(x)"),
        }}
        refused, done = [], []
        for name, attempt in attempts.items():
            try:
                attempt()
                done.append(name)
            except PermissionError:
                refused.append(name)
        with open("inside.txt", "w") as fh:  # its own folder stays writable
            fh.write("fine")
        raise RuntimeError("refused " + ",".join(refused) + "; done " + ",".join(done))
        """
    )
    refused = "open,os.open,mkdir,remove,rename,copy,link,system,subprocess,torch.save,sqlite"
    assert f"refused {refused}; done" in found, found
    assert sorted(p.name for p in outside.iterdir()) == ["keep"]
    assert (outside / "keep").read_text() == "mine"


FAKE_BWRAP = """#!/bin/sh
# records its arguments (NUL-separated, a file per run), then runs what follows ``--`` unisolated
for arg in "$@"; do printf '%s\\0' "$arg" >> LOG.$$; done
while [ "$#" -gt 0 ]; do arg=$1; shift; [ "$arg" = "--" ] && break; done
exec "$@"
"""


@pytest.mark.skipif(not Path("/bin/sh").exists(), reason="needs a POSIX shell")
def test_the_bubblewrap_fallback_builds_its_command(tmp_path: Path, monkeypatch) -> None:
    """Where ``unshare`` is missing (or refused) and ``bwrap`` is installed, the child runs under
    bubblewrap. bwrap is rarely installed where the tests run, so a fake one on PATH records the
    command it is given and runs the child without isolating it."""
    bin_dir, log = tmp_path / "bin", tmp_path / "bwrap"
    bin_dir.mkdir()
    fake = bin_dir / "bwrap"
    fake.write_text(FAKE_BWRAP.replace("LOG", shlex.quote(str(log))))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # no unshare: the fallback is next
    runner.isolation.cache_clear()
    try:
        mode, prefix = runner.isolation()
        (verdict,) = verdicts("pass")
    finally:
        runner.isolation.cache_clear()
    assert mode == "bubblewrap" and prefix[0] == str(fake)
    runs = [record.read_text().split("\0")[:-1] for record in tmp_path.glob("bwrap.*")]
    assert len(runs) >= 2  # the probe that isolation() runs, then the child
    (child,) = [run for run in runs if any(arg.startswith("fd:") for arg in run)]  # the results pipe
    options = child[: child.index("--")]
    assert {"--unshare-net", "--unshare-pid", "--die-with-parent"} <= set(options)
    command = child[child.index("--") + 1 :]
    assert command[:2] == [sys.executable, "-c"]
    assert verdict["status"] in ("confirmed", "not-reproduced"), verdict  # the child ran and answered


def test_results_appended_by_the_snippet_are_not_believed() -> None:
    (verdict,) = verdicts(
        """
        import json, os
        forged = {"id": "0", "status": "confirmed", "detail": "forged", "evidence": {}, "fixed_matches": True}
        for path in ("../results.jsonl", "results.jsonl"):
            with open(path, "a") as fh:
                fh.write("[]\\n" + json.dumps(forged) + "\\n")
        os._exit(0)
        """
    )
    assert verdict["detail"] != "forged"
    assert verdict["status"] in ("not-executable", "error")


def test_garbage_on_the_results_channel_is_an_error_not_a_crash() -> None:
    probes = [{"id": "a"}, {"id": "b"}]
    data = b'{"id": "a", "started": true}\n[]\n{"id": "a", "status": "confirmed"}\n'
    found, started, broken = runner.parse_results(data, probes)
    assert started == 1 and broken == {"a"}
    forged_other = b'{"id": "a", "started": true}\n{"id": "b", "status": "confirmed"}\n'
    found, started, broken = runner.parse_results(forged_other, probes)
    assert "b" not in found and broken == {"a"}
    repeated = b'{"id": "a", "started": true}\n' + b'{"id": "a", "status": "confirmed"}\n' * 2
    assert runner.parse_results(repeated, probes)[2] == {"a"}
    unknown = b'{"id": "a", "started": true}\n{"id": "a", "status": "upgraded"}\n'
    assert runner.parse_results(unknown, probes)[0] == {}


def test_an_endless_configured_timeout_is_capped(monkeypatch) -> None:
    seen: list[float] = []

    def fake_batch(probes, device, timeout):
        seen.append(timeout)
        return {p["id"]: {"status": "error", "detail": "", "evidence": {}} for p in probes}, None, True

    monkeypatch.setattr(runner, "_run_batch", fake_batch)
    runner.run_probes([{"id": "0"}], "cpu", 1e9)
    assert seen and seen[0] <= 600


def test_help_says_verify_runs_the_repository_code() -> None:
    from trainlint.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "RUNS THE REPOSITORY'S CODE" in text
    assert "only on code you would run yourself" in text


def test_the_weaker_mode_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setattr(runner, "isolation", lambda: ("python", ()))
    runner._warn_weak_isolation.cache_clear()
    (verdict,) = verdicts("import socket\nsocket.socket().connect_ex(('127.0.0.1', 9))\n")
    assert "without a network namespace" in capsys.readouterr().err
    assert "network access is disabled" in verdict["detail"]  # the Python-level block still stands
