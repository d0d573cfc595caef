"""The ``trainlint`` command line: arguments, configuration, running the engine, reporting, exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainlint import __version__
from trainlint.cache import ResultCache
from trainlint.config import (
    Config,
    ConfigError,
    check_selectors,
    find_config,
    ignored_for_file,
    load_config,
    select_rules,
)
from trainlint.files import DEFAULT_EXCLUDES, discover, read_source
from trainlint.report import RunReport
from trainlint.results import FileResult, LintOptions
from trainlint.rule import registry, use_known_ids

if TYPE_CHECKING:
    from rich.console import Console

# A run answered from the result cache imports neither the engine (libcst, the rules) nor rich: both
# are imported where a file is really linted or findings are drawn.

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
FORMATS = ("text", "json", "sarif", "github")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep one clear line
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trainlint",
        description="Find silent mistakes in PyTorch training code: mixed precision, loss scaling, "
        "activation checkpointing and gradient accumulation.",
    )
    p.add_argument("paths", nargs="*", help="files or folders to lint (default: .); '-' reads stdin")
    p.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    p.add_argument("--select", help="comma-separated rule ids or prefixes to enable (replaces the default)")
    p.add_argument("--extend-select", help="comma-separated rule ids or prefixes to enable in addition")
    p.add_argument("--ignore", help="comma-separated rule ids or prefixes to disable")
    p.add_argument("--fix", action="store_true", help="apply safe fixes (and verified ones with --verify)")
    p.add_argument("--diff", action="store_true", help="print the fixes as a unified diff; change nothing")
    p.add_argument("--unsafe-fixes", action="store_true", help="also apply or show unsafe fixes")
    p.add_argument(
        "--verify", action="store_true", help="run the runtime check on findings that have a probe"
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="device for --verify (default: auto)")
    p.add_argument("--explain", metavar="RULE", help="print a rule's documentation and exit")
    p.add_argument("--list-rules", action="store_true", help="list every rule and exit")
    p.add_argument("--stdin-filename", metavar="FILE", help="the name to report stdin under")
    p.add_argument("--config", metavar="PATH", help="configuration file (default: nearest pyproject.toml)")
    p.add_argument("--jobs", "-j", type=int, metavar="N", help="worker processes (default: number of cores)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the result cache")
    p.add_argument("--cache-dir", metavar="DIR", help="result cache folder (default: .trainlint_cache)")
    p.add_argument("--quiet", "-q", action="store_true", help="print findings only, no summary")
    p.add_argument("--statistics", action="store_true", help="print the number of findings per rule")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when there are findings")
    p.add_argument("--version", action="version", version=f"trainlint {__version__}")
    return p


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()] if value else []


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _plain(stream: object) -> bool:
    """Output rich would print without colour: not a terminal, and colour not forced."""
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty()) if callable(isatty) else False
    return not tty and not os.environ.get("FORCE_COLOR") and not os.environ.get("TTY_COMPATIBLE")


def _error(message: str) -> None:
    """One plain line on stderr (no markup or emoji codes: paths are printed as they are)."""
    print(f"trainlint: error: {message}", file=sys.stderr)


def list_rules(console: Console) -> None:
    columns = ("id", "name", "severity", "fix", "probe", "summary")
    rows = [
        (
            r.id,
            r.name,
            r.severity.value,
            "yes" if r.has_fix else "no",
            "yes" if r.has_probe() else "no",
            r.summary,
        )
        for r in registry()
    ]
    if not console.is_terminal:  # pipes and CI logs: one unwrapped line per rule
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns[:-1])]
        for row in [columns, *rows]:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) + "  " + row[-1])
        return
    from rich.table import Table

    table = Table()
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _physical(path: str | Path, cwd: str) -> str:
    """The path with its folders resolved (links, ``..``) but not its last part: a link is still
    named as itself, and a path reached through a linked folder is seen where it really is."""
    joined = os.path.join(cwd, path)
    folder, name = os.path.split(joined)
    return os.path.join(os.path.realpath(folder), name) if name else os.path.realpath(joined)


def _display_path(path: Path, cwd: str | None = None) -> str:
    """The path relative to the working folder when it lies inside it, else as given."""
    folder = cwd if cwd is not None else os.getcwd()
    prefix = folder if folder.endswith(os.sep) else folder + os.sep
    absolute = os.path.abspath(path)
    if not absolute.startswith(prefix):  # resolve folders only when needed: this runs once per file
        absolute = _physical(path, folder)
    if absolute.startswith(prefix):
        return Path(absolute[len(prefix) :]).as_posix()
    return path.as_posix()


# the process that last checked that the pre-linting heap is frozen (``gc.get_freeze_count`` walks the
# whole frozen heap: once per process, not once per file)
_FROZEN_IN: dict[str, int] = {}


def _lint_one(
    job: tuple[str, str, LintOptions], cache: ResultCache | None = None
) -> tuple[FileResult, str | None]:
    """Worker: read and lint one file, and record the outcome in the cache (from the very text that
    was linted, so a file edited during the run is never cached under the wrong content). Returns the
    text only when it is needed for code frames."""
    import gc

    from trainlint.engine import lint_text, unreadable, with_configured_severity

    fs_path, shown, options = job
    source = read_source(Path(fs_path))
    if source.text is None:
        result = FileResult(shown)
        if "TL902" in options.rule_ids:
            result.findings.append(
                with_configured_severity(unreadable(shown, source.error or "unknown error"), options)
            )
        return result, None
    # The cyclic garbage collector would scan the growing syntax tree over and over while libcst
    # builds it, for nothing: the engine leaves no cycle behind (FileModel.release), so the tree is
    # freed by reference counting once the file is done. Objects alive before linting started are
    # frozen (see _run_jobs): never scanned again.
    collect = gc.isenabled()
    if collect:
        if _FROZEN_IN.get("pid") != os.getpid():
            _FROZEN_IN["pid"] = os.getpid()
            if not gc.get_freeze_count():  # a worker that did not inherit the frozen heap (spawn)
                gc.collect()
                gc.freeze()
        gc.disable()
    try:
        result = lint_text(source.text, shown, options)
    except Exception as exc:  # the engine itself failed on this file: report it, keep going
        result = FileResult(
            shown, errors=[{"path": shown, "message": f"internal error: {type(exc).__name__}: {exc}"}]
        )
    finally:
        if collect:
            gc.enable()
    if cache is not None:
        cache.store(job, source.text, result)
    return result, (source.text if result.findings else None)


def _rule_ids_for(config: Config, base: list[str], display: str) -> tuple[str, ...]:
    if not config.per_file_ignores:
        return tuple(base)
    ignored = ignored_for_file(config, _relative_to_root(config, display))
    return tuple(i for i in base if not any(i.startswith(p) for p in ignored))


def _relative_to_root(config: Config, display: str) -> str:
    for resolve in (os.path.abspath, lambda d: _physical(d, os.getcwd())):
        try:
            return Path(resolve(display)).relative_to(config.root).as_posix()
        except ValueError:
            continue
    return display


def _tolerant_output() -> None:
    """File names are bytes: one that is not valid in the output's encoding (a Latin-1 name under a
    UTF-8 locale arrives as surrogates) is printed with backslash escapes instead of failing."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if callable(reconfigure):
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # pragma: no cover - a stream that cannot change
                pass


