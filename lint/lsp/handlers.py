"""The Language Server's handlers, on pygls.

Diagnostics are published when a document is opened or saved, and after a pause in typing
(``--debounce``); code actions, hover and the ``trainlint.verify`` command read the findings of the
document's current text, which the linter keeps (see ``link.Linter``), so they never lint twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lsprotocol import types as lsp
from pygls.lsp.server import LanguageServer
from pygls.uris import to_fs_path

from trainlint import __version__
from trainlint.config import ConfigError
from trainlint.lsp import convert
from trainlint.lsp.link import Linter, describe_verify, explain, has_probe, suppressible, url_of
from trainlint.lsp.server import DEBOUNCE_S
from trainlint.rule import Applicability, Finding


@dataclass
class _State:
    """The findings of one open document's text; ``verified``: findings --verify has run on since."""

    text: str
    findings: list[Finding]
    verified: dict[tuple[str, int, int], Finding] = field(default_factory=dict)

    def current(self) -> list[Finding]:
        return [self.verified.get((f.rule, f.line, f.column), f) for f in self.findings]


class TrainlintServer(LanguageServer):
    def __init__(self, debounce: float = DEBOUNCE_S) -> None:
        # Full sync: pygls applies incremental changes with str.splitlines, which breaks lines at
        # form feeds and other characters that are not line breaks to LSP or to Python.
        super().__init__("trainlint", __version__, text_document_sync_kind=lsp.TextDocumentSyncKind.Full)
        self.debounce = debounce
        self.linter = Linter()
        self.states: dict[str, _State] = {}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.config_errors: set[str] = set()

    def path_of(self, uri: str) -> Path | None:
        """The file behind a document (None for an unsaved one: it gets the workspace's settings)."""
        if not uri.startswith("file:"):
            return None
        path = to_fs_path(uri)
        return Path(path) if path else None

    def document(self, uri: str) -> convert.Document:
        text = self.workspace.get_text_document(uri).source
        return convert.Document(text, self.workspace.position_encoding or lsp.PositionEncodingKind.Utf16)

    def state(self, uri: str) -> _State:
        """The findings of the document's current text, linted now if the text is new."""
        text = self.workspace.get_text_document(uri).source
        known = self.states.get(uri)
        if known is not None and known.text == text:
            return known
        path = self.path_of(uri)
        try:
            findings = self.linter.lint(text, path, str(path) if path is not None else uri)
        except ConfigError as exc:
            findings = []
            if str(exc) not in self.config_errors:  # once per distinct problem, not per keystroke
                self.config_errors.add(str(exc))
                self.show(lsp.MessageType.Error, f"trainlint: configuration error: {exc}")
        self.states[uri] = _State(text, findings)
        return self.states[uri]

    def publish(self, uri: str) -> None:
        timer = self.timers.pop(uri, None)
        if timer is not None:  # a change still waiting for its pause: this publication answers it
            timer.cancel()
        if uri not in self.workspace.text_documents:  # closed while the timer ran
            return
        state = self.state(uri)
        doc = self.document(uri)
        self.text_document_publish_diagnostics(
            lsp.PublishDiagnosticsParams(
                uri=uri,
                version=self.workspace.get_text_document(uri).version,
                diagnostics=[convert.diagnostic(f, doc, uri, url_of(f)) for f in state.current()],
            )
        )

    def publish_later(self, uri: str) -> None:
        timer = self.timers.pop(uri, None)
        if timer is not None:
            timer.cancel()
        self.timers[uri] = asyncio.get_running_loop().call_later(self.debounce, self.publish, uri)

    def show(self, kind: lsp.MessageType, message: str) -> None:
        self.window_show_message(lsp.ShowMessageParams(type=kind, message=message))


def _initialize(ls: TrainlintServer, params: lsp.InitializeParams) -> None:
    folders = params.workspace_folders or []
    root = folders[0].uri if folders else params.root_uri
    path = to_fs_path(root) if root else None
    if path:
        ls.linter.root = Path(path)


def _did_open(ls: TrainlintServer, params: lsp.DidOpenTextDocumentParams) -> None:
    ls.publish(params.text_document.uri)


def _did_change(ls: TrainlintServer, params: lsp.DidChangeTextDocumentParams) -> None:
    ls.publish_later(params.text_document.uri)


def _did_save(ls: TrainlintServer, params: lsp.DidSaveTextDocumentParams) -> None:
    saved = params.text_document.uri
    if saved.endswith(".toml"):
        ls.linter.forget_configs()
        ls.config_errors.clear()
    # A saved file can change what the open documents import from it (cross-file rules), a saved
    # configuration what every document reports: all of them are linted again, the saved one now.
    linted = list(ls.states)
    ls.linter.forget_results()
    ls.states.clear()
    for uri in linted:
        if uri == saved:
            ls.publish(uri)
        else:
            ls.publish_later(uri)
    if saved not in linted and not saved.endswith(".toml"):
        ls.publish(saved)


