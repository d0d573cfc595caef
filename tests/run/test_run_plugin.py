"""The pytest plugin: with --trainlint, a test whose call hits a training hazard fails with the
measured numbers; without the option nothing changes.

In a subprocess: an in-process pytester run restores sys.modules afterwards, and torch cannot import
its lazily loaded operator libraries a second time."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytest_plugins = ["pytester"]

TESTS = """
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def _train(unscale_first):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    if unscale_first:
        scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()


def test_clips_scaled_gradients():
    _train(unscale_first=False)


def test_clips_after_unscale():
    _train(unscale_first=True)


def test_checkpoint_imported_at_collection_is_instrumented():
    block, head = nn.Linear(4, 4), nn.Linear(4, 1)
    head(checkpoint(block, torch.randn(2, 4))).sum().backward()


def test_times_a_step_without_a_sync():
    # TL402 on a CUDA run; on the CPU the interval is right, so it must not fail the test
    import time

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t0 = time.perf_counter()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    assert time.perf_counter() - t0 >= 0
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_training=TESTS)
    return pytester


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(TESTS.strip().splitlines(), 1) if text in line)


def test_tests_that_hit_a_hazard_fail_with_the_numbers(suite: pytest.Pytester) -> None:
    clip, ckpt = line_of("clip_grad_norm_"), line_of("head(checkpoint(")
    result = suite.runpytest_subprocess("-p", "trainlint.run.pytest_plugin", "--trainlint", "-W", "ignore")
    on_gpu = torch.cuda.is_available()
    result.assert_outcomes(passed=1 + (not on_gpu), failed=2 + on_gpu)
    result.stdout.fnmatch_lines(
        [
            "*trainlint: this test hit 1 training hazard(s):*",
            f"*test_training.py:{clip}: TL101 clip_grad_norm_ ran while*loss scale 65536*",
            f"*test_training.py:{ckpt}: TL201 checkpoint() without use_reentrant*no input requires grad*",
        ]
    )
    assert "FAILED test_training.py::test_clips_after_unscale" not in result.stdout.str()


def test_without_the_option_nothing_is_instrumented(suite: pytest.Pytester) -> None:
    result = suite.runpytest_subprocess("-p", "trainlint.run.pytest_plugin", "-W", "ignore")
    result.assert_outcomes(passed=4)