def run(argv: Sequence[str] | None = None, stdin: str | None = None) -> int:
    _tolerant_output()
    use_known_ids(None)  # what an earlier run in this process installed is not this run's to use
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        _error(str(exc))
        return EXIT_ERROR

    if args.list_rules:
        list_rules(_console())
        return EXIT_CLEAN
    if args.explain:
        rule = registry().get(args.explain)
        if rule is None:
            _error(f"unknown rule {args.explain!r} (see `trainlint --list-rules`)")
            return EXIT_ERROR
        print(rule.explain())
        return EXIT_CLEAN

    try:
        config_path = Path(args.config) if args.config else find_config(Path.cwd())
        if args.config and not config_path.is_file():
            raise ConfigError(f"{args.config}: no such configuration file")
        cache = None
        if not args.no_cache and "-" not in args.paths:
            root = config_path.parent.resolve() if config_path is not None else Path.cwd()
            cache = ResultCache(Path(args.cache_dir) if args.cache_dir else root / ".trainlint_cache")
            known = cache.recorded_rule_ids()
            if known is not None:
                use_known_ids(known)
        config = load_config(config_path)
        select = check_selectors(_split(args.select), "--select") if args.select else config.select
        extend = config.extend_select + check_selectors(_split(args.extend_select), "--extend-select")
        ignore = config.ignore + check_selectors(_split(args.ignore), "--ignore")
    except ConfigError as exc:
        _error(f"{exc}")
        return EXIT_ERROR
    if args.jobs is not None and args.jobs < 1:
        _error(f"--jobs must be at least 1, got {args.jobs}")
        return EXIT_ERROR
    rule_ids = select_rules(select, extend, ignore)
    severity = tuple(sorted((k, v.value) for k, v in config.severity.items()))

    if args.verify:
        from trainlint.verify import torch_available

        if not torch_available():
            _error('--verify needs PyTorch. Install the extra: pip install "trainlint[verify]"')
            return EXIT_ERROR

    started = time.perf_counter()
    errors: list[dict[str, str]] = []
    results: list[tuple[FileResult, str | None]] = []
    jobs_list: list[tuple[str, str, LintOptions]] = []
    stdin_text: str | None = None
    paths = args.paths or ["."]
    if paths == ["-"] or "-" in paths:
        if paths != ["-"]:
            _error("'-' (stdin) cannot be combined with other paths")
            return EXIT_ERROR
        from trainlint.engine import lint_text

        stdin_text = stdin if stdin is not None else sys.stdin.read()
        shown = args.stdin_filename or "<stdin>"
        options = LintOptions(_rule_ids_for(config, rule_ids, shown), severity)
        try:
            result = lint_text(stdin_text, shown, options)
        except Exception as exc:  # the engine itself failed: report it like a file's failure
            message = f"internal error: {type(exc).__name__}: {exc}"
            result = FileResult(shown, errors=[{"path": shown, "message": message}])
        results.append((result, stdin_text))
        file_count = 1
    else:
        missing = [p for p in paths if not os.path.lexists(p)]
        if missing:
            _error(f"{missing[0]}: no such file or folder")
            return EXIT_ERROR
        excludes = (
            config.exclude if config.exclude is not None else list(DEFAULT_EXCLUDES)
        ) + config.extend_exclude
        listing_errors: list[str] = []
        files = list(discover([Path(p) for p in paths], excludes, config.root, listing_errors))
        errors.extend({"path": "", "message": m} for m in listing_errors)
        cwd = os.getcwd()
        for f in files:
            shown = _display_path(f, cwd)
            jobs_list.append((str(f), shown, LintOptions(_rule_ids_for(config, rule_ids, shown), severity)))
        results = _run_jobs(jobs_list, args.jobs, cache)
        file_count = len(files)

    findings = sorted((f for r, _ in results for f in r.findings), key=lambda f: f.sort_key)
    for r, _ in results:
        errors.extend(r.errors)
    sources = {r.path: text for r, text in results if text is not None}

    report = RunReport(findings, errors, file_count, time.perf_counter() - started, sources)

    if args.verify:
        from trainlint.verify import verify_findings

        report.findings = verify_findings(
            report.findings,
            sources,
            device=args.device or config.verify_device,
            timeout=config.verify_timeout,
        )

    if args.fix or args.diff:
        targets = {shown: (fs, opts) for fs, shown, opts in jobs_list}
        if stdin_text is not None:
            targets = {shown: (None, LintOptions(_rule_ids_for(config, rule_ids, shown), severity))}
        code = _fix(report, targets, stdin_text, args)
        if code is not None:
            return code

    for e in errors:
        where = f"{e['path']}: " if e.get("path") else ""
        _error(f"{where}{e['message']}")
    _render(report, args)
    if any("internal error" in e["message"] for e in errors):
        return EXIT_ERROR
    if report.findings and not args.exit_zero:
        return EXIT_FINDINGS
    return EXIT_CLEAN


