"""The ``trainlint`` command line: arguments, configuration, running the engine, reporting, exit codes."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from trainlint import __version__
from trainlint.bounded import give_back_memory
from trainlint.config import (
    Config,
    ConfigError,
    ConfigResolver,
    find_config,
    flag_selectors,
    rule_ids_for_file,
    select_rules,
)
from trainlint.files import MAX_SOURCE_BYTES, NOTEBOOK, discover, display_path, is_excluded, read_source
from trainlint.gates import rule_ids
from trainlint.procs import PENDING_EXIT, Terminated, discard_stdout, init_worker, sigterm_unwinds
from trainlint.report import REPORTERS, OutputOptions, RunReport, make_console
from trainlint.results import FileResult, LintOptions, Problem, ProblemKind, frame_text, internal_error
from trainlint.rule import Finding, use_known_ids

if TYPE_CHECKING:
    import multiprocessing.context

    from trainlint.cache import Job, Outcome, ResultCache
    from trainlint.fix import FixOutcome
    from trainlint.verify.runner import Child

# A run answered from the result cache imports neither the engine (libcst, the rules) nor rich, and an
# editor's ``--no-cache -`` neither the cache (with the project index) nor the notebook reader: each is
# imported where a file is really linted, a cache used, a notebook read or findings are drawn.

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
_PENDING_EXIT = PENDING_EXIT  # the exit code of a run whose output is being printed (or a subcommand's)
# PyTorch is not a dependency: the extra would pull the multi-GB CUDA build. Say what works instead.
TORCH_HINT = (
    "--verify needs PyTorch in this environment; install it first, e.g. the CPU build: "
    "pip install torch --index-url https://download.pytorch.org/whl/cpu "
    "(or the build for your GPU, see https://pytorch.org/get-started/locally/)"
)
# A first argument naming one of these runs that tool instead of the linter (see the --help epilog).
SUBCOMMANDS = {"memory": "trainlint.memory.cli", "run": "trainlint.run.cli", "server": "trainlint.lsp.server"}


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep one clear line
        raise UsageError(message)


class _HelpFormatter(argparse.HelpFormatter):
    def __init__(self, prog: str, *args: Any, **kwargs: Any) -> None:
        # argparse makes one for every argument added (to check its metavar); without a width, each asks
        # shutil (2 ms to import, with its compression modules) for a help text an editor's run never prints
        if len(args) < 3 and kwargs.get("width") is None:
            kwargs["width"] = _terminal_columns() - 2
        super().__init__(prog, *args, **kwargs)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        # the epilog is laid out by hand (a table of commands); the description is one paragraph
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _terminal_columns() -> int:
    """``shutil.get_terminal_size().columns``: ``$COLUMNS``, else the terminal's on stdout, else 80."""
    with suppress(KeyError, ValueError):
        if int(os.environ["COLUMNS"]) > 0:
            return int(os.environ["COLUMNS"])
    with suppress(AttributeError, ValueError, OSError):
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80
    return 80


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="trainlint",
        description="Find silent mistakes in PyTorch training code: mixed precision, loss scaling, "
        "activation checkpointing and gradient accumulation.",
        epilog="commands:\n"
        "  trainlint memory ARGS...  the memory bill of a training setup (see `trainlint memory --help`)\n"
        "  trainlint run ARGS...     watch your own training run (see `trainlint run --help`)\n"
        "  trainlint server          a language server for editors (see `trainlint server --help`)\n"
        "Only a first argument of exactly `memory`, `run` or `server` starts a command; to lint a file\n"
        "or folder of that name, write ./memory, ./run or ./server.",
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
        "--verify",
        action="store_true",
        help="run the runtime check on findings that have a probe; this RUNS THE REPOSITORY'S CODE "
        "(its definitions, constructors, imports and the flagged statements) in a sandboxed child: "
        "use it only on code you would run yourself",
    )
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="device for --verify (default: auto)")
    p.add_argument("--explain", metavar="RULE", help="print a rule's documentation (by id or name) and exit")
    p.add_argument(
        "--list-rules", action="store_true", help="list every rule (--format json: as JSON) and exit"
    )
    p.add_argument("--stdin-filename", metavar="FILE", help="the name to report stdin under")
    p.add_argument(
        "--force-exclude",
        action="store_true",
        help="apply the excludes to files named on the command line too (pre-commit, editors)",
    )
    p.add_argument(
        "--config",
        metavar="PATH",
        help="use this configuration for every file (default: the closest one above each file)",
    )
    p.add_argument("--jobs", "-j", type=int, metavar="N", help="worker processes (default: number of cores)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the result cache")
    p.add_argument(
        "--cache-dir", metavar="DIR", help="result cache folder (default: per user, ~/.cache/trainlint)"
    )
    p.add_argument("--quiet", "-q", action="store_true", help="print findings only, no summary")
    p.add_argument("--statistics", action="store_true", help="print the number of findings per rule")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when there are findings")
    p.add_argument("--version", action="version", version=f"trainlint {__version__}")
    return p


