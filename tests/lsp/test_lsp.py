"""``trainlint server`` driven by a real LSP client (pygls's) over stdio, in a subprocess.

The expected texts after a fix are the rules' own hand-written examples (``Invalid.fix`` and
``Invalid.unsafe_fix``), so a test fails when the server's edits differ from what the rule promises.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import pytest

pytest.importorskip("pygls")

from lsprotocol import types as lsp
from pygls.lsp.client import LanguageClient
from pygls.protocol import default_converter

from trainlint.rule import registry

ROOT = Path(__file__).resolve().parents[2]
# Only a guard against a hung server: every wait ends as soon as its condition holds.
WAIT_S = 120.0


def example(rule: str, marker: str):
    """The rule's invalid example with a hand-written fix whose code holds ``marker`` (found by content,
    not position, so that adding examples to the rule does not change which one a test uses)."""
    (found,) = [
        ex
        for ex in registry().get(rule).invalid  # type: ignore[union-attr]
        if (ex.fix or ex.unsafe_fix) and marker in ex.code
    ]
    return found


SAFE = example("TL104", "# again")  # unscale_ twice: the second call is deleted (a safe fix)
UNSAFE = example("TL201", "# saves memory")  # checkpoint without use_reentrant: use_reentrant=False (unsafe)


def apply(text: str, edits: list[lsp.TextEdit]) -> str:
    """Apply LSP edits (UTF-16 positions) the way an editor does, last edit first."""
    lines = [*text.splitlines(keepends=True), ""]

    def offset(pos: lsp.Position) -> int:
        line = lines[pos.line]
        units = 0
        for index, char in enumerate(line):
            if units >= pos.character:
                return sum(map(len, lines[: pos.line])) + index
            units += 2 if ord(char) > 0xFFFF else 1
        return sum(map(len, lines[: pos.line])) + len(line.rstrip("\r\n"))

    spans = sorted(((offset(e.range.start), offset(e.range.end), e.new_text) for e in edits), reverse=True)
    for start, end, new in spans:
        text = text[:start] + new + text[end:]
    return text


def converter() -> Any:
    """pygls's converter, reading a code action that runs a command as a ``CodeAction``: lsprotocol
    takes any object with a ``command`` key for a ``Command``, but a ``CodeAction``'s ``command`` is an
    object where a ``Command``'s is a string."""
    conv = default_converter()

    def action(obj: Any, _: type) -> lsp.Command | lsp.CodeAction:
        kind = lsp.Command if isinstance(obj.get("command"), str) else lsp.CodeAction
        return conv.structure(obj, kind)

    conv.register_structure_hook(Union[lsp.Command, lsp.CodeAction], action)  # noqa: UP007
    return conv


