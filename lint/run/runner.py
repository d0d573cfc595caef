"""Run the user's script or module in this process, as ``python`` would, with the monitor installed."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import traceback
from dataclasses import dataclass

from trainlint.run.monitor import Monitor, StopRun, _is_user_file


@dataclass(frozen=True)
class Target:
    """``python SCRIPT ARGS`` (module is None) or ``python -m MODULE ARGS`` (script is None)."""

    script: str | None
    module: str | None
    args: tuple[str, ...]


@dataclass
class Outcome:
    ended: str  # "finished", "stopped" (--steps reached), "interrupted" (Ctrl-C), "raised", "exited"
    error: str | None = None  # the user's exception, one line, with its place in the user's code
    exit_status: int | None = None
    loaded: frozenset[str] = frozenset()  # absolute paths of the Python files the run loaded


def _describe(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    where = f" (at {os.path.relpath(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def run_target(target: Target, monitor: Monitor) -> Outcome:
    """Execute the target to its end, the requested step count, Ctrl-C or its first uncaught error.

    Modules the run imported from its own folder are dropped from ``sys.modules`` afterwards, so that
    a second run in the same process (tests, the pytest plugin) imports them afresh, as ``python`` would.
    """
    before = set(sys.modules)
    outcome = _execute(target, monitor)
    folder = os.path.dirname(os.path.abspath(target.script)) if target.script else os.getcwd()
    loaded = {os.path.abspath(target.script)} if target.script else _module_files(target.module or "")
    for name in set(sys.modules) - before:
        path = getattr(sys.modules[name], "__file__", None)
        if isinstance(path, str) and path.endswith(".py"):
            loaded.add(os.path.abspath(path))
            if os.path.abspath(path).startswith(folder + os.sep):
                del sys.modules[name]
    outcome.loaded = frozenset(loaded)
    monitor.release()  # the script's globals (and any exception holding them) are gone by now
    return outcome


def _module_files(module: str) -> set[str]:
    """The file ``python -m module`` runs (a package's ``__main__``); runpy leaves no trace of it."""
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{module}.__main__")
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.remove(os.getcwd())
    origin = spec.origin if spec is not None else None
    return {os.path.abspath(origin)} if origin and origin.endswith(".py") else set()


def _execute(target: Target, monitor: Monitor) -> Outcome:
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    if target.script is not None:
        sys.argv = [target.script, *target.args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target.script)))
    else:
        sys.argv = [target.module or "", *target.args]
        sys.path.insert(0, os.getcwd())
    try:
        with monitor.active():
            if target.script is not None:
                runpy.run_path(target.script, run_name="__main__")
            else:
                runpy.run_module(target.module or "", run_name="__main__", alter_sys=True)
        return Outcome("finished")
    except StopRun:
        return Outcome("stopped")
    except KeyboardInterrupt:
        return Outcome("interrupted")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code == 0:
            return Outcome("finished")
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        return Outcome("exited", f"the script exited with status {code}", code)
    except Exception as exc:  # the user's own error: reported as theirs, with what was seen so far
        return Outcome("raised", _describe(exc))
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