def _error(message: str) -> None:
    """One plain line on stderr (no markup or emoji codes; control characters escaped)."""
    from trainlint.report.escape import escape_controls  # (its patterns: a run with no error needs none)

    print(f"trainlint: error: {escape_controls(message)}", file=sys.stderr)


# the process that last checked the pre-linting heap is frozen (``gc.get_freeze_count`` walks it all)
_FROZEN_IN: dict[str, int] = {}


def _lint_one(job: Job, cache: ResultCache | None = None, trim: bool = True) -> Outcome:
    """Worker: read and lint one file, and record the outcome in the cache (from the very text linted,
    so a file edited during the run is never cached under the wrong content) with what the lint asked
    of the project. Returns the text only when it is needed for code frames. ``trim``: give the file's
    memory back to the system (not after a run's last file: the trim costs pre-commit 3-5 ms)."""
    import gc
    from contextlib import nullcontext

    from trainlint.engine import lint_text, unreadable, with_configured_severity

    fs_path, shown, options = job
    lint, limit = lint_text, MAX_SOURCE_BYTES
    if fs_path.endswith(NOTEBOOK):
        from trainlint.notebook import MAX_NOTEBOOK_BYTES, lint_notebook

        lint, limit = lint_notebook, MAX_NOTEBOOK_BYTES
    source = read_source(Path(fs_path), limit)
    if source.text is None:
        result = FileResult(shown)
        if "TL902" in options.rule_ids:
            result.findings.append(
                with_configured_severity(unreadable(shown, source.error or "unknown error"), options)
            )
        return result, None
    # The cyclic garbage collector would scan libcst's growing tree over and over, for nothing: the
    # engine leaves no cycle behind (FileModel.release), so reference counting frees the tree once the
    # file is done. Objects alive before linting started are frozen (_run_jobs): never scanned again.
    collect = gc.isenabled()
    if collect:
        if _FROZEN_IN.get("pid") != os.getpid():
            _FROZEN_IN["pid"] = os.getpid()
            if not gc.get_freeze_count():  # a worker that did not inherit the frozen heap (spawn)
                gc.collect()
                gc.freeze()
        gc.disable()
    try:
        with cache.recording(job, source.text) if cache is not None else nullcontext() as found:
            result = lint(source.text, shown, options)
    except Exception as exc:  # the engine itself failed on this file: report it, keep going
        result, found = FileResult(shown, errors=[internal_error(shown, exc)]), None
    finally:
        if collect:
            gc.enable()
        if trim:
            give_back_memory()  # what this file's trees took, once it adds up
    if cache is not None:
        cache.store(job, source.text, result, found)
    return result, frame_text(fs_path, result.findings, source.text)


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


class _Selectors(NamedTuple):
    """``--select`` (None: the configuration's), ``--extend-select`` and ``--ignore``, checked."""

    select: list[str] | None
    extend: list[str]
    ignore: list[str]


@dataclass(repr=False, eq=False)  # (each method made costs the import an exec: never compared or printed)
class _Settings:
    """What the command line and the configuration decide for this run. Each file is linted with the
    configuration closest above it (or the one ``--config`` pins); ``config`` is the run's own (the
    first path's): it decides the verify settings and where the cache lives."""

    args: argparse.Namespace
    config: Config
    configs: ConfigResolver
    selectors: _Selectors
    cache: ResultCache | None
    _chosen: dict[int, tuple[list[str], tuple[tuple[str, str], ...]]] = field(default_factory=dict)
    early: Child | None = None  # --verify: the child started before linting (imports torch meanwhile)

    def chosen(self, config: Config) -> tuple[list[str], tuple[tuple[str, str], ...]]:
        """The rules a configuration enables once the command line has had its say, and their severities."""
        found = self._chosen.get(id(config))
        if found is None:
            cli = self.selectors
            select = cli.select if cli.select is not None else config.select
            ids = select_rules(select, config.extend_select + cli.extend, config.ignore + cli.ignore)
            severity = tuple(sorted((k, v.value) for k, v in config.severity.items()))
            found = self._chosen[id(config)] = (ids, severity)
        return found

    def options(self, shown: str, config: Config | None = None) -> LintOptions:
        config = self.config if config is None else config
        rule_ids, severity = self.chosen(config)
        return LintOptions(rule_ids_for_file(config, rule_ids, shown), severity)