class Session:
    """One server process and the notifications it sent."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.client = LanguageClient("trainlint-tests", "0", converter_factory=converter)
        self.diagnostics: dict[str, list[lsp.PublishDiagnosticsParams]] = {}
        self.messages: list[str] = []
        self.versions: dict[str, int] = {}

        # pygls marks its handlers with attributes, which a bound method cannot take: plain functions
        def on_diagnostics(params: lsp.PublishDiagnosticsParams) -> None:
            self.diagnostics.setdefault(params.uri, []).append(params)

        def on_message(params: lsp.ShowMessageParams) -> None:
            self.messages.append(params.message)

        self.client.feature(lsp.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)(on_diagnostics)
        self.client.feature(lsp.WINDOW_SHOW_MESSAGE)(on_message)

    async def start(self) -> None:
        await self.client.start_io(sys.executable, "-m", "trainlint", "server", "--debounce", "0.05")
        await self.client.initialize_async(
            lsp.InitializeParams(
                capabilities=lsp.ClientCapabilities(),
                root_uri=self.root.as_uri(),
                workspace_folders=[lsp.WorkspaceFolder(self.root.as_uri(), "root")],
            )
        )
        self.client.initialized(lsp.InitializedParams())

    async def stop(self) -> None:
        await self.client.shutdown_async(None)
        self.client.exit(None)
        await self.client.stop()

    async def until(self, condition: Callable[[], object]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while not condition():
            assert loop.time() < deadline, "the server did not answer"
            await asyncio.sleep(0.02)

    async def open(self, name: str, text: str) -> tuple[str, list[lsp.Diagnostic]]:
        path = self.root / name
        path.write_text(text, encoding="utf-8")
        uri = path.as_uri()
        self.versions[uri] = 1
        self.client.text_document_did_open(
            lsp.DidOpenTextDocumentParams(lsp.TextDocumentItem(uri, "python", 1, text))
        )
        return uri, await self.published(uri, 1)

    async def change(self, uri: str, text: str) -> list[lsp.Diagnostic]:
        self.versions[uri] += 1
        version = self.versions[uri]
        self.client.text_document_did_change(
            lsp.DidChangeTextDocumentParams(
                lsp.VersionedTextDocumentIdentifier(version=version, uri=uri),
                [lsp.TextDocumentContentChangeWholeDocument(text=text)],
            )
        )
        return await self.published(uri, version)

    async def published(self, uri: str, version: int) -> list[lsp.Diagnostic]:
        def latest() -> lsp.PublishDiagnosticsParams | None:
            sent = [p for p in self.diagnostics.get(uri, []) if p.version == version]
            return sent[-1] if sent else None

        await self.until(latest)
        return list(latest().diagnostics)  # type: ignore[union-attr]

    async def actions(
        self, uri: str, diagnostic: lsp.Diagnostic | None, only: list[str] | None = None
    ) -> list[lsp.CodeAction]:
        span = diagnostic.range if diagnostic else lsp.Range(lsp.Position(0, 0), lsp.Position(0, 0))
        found = await self.client.text_document_code_action_async(
            lsp.CodeActionParams(
                lsp.TextDocumentIdentifier(uri),
                span,
                lsp.CodeActionContext(diagnostics=[diagnostic] if diagnostic else [], only=only),
            )
        )
        return [a for a in found or [] if isinstance(a, lsp.CodeAction)]


def run(root: Path, scenario: Callable[[Session], object]) -> None:
    async def main() -> None:
        session = Session(root)
        await session.start()
        try:
            await scenario(session)  # type: ignore[misc]
        finally:
            await session.stop()

    asyncio.run(main())


def only_edits(action: lsp.CodeAction, uri: str) -> list[lsp.TextEdit]:
    assert action.edit is not None and action.edit.changes is not None
    assert list(action.edit.changes) == [uri]
    return list(action.edit.changes[uri])


def test_diagnostics_carry_rule_severity_range_and_related(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, diagnostics = await s.open("step.py", SAFE.code)
        assert [d.code for d in diagnostics] == ["TL104"]
        (d,) = diagnostics
        assert d.source == "trainlint"
        assert d.severity == lsp.DiagnosticSeverity.Error
        lines = SAFE.code.splitlines()
        second = next(i for i, line in enumerate(lines) if "# again" in line)
        first = next(i for i, line in enumerate(lines) if "# once" in line)
        assert d.range.start == lsp.Position(second, lines[second].index("scaler"))
        assert d.range.end.line == second
        # the rule's page, in the repository's docs/rules/
        assert d.code_description is not None and d.code_description.href.endswith("/docs/rules/TL104.md")
        assert (ROOT / "docs" / "rules" / "TL104.md").is_file()
        (related,) = d.related_information or []
        assert related.location.uri == uri
        assert related.location.range.start.line == first

    run(tmp_path, scenario)


def test_columns_are_utf16_units_after_astral_characters(tmp_path: Path) -> None:
    # U+1D518 is one code point (trainlint's column unit) but two UTF-16 units (LSP's default)
    line = '        x = ("\U0001d518", cp.checkpoint(block, x))[1]'
    text = UNSAFE.code.replace("        x = cp.checkpoint(block, x)  # saves memory", line)
    assert text != UNSAFE.code

    async def scenario(s: Session) -> None:
        _, diagnostics = await s.open("astral.py", text)
        (d,) = diagnostics
        assert d.code == "TL201"
        assert d.range.start.character == line.index("cp.checkpoint") + 1

    run(tmp_path, scenario)


def test_diagnostics_follow_changes_and_the_configuration(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, diagnostics = await s.open("step.py", SAFE.code)
        assert [d.code for d in diagnostics] == ["TL104"]
        assert await s.change(uri, SAFE.fix) == []
        assert [d.code for d in await s.change(uri, SAFE.code)] == ["TL104"]
        project = s.root / "project"
        project.mkdir()
        (project / "pyproject.toml").write_text('[tool.trainlint]\nignore = ["TL104"]\n', encoding="utf-8")
        _, ignored = await s.open("project/step.py", SAFE.code)
        assert ignored == []
        other = s.root / "other"
        (other / "legacy").mkdir(parents=True)
        (other / "trainlint.toml").write_text('extend-exclude = ["legacy"]\n', encoding="utf-8")
        _, excluded = await s.open("other/legacy/step.py", SAFE.code)
        assert excluded == []
        _, linted = await s.open("other/current.py", SAFE.code)
        assert [d.code for d in linted] == ["TL104"]

    run(tmp_path, scenario)


def test_saving_a_configuration_relints_the_open_documents(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, diagnostics = await s.open("step.py", SAFE.code)
        assert [d.code for d in diagnostics] == ["TL104"]
        sent = len(s.diagnostics[uri])
        config = s.root / "pyproject.toml"
        config.write_text('[tool.trainlint]\nignore = ["TL104"]\n', encoding="utf-8")
        s.client.text_document_did_save(
            lsp.DidSaveTextDocumentParams(lsp.TextDocumentIdentifier(config.as_uri()))
        )
        await s.until(lambda: len(s.diagnostics[uri]) > sent)
        assert list(s.diagnostics[uri][-1].diagnostics) == []

    run(tmp_path, scenario)


@pytest.mark.parametrize("case", ["safe", "unsafe"])
def test_quick_fix_gives_the_rules_own_fixed_text(tmp_path: Path, case: str) -> None:
    ex = SAFE if case == "safe" else UNSAFE
    expected = ex.fix if case == "safe" else ex.unsafe_fix

    async def scenario(s: Session) -> None:
        uri, (d,) = await s.open("f.py", ex.code)
        fixes = [a for a in await s.actions(uri, d) if a.title.startswith(f"Fix {d.code}")]
        assert len(fixes) == 1
        assert ("(unsafe)" in fixes[0].title) == (case == "unsafe")
        assert fixes[0].kind == lsp.CodeActionKind.QuickFix
        assert apply(ex.code, only_edits(fixes[0], uri)) == expected

    run(tmp_path, scenario)


def test_fix_all_applies_safe_fixes_only(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, _ = await s.open("safe.py", SAFE.code)
        (action,) = await s.actions(uri, None, only=["source.fixAll.trainlint"])
        assert action.kind == "source.fixAll.trainlint"
        assert apply(SAFE.code, only_edits(action, uri)) == SAFE.fix
        # asking for every source action includes it too
        assert any(a.kind == "source.fixAll.trainlint" for a in await s.actions(uri, None, only=["source"]))
        unsafe_uri, (d,) = await s.open("unsafe.py", UNSAFE.code)
        assert d.code == "TL201"
        assert await s.actions(unsafe_uri, None, only=["source.fixAll"]) == []

    run(tmp_path, scenario)


def test_noqa_action_silences_the_finding(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        for name, text in (("safe.py", SAFE.code), ("unsafe.py", UNSAFE.code)):
            uri, (d,) = await s.open(name, text)
            (noqa,) = [a for a in await s.actions(uri, d) if "noqa" in a.title]
            fixed = apply(text, only_edits(noqa, uri))
            changed = [line for line in fixed.splitlines() if line not in text.splitlines()]
            assert len(changed) == 1 and f"noqa: {d.code}" in changed[0]
            assert await s.change(uri, fixed) == []

    run(tmp_path, scenario)


def test_no_noqa_action_where_a_comment_cannot_silence_the_finding(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, (d,) = await s.open("broken.py", "def f(:\n    pass\n")
        assert d.code == "TL901"  # the file does not parse: no comment in it can change that
        assert [a.title for a in await s.actions(uri, d) if "noqa" in a.title] == []

    run(tmp_path, scenario)


def test_noqa_action_extends_an_existing_list(tmp_path: Path) -> None:
    text = UNSAFE.code.replace("# saves memory", "# noqa: TL202")

    async def scenario(s: Session) -> None:
        uri, (d,) = await s.open("f.py", text)
        (noqa,) = [a for a in await s.actions(uri, d) if "noqa" in a.title]
        fixed = apply(text, only_edits(noqa, uri))
        assert "# noqa: TL202, TL201" in fixed
        assert await s.change(uri, fixed) == []

    run(tmp_path, scenario)


def test_hover_shows_the_rules_explanation(tmp_path: Path) -> None:
    async def scenario(s: Session) -> None:
        uri, (d,) = await s.open("f.py", SAFE.code)
        doc = lsp.TextDocumentIdentifier(uri)
        hover = await s.client.text_document_hover_async(lsp.HoverParams(doc, d.range.start))
        assert hover is not None and isinstance(hover.contents, lsp.MarkupContent)
        assert hover.contents.kind == lsp.MarkupKind.Markdown
        assert hover.contents.value.startswith("# TL104 (unscale-twice)")
        assert "## Why is this bad?" in hover.contents.value
        assert await s.client.text_document_hover_async(lsp.HoverParams(doc, lsp.Position(0, 0))) is None

    run(tmp_path, scenario)


@pytest.mark.slow
def test_verify_command_shows_the_verdict(tmp_path: Path) -> None:
    pytest.importorskip("torch")

    async def scenario(s: Session) -> None:
        uri, (d,) = await s.open("step.py", SAFE.code)
        (verify,) = [a for a in await s.actions(uri, d) if a.command is not None]
        assert verify.command.command == "trainlint.verify"
        result = await s.client.workspace_execute_command_async(
            lsp.ExecuteCommandParams(verify.command.command, verify.command.arguments)
        )
        assert result["status"] in ("confirmed", "not-reproduced", "not-executable")
        assert result["verify"]["status"] == result["status"]
        await s.until(lambda: any(m.startswith("trainlint --verify TL104") for m in s.messages))
        shown = next(m for m in s.messages if m.startswith("trainlint --verify TL104"))
        assert result["status"] in shown

    run(tmp_path, scenario)


def test_static_linting_in_the_server_never_imports_torch(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from trainlint.lsp.link import Linter
        from trainlint.lsp.handlers import build_server
        build_server()
        linter = Linter(Path({str(tmp_path)!r}))
        found = linter.lint({SAFE.code!r}, None, "f.py")
        fixed = linter.fix_all({SAFE.code!r}, None, "f.py")
        assert [f.rule for f in found] == ["TL104"] and fixed.fixed == 1, (found, fixed)
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_server_is_a_command_of_trainlint() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "trainlint", "server", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: trainlint server" in shown.stdout and "--debounce" in shown.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "trainlint", "server", "--debounce", "-1"], capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "--debounce" in wrong.stderr


def test_without_the_lsp_extra_the_server_says_how_to_install_it() -> None:
    code = (
        "import sys; sys.modules['lsprotocol'] = None; from trainlint.cli import main; "
        "sys.exit(main(['server']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    assert 'pip install "trainlint[lsp]"' in out.stderr and "Traceback" not in out.stderr
