"""``--verify`` on pairs of snippets shaped like real training code (issue 14): libraries that are
not installed, the user's own package, numbers read from a configuration at run time.

Each pair is one snippet and the same snippet with one substring replaced; each test asserts both
verdicts and that the detail names what is synthetic (the stand-in, the swept values, the one thing
that could not be built).
"""

from __future__ import annotations

import importlib.util

import pytest
from conftest import Snippets

from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL101", "TL201", "TL301")
VERIFY_FIXTURES = ()
VERIFY_TIMEOUT = 60

SNIPPETS = Snippets()


pair = SNIPPETS.pair


# TL201: a library that is not installed (its decorator factory, given a class of the library, is a
# stand-in) vs one of its functions called inside the checkpointed block (no stand-in can say what it
# computes)
pair(
    "tl201_missing_library",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint
    from tl_not_installed_lib import ModelOutput, register_block, scale_features


    class Encoder(nn.Module):
        def __init__(self, dim, depth):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

        @register_block(output_type=ModelOutput, name="encoder")
        def forward(self, x):
            h = x
            for block in self.blocks:
                h = checkpoint(block, h)
            return h
    """,
    "h = x\n",
    "h = scale_features(x)\n",
)
# TL201: a name from the user's own package (relative import), used as a decorator vs called
pair(
    "tl201_own_package",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint
    from ._helpers import traced, prepare


    class Encoder(nn.Module):
        def __init__(self, dim, depth):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

        @traced
        def forward(self, x):
            h = x
            for block in self.blocks:
                h = checkpoint(block, h)
            return h
    """,
    "h = x\n",
    "h = prepare(x)\n",
)
# TL101: a clip threshold read from a configuration dict at run time is swept; a scaler scale of 2
# leaves the scaled norm under the large typical thresholds
pair(
    "tl101_config_threshold",
    "TL101",
    """
    import torch
    from torch import nn


    def train(model, loader, conf):
        max_norm = conf["trainer"]["grad_max_norm"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
            scaler.step(optimizer)
            scaler.update()
    """,
    'GradScaler("cuda")',
    'GradScaler("cuda", init_scale=2.0)',
)

# TL201: a model whose base class checks its settings with isinstance (as BERT's does) is built with a
# settings stand-in of that class; the input straight from the batch vs through a layer
pair(
    "tl201_checked_config",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class EncoderConfig:
        def __init__(self, hidden_size=768, num_layers=12):
            self.hidden_size = hidden_size
            self.num_layers = num_layers


    class PreTrained(nn.Module):
        def __init__(self, config):
            super().__init__()
            if not isinstance(config, EncoderConfig):
                raise ValueError("config must be an EncoderConfig")
            self.config = config


    class Encoder(PreTrained):
        def __init__(self, config):
            super().__init__(config)
            self.proj = nn.Linear(config.hidden_size, config.hidden_size)
            self.blocks = nn.ModuleList([nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_layers)])

        def forward(self, x):
            h = x
            for block in self.blocks:
                h = checkpoint(block, h)
            return h
    """,
    "h = x\n",
    "h = self.proj(x)\n",
)
# TL201: a batch taken apart by position; the checkpoint's input comes from an embedding (requires
# grad: nothing lost) vs the same embedding detached
pair(
    "tl201_unpacked_batch",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class Model(nn.Module):
        def __init__(self, vocab_size, hidden_size):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, hidden_size)
            self.block = nn.Linear(hidden_size, hidden_size)

        def forward(self, batch):
            input_ids = batch[0]
            attention_mask = batch[1]
            h = self.emb(input_ids)
            h = checkpoint(self.block, h * attention_mask.unsqueeze(-1))
            return h
    """,
    "h = self.emb(input_ids)\n",
    "h = self.emb(input_ids).detach()\n",
)
# TL201: sizes whose names the stand-ins do not list are chosen by the shape of the name, and a flag
# that is only tested is off; both are named
pair(
    "tl201_sizes_by_name",
    "TL201",
    """
    import torch
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class DenseLayer(nn.Module):
        def __init__(self, num_input_features, growth_planes, use_gate):
            super().__init__()
            self.conv = nn.Linear(num_input_features, growth_planes)
            self.pre = nn.Linear(num_input_features, num_input_features)
            self.use_gate = use_gate

        def forward(self, x):
            h = x
            if self.use_gate:
                h = torch.sigmoid(h) * h
            return checkpoint(self.conv, h)
    """,
    "h = x\n",
    "h = self.pre(x)\n",
)

