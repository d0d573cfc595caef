"""The ``trainlint`` command line: arguments, configuration, running the engine, reporting, exit codes."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from trainlint import __version__
from trainlint.cache import Job, Outcome, ResultCache
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
from trainlint.report import REPORTERS, OutputOptions, RunReport, make_console
from trainlint.results import FileResult, LintOptions, Problem, ProblemKind, internal_error
from trainlint.rule import registry, use_known_ids

if TYPE_CHECKING:
    import multiprocessing.context

    from rich.console import Console

    from trainlint.fix import FixOutcome

# A run answered from the result cache imports neither the engine (libcst, the rules) nor rich: both
# are imported where a file is really linted or findings are drawn.

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
# A first argument naming one of these runs that tool instead of the linter (see the --help epilog).
SUBCOMMANDS = {"memory": "trainlint.memory.cli", "run": "trainlint.run.cli"}


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep one clear line
        raise UsageError(message)


class _HelpFormatter(argparse.HelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # the epilog is laid out by hand (a table of commands); the description is one paragraph
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trainlint",
        description="Find silent mistakes in PyTorch training code: mixed precision, loss scaling, "
        "activation checkpointing and gradient accumulation.",
        epilog="commands:\n"
        "  trainlint memory ARGS...  the memory bill of a training setup (see `trainlint memory --help`)\n"
        "  trainlint run ARGS...     watch your own training run (see `trainlint run --help`)\n"
        "Only a first argument of exactly `memory` or `run` starts a command; to lint a file or folder\n"
        "of that name, write ./memory or ./run.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument("paths", nargs="*", help="files or folders to lint (default: .); '-' reads stdin")
    p.add_argument("--format", choices=tuple(REPORTERS), default="text", help="output format (default: text)")
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


def _lint_one(job: Job, cache: ResultCache | None = None) -> Outcome:
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
        result = FileResult(shown, errors=[internal_error(shown, exc)])
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


@dataclass
class _Settings:
    """What the command line and the configuration decide for this run."""

    args: argparse.Namespace
    config: Config
    rule_ids: list[str]
    severity: tuple[tuple[str, str], ...]
    cache: ResultCache | None

    def options(self, shown: str) -> LintOptions:
        return LintOptions(_rule_ids_for(self.config, self.rule_ids, shown), self.severity)


@dataclass
class _Linted:
    """The outcome of linting every file, before verification and fixes."""

    results: list[tuple[FileResult, str | None]]
    files: int
    # what ``--fix`` may rewrite: the reported path -> (the file on disk, or None for stdin; its options)
    targets: dict[str, tuple[str | None, LintOptions]]
    problems: list[Problem] = field(default_factory=list)
    stdin_text: str | None = None


def run(argv: Sequence[str] | None = None, stdin: str | None = None) -> int:
    _tolerant_output()
    use_known_ids(None)  # what an earlier run in this process installed is not this run's to use
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _subcommand(argv[0], argv[1:])
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        return _stop(Problem(ProblemKind.USAGE, "", str(exc)))
    if args.list_rules or args.explain:
        return _document(args)
    try:
        settings = _settings(args)
    except ConfigError as exc:
        return _stop(Problem(ProblemKind.CONFIG, "", str(exc)))
    started = time.perf_counter()
    linted = _lint_all(settings, stdin)
    if isinstance(linted, Problem):
        return _stop(linted)
    report = _report(linted, time.perf_counter() - started)
    if args.verify:
        from trainlint.verify import verify_findings

        report.findings = verify_findings(
            report.findings,
            report.sources,
            device=args.device or settings.config.verify_device,
            timeout=settings.config.verify_timeout,
        )
    if args.fix or args.diff:
        code = _fix(report, linted.targets, linted.stdin_text, args)
        if code is not None:
            return code
    _print_problems(report.errors)
    REPORTERS[args.format](
        report, OutputOptions(quiet=args.quiet, statistics=args.statistics, unsafe_fixes=args.unsafe_fixes)
    )
    return _exit_code(report, args)


def _exit_code(report: RunReport, args: argparse.Namespace) -> int:
    if any(problem.kind.fatal for problem in report.errors):
        return EXIT_ERROR
    if report.findings and not args.exit_zero:
        return EXIT_FINDINGS
    return EXIT_CLEAN


def _stop(problem: Problem) -> int:
    """End the run before anything is linted: one line on stderr, and the exit code of its kind."""
    _print_problems([problem])
    return EXIT_ERROR if problem.kind.fatal else EXIT_CLEAN


def _print_problems(problems: Sequence[Problem]) -> None:
    for problem in problems:
        _error(f"{problem.path}: {problem.message}" if problem.path else problem.message)


def _subcommand(name: str, argv: list[str]) -> int:
    """``trainlint memory ...`` and ``trainlint run ...``: tools next to the linter, imported only
    when asked for, so that linting never pays for them."""
    import importlib

    module_name = SUBCOMMANDS[name]
    missing = f"the `{name}` command is not available in this installation ({module_name} is missing)"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, module_name.rpartition(".")[0]):
            missing = f"`trainlint {name}` needs the module {exc.name!r}, which is not installed"
        return _stop(Problem(ProblemKind.USAGE, "", missing))
    entry = getattr(module, "main", None)
    if not callable(entry):
        return _stop(Problem(ProblemKind.USAGE, "", missing))
    return entry(argv)


def _document(args: argparse.Namespace) -> int:
    """``--list-rules`` and ``--explain``: print and exit, nothing is linted."""
    if args.list_rules:
        list_rules(make_console())
        return EXIT_CLEAN
    rule = registry().get(args.explain)
    if rule is None:
        return _stop(
            Problem(ProblemKind.USAGE, "", f"unknown rule {args.explain!r} (see `trainlint --list-rules`)")
        )
    print(rule.explain())
    return EXIT_CLEAN


def _settings(args: argparse.Namespace) -> _Settings:
    """The configuration, the cache and the rule selection; raises ``ConfigError``."""
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
    severity = tuple(sorted((k, v.value) for k, v in config.severity.items()))
    return _Settings(args, config, select_rules(select, extend, ignore), severity, cache)


def _refusal(args: argparse.Namespace, paths: list[str]) -> Problem | None:
    """What this run is asked to do that it cannot, found before linting anything."""
    if args.jobs is not None and args.jobs < 1:
        return Problem(ProblemKind.USAGE, "", f"--jobs must be at least 1, got {args.jobs}")
    if args.verify:
        from trainlint.verify import torch_available

        if not torch_available():
            return Problem(
                ProblemKind.USAGE,
                "",
                '--verify needs PyTorch. Install the extra: pip install "trainlint[verify]"',
            )
    if "-" in paths and paths != ["-"]:
        return Problem(ProblemKind.USAGE, "", "'-' (stdin) cannot be combined with other paths")
    missing = [p for p in paths if p != "-" and not os.path.lexists(p)]
    if missing:
        return Problem(ProblemKind.USAGE, "", f"{missing[0]}: no such file or folder")
    return None


def _lint_all(settings: _Settings, stdin: str | None) -> _Linted | Problem:
    paths = settings.args.paths or ["."]
    refusal = _refusal(settings.args, paths)
    if refusal is not None:
        return refusal
    if paths == ["-"]:
        return _lint_stdin(settings, stdin)
    return _lint_paths(settings, paths)


def _lint_stdin(settings: _Settings, stdin: str | None) -> _Linted:
    from trainlint.engine import lint_text

    text = stdin if stdin is not None else sys.stdin.read()
    shown = settings.args.stdin_filename or "<stdin>"
    options = settings.options(shown)
    try:
        result = lint_text(text, shown, options)
    except Exception as exc:  # the engine itself failed: report it like a file's failure
        result = FileResult(shown, errors=[internal_error(shown, exc)])
    return _Linted([(result, text)], 1, {shown: (None, options)}, stdin_text=text)


def _lint_paths(settings: _Settings, paths: list[str]) -> _Linted:
    config = settings.config
    excludes = (
        config.exclude if config.exclude is not None else list(DEFAULT_EXCLUDES)
    ) + config.extend_exclude
    listing_errors: list[str] = []
    files = list(discover([Path(p) for p in paths], excludes, config.root, listing_errors))
    cwd = os.getcwd()
    jobs_list: list[Job] = []
    for f in files:
        shown = _display_path(f, cwd)
        jobs_list.append((str(f), shown, settings.options(shown)))
    results = _run_jobs(jobs_list, settings.args.jobs, settings.cache)
    targets = {shown: (fs, opts) for fs, shown, opts in jobs_list}
    problems = [Problem(ProblemKind.SKIPPED, "", m) for m in listing_errors]
    return _Linted(results, len(files), targets, problems)


def _report(linted: _Linted, elapsed_s: float) -> RunReport:
    results = linted.results
    findings = sorted((f for r, _ in results for f in r.findings), key=lambda f: f.sort_key)
    errors = [*linted.problems, *(e for r, _ in results for e in r.errors)]
    sources = {r.path: text for r, text in results if text is not None}
    return RunReport(findings, errors, linted.files, elapsed_s, sources)


class _FixedFile(NamedTuple):
    original: bytes | None  # the file's bytes as read before fixing (None: stdin)
    before: str
    outcome: FixOutcome


def _fix(
    report: RunReport,
    targets: dict[str, tuple[str | None, LintOptions]],
    stdin_text: str | None,
    args: argparse.Namespace,
) -> int | None:
    """Apply (``--fix``) or show (``--diff``) fixes; returns an exit code when the run ends here."""
    from trainlint.engine import lint_text
    from trainlint.fix import applicable, unified_diff, write_fixed

    paths = sorted({f.path for f in report.findings if applicable(f, args.unsafe_fixes)})
    diffs: list[str] = []
    remaining = [f for f in report.findings if f.path not in paths]
    fixed_stdin = stdin_text
    for shown in paths:
        fs_path, options = targets[shown]
        fixed = _fixed_file(report, shown, fs_path, options, stdin_text, args.unsafe_fixes)
        if fixed is None:  # the file could not be read again: its findings stay as they were
            remaining.extend(f for f in report.findings if f.path == shown)
            continue
        original, before, outcome = fixed
        if args.diff:
            if outcome.text != before:
                diffs.append(unified_diff(shown, before, outcome.text))
            continue
        if fs_path is not None and original is not None and outcome.text != before:
            write_fixed(Path(fs_path), original, outcome.text)
        elif fs_path is None:
            fixed_stdin = outcome.text
        report.fixed += outcome.fixed
        remaining.extend(lint_text(outcome.text, shown, options).findings)
        report.sources[shown] = outcome.text
    if args.diff:
        _print_problems(report.errors)
        if diffs:
            sys.stdout.write("".join(diffs))
        return EXIT_FINDINGS if diffs and not args.exit_zero else EXIT_CLEAN
    report.findings = sorted(remaining, key=lambda f: f.sort_key)
    if stdin_text is not None:
        sys.stdout.write(fixed_stdin or "")
        return EXIT_FINDINGS if report.findings and not args.exit_zero else EXIT_CLEAN
    return None


def _fixed_file(
    report: RunReport,
    shown: str,
    fs_path: str | None,
    options: LintOptions,
    stdin_text: str | None,
    unsafe: bool,
) -> _FixedFile | None:
    """One file's (or stdin's) text with its fixes applied, written nowhere yet; None when the file
    cannot be read again. Fixes that had to be dropped are recorded in ``report.errors``."""
    from trainlint.engine import lint_text
    from trainlint.fix import fix_text

    if fs_path is None:
        original, before = None, stdin_text or ""
    else:
        try:
            original = Path(fs_path).read_bytes()
        except OSError as exc:  # deleted or made unreadable since it was linted
            reason = (exc.strerror or type(exc).__name__).lower()
            report.errors.append(
                Problem(ProblemKind.FIX, shown, f"fix not applied: cannot read the file: {reason}")
            )
            return None
        before = report.sources.get(shown) or read_source(Path(fs_path)).text or ""
    outcome = fix_text(before, lambda t: lint_text(t, shown, options).findings, unsafe)
    report.errors.extend(Problem(ProblemKind.FIX, shown, f"fix not applied: {m}") for m in outcome.dropped)
    return _FixedFile(original, before, outcome)


def _run_jobs(
    jobs_list: list[Job], jobs: int | None, cache: ResultCache | None
) -> list[tuple[FileResult, str | None]]:
    """Lint every job: cache hits first, the rest in worker processes when that pays off.

    Results keep the order of ``jobs_list`` whatever order the workers finish in."""
    results: list[Outcome | None] = [None] * len(jobs_list)
    todo: list[int] = []
    for i, job in enumerate(jobs_list):
        hit = cache.get(job) if cache else None
        if hit is not None:
            results[i] = hit
        else:
            todo.append(i)
    if todo:
        _lint_todo(jobs_list, todo, results, jobs, cache)
    return [r for r in results if r is not None]


def _lint_todo(
    jobs_list: list[Job],
    todo: list[int],
    results: list[Outcome | None],
    jobs: int | None,
    cache: ResultCache | None,
) -> None:
    """Lint the jobs the cache could not answer, filling ``results`` in place."""
    import gc

    # Files to lint: load the engine and the rules here, once, before any worker is forked.
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
    workers = max(1, min(_worker_count(jobs), len(todo)))
    # Starting workers costs tens of milliseconds: not worth it for a few small files (a pre-commit run).
    parallel = workers > 1 and sum(sizes.values()) >= 64 * 1024
    # Freeze what is alive now (modules, rules, the job list): the collector never scans it again, and
    # forked workers never copy its pages just to update the collector's bookkeeping.
    gc.collect()
    gc.freeze()
    try:
        if parallel:
            _lint_in_workers(jobs_list, todo, results, workers, cache)
        else:
            with _progress(len(todo)) as advance:
                for i in todo:
                    results[i] = _lint_one(jobs_list[i], cache)
                    advance()
    finally:
        gc.unfreeze()


def _worker_count(jobs: int | None) -> int:
    if jobs is not None:
        return jobs
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # the cores this process may use, not the machine's
    return os.cpu_count() or 1


def _fork_context() -> multiprocessing.context.BaseContext | None:
    # fork: workers start with trainlint and libcst already imported (spawn would import them again
    # in each)
    import multiprocessing

    return multiprocessing.get_context("fork") if sys.platform == "linux" else None


def _lint_in_workers(
    jobs_list: list[Job],
    todo: list[int],
    results: list[Outcome | None],
    workers: int,
    cache: ResultCache | None,
) -> None:
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=_fork_context())
    try:
        # ``map`` submits at once, so the workers are forked before any thread of ours (the progress
        # bar) runs.
        chunk = max(1, len(todo) // (workers * 32))
        outcomes = pool.map(_lint_one, [jobs_list[i] for i in todo], [cache] * len(todo), chunksize=chunk)
        with _progress(len(todo)) as advance:
            try:
                for i, outcome in zip(todo, outcomes, strict=True):
                    results[i] = outcome
                    advance()
            except BrokenProcessPool:
                # A worker died (killed, out of memory, a crash in native code). Lint what is left one
                # file per fresh process, so that only the file that kills its process is reported.
                for i in todo:
                    if results[i] is None:
                        results[i] = _lint_isolated(jobs_list[i], cache)
                        advance()
    finally:
        pool.shutdown(cancel_futures=True)


def _lint_isolated(job: Job, cache: ResultCache | None) -> Outcome:
    """``_lint_one`` in a process of its own: its death becomes an error for this file alone."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=_fork_context()) as single:
            return single.submit(_lint_one, job, cache).result()
    except BrokenProcessPool:
        message = (
            "internal error: the process linting this file died (out of memory, or a crash in native code)"
        )
        return FileResult(job[1], errors=[Problem(ProblemKind.INTERNAL, job[1], message)]), None


@contextmanager
def _progress(total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on a terminal for long runs; yields the function that advances it."""
    if not (sys.stderr.isatty() and total > 50):
        yield lambda: None
        return
    from rich.progress import Progress

    progress = Progress(console=make_console(stderr=True), transient=True)
    progress.start()
    task = progress.add_task("linting", total=total)
    try:
        yield lambda: progress.advance(task)
    finally:
        progress.stop()


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
