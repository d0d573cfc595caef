"""The runtime check (``--verify``): probes for TL101, TL105 and TL301 (the checkpoint rules are in
``test_verify_checkpoint.py``), the child's containment, and the pieces of the harness.

Every snippet below is linted, its findings are verified in one batch (one child process, so torch is
imported once), and each test checks the verdict of one finding. Expected values come from the
mechanics of the hazard (which gradients must be None, which counts must double), not from output.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import Snippets

from trainlint.engine import lint_source
from trainlint.rule import Applicability
from trainlint.verify import torch_available, verify_findings
from trainlint.verify.context import TextEdit, apply_text_edits
from trainlint.verify.runner import run_probes
from trainlint.verify.source import analyse_names
from trainlint.verify.window import argparse_defaults

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL101", "TL105", "TL301")


# --------------------------------------------------------------------------------------------------
# snippets: name -> (rule id, code)

SNIPPETS = Snippets()
snippet = SNIPPETS.add


# TL101 ---------------------------------------------------------------------------------------------
snippet(
    "tl101_sgd",
    "TL101",
    """
    import torch
    from torch import nn


    def train(model, loader, epochs=1):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        for epoch in range(epochs):
            for x, y in loader:
                optimizer.zero_grad()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = nn.functional.mse_loss(model(x), y)
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                scaler.step(optimizer)
                scaler.update()
    """,
)
snippet(
    "tl101_scaler_disabled",
    "TL101",
    """
    import torch
    from torch import nn

    use_amp = False


    def train(model, loader):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.cuda.amp.GradScaler(enabled=use_amp)
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", enabled=use_amp):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    """,
)
snippet(
    "tl101_accumulation_argparse",
    "TL101",
    """
    import argparse
    import torch


    def train(args, model, loader):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        scaler = torch.cuda.amp.GradScaler()
        for step, (x, y) in enumerate(loader):
            for micro in range(4):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x, y) / 4
                scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--max-norm", type=float, default=1.0)
        train(parser.parse_args(), None, None)
    """,
)
snippet(
    "tl101_unbindable",
    "TL101",
    """
    import torch


    def train(model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler()
        for x, y in loader:
            loss = model(x, y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_threshold)
            scaler.step(optimizer)
            scaler.update()
    """,
)

# TL105 ---------------------------------------------------------------------------------------------
snippet(
    "tl105_fp16_adamw",
    "TL105",
    """
    import torch
    from torch import nn


    def main(loader):
        model = nn.Linear(16, 16).cuda().half()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x.half()), y.half())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    """,
)
snippet(
    "tl105_bf16_small_updates",
    "TL105",
    """
    import torch


    def fit(model, data):
        model = model.to(torch.bfloat16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    """,
)
snippet(
    "tl105_with_scaler",
    "TL105",
    """
    import torch


    def train(model, data):
        model.half()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = torch.cuda.amp.GradScaler()
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    """,
)
snippet(
    "tl105_large_steps",
    "TL105",
    """
    import torch

    model = torch.nn.Linear(8, 8)
    model = model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    """,
)
snippet(
    "tl105_unbindable",
    "TL105",
    """
    import torch


    def train(model, data, hp):
        model = model.to(dtype=torch.bfloat16)
        opt = torch.optim.Adam(model.parameters(), lr=hp.learning_rate)
    """,
)

