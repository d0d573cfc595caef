"""``--verify`` on pairs of snippets that differ in one thing only, the thing that flips the verdict.

Each pair is one snippet and the same snippet with one substring replaced (``pair`` checks that the
replacement happened). Each test asserts both verdicts, and that the detail names what the verdict
rests on: the value the file sets and where, the loss scale, the tolerance.
"""

from __future__ import annotations

import pytest
from conftest import Snippets

from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL101", "TL105", "TL201", "TL203", "TL301", "TL302", "TL303")
VERIFY_FIXTURES = ()
VERIFY_TIMEOUT = 60

SNIPPETS = Snippets()


pair = SNIPPETS.pair


# TL101: the scaler's own init_scale (PyTorch's default is 65536); a clip at 5e4 sees the scaled norm
pair(
    "tl101_init_scale",
    "TL101",
    """
    import torch
    from torch import nn


    def train(model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=5e4)
            scaler.step(optimizer)
            scaler.update()
    """,
    'GradScaler("cuda")',
    'GradScaler("cuda", init_scale=2.0)',
)
# TL101: `enabled=` bound to a parameter default
pair(
    "tl101_enabled_default",
    "TL101",
    """
    import torch
    from torch import nn


    def train(model, loader, use_amp=False):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16, enabled=use_amp):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    """,
    "use_amp=False",
    "use_amp=True",
)
# TL101: the threshold is `self.clip_at`, set in __init__ from a parameter default
pair(
    "tl101_init_attribute",
    "TL101",
    """
    import torch
    from torch import nn


    class Trainer:
        def __init__(self, model, clip_at=1.0):
            self.model = model
            self.clip_at = clip_at
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            self.scaler = torch.amp.GradScaler("cuda")

        def step(self, x, y):
            self.optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(self.model(x), y)
            self.scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_at)
            self.scaler.step(self.optimizer)
            self.scaler.update()
    """,
    "clip_at=1.0",
    "clip_at=1e9",
)
# TL101: a threshold whose value is not in the file (`args.clip`, no argparse here) is swept
pair(
    "tl101_swept_threshold",
    "TL101",
    """
    import torch
    from torch import nn


    def train(args, model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(optimizer)
            scaler.update()
    """,
    'GradScaler("cuda")',
    'GradScaler("cuda", init_scale=2.0)',
)
# TL201: an entry input the probe synthesises (run in both requires_grad states) vs one the code
# computes with a trainable layer
pair(
    "tl201_synthetic_input",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class Encoder(nn.Module):
        def __init__(self, dim, depth):
            super().__init__()
            self.proj = nn.Linear(dim, dim)
            self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

        def forward(self, x):
            h = x
            for block in self.blocks:
                h = checkpoint(block, h)
            return h
    """,
    "h = x\n",
    "h = self.proj(x)\n",
)
# TL203: a repeat that changes nothing vs one that grows a list
pair(
    "tl203_repeat",
    "TL203",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            self.seen = []

        def inner(self, x):
            self.seen_shape = tuple(x.shape)
            return torch.relu(self.fc(x))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)
    """,
    "self.seen_shape = tuple(x.shape)",
    "self.seen.append(tuple(x.shape))",
)
# TL203: `global N; N += 1` with N defined in the file vs a global set to the same value again
pair(
    "tl203_global",
    "TL203",
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    N = 0


    def block(x):
        global N
        N += 1
        return torch.sin(x) * 2


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(block, self.inp(x), use_reentrant=False)
    """,
    "N += 1",
    "N = 1",
)
# TL303: the accumulation count is `self.accum_steps`, set in __init__ from a parameter default
pair(
    "tl303_init_count",
    "TL303",
    """
    import torch
    import torch.nn.functional as F


    class Trainer:
        def __init__(self, model, accum_steps=4):
            self.model = model
            self.accum_steps = accum_steps
            self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def fit(self, loader):
            for i, (x, y) in enumerate(loader):
                self.optimizer.zero_grad()
                loss = F.cross_entropy(self.model(x), y) / self.accum_steps
                loss.backward()
                if (i + 1) % self.accum_steps == 0:
                    self.optimizer.step()
    """,
    "accum_steps=4",
    "accum_steps=1",
)
# TL303: the count is a module constant unpacked from a tuple
pair(
    "tl303_unpacked_constant",
    "TL303",
    """
    import torch
    import torch.nn.functional as F

    ACCUM, SEQ = 4, 12


    def train(model, loader):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(loader):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y) / ACCUM
            loss.backward()
            if (i + 1) % ACCUM == 0:
                optimizer.step()
    """,
    "ACCUM, SEQ = 4, 12",
    "ACCUM, SEQ = 1, 12",
)
# TL203: a buffer registered in __init__, counted up vs set to the same value on every run
pair(
    "tl203_buffer",
    "TL203",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 16)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += x.shape[0]
            return torch.tanh(self.linear(x))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)
    """,
    "self.seen += x.shape[0]",
    "self.seen.fill_(1.0)",
)
# TL301 under bf16 autocast: uneven token counts vs equal ones (bf16 rounding is not a hazard)
pair(
    "tl301_autocast",
    "TL301",
    """
    import torch
    import torch.nn.functional as F

    ACCUM = 4


    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            input_ids = batch["input_ids"]
            labels = batch["labels"]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100)
            (loss / ACCUM).backward()
            if (step + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    """
            labels = batch["labels"]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids)""",
    """
            labels = input_ids[:, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids)[:, :-1]""",
)
# TL301: the logits reshaped by the file's own vocabulary size (a module constant from a tuple)
pair(
    "tl301_file_vocabulary",
    "TL301",
    """
    import torch.nn.functional as F

    VOCAB, ACCUM = 32, 4


    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            input_ids = batch["input_ids"]
            labels = batch["labels"]
            logits = model(input_ids)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            (loss / ACCUM).backward()
            if (step + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    """
            labels = batch["labels"]
            logits = model(input_ids)""",
    """
            labels = input_ids[:, 1:]
            logits = model(input_ids)[:, :-1]""",
)
# TL302: a running total kept across iterations vs one reset at the end of every iteration
pair(
    "tl302_reset",
    "TL302",
    """
    def train(model, loader, optimizer):
        running = 0.0
        for step, (x, y) in enumerate(loader):
            loss = model(x, y)
            running += loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(step)
    """,
    "print(step)",
    "running = 0.0",
)
# TL105: 16-bit parameters vs fp32, with a learning rate at which fp32 training itself diverges
pair(
    "tl105_diverging",
    "TL105",
    """
    import torch


    def fit(model, data):
        model = model.half()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    """,
    "lr=1e-3",
    "lr=1e4",
)


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_tl101_uses_pytorchs_default_init_scale_and_the_files_own(verified):
    default, small = verified.pair("tl101_init_scale")
    assert default["status"] == "confirmed", default["detail"]
    assert default["evidence"]["loss_scale"] == 65536.0
    assert "65536" in default["detail"]
    # a scale of 2 leaves the scaled norm far below the 5e4 threshold: the clip never engages
    assert small["status"] == "not-reproduced", small["detail"]
    assert small["evidence"]["loss_scale"] == 2.0
    assert "loss scale 2" in small["detail"]


