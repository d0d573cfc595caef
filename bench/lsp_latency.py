"""How fast ``trainlint server`` relints a 1,000-line file after an edit.

Builds a file of about 1,000 lines from the bundled fixtures (``--corpus clean``: the nanoGPT-style
model and training script and the ``good_*`` fixtures, a handful of findings; ``--corpus dense``: every
fixture, a planted mistake every few lines), then:

- in process: ``Linter.lint`` (what the server runs) on the first text, then on ``--edits`` edited
  versions (a series: each differs from the one before in one line, as typing makes them), and on an
  unchanged text (a save, a hover);
- phases: where a whole lint's time goes, and where a relint after an edit goes (the partial
  re-parse of ``trainlint.incremental``, the positions, ``lint_module``);
- over stdio: a real server process (``--debounce 0``) and pygls's client; the time from sending
  ``didChange`` to receiving its ``publishDiagnostics``.

    python bench/lsp_latency.py [--corpus clean|dense] [--edits 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lsprotocol import types as lsp
from pygls.lsp.client import LanguageClient

from trainlint.lsp.link import Linter

ROOT = Path(__file__).resolve().parent.parent
LINES = 1000


def corpus(kind: str) -> str:
    fixtures = ROOT / "fixtures"
    if kind == "dense":
        files = sorted(fixtures.glob("*.py"))
    else:
        files = sorted((fixtures / "run" / "nanogpt").glob("*.py")) + sorted(fixtures.glob("good_*.py"))
    parts = [f.read_text(encoding="utf-8") for f in files]
    text, i = "", 0
    while text.count("\n") < LINES:
        text += parts[i % len(parts)] + "\n"
        i += 1
    return text


def edited(text: str, n: int) -> str:
    """The text with one line changed, as typing does: edit ``n`` of a series appends a word to one
    comment line, a different one each time, spread over the file (always valid Python). Applied to
    the previous edit's text, so that two consecutive texts differ in that one line."""
    lines = text.split("\n")
    comments = [k for k, line in enumerate(lines) if line.lstrip().startswith("#")]
    k = comments[(n * 7919) % len(comments)]
    lines[k] += f" edit{n}"
    return "\n".join(lines)


def series(text: str, edits: int) -> list[str]:
    """``edits`` texts, each one ``edited`` from the one before."""
    out = []
    for n in range(edits):
        text = edited(text, n)
        out.append(text)
    return out


def ms(values: list[float]) -> str:
    low, mid, high = (round(v * 1000) for v in (min(values), statistics.median(values), max(values)))
    return f"median {mid} ms (min {low}, max {high})"