# TL301: litgpt's loss where litgpt is not installed: known by its name (a token-mean cross-entropy),
# over a model asked for its head's output in chunks; prompt-masked labels vs every token
pair(
    "tl301_missing_loss",
    "TL301",
    """
    from litgpt.utils import chunked_cross_entropy

    ACCUM = 4


    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            input_ids, targets = batch["input_ids"], batch["labels"]
            logits = model(input_ids, lm_head_chunk_size=128)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, targets[..., 1:], ignore_index=-100)
            (loss / ACCUM).backward()
            if (step + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    'batch["labels"]',
    'batch["input_ids"]',
)
# TL101: a dataclass field whose default is None is a placeholder (filled from a config file): the
# threshold is swept; a real default is used
pair(
    "tl101_placeholder_field",
    "TL101",
    """
    from dataclasses import dataclass

    import torch


    @dataclass
    class TrainerConfig:
        grad_norm_clip: float = None


    class Trainer:
        def __init__(self, config: TrainerConfig, model, optimizer):
            self.config = config
            self.model = model
            self.optimizer = optimizer
            self.scaler = torch.amp.GradScaler("cuda")

        def run_batch(self, loss):
            self.scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
    """,
    "grad_norm_clip: float = None",
    "grad_norm_clip: float = 1e9",
)

# TL101: ZeroRedundancyOptimizer is its optimizer_class on one rank; PyTorch's default loss scale vs
# a scale of 2 under a clip at 5e4
pair(
    "tl101_zero_optimizer",
    "TL101",
    """
    import torch
    from torch import nn
    from torch.distributed.optim import ZeroRedundancyOptimizer


    def train(model, loader):
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, parameters_as_bucket_view=True, lr=0.1
        )
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

# TL101: an accumulation count read from a config dict at run time gets a value chosen by its name
# (named, 4); PyTorch's default loss scale vs a scale of 2 under a clip at 1e4
pair(
    "tl101_runtime_count",
    "TL101",
    """
    import torch
    from torch import nn


    def train(model, loader, conf):
        grad_accum_every = conf["trainer"]["grad_accum_every"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss / grad_accum_every).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e4)
            scaler.step(optimizer)
            scaler.update()
    """,
    'GradScaler("cuda")',
    'GradScaler("cuda", init_scale=2.0)',
)

# TL301: a loss that ignores -1 (BERT style): the synthetic padding follows the loss's own
# ignore_index; prompt-masked labels vs every token
pair(
    "tl301_ignore_minus_one",
    "TL301",
    """
    import torch.nn.functional as F

    ACCUM = 4


    def train(model, loader, optimizer):
        for step, batch in enumerate(loader):
            input_ids = batch["input_ids"]
            labels = batch["labels"]
            logits = model(input_ids)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-1)
            (loss / ACCUM).backward()
            if (step + 1) % ACCUM == 0:
                optimizer.step()
                optimizer.zero_grad()
    """,
    'labels = batch["labels"]',
    "labels = input_ids",
)

# TL201: the climb reaches a model whose forward the probe cannot run (a per-sequence label it cannot
# build): the caller below it runs instead, and the detail says so; the same model returning logits
# runs from the top (the checkpoint's input then comes from the embedding)
pair(
    "tl201_entry_fallback",
    "TL201",
    """
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint


    class Encoder(nn.Module):
        def __init__(self, hidden_size, num_layers):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(num_layers)])

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x)
            return x


    class Classifier(nn.Module):
        def __init__(self, vocab_size, hidden_size, num_layers):
            super().__init__()
            self.emb = nn.Embedding(vocab_size, hidden_size)
            self.encoder = Encoder(hidden_size, num_layers)
            self.head = nn.Linear(hidden_size, 2)

        def forward(self, input_ids, sequence_label):
            logits = self.head(self.encoder(self.emb(input_ids))[:, 0])
            return F.cross_entropy(logits, sequence_label.view(-1))
    """,
    "return F.cross_entropy(logits, sequence_label.view(-1))",
    "return logits",
)

# TL101: a flag computed from an argparse default (`use_amp = args.precision == "fp16"`) switches the
# scaler on (fp16 by default) or off (fp32 by default)
pair(
    "tl101_flag_from_argparse",
    "TL101",
    """
    import argparse

    import torch
    from torch import nn


    def parse_args():
        parser = argparse.ArgumentParser()
        parser.add_argument("--precision", type=str, default="fp16")
        return parser.parse_args()


    def train(model, loader):
        args = parse_args()
        use_amp = args.precision == "fp16"
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    """,
    'default="fp16"',
    'default="fp32"',
)


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_tl201_library_not_installed_gets_a_named_stand_in(verified):
    decorated, called = verified.pair("tl201_missing_library")
    assert decorated["status"] == "confirmed", decorated["detail"]
    assert (
        "stand-ins for what cannot be imported: `tl_not_installed_lib.register_block`" in decorated["detail"]
    )
    assert decorated["evidence"]["stand_ins"] == {
        "`tl_not_installed_lib`, not installed here": ["tl_not_installed_lib.register_block"]
    }
    # called on the checkpoint's input, the library's function decides the values: not built
    assert called["status"] == "not-executable", called["detail"]
    assert "`tl_not_installed_lib.scale_features`" in called["detail"]


def test_tl201_users_own_package_gets_a_named_stand_in(verified):
    decorated, called = verified.pair("tl201_own_package")
    assert decorated["status"] == "confirmed", decorated["detail"]
    assert "`._helpers.traced` (`._helpers`, the user's own package)" in decorated["detail"]
    assert called["status"] == "not-executable", called["detail"]
    assert "`._helpers.prepare`" in called["detail"]