@dataclass(repr=False, eq=False)
class _Linted:
    """The outcome of linting every file, before verification and fixes."""

    results: list[tuple[FileResult, str | None]]
    files: int
    # what ``--fix`` may rewrite: the reported path -> (the file on disk, or None for stdin; its options)
    targets: dict[str, tuple[str | None, LintOptions]]
    problems: list[Problem] = field(default_factory=list)
    stdin_text: str | None = None
    excluded: int = 0  # paths the excludes skipped (files named, files and folders found)


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
    try:
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
                early=settings.early,
            )
    except ConfigError as exc:  # the configuration of a nested project, read when its files came up
        return _stop(Problem(ProblemKind.CONFIG, "", str(exc)))
    finally:
        if settings.early is not None:
            settings.early.close()  # already used or ended, unless linting stopped on an error
    if args.fix or args.diff:
        code = _fix(report, linted.targets, linted.stdin_text, args)
        if code is not None:
            return code
    _PENDING_EXIT[:] = [_exit_code(report, args)]  # what a reader that stops reading still gets
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
    code = EXIT_ERROR if problem.kind.fatal else EXIT_CLEAN
    _PENDING_EXIT[:] = [code]  # `trainlint ... 2>&1 | head -1` still exits with it
    _print_problems([problem])
    return code


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
    from trainlint.report.rules import find_rule, list_rules

    if args.list_rules:
        list_rules(as_json=args.format == "json")
        return EXIT_CLEAN
    rule = find_rule(args.explain)
    if rule is None:
        return _stop(
            Problem(ProblemKind.USAGE, "", f"unknown rule {args.explain!r} (see `trainlint --list-rules`)")
        )
    print(rule.explain())
    return EXIT_CLEAN


def _settings(args: argparse.Namespace) -> _Settings:
    """The configuration, the cache and the rule selection; raises ``ConfigError``."""
    config_path = Path(args.config) if args.config else find_config(_first_folder(args))
    if args.config and not config_path.is_file():
        raise ConfigError(f"{args.config}: no such configuration file")
    cache = None
    if not args.no_cache and "-" not in args.paths:
        from trainlint.cache import open_cache

        root = config_path.parent.resolve() if config_path is not None else Path.cwd()
        cache = open_cache(args.cache_dir, root)
        known = cache.recorded_rule_ids() if cache is not None else None
        if known is not None:
            use_known_ids(known)
    configs = ConfigResolver(config_path if args.config else None)
    config = configs.for_folder(_first_folder(args))
    selectors = _Selectors(
        flag_selectors(args.select, "--select") if args.select is not None else None,
        flag_selectors(args.extend_select, "--extend-select"),
        flag_selectors(args.ignore, "--ignore"),
    )
    return _Settings(args, config, configs, selectors, cache)


def _first_folder(args: argparse.Namespace) -> Path:
    """Where the run's own configuration is looked for: the first path's folder (stdin: the folder of
    ``--stdin-filename``), so that an editor starting trainlint from ``/`` still finds the project."""
    first = args.paths[0] if args.paths else "."
    if first == "-":
        first = args.stdin_filename or "."
    path = Path(first).absolute()
    return path if path.is_dir() else path.parent