def _did_close(ls: TrainlintServer, params: lsp.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    timer = ls.timers.pop(uri, None)
    if timer is not None:
        timer.cancel()
    ls.states.pop(uri, None)
    path = ls.path_of(uri)
    ls.linter.documents.forget(str(path) if path is not None else uri)  # its syntax tree
    ls.text_document_publish_diagnostics(lsp.PublishDiagnosticsParams(uri=uri, diagnostics=[]))


def _wants(only: Sequence[str] | None, kind: str) -> bool:
    """Whether a code action of ``kind`` answers a request limited to ``only`` (kinds are dotted
    hierarchies: asking for ``source`` includes ``source.fixAll.trainlint``)."""
    return only is None or any(kind == k or kind.startswith(f"{k}.") for k in only)


def _code_actions(ls: TrainlintServer, params: lsp.CodeActionParams) -> list[lsp.CodeAction]:
    uri = params.text_document.uri
    state = ls.state(uri)
    doc = ls.document(uri)
    only = params.context.only
    actions: list[lsp.CodeAction] = []
    if _wants(only, lsp.CodeActionKind.QuickFix):
        start, end = doc.point(params.range.start), doc.point(params.range.end)
        for finding in state.current():
            if (finding.end_line, finding.end_column) < start or (finding.line, finding.column) > end:
                continue
            diag = convert.diagnostic(finding, doc, uri, url_of(finding))
            fix = convert.quick_fix(finding, doc, uri, diag)
            actions.extend([fix] if fix is not None else [])
            if suppressible(finding.rule):
                actions.append(convert.noqa_action(finding, doc, uri, diag))
            if has_probe(finding.rule):
                actions.append(convert.verify_action(finding, uri, diag))
    safe = any(f.fix is not None and f.fix.applicability is Applicability.SAFE for f in state.findings)
    if _wants(only, convert.FIX_ALL) and (safe or only is not None):
        fixed = ls.linter.fix_all(state.text, ls.path_of(uri), str(ls.path_of(uri) or uri)).text
        if fixed != state.text:
            actions.append(convert.fix_all_action(doc, uri, fixed))
    return actions


def _hover(ls: TrainlintServer, params: lsp.HoverParams) -> lsp.Hover | None:
    uri = params.text_document.uri
    findings = ls.state(uri).current()
    docs = {rule: text for rule in {f.rule for f in findings} if (text := explain(rule)) is not None}
    return convert.hover(findings, ls.document(uri), params.position, docs)


async def _verify(ls: TrainlintServer, *args: Any) -> dict[str, Any]:
    """``trainlint.verify`` with arguments ``[uri, rule, line, column]`` (as the code action sends
    them): runs the finding's probe in a child process and shows the verdict."""
    try:
        uri, rule, line, column = str(args[0]), str(args[1]), int(args[2]), int(args[3])
    except (IndexError, TypeError, ValueError):
        return {"status": "usage", "message": "expected arguments [uri, rule, line, column]"}
    state = ls.state(uri)
    finding = next((f for f in state.findings if (f.rule, f.line, f.column) == (rule, line, column)), None)
    if finding is None:
        message = f"trainlint: no {rule} finding at line {line}, column {column} any more"
        ls.show(lsp.MessageType.Warning, message)
        return {"status": "gone", "message": message}
    ls.show(
        lsp.MessageType.Info, f"trainlint: verifying {rule} at line {line} (running it in a child process)"
    )
    try:
        verified = await asyncio.get_running_loop().run_in_executor(
            None, ls.linter.verify, finding, state.text, ls.path_of(uri)
        )
    except ConfigError as exc:
        ls.show(lsp.MessageType.Error, f"trainlint: {exc}")
        return {"status": "unavailable", "message": str(exc)}
    verdict = verified.verify or {"status": "no-probe", "detail": f"{rule} has no runtime probe"}
    if ls.states.get(uri) is state:  # the text has not changed since: a verified fix may now apply
        state.verified[(rule, line, column)] = verified
    message = f"trainlint --verify {rule} (line {line}): {describe_verify(verdict)}"
    confirmed = verdict.get("status") == "confirmed"
    ls.show(lsp.MessageType.Warning if confirmed else lsp.MessageType.Info, message)
    return {"status": verdict.get("status"), "message": message, "verify": verdict}


def build_server(debounce: float = DEBOUNCE_S) -> TrainlintServer:
    server = TrainlintServer(debounce)
    server.feature(lsp.INITIALIZE)(_initialize)
    server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)(_did_open)
    server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)(_did_change)
    server.feature(lsp.TEXT_DOCUMENT_DID_SAVE)(_did_save)
    server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)(_did_close)
    server.feature(
        lsp.TEXT_DOCUMENT_CODE_ACTION,
        lsp.CodeActionOptions(code_action_kinds=[lsp.CodeActionKind.QuickFix, convert.FIX_ALL]),
    )(_code_actions)
    server.feature(lsp.TEXT_DOCUMENT_HOVER)(_hover)
    server.command(convert.VERIFY_COMMAND)(_verify)
    return server
