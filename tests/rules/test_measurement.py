"""TL4xx: measuring memory and time."""

from __future__ import annotations

import textwrap

import pytest

from trainlint.engine import lint_source
from trainlint.rule import registry


def run(rule: str, code: str):
    return lint_source(textwrap.dedent(code), "snippet.py", [rule])


# -- TL401 ------------------------------------------------------------------------------------------------


def test_tl401_per_step_peak_and_the_reset_that_fixes_it() -> None:
    code = """
        import torch
        for step, batch in enumerate(loader):
            train_step(model, batch)
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(step, peak)
        """
    (finding,) = run("TL401", code)
    assert finding.line == 5
    assert "every iteration of a loop" in finding.message
    assert "reset_peak_memory_stats()" in finding.message
    fixed = code.replace(
        "    train_step(", "    torch.cuda.reset_peak_memory_stats()\n            train_step("
    )
    assert run("TL401", fixed) == []


def test_tl401_baseline_subtraction_through_names() -> None:
    code = """
        import torch

        def measure(fn):
            before = torch.cuda.memory_allocated()
            fn()
            after = torch.cuda.max_memory_allocated()
            return (after - before) / 2**20
        """
    (finding,) = run("TL401", code)
    assert finding.line == 7
    assert "baseline" in finding.message


def test_tl401_whole_run_report_is_not_reported() -> None:
    # litgpt's generate scripts end with this line: the peak of the whole run is what they mean.
    code = """
        import torch
        def main():
            model = load()
            for i in range(num_samples):
                y = generate(model, encoded)
            if fabric.device.type == "cuda":
                fabric.print(f"Memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB")
        """
    assert run("TL401", code) == []


def test_tl401_context_manager_reset_in_enter() -> None:
    code = """
        import torch

        class TorchTracemalloc:
            def __enter__(self):
                torch.cuda.reset_max_memory_allocated()
                self.begin = torch.cuda.memory_allocated()
                return self

            def __exit__(self, *exc):
                self.peak = torch.cuda.max_memory_allocated()
                self.peaked = (self.peak - self.begin) // 2**20
        """
    assert run("TL401", code) == []
    assert len(run("TL401", code.replace("torch.cuda.reset_max_memory_allocated()", "pass"))) == 1


# -- TL402 ------------------------------------------------------------------------------------------------


def test_tl402_reports_the_closing_read_with_the_opening_as_related() -> None:
    code = """
        import time
        import torch
        model = model.cuda()
        t0 = time.perf_counter()
        loss = model(x).loss
        loss.backward()
        optimizer.step()
        dt = time.perf_counter() - t0
        """
    (finding,) = run("TL402", code)
    assert finding.line == 9
    assert "torch.cuda.synchronize()" in finding.message
    assert [r.line for r in finding.related] == [5]
    fixed = code.replace(
        "dt = time.perf_counter() - t0", "torch.cuda.synchronize()\ndt = time.perf_counter() - t0"
    )
    assert run("TL402", fixed) == []


@pytest.mark.parametrize(
    "wait",
    [
        "print(loss.item())",
        "vals = loss.tolist()",
        "end_event.synchronize()",
        "synchronize_func()",
        "x = out.cpu()",
    ],
)
def test_tl402_anything_that_waits_for_the_device_counts(wait: str) -> None:
    code = f"""
        import time
        model.cuda()
        t0 = time.time()
        out = model(x)
        loss = out.sum()
        loss.backward()
        {wait}
        dt = time.time() - t0
        """
    assert run("TL402", code) == []


def test_tl402_autoregressive_generation_is_not_reported() -> None:
    # generation checks its stopping condition on the host after every token
    code = """
        import time
        model.cuda()
        start = time.perf_counter()
        outputs = model.generate(**inputs, max_new_tokens=64)
        end = time.perf_counter()
        """
    assert run("TL402", code) == []