def _fix(
    report: RunReport,
    targets: dict[str, tuple[str | None, LintOptions]],
    stdin_text: str | None,
    args: argparse.Namespace,
) -> int | None:
    """Apply (``--fix``) or show (``--diff``) fixes; returns an exit code when the run ends here."""
    from trainlint.engine import lint_text
    from trainlint.fix import applicable, fix_text, unified_diff, write_fixed

    unsafe = args.unsafe_fixes
    paths = sorted({f.path for f in report.findings if applicable(f, unsafe)})
    diffs: list[str] = []
    remaining = [f for f in report.findings if f.path not in paths]
    fixed_stdin = stdin_text
    for shown in paths:
        fs_path, options = targets[shown]
        if fs_path is None:
            original_bytes, before = None, stdin_text or ""
        else:
            try:
                original_bytes = Path(fs_path).read_bytes()
            except OSError as exc:  # deleted or made unreadable since it was linted
                reason = (exc.strerror or type(exc).__name__).lower()
                report.errors.append(
                    {"path": shown, "message": f"fix not applied: cannot read the file: {reason}"}
                )
                remaining.extend(f for f in report.findings if f.path == shown)
                continue
            before = report.sources.get(shown) or read_source(Path(fs_path)).text or ""
        outcome = fix_text(before, lambda t, s=shown, o=options: lint_text(t, s, o).findings, unsafe)
        for message in outcome.dropped:
            report.errors.append({"path": shown, "message": f"fix not applied: {message}"})
        if args.diff:
            if outcome.text != before:
                diffs.append(unified_diff(shown, before, outcome.text))
            continue
        if fs_path is not None and original_bytes is not None and outcome.text != before:
            write_fixed(Path(fs_path), original_bytes, outcome.text)
        elif fs_path is None:
            fixed_stdin = outcome.text
        report.fixed += outcome.fixed
        after = lint_text(outcome.text, shown, options)
        remaining.extend(after.findings)
        report.sources[shown] = outcome.text
    if args.diff:
        for e in report.errors:
            _error(f"{e['path']}: {e['message']}")
        if diffs:
            sys.stdout.write("".join(diffs))
        return EXIT_FINDINGS if diffs and not args.exit_zero else EXIT_CLEAN
    report.findings = sorted(remaining, key=lambda f: f.sort_key)
    if stdin_text is not None:
        sys.stdout.write(fixed_stdin or "")
        return EXIT_FINDINGS if report.findings and not args.exit_zero else EXIT_CLEAN
    return None


