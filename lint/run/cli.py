"""``trainlint run [--steps N] [--format F] [--no-lint] -- python train.py ARGS`` (or ``-m module``)."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
from pathlib import Path

from trainlint.procs import discard_stderr, pending_exit

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
PYTHONS = ("python", "python3")


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]  # one line, no usage dump
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainlint run",
        usage="trainlint run [--steps N] [--format text|json|sarif] [--no-lint] "
        "-- python SCRIPT ARGS... | -- python -m MODULE ARGS...",
        description="Run a training script in this process with torch instrumented, and report the "
        "hazards it hits, with measured numbers. This executes your code.",
    )
    parser.add_argument("--steps", type=int, default=None, help="stop after N optimizer steps")
    parser.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    parser.add_argument(
        "--no-lint", action="store_true", help="skip the static pass over the script's folder"
    )
    return parser


def parse_command(command: list[str]):  # -> Target
    """``python SCRIPT ARGS`` / ``python -m MODULE ARGS`` (the ``python`` may be left out)."""
    from trainlint.run.runner import Target

    if command and (os.path.basename(command[0]) in PYTHONS or command[0] == sys.executable):
        command = command[1:]
    if not command:
        raise UsageError("give the command to run after --, e.g. trainlint run -- python train.py")
    if command[0] == "-m":
        if len(command) < 2:
            raise UsageError("-m needs a module name")
        module = command[1]
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.remove(os.getcwd())
        if not found:
            raise UsageError(f"no module named {module!r}")
        return Target(None, module, tuple(command[2:]))
    if command[0].startswith("-"):
        raise UsageError(f"unsupported python option {command[0]!r} (only a script or -m module)")
    script = command[0]
    if not os.path.isfile(script):
        raise UsageError(f"{script}: no such file")
    return Target(script, None, tuple(command[1:]))


def main(argv: list[str]) -> int:
    """Lint, run and report; returns the exit code (0 clean, 1 hazards or the script failed, 2 usage)."""
    from trainlint.run import quiet_torch_import

    quiet_torch_import()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    try:
        args = build_parser().parse_args(argv[:split])
        target = parse_command(argv[split + 1 :])
        if args.steps is not None and args.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {args.steps}")
    except UsageError as exc:
        return _error(str(exc))
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_CLEAN
    if importlib.util.find_spec("torch") is None:
        return _error('needs PyTorch: pip install "trainlint[verify]"')
    return _lint_run_report(target, args)


def _error(message: str) -> int:
    """One line on stderr; the exit code holds when nobody reads it (``2>&1 | true``)."""
    code = pending_exit(EXIT_ERROR)
    print(f"trainlint run: error: {message}", file=sys.stderr)
    return code


def _note(message: str) -> None:
    """A line on stderr about the run; when nobody reads stderr any more the run goes on without it."""
    try:
        print(f"trainlint run: {message}", file=sys.stderr)
    except BrokenPipeError:
        discard_stderr()


def _lint_run_report(target, args: argparse.Namespace) -> int:
    from trainlint.config import ConfigError
    from trainlint.run.join import display, join, static_findings
    from trainlint.run.monitor import Monitor
    from trainlint.run.report import render
    from trainlint.run.runner import run_target

    static = []
    if not args.no_lint:
        folder = Path(target.script).resolve().parent if target.script else Path.cwd()
        try:
            static, errors = static_findings(folder)
        except ConfigError as exc:
            return _error(str(exc))
        for error in errors:
            _note(f"note: {error.get('path')}: {error['message']}")
    shown = target.script or f"-m {target.module}"
    _note(f"executing {shown} in this process, with torch instrumented")
    monitor = Monitor(max_steps=args.steps)
    # JSON and SARIF must be alone on stdout: the script's own prints go to stderr then
    quiet = contextlib.redirect_stdout(sys.stderr) if args.format != "text" else contextlib.nullcontext()
    with quiet:
        outcome = run_target(target, monitor)
    ran = {display(path) for path in outcome.loaded}
    reached = [f for f in static if f.path in ran]
    joined = join(reached, list(monitor.observations.values()))
    failed = outcome.ended in ("raised", "exited")
    # (set before the report: a reader that stops reading it leaves the run's exit code as it is)
    code = pending_exit(EXIT_FINDINGS if failed or any(j.observation for j in joined) else EXIT_CLEAN)
    sys.stdout.flush()
    render(joined, outcome, monitor.steps, args.format, unloaded=len(static) - len(reached))
    sys.stdout.flush()  # a broken pipe shows here, not in the flush at exit
    return code