def test_tl101_scaler_switched_off_by_a_parameter_default_is_said_to_be_off(verified):
    off, on = verified.pair("tl101_enabled_default")
    assert off["status"] == "not-reproduced", off["detail"]
    assert off["evidence"]["scaler_enabled"] is False
    assert "scaler is off" in off["detail"] and "default of the parameter `use_amp`" in off["detail"]
    assert "loss scale 65536" not in off["detail"]
    assert on["status"] == "confirmed", on["detail"]
    assert "scaler_enabled" not in on["evidence"]


def test_tl101_threshold_set_in_init_from_a_default(verified):
    tight, loose = verified.pair("tl101_init_attribute")
    assert tight["status"] == "confirmed", tight["detail"]
    assert "`self.clip_at` = 1.0" in tight["detail"] and "Trainer.__init__" in tight["detail"]
    assert loose["status"] == "not-reproduced", loose["detail"]
    assert "`self.clip_at` = 1e9" in loose["detail"]


def test_tl101_threshold_not_in_the_file_is_swept_with_a_verdict_per_value(verified):
    large, small = verified.pair("tl101_swept_threshold")
    for v in (large, small):
        assert v["evidence"]["sweep"]["name"] == "args.clip"
        assert list(v["evidence"]["sweep"]["status"]) == ["0.1", "1", "10", "1000", "100000"]
        assert "`args.clip` is not in the file: swept over 0.1, 1, 10, 1000, 100000" in v["detail"]
    # scaled by 65536 the norm is above every typical threshold; scaled by 2 only below 1 or so
    assert large["status"] == "confirmed", large["detail"]
    assert set(large["evidence"]["sweep"]["status"].values()) == {"confirmed"}
    assert small["status"] == "confirmed", small["detail"]
    statuses = small["evidence"]["sweep"]["status"]
    assert statuses["0.1"] == "confirmed" and statuses["100000"] == "not-reproduced"
    assert "not reproduced above" in small["detail"]