def _render(report: RunReport, args: argparse.Namespace) -> None:
    if args.format == "json":
        from trainlint.report.json_format import render_json

        print(render_json(report))
    elif args.format == "sarif":
        from trainlint.report.sarif import render_sarif

        print(render_sarif(report))
    elif args.format == "github":
        from trainlint.report.github import render_github

        text = render_github(report)
        if text:
            print(text)
    elif not (report.findings or report.errors or report.fixed or args.statistics or args.quiet) and _plain(
        sys.stdout
    ):
        # nothing to draw: no need to load rich for one uncoloured line (pre-commit, CI logs)
        print(f"All checks passed! ({report.files} file{'s' if report.files != 1 else ''} checked)")
    else:
        from trainlint.report.text import render_statistics, render_text

        if args.statistics:
            render_statistics(report, _console())
        else:
            render_text(report, _console(), quiet=args.quiet, unsafe_fixes=args.unsafe_fixes)


def _run_jobs(
    jobs_list: list[tuple[str, str, LintOptions]],
    jobs: int | None,
    cache: ResultCache | None,
) -> list[tuple[FileResult, str | None]]:
    """Lint every job: cache hits first, the rest in worker processes when that pays off.

    Results keep the order of ``jobs_list`` whatever order the workers finish in."""
    import gc

    def isolated(job: tuple[str, str, LintOptions]) -> tuple[FileResult, str | None]:
        """``_lint_one`` in a process of its own: its death becomes an error for this file alone."""
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as single:
                return single.submit(_lint_one, job, cache).result()
        except BrokenProcessPool:
            message = "internal error: the process linting this file died (out of memory, or a crash in native code)"
            return FileResult(job[1], errors=[{"path": job[1], "message": message}]), None

    results: list[tuple[FileResult, str | None] | None] = [None] * len(jobs_list)
    todo: list[int] = []
    for i, job in enumerate(jobs_list):
        hit = cache.get(job) if cache else None
        if hit is not None:
            results[i] = hit
        else:
            todo.append(i)
    if not todo:
        return [r for r in results if r is not None]
    # Files to lint: load the engine and the rules here, once, before any worker is forked.
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    import trainlint.engine  # noqa: F401

    if cache is not None:
        cache.record_rule_ids(tuple(registry().ids()))
    sizes = {}
    for i in todo:
        try:
            sizes[i] = os.stat(jobs_list[i][0]).st_size
        except OSError:
            sizes[i] = 0
    # Largest files first: the last tasks are the smallest, so no worker is left alone with a big one.
    todo.sort(key=lambda i: -sizes[i])
    if jobs is not None:
        workers = jobs
    elif hasattr(os, "sched_getaffinity"):
        workers = len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
    else:
        workers = os.cpu_count() or 1
    workers = max(1, min(workers, len(todo)))
    # Starting workers costs tens of milliseconds: not worth it for a few small files (a pre-commit run).
    parallel = workers > 1 and sum(sizes.values()) >= 64 * 1024
    context = multiprocessing.get_context("fork") if sys.platform == "linux" else None
    # Freeze what is alive now (modules, rules, the job list): the collector never scans it again, and
    # forked workers never copy its pages just to update the collector's bookkeeping.
    gc.collect()
    gc.freeze()
    pool = outcomes = progress = None
    try:
        if parallel:
            # fork: workers start with trainlint and libcst already imported (spawn would import them
            # again in each). ``map`` submits at once, so the workers are forked before any thread of
            # ours (the progress bar) runs.
            pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
            chunk = max(1, len(todo) // (workers * 32))
            outcomes = pool.map(_lint_one, [jobs_list[i] for i in todo], [cache] * len(todo), chunksize=chunk)
        if sys.stderr.isatty() and len(todo) > 50:
            from rich.progress import Progress

            progress = Progress(console=_console(stderr=True), transient=True)
            progress.start()
            task = progress.add_task("linting", total=len(todo))
        if outcomes is not None:
            try:
                for i, outcome in zip(todo, outcomes, strict=True):
                    results[i] = outcome
                    if progress:
                        progress.advance(task)
            except BrokenProcessPool:
                # A worker died (killed, out of memory, a crash in native code). Lint what is left one
                # file per fresh process, so that only the file that kills its process is reported.
                for i in todo:
                    if results[i] is None:
                        results[i] = isolated(jobs_list[i])
                        if progress:
                            progress.advance(task)
        else:
            for i in todo:
                results[i] = _lint_one(jobs_list[i], cache)
                if progress:
                    progress.advance(task)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if progress:
            progress.stop()
        gc.unfreeze()
    return [r for r in results if r is not None]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_CLEAN
    except Exception as exc:  # a bug in trainlint: one line, exit 2, never a traceback
        print(f"trainlint: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
