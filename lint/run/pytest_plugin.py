"""pytest plugin: ``pytest -p trainlint.run.pytest_plugin --trainlint`` (or, installed, ``--trainlint``
alone: the ``pytest11`` entry point loads it) instruments torch for the whole session and fails each
test whose own call hits a training hazard, with the measured numbers in the failure message.

Without ``--trainlint`` the plugin only adds the option: it imports neither torch nor the monitor.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

_MONITOR = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("trainlint")
    group.addoption(
        "--trainlint",
        action="store_true",
        default=False,
        help="instrument torch (trainlint run) and fail tests that hit a training hazard",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("trainlint", default=False):
        return
    from trainlint.run.monitor import Monitor

    # installed before collection, so that names test modules import (checkpoint, clip_grad_norm_)
    # are the instrumented ones
    monitor = Monitor()
    monitor.install()
    config.stash[_MONITOR] = monitor


def pytest_unconfigure(config: pytest.Config) -> None:
    monitor = config.stash.get(_MONITOR, None)
    if monitor is not None:
        monitor.uninstall()
        monitor.release()
        del config.stash[_MONITOR]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    monitor = item.config.stash.get(_MONITOR, None)
    if monitor is None:
        return (yield)
    __tracebackhide__ = True  # the failure is the test's, not this hook's
    monitor.reset()
    result = yield
    # a hazard that cannot happen on this device (TL402 on the CPU) does not fail the test
    hit = [o for o in monitor.observations.values() if o.measured.get("applicable", True)]
    if hit:
        lines = [f"  {os.path.relpath(o.path)}:{o.line}: {o.rule} {o.message}" for o in hit]
        pytest.fail(f"trainlint: this test hit {len(lines)} training hazard(s):\n" + "\n".join(lines))
    return result