def timed(work: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of ``work`` (CPU time: what the wall time would be on an idle machine,
    for this single-threaded work; the machines these benches run on are often shared)."""
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def in_process(text: str, edits: int) -> None:
    linter = Linter(ROOT)
    wall, cpu = timed(lambda: linter.lint(text, None, "bench.py"))
    print(f"in process, first lint: {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU")
    after = [timed(lambda t=t: linter.lint(t, None, "bench.py")) for t in series(text, edits)]
    print(f"in process, after an edit: wall {ms([w for w, _ in after])}; CPU {ms([c for _, c in after])}")
    same = [timed(lambda: linter.lint(text, None, "bench.py")) for _ in range(edits)]
    print(f"in process, unchanged text (save, hover, code action): wall {ms([w for w, _ in same])}")


def phases(text: str, rounds: int) -> None:
    """Where a whole lint's time goes (wall time, best of ``rounds``): libcst's parser, the file model,
    the position pass the first finding triggers (code generation of the whole module), and the whole
    ``lint_text`` (what the server ran for every edit before it re-parsed in part, and still runs for a
    text it cannot: one that does not parse, say)."""
    import libcst as cst

    from trainlint.engine import lint_text
    from trainlint.model import FileModel
    from trainlint.results import LintOptions
    from trainlint.rule import registry

    options = LintOptions(tuple(registry().ids()))
    best: dict[str, float] = {}
    for n in range(rounds):
        changed = edited(text, n)  # from ``text``: the whole parse does not depend on the last text
        marks = [time.perf_counter()]
        module = cst.parse_module(changed)
        marks.append(time.perf_counter())
        model = FileModel(module, "bench.py", changed)
        marks.append(time.perf_counter())
        model.position(module)
        marks.append(time.perf_counter())
        model.release()
        lint_text(changed, "bench.py", options)
        marks.append(time.perf_counter())
        names = ("parse", "file model", "positions", "whole lint_text")
        for name, start, end in zip(names, marks[:-1], marks[1:], strict=True):
            best[name] = min(best.get(name, float("inf")), end - start)
    print("phases (best of", rounds, "):", ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in best.items()))


def partial_phases(text: str, rounds: int) -> None:
    """Where a relint after an edit goes in the server (CPU time, best of ``rounds``): the partial
    re-parse (``trainlint.incremental``), the positions of the module (the untouched statements'
    shifted), and ``lint_module`` (file model, rules, suppressions) on it."""
    from trainlint.engine import lint_module
    from trainlint.incremental import parse_full, reparse
    from trainlint.model.filemodel import PRECOMPUTED
    from trainlint.results import LintOptions
    from trainlint.rule import registry

    options = LintOptions(tuple(registry().ids()))
    parsed = parse_full(text)
    best: dict[str, float] = {}
    for changed in series(text, rounds):
        assert parsed is not None
        marks = [time.process_time()]
        new = reparse(parsed, changed)
        assert new is not None and new is not parsed, "a comment edit is always re-parsed in part"
        marks.append(time.process_time())
        PRECOMPUTED[id(new.module)] = (new.module, new.positions())
        marks.append(time.process_time())
        lint_module(new.module, changed, "bench.py", options)
        marks.append(time.process_time())
        PRECOMPUTED.pop(id(new.module))
        parsed = new
        names = ("partial parse", "positions", "lint_module")
        for name, start, end in zip(names, marks[:-1], marks[1:], strict=True):
            best[name] = min(best.get(name, float("inf")), end - start)
    shown = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in best.items())
    print(f"after an edit, CPU (best of {rounds}): {shown}")


async def over_stdio(text: str, edits: int) -> None:
    client = LanguageClient("bench", "0")
    published: dict[int, float] = {}

    def on_diagnostics(params: lsp.PublishDiagnosticsParams) -> None:
        published[params.version or 0] = time.perf_counter()

    client.feature(lsp.TEXT_DOCUMENT_PUBLISH_DIAGNOSTICS)(on_diagnostics)
    await client.start_io(sys.executable, "-m", "trainlint", "server", "--debounce", "0")
    await client.initialize_async(lsp.InitializeParams(capabilities=lsp.ClientCapabilities()))
    client.initialized(lsp.InitializedParams())
    uri = (ROOT / "bench_lsp_document.py").as_uri()  # never written: the text travels in the messages

    async def wait(version: int) -> float:
        while version not in published:
            await asyncio.sleep(0.001)
        return published[version]

    sent = time.perf_counter()
    client.text_document_did_open(lsp.DidOpenTextDocumentParams(lsp.TextDocumentItem(uri, "python", 1, text)))
    print(f"over stdio, open (first lint): {(await wait(1) - sent) * 1000:.0f} ms")
    times = []
    for n, changed in enumerate(series(text, edits)):
        version = n + 2
        sent = time.perf_counter()
        client.text_document_did_change(
            lsp.DidChangeTextDocumentParams(
                lsp.VersionedTextDocumentIdentifier(version=version, uri=uri),
                [lsp.TextDocumentContentChangeWholeDocument(text=changed)],
            )
        )
        times.append(await wait(version) - sent)
    print(f"over stdio, didChange -> publishDiagnostics: {ms(times)}")
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--corpus", choices=("clean", "dense"), default="clean")
    parser.add_argument("--edits", type=int, default=20)
    args = parser.parse_args()
    text = corpus(args.corpus)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.corpus} corpus: {text.count(chr(10))} lines; load average {load:.1f} on {os.cpu_count()} cores"
    )
    in_process(text, args.edits)
    phases(text, min(args.edits, 8))
    partial_phases(text, min(args.edits, 8))
    asyncio.run(over_stdio(text, args.edits))


if __name__ == "__main__":
    main()