def test_tl101_threshold_read_from_a_config_dict_is_swept(verified):
    large, small = verified.pair("tl101_config_threshold")
    for v in (large, small):
        assert v["evidence"]["sweep"]["name"] == "max_norm"
        assert "`max_norm` is not in the file: swept over 0.1, 1, 10, 1000, 100000" in v["detail"]
    assert large["status"] == "confirmed", large["detail"]
    assert set(large["evidence"]["sweep"]["status"].values()) == {"confirmed"}
    statuses = small["evidence"]["sweep"]["status"]
    assert statuses["0.1"] == "confirmed" and statuses["100000"] == "not-reproduced"


def test_tl201_settings_checked_with_isinstance_get_a_stand_in_of_that_class(verified):
    raw, projected = verified.pair("tl201_checked_config")
    assert raw["status"] == "confirmed", raw["detail"]
    # the user's own constructor ran (`proj` and two blocks); a class rebuilt from the uses in
    # `forward` would hold the blocks only
    assert raw["evidence"]["gradients_compared"] == 6
    assert projected["status"] == "not-reproduced", projected["detail"]


def test_tl201_batch_unpacked_by_position_is_built_by_element_names(verified):
    embedded, detached = verified.pair("tl201_unpacked_batch")
    assert embedded["status"] == "not-reproduced", embedded["detail"]
    assert detached["status"] == "confirmed", detached["detail"]


def test_tl201_sizes_and_flags_chosen_by_name_or_use_are_named(verified):
    raw, projected = verified.pair("tl201_sizes_by_name")
    assert raw["status"] == "confirmed", raw["detail"]
    assert projected["status"] == "not-reproduced", projected["detail"]
    for v in (raw, projected):
        assert v["evidence"]["sized_by_name"] == {
            "num_input_features": 8,
            "growth_planes": 8,
            "use_gate": False,
        }
        assert "`num_input_features` = 8" in v["detail"] and "`use_gate` = False" in v["detail"]


def test_tl301_loss_of_a_library_not_installed_is_a_named_token_mean(verified):
    uneven, every_token = verified.pair("tl301_missing_loss")
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert every_token["status"] == "not-reproduced", every_token["detail"]
    if importlib.util.find_spec("litgpt") is None:  # installed, its own function runs
        for v in (uneven, every_token):
            assert "`litgpt.utils.chunked_cross_entropy` (as a token-mean cross-entropy)" in v["detail"]


def test_tl101_none_default_is_a_placeholder_and_is_swept(verified):
    placeholder, large = verified.pair("tl101_placeholder_field")
    assert placeholder["status"] == "confirmed", placeholder["detail"]
    assert placeholder["evidence"]["sweep"]["name"] == "self.config.grad_norm_clip"
    assert "= None (field of `TrainerConfig`): a placeholder" in placeholder["detail"]
    assert large["status"] == "not-reproduced", large["detail"]
    assert "sweep" not in large["evidence"]


def test_tl101_zero_redundancy_optimizer_runs_as_its_optimizer_class(verified):
    default, small = verified.pair("tl101_zero_optimizer")
    assert default["status"] == "confirmed", default["detail"]
    assert small["status"] == "not-reproduced", small["detail"]
    for v in (default, small):
        assert "ZeroRedundancyOptimizer on one rank, that is SGD(lr=0.1)" in v["detail"]


def test_tl101_count_read_at_run_time_is_chosen_by_name_and_named(verified):
    default, small = verified.pair("tl101_runtime_count")
    assert default["status"] == "confirmed", default["detail"]
    assert small["status"] == "not-reproduced", small["detail"]
    for v in (default, small):
        assert "`grad_accum_every` = 4" in v["detail"]
        assert 'read at run time (`conf["trainer"]["grad_accum_every"]`)' in v["detail"]


def test_tl301_padding_follows_the_losss_ignore_index(verified):
    uneven, every_token = verified.pair("tl301_ignore_minus_one")
    assert uneven["status"] == "confirmed", uneven["detail"]
    assert every_token["status"] == "not-reproduced", every_token["detail"]
    assert "padding labels are -1, the `ignore_index` of the file's loss" in uneven["detail"]


def test_tl201_entry_that_cannot_run_falls_back_to_its_callee_and_says_so(verified):
    fallback, top = verified.pair("tl201_entry_fallback")
    assert fallback["status"] == "confirmed", fallback["detail"]
    assert "`Classifier.forward` did not run; run through `Encoder.forward`" in fallback["detail"]
    assert top["status"] == "not-reproduced", top["detail"]
    assert "run through `Classifier.forward`" in top["detail"] and "did not run" not in top["detail"]


def test_tl101_flag_computed_from_an_argparse_default(verified):
    on, off = verified.pair("tl101_flag_from_argparse")
    assert on["status"] == "confirmed", on["detail"]
    assert '`args.precision` = "fp16" (argparse default)' in on["detail"]
    assert off["status"] == "not-reproduced", off["detail"]
    assert '`args.precision` = "fp32" (argparse default)' in off["detail"]