def test_tl201_synthetic_input_is_named_and_run_in_both_grad_states(verified):
    raw, projected = verified.pair("tl201_synthetic_input")
    assert raw["status"] == "confirmed", raw["detail"]
    assert raw["evidence"]["synthetic_inputs"] == ["x"]
    # the same input as an earlier layer's output requires grad: then nothing is lost
    assert raw["evidence"]["with_inputs_requiring_grad"] == "not-reproduced"
    assert "`x`" in raw["detail"] and "requires grad" in raw["detail"]
    assert projected["status"] == "not-reproduced", projected["detail"]
    assert projected["evidence"]["with_inputs_requiring_grad"] == "not-reproduced"


def test_tl203_harmless_repeat_is_told_apart_from_a_growing_list(verified):
    harmless, growing = verified.pair("tl203_repeat")
    assert harmless["status"] == "not-reproduced", harmless["detail"]
    assert harmless["evidence"]["harmless_repeat"] is True
    (counts,) = harmless["evidence"]["executions"].values()
    assert counts == {"checkpointed": 2, "plain": 1}  # it does run twice
    assert growing["status"] == "confirmed", growing["detail"]
    assert "harmless_repeat" not in growing["evidence"]


def test_tl203_global_defined_in_the_file(verified):
    counter, same_value = verified.pair("tl203_global")
    assert counter["status"] == "confirmed", counter["detail"]
    assert counter["evidence"]["globals"] == {"N": {"checkpointed": 2.0, "plain": 1.0}}
    assert same_value["status"] == "not-reproduced", same_value["detail"]
    assert same_value["evidence"]["harmless_repeat"] is True


def test_tl303_count_taken_from_init(verified):
    four, one = verified.pair("tl303_init_count")
    assert four["status"] == "confirmed", four["detail"]
    assert "`self.accum_steps` = 4" in four["detail"]
    assert one["status"] == "not-reproduced", one["detail"]
    assert "`self.accum_steps` = 1" in one["detail"]
    assert "taken as 4" not in one["detail"]


def test_tl303_count_unpacked_from_a_module_tuple(verified):
    four, one = verified.pair("tl303_unpacked_constant")
    assert four["status"] == "confirmed", four["detail"]
    assert "`ACCUM` = 4 (module constant)" in four["detail"]
    assert one["status"] == "not-reproduced", one["detail"]
    assert "`ACCUM` = 1 (module constant)" in one["detail"]


def test_tl203_buffer_registered_in_init_is_built(verified):
    counted, same = verified.pair("tl203_buffer")
    assert counted["status"] == "confirmed", counted["detail"]
    assert counted["evidence"]["state_differs"] == ["self.block.seen"]
    assert same["status"] == "not-reproduced", same["detail"]
    assert same["evidence"]["harmless_repeat"] is True


def test_tl301_bf16_rounding_does_not_confirm_equal_token_counts(verified):
    uneven, equal = verified.pair("tl301_autocast")
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert len(set(uneven["evidence"]["valid_tokens_per_microbatch"])) > 1
    assert equal["status"] == "not-reproduced", equal["detail"]
    assert len(set(equal["evidence"]["valid_tokens_per_microbatch"])) == 1
    for v in (uneven, equal):
        assert v["evidence"]["autocast_dtype"] == "bfloat16"
        assert f"rtol {v['evidence']['tolerance']['rtol']:g}" in v["detail"]
    # the fix is proved within the same tolerance, not left "still differs" by rounding
    assert "(matches)" in uneven["detail"]


def test_tl301_stand_in_takes_the_files_vocabulary(verified):
    uneven, equal = verified.pair("tl301_file_vocabulary")
    for v in (uneven, equal):
        assert "the stand-in model's vocabulary is `VOCAB` = 32 (module constant)" in v["detail"]
        assert "`ACCUM` = 4 (module constant)" in v["detail"]
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert equal["status"] == "not-reproduced", equal["detail"]


def test_tl302_total_reset_every_iteration_is_not_reproduced(verified):
    kept, reset = verified.pair("tl302_reset")
    assert kept["status"] == "confirmed", kept["detail"]
    assert reset["status"] == "not-reproduced", reset["detail"]


def test_tl105_diverging_reference_is_inconclusive(verified):
    small, diverging = verified.pair("tl105_diverging")
    assert small["status"] == "confirmed", small["detail"]
    assert diverging["status"] == "not-executable", diverging["detail"]
    assert "reference diverges too" in diverging["detail"]
    assert diverging["evidence"]["non_finite_entries"]["reference"] > 0