def _refusal(args: argparse.Namespace, paths: list[str], device: str) -> Problem | None:
    """What this run is asked to do that it cannot, found before linting anything."""
    if args.jobs is not None and args.jobs < 1:
        return Problem(ProblemKind.USAGE, "", f"--jobs must be at least 1, got {args.jobs}")
    if args.verify:
        from trainlint.verify import torch_available

        if not torch_available():
            return Problem(ProblemKind.USAGE, "", TORCH_HINT)
        if device == "cuda" and not _cuda_available():
            return Problem(
                ProblemKind.USAGE,
                "",
                "--device cuda: PyTorch sees no CUDA device here (use --device cpu or auto)",
            )
    if "-" in paths and paths != ["-"]:
        return Problem(ProblemKind.USAGE, "", "'-' (stdin) cannot be combined with other paths")
    missing = [p for p in paths if p != "-" and not os.path.lexists(p)]
    if missing:
        return Problem(ProblemKind.USAGE, "", f"{missing[0]}: no such file or folder")
    return None


def _cuda_available() -> bool:
    """Asked of a child process: the linter itself never imports torch."""
    import subprocess

    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _lint_all(settings: _Settings, stdin: str | None) -> _Linted | Problem:
    paths = settings.args.paths or ["."]
    device = settings.args.device or settings.config.verify_device
    refusal = _refusal(settings.args, paths, device)
    if refusal is not None:
        return refusal
    if settings.args.verify:
        from trainlint.verify.runner import start_early

        # the child imports torch (seconds) while the files are linted and the probes built
        settings.early = start_early(device, settings.config.verify_timeout)
    if paths == ["-"]:
        return _lint_stdin(settings, stdin)
    return _lint_paths(settings, paths)


def _lint_stdin(settings: _Settings, stdin: str | None) -> _Linted:
    from trainlint.engine import lint_text

    text = stdin if stdin is not None else sys.stdin.read()
    shown = settings.args.stdin_filename or "<stdin>"
    config = settings.config
    if settings.args.stdin_filename and settings.args.force_exclude:
        if is_excluded(Path(shown).absolute(), config.excludes(), config.root):
            return _Linted([], 0, {}, stdin_text=text, excluded=1)  # as Ruff: no findings, text unchanged
    options = settings.options(shown)
    try:
        result = lint_text(text, shown, options)
    except Exception as exc:  # the engine itself failed: report it like a file's failure
        result = FileResult(shown, errors=[internal_error(shown, exc)])
    return _Linted([(result, text)], 1, {shown: (None, options)}, stdin_text=text)


def _discover_all(settings: _Settings, paths: list[str]) -> tuple[list[tuple[Path, Config]], list[str], int]:
    """Every file to lint with its configuration, the listing errors, and how many paths were excluded.

    Each path given is walked with the excludes of its own configuration; a file inside it that has a
    closer configuration of its own (a nested project) is held to that one's excludes too."""
    errors: list[str] = []
    excluded: list[str] = []
    found: list[tuple[Path, Config]] = []
    seen: set[Path] = set()
    many, by_folder = len(paths) > 1, {}  # (one path: each file once; absolute() per file: 1/3 of warm)
    for given in map(Path, paths):
        config = settings.configs.for_path(given)
        if settings.args.force_exclude and is_excluded(given, config.excludes(), config.root):
            excluded.append(str(given))  # pre-commit names excluded files: --force-exclude skips them
            continue
        for f in discover([given], config.excludes(), config.root, errors, excluded):
            key = f.absolute() if many else f
            if key in seen:
                continue
            seen.add(key)
            own = config if f == given else by_folder.get(f.parent) or settings.configs.for_folder(f.parent)
            by_folder[f.parent] = own
            if own is not config and is_excluded(f, own.excludes(), own.root):
                excluded.append(str(f))
                continue
            found.append((f, own))
    return found, errors, len(excluded)


def _lint_paths(settings: _Settings, paths: list[str]) -> _Linted:
    files, listing_errors, excluded = _discover_all(settings, paths)
    cwd = os.getcwd()
    jobs_list: list[Job] = []
    for f, config in files:
        shown = display_path(f, cwd)
        jobs_list.append((str(f), shown, settings.options(shown, config)))
    results = _run_jobs(jobs_list, settings.args.jobs, settings.cache)
    targets = {shown: (fs, opts) for fs, shown, opts in jobs_list}
    problems = [Problem(ProblemKind.SKIPPED, "", m) for m in listing_errors]
    return _Linted(results, len(files), targets, problems, excluded=excluded)