def test_tl402_per_iteration_rolling_timer() -> None:
    code = """
        import time
        end = time.time()
        for i, (images, target) in enumerate(train_loader):
            images = images.cuda(non_blocking=True)
            output = model(images)
            loss = criterion(output, target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            batch_time.update(time.time() - end)
            end = time.time()
        """
    assert [f.line for f in run("TL402", code)] == [11]
    # the classic ImageNet example logs loss.item() every iteration, which waits for the GPU
    with_item = code.replace("optimizer.step()", "optimizer.step()\n            losses.update(loss.item())")
    assert run("TL402", with_item) == []


# -- TL403 ------------------------------------------------------------------------------------------------


def test_tl403_reported_in_the_step_loop_only() -> None:
    code = """
        import torch
        for epoch in range(epochs):
            for batch in loader:
                loss = model(batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                torch.cuda.empty_cache()
            evaluate(model)
            torch.cuda.empty_cache()
        """
    findings = run("TL403", code)
    assert [f.line for f in findings] == [9]
    assert "every training iteration" in findings[0].message


def test_tl403_empty_cache_after_eval_is_not_reported() -> None:
    code = """
        import torch
        for step, batch in enumerate(loader):
            model(batch).loss.backward()
            optimizer.step()
            if step % eval_every == 0:
                evaluate(model)
                torch.cuda.empty_cache()
        """
    assert run("TL403", code) == []


# -- TL404 ------------------------------------------------------------------------------------------------


def test_tl404_reading_before_the_first_step() -> None:
    code = """
        import torch
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        print(f"allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
        for batch in loader:
            model(batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        """
    (finding,) = run("TL404", code)
    assert finding.line == 4
    assert finding.severity.value == "info"
    assert "first `step()`" in finding.message
    assert [r.line for r in finding.related] == [3]
    moved = (
        textwrap.dedent(code).replace(
            'print(f"allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")\n', ""
        )
        + 'print(f"allocated: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")\n'
    )
    assert run("TL404", moved) == []


# -- TL405 ------------------------------------------------------------------------------------------------

ATTENTION = """
    import math
    import torch.nn.functional as F
    from torch import nn

    class CausalSelfAttention(nn.Module):
        def forward(self, x):
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
            return self.c_proj(y)
    """


def test_tl405_reported_at_the_score_product() -> None:
    (finding,) = run("TL405", ATTENTION)
    assert (finding.line, finding.column) == (9, 16)
    assert "scaled_dot_product_attention" in finding.message
    assert finding.severity.value == "info"


def test_tl405_nanogpt_flash_fallback_is_not_reported() -> None:
    code = ATTENTION.replace(
        "            att = (q @ k",
        "            if self.flash:\n                return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "            att = (q @ k",
    )
    assert run("TL405", code) == []


def test_tl405_steps_the_kernel_cannot_express_are_not_reported() -> None:
    # a projection of the scores across heads (talking heads) between product and softmax
    talking = ATTENTION.replace(
        "            att = F.softmax(att, dim=-1)",
        "            att = self.proj_l(att.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)\n"
        "            att = F.softmax(att, dim=-1)",
    )
    assert run("TL405", talking) == []


def test_tl405_inference_only_forward_is_not_reported() -> None:
    code = ATTENTION.replace(
        "        def forward(self, x):", "        @torch.no_grad()\n        def forward(self, x):"
    )
    code = "import torch\n" + textwrap.dedent(code)
    assert run("TL405", code) == []


# -- documentation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule_id", "numbers"),
    [
        ("TL401", ("28 GB", "18 GB")),
        ("TL402", ("120 ms", "8 ms")),
        ("TL403", ("300 ms",)),
        ("TL404", ("8 GB", "16 GB")),
        ("TL405", ("4096", "8.6 GB")),
    ],
)
def test_measurement_docs_carry_a_numeric_illustration(rule_id: str, numbers: tuple[str, ...]) -> None:
    rule = registry().get(rule_id)
    assert rule is not None
    text = rule.explain()
    for number in numbers:
        assert number in text
    assert len(rule.valid) >= 6 and len(rule.invalid) >= 6