# TL301 ---------------------------------------------------------------------------------------------
snippet(
    "tl301_cross_entropy",
    "TL301",
    """
    import torch.nn.functional as F


    def train(model, loader, optimizer, accum_steps=4):
        for step, batch in enumerate(loader):
            input_ids = batch["input_ids"].cuda()
            labels = batch["labels"].cuda()
            logits = model(input_ids)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            loss = loss / accum_steps
            loss.backward()
            if (step + 1) % accum_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
)
snippet(
    "tl301_hf_output_loss",
    "TL301",
    """
    from transformers import DataCollatorForLanguageModeling


    def train(model, loader, optimizer, gradient_accumulation_steps=8):
        model.train()
        for step, batch in enumerate(loader):
            outputs = model(**batch)
            loss = outputs.loss
            loss = loss / gradient_accumulation_steps
            loss.backward()
            if (step + 1) % gradient_accumulation_steps == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
)
snippet(
    "tl301_packed_equal_tokens",
    "TL301",
    """
    import torch.nn.functional as F

    ACCUM = 4


    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            input_ids = batch["input_ids"]
            labels = input_ids[:, 1:]
            logits = model(input_ids)[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
            (loss / ACCUM).backward()
            if (step + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
)
snippet(
    "tl301_unbindable",
    "TL301",
    """
    import torch.nn.functional as F


    def train(model, loader, optimizer, accum):
        for step, batch in enumerate(loader):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
            loss = loss * temperature_schedule(step) / accum
            loss.backward()
    """,
)

VERIFY_FIXTURES = ("fixtures/bad_gpt_amp.py", "fixtures/bad_finetune_half.py")
VERIFY_TIMEOUT = 60
line_of = SNIPPETS.line_of


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


# TL101 -----------------------------------------------------------------------------------------------


def test_tl101_clip_of_scaled_gradients_is_confirmed_and_fix_matches(verified):
    finding = verified.one("tl101_sgd")
    v = finding.verify
    assert v["status"] == "confirmed"
    seen = v["evidence"]["clip_saw_norm"]
    # the clip saw the true norm times the loss scale
    assert seen["as_written"][0] == pytest.approx(
        seen["reference"][0] * v["evidence"]["loss_scale"], rel=1e-3
    )
    assert v["evidence"]["as_written_vs_reference"]["max_rel"] > 0.5
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] < 1e-5
    assert finding.fix.applicability is Applicability.VERIFIED


def test_tl101_disabled_scaler_is_not_reproduced(verified):
    v = verified.one("tl101_scaler_disabled").verify
    assert v["status"] == "not-reproduced"
    seen = v["evidence"]["clip_saw_norm"]
    assert seen["as_written"] == seen["reference"]


def test_tl101_adamw_with_argparse_threshold(verified):
    v = verified.one("tl101_accumulation_argparse").verify
    assert v["status"] == "confirmed"
    assert "`args.max_norm` = 1.0 (argparse default)" in v["detail"]
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] < 1e-5


def test_tl101_unbindable_threshold_is_named(verified):
    v = verified.one("tl101_unbindable").verify
    assert v["status"] == "not-executable"
    assert "clip_threshold" in v["detail"]


# TL105 -----------------------------------------------------------------------------------------------


def test_tl105_fp16_adamw_is_confirmed(verified):
    v = verified.one("tl105_fp16_adamw").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["parameter_dtype"] == "float16"


def test_tl105_small_bf16_updates_round_away(verified):
    v = verified.one("tl105_bf16_small_updates").verify
    assert v["status"] == "confirmed"
    never = v["evidence"]["entries_never_updated"]
    assert never["as_written"] > never["of"] // 2
    assert never["reference"] == 0


def test_tl105_gradscaler_refuses_fp16_gradients(verified):
    v = verified.one("tl105_with_scaler").verify
    assert v["status"] == "confirmed"
    assert "Attempting to unscale FP16 gradients" in v["detail"]


def test_tl105_large_updates_survive_bf16(verified):
    v = verified.one("tl105_large_steps").verify
    assert v["status"] == "not-reproduced"
    assert v["evidence"]["movement_rel_error"] < 0.1


def test_tl105_unbindable_learning_rate_is_named(verified):
    v = verified.one("tl105_unbindable").verify
    assert v["status"] == "not-executable"
    assert "hp.learning_rate" in v["detail"]


# TL301 -----------------------------------------------------------------------------------------------


def test_tl301_uneven_token_counts_are_confirmed_and_fix_matches(verified):
    v = verified.one("tl301_cross_entropy").verify
    assert v["status"] == "confirmed"
    tokens = v["evidence"]["valid_tokens_per_microbatch"]
    assert len(tokens) == 4 and len(set(tokens)) > 1
    assert v["evidence"]["as_written_vs_reference"]["max_rel"] > 0.1
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] < 1e-4


def test_tl301_hugging_face_loss(verified):
    v = verified.one("tl301_hf_output_loss").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["microbatches"] == 8  # the function's default accumulation count
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] < 1e-4


def test_tl301_equal_token_counts_are_not_reproduced(verified):
    v = verified.one("tl301_packed_equal_tokens").verify
    assert v["status"] == "not-reproduced"
    assert len(set(v["evidence"]["valid_tokens_per_microbatch"])) == 1


def test_tl301_unbindable_name(verified):
    v = verified.one("tl301_unbindable").verify
    assert v["status"] == "not-executable"
    assert "temperature_schedule" in v["detail"]


# fixtures ----------------------------------------------------------------------------------------------

PLANTED = [
    ("fixtures/bad_gpt_amp.py", "TL101"),
    ("fixtures/bad_gpt_amp.py", "TL301"),
    ("fixtures/bad_finetune_half.py", "TL105"),
    ("fixtures/bad_finetune_half.py", "TL301"),
]


@pytest.mark.parametrize(("path", "rule"), PLANTED)
def test_planted_fixture_mistakes_are_confirmed(verified, path, rule):
    verified.assert_confirmed(path, rule)


# containment ---------------------------------------------------------------------------------------------

RUNAWAY = textwrap.dedent(
    """
    import os
    import sys
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    def spin(x):
        while True:
            x = x + 1
        return x


    def quit_now(x):
        sys.exit(3)


    def vanish(x):
        os._exit(0)


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return checkpoint(spin, self.fc(x))

        def stop(self, x):
            return checkpoint(quit_now, self.fc(x))

        def gone(self, x):
            return checkpoint(vanish, self.fc(x))

        def fine(self, x):
            return checkpoint(self.fc, x)
    """
)


def test_runaway_snippets_are_contained_and_reported():
    findings = lint_source(RUNAWAY, "runaway.py", ["TL201"])
    assert len(findings) == 4
    out = {
        f.line: f.verify for f in verify_findings(findings, {"runaway.py": RUNAWAY}, device="cpu", timeout=2)
    }
    loop, exit_, gone, fine = (out[line] for line in sorted(out))
    assert loop["status"] == "not-executable" and "did not finish within 2s" in loop["detail"]
    assert exit_["status"] == "not-executable" and "sys.exit(3)" in exit_["detail"]
    assert gone["status"] == "not-executable" and "exit code 0" in gone["detail"]
    # the probe after the one that killed its process still runs, in a fresh child
    assert fine["status"] == "confirmed"


def test_probe_that_hangs_in_native_code_is_killed():
    probe = {
        "id": "0",
        "driver": "grads",
        "programs": {
            "reference": "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n"
        },
    }
    result = run_probes([probe], "cpu", timeout=1)["0"]
    assert result["status"] == "not-executable"
    assert "killed" in result["detail"]


def test_findings_without_a_probe_are_returned_unchanged():
    code = "import torch\nfor p in model.parameters():\n    total += p.sum()\n"
    findings = lint_source(code, "plain.py", None)
    assert verify_findings(findings, {"plain.py": code}, device="cpu", timeout=5) == findings


# pieces -------------------------------------------------------------------------------------------------


def test_free_names_are_order_aware():
    names = analyse_names("loss = loss / n\nfor x in xs:\n    y = x + z\nwith f(a) as b:\n    b.c\n")
    assert names.free == ["loss", "n", "xs", "z", "f", "a"]


def test_text_edits_insert_in_the_order_given():
    text = "a = f(x)\n"
    edits = [TextEdit(1, 5, 1, 5, "g("), TextEdit(1, 5, 1, 5, "h("), TextEdit(1, 9, 1, 9, "))")]
    assert apply_text_edits(text, edits) == "a = g(h(f(x)))\n"


def test_argparse_defaults():
    from trainlint.model import FileModel

    model = FileModel.from_source(
        "p.add_argument('--max-norm', type=float, default=0.5)\n"
        "p.add_argument('--amp', action='store_true')\n"
        "p.add_argument('-a', '--grad-accum', dest='accum', default=8)\n"
        "p.add_argument('--lr', type=float)\n"
    )
    assert argparse_defaults(model) == {"max_norm": "0.5", "amp": "False", "accum": "8"}


@pytest.mark.cuda
def test_cuda_path():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    names = ["tl101_sgd", "tl301_cross_entropy", "tl105_fp16_adamw"]  # TL201: test_verify_checkpoint.py
    findings, sources = SNIPPETS.findings(names)
    out = verify_findings(findings, sources, device="cuda", timeout=60)
    for finding in out:
        assert finding.verify["device"] == "cuda", finding.verify
        assert finding.verify["status"] == "confirmed", finding.verify["detail"]