def _report(linted: _Linted, elapsed_s: float) -> RunReport:
    results = linted.results
    findings = sorted((f for r, _ in results for f in r.findings), key=lambda f: f.sort_key)
    errors = [*linted.problems, *(e for r, _ in results for e in r.errors)]
    sources = {r.path: text for r, text in results if text is not None}
    return RunReport(findings, errors, linted.files, elapsed_s, sources, excluded=linted.excluded)


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
    from trainlint.fix import applicable, unified_diff, write_fixed
    from trainlint.notebook_fix import lint_file
    from trainlint.verdicts import carry_verdicts, unsafe_hint

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
            failure = write_fixed(Path(fs_path), before, outcome.text)
            if failure is not None:  # reported; the other files are still fixed
                report.errors.append(Problem(ProblemKind.FIX, shown, f"fix not applied: {failure}"))
                remaining.extend(f for f in report.findings if f.path == shown)
                continue
        elif fs_path is None:
            fixed_stdin = outcome.text
        report.fixed += outcome.fixed
        left = lint_file(outcome.text, shown, options).findings
        remaining.extend(carry_verdicts(left, report.findings, before, outcome.text))
        report.sources[shown] = outcome.text
    if args.diff:
        code = EXIT_FINDINGS if diffs and not args.exit_zero else EXIT_CLEAN
        if any(problem.kind.fatal for problem in report.errors):
            code = EXIT_ERROR  # (as without --diff: the run cannot be trusted)
        _PENDING_EXIT[:] = [code]  # `trainlint --diff . | head -1` still exits with it
        _print_problems(report.errors)
        if diffs:
            sys.stdout.write("".join(diffs))
        elif not args.unsafe_fixes:
            unsafe_hint(report)
        return code
    report.findings = sorted(remaining, key=lambda f: f.sort_key)
    if stdin_text is not None:
        code = _exit_code(report, args)
        _PENDING_EXIT[:] = [code]
        _print_problems(report.errors)
        sys.stdout.write(fixed_stdin or "")
        return code
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
    from trainlint.notebook_fix import fix_file, lint_file

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
    known = [f for f in report.findings if f.path == shown]

    def lint(text: str) -> list[Finding]:
        # the text as it was linted (and verified): its findings, whose fixes --verify may have
        # marked verified; a re-lint would only find them unsafe again
        return known if text == before else lint_file(text, shown, options).findings

    outcome = fix_file(fs_path or shown, before, lint, unsafe)
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
            if cache is not None:
                give_back_memory()  # the key summarised the file's imports: their trees are garbage now
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

    # Files to lint: load the engine here, once, before any worker is forked. libcst and the rules
    # load where a file needs them (a run whose files the prefilter rejects never loads them).
    from trainlint.engine import load_for_kept_verdicts

    if cache is not None:
        cache.record_rule_ids(rule_ids())
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
    # forked workers never copy its pages just to update the collector's bookkeeping. The garbage is
    # collected first, but not for one file linted here (pre-commit's run): it would outlive the run
    # by a few milliseconds only, and the collection costs 4 ms.
    if parallel:  # (what the cache's lookups found files need, once here rather than in each worker)
        load_for_kept_verdicts()
    if parallel or len(todo) > 1:
        gc.collect()
    gc.freeze()
    _FROZEN_IN["pid"] = os.getpid()  # known here: _lint_one need not count the frozen heap (4 ms)
    try:
        if parallel:
            _lint_in_workers(jobs_list, todo, results, workers, cache)
        else:
            with _progress(len(todo)) as advance:
                for i in todo:
                    results[i] = _lint_one(jobs_list[i], cache, trim=i != todo[-1])
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
    # fork: workers start with trainlint and libcst imported (spawn would import them again in each)
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

    pool = ProcessPoolExecutor(workers, _fork_context(), init_worker, (os.getpid(),))
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
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): the workers stop now, not after their file
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def _lint_isolated(job: Job, cache: ResultCache | None) -> Outcome:
    """``_lint_one`` in a process of its own: its death becomes an error for this file alone."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(1, _fork_context(), init_worker, (os.getpid(),)) as single:
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
    _PENDING_EXIT.clear()
    with sigterm_unwinds():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 128 + signal.SIGTERM
    except BrokenPipeError:  # `trainlint . | head`: the findings still decide the exit code
        discard_stdout()
        return _PENDING_EXIT[0] if _PENDING_EXIT else EXIT_CLEAN
    except Exception as exc:  # a bug in trainlint: one line, exit 2, never a traceback
        print(f"trainlint: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
