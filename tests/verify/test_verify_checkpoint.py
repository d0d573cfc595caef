"""The runtime check (``--verify``): probes for the checkpoint rules TL201, TL202 and TL203.

Every snippet below is linted, its findings are verified in one batch (one child process, so torch is
imported once), and each test checks the verdict of one finding. Expected values come from the
mechanics of the hazard (which gradients must be None, which counts must double), not from output.
"""

from __future__ import annotations

import json

import pytest
from conftest import Snippets

from trainlint.rule import Applicability
from trainlint.verify import torch_available, verify_findings

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL201", "TL202", "TL203")


SNIPPETS = Snippets()
snippet = SNIPPETS.add


# TL201 ---------------------------------------------------------------------------------------------
snippet(
    "tl201_raw_features",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class Encoder(nn.Module):
        def __init__(self, dim, depth):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])
            self.head = nn.Linear(dim, 2)

        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(block, x)
            return self.head(x)
    """,
)
snippet(
    "tl201_frozen_embedding_lora",
    "TL201",
    """
    import torch.nn as nn
    import torch.utils.checkpoint


    class LoRABlock(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.base = nn.Linear(dim, dim)
            self.base.requires_grad_(False)
            self.lora_a = nn.Linear(dim, 4, bias=False)
            self.lora_b = nn.Linear(4, dim, bias=False)

        def forward(self, x):
            return self.base(x) + self.lora_b(self.lora_a(x))


    class Model(nn.Module):
        def __init__(self, vocab, dim):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.embed.weight.requires_grad = False
            self.layers = nn.ModuleList([LoRABlock(dim) for _ in range(2)])
            self.gradient_checkpointing = False

        def forward(self, input_ids, attention_mask=None):
            hidden = self.embed(input_ids)
            for layer in self.layers:
                if self.gradient_checkpointing and self.training:
                    hidden = torch.utils.checkpoint.checkpoint(layer, hidden)
                else:
                    hidden = layer(hidden)
            return hidden
    """,
)
snippet(
    "tl201_pure_function",
    "TL201",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    def gelu_tanh(x):
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


    class MLP(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc1 = nn.Linear(dim, 4 * dim)
            self.fc2 = nn.Linear(4 * dim, dim)

        def forward(self, x):
            h = self.fc1(x)
            h = checkpoint(gelu_tanh, h)
            return self.fc2(h)
    """,
)
snippet(
    "tl201_trainable_embedding",
    "TL201",
    """
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint


    class LM(nn.Module):
        def __init__(self, vocab, dim, depth):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([nn.Linear(dim, dim) for _ in range(depth)])

        def forward(self, input_ids):
            x = self.embed(input_ids)
            for block in self.blocks:
                x = checkpoint(block, x)
            return x
    """,
)
snippet(
    "tl201_keyword_argument",
    "TL201",
    """
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.proj = nn.Linear(dim, dim)

        def forward(self, x, scale=1.0):
            return self.proj(x) * scale


    class Net(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.inp = nn.Linear(dim, dim)
            self.block = Block(dim)

        def forward(self, x):
            h = self.inp(x)
            return checkpoint(self.block, h, scale=0.5)
    """,
)
snippet(
    "tl201_method_of_self",
    "TL201",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Attention(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.qkv = nn.Linear(dim, 3 * dim)
            self.out = nn.Linear(dim, dim)
            self.norm = nn.LayerNorm(dim)

        def _attend(self, x):
            q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
            w = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
            return self.out(w @ v)

        def forward(self, x):
            return x + checkpoint(self._attend, x)
    """,
)
snippet(
    "tl201_unbindable",
    "TL201",
    """
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Net(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.block = nn.Linear(config.hidden, config.hidden)

        def forward(self, x):
            x = x * self.config.embedding_multiplier
            return checkpoint(self.block, x)
    """,
)

# TL202 ---------------------------------------------------------------------------------------------
snippet(
    "tl202_sequential_on_inputs",
    "TL202",
    """
    from torch.utils.checkpoint import checkpoint_sequential


    def run_stages(stages, features):
        return checkpoint_sequential(stages, 2, features, use_reentrant=True)
    """,
)
snippet(
    "tl202_after_trainable_layer",
    "TL202",
    """
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Net(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.stem = nn.Linear(dim, dim)
            self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

        def forward(self, x):
            return checkpoint(self.body, self.stem(x), use_reentrant=True)
    """,
)

# TL203 ---------------------------------------------------------------------------------------------
snippet(
    "tl203_counter",
    "TL203",
    """
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.fc = nn.Linear(dim, dim)
            self.calls = 0

        def inner(self, x):
            self.calls += 1
            return torch.relu(self.fc(x))

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)
    """,
)
snippet(
    "tl203_batchnorm",
    "TL203",
    """
    from torch import nn
    from torch.utils.checkpoint import checkpoint


    class ConvBlock(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.proj = nn.Linear(channels, channels)
            self.bn = nn.BatchNorm1d(channels)

        def body(self, x):
            return self.bn(self.proj(x))

        def forward(self, x):
            return checkpoint(self.body, x, use_reentrant=False)
    """,
)
snippet(
    "tl203_global_step",
    "TL203",
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    STEP = 0


    def block(x):
        global STEP
        STEP = STEP + 1
        return torch.sin(x) * 2


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(8, 8)

        def forward(self, x):
            return checkpoint(block, self.inp(x), use_reentrant=False)
    """,
)
snippet(
    "tl203_aux_losses",
    "TL203",
    """
    from torch.utils.checkpoint import checkpoint


    def run(layers, x, aux):
        def exec_func(h):
            for layer in layers:
                h = layer(h)
                aux.append(h.mean())
            return h
        return checkpoint(exec_func, x, use_reentrant=False)
    """,
)
snippet(
    "tl203_after_last_op",
    "TL203",
    """
    import torch
    from torch.utils.checkpoint import checkpoint

    TRACE = []


    def block(x, w):
        y = torch.tanh(x @ w)
        TRACE.append(1)
        return y


    def run(x, w):
        return checkpoint(block, x, w, use_reentrant=False)
    """,
)
snippet(
    "tl203_unbindable",
    "TL203",
    """
    import torch
    from torch.utils.checkpoint import checkpoint


    class M(torch.nn.Module):
        def inner(self, x):
            self.calls += 1
            return self.lin(x)

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)
    """,
)

VERIFY_FIXTURES = ("fixtures/bad_gpt_amp.py",)
VERIFY_TIMEOUT = 60
line_of = SNIPPETS.line_of


def test_every_snippet_is_reported_by_its_rule(verified):
    verified.assert_each_snippet_reported_once(SNIPPETS)


def test_verify_object_shape(verified):
    finding = verified.one("tl201_raw_features")
    data = json.loads(json.dumps(finding.to_json()))["verify"]
    assert set(data) == {"status", "device", "torch", "detail", "evidence"}
    assert data["device"] == "cpu"
    assert data["torch"][0].isdigit()
    for key in ("as_written_vs_reference", "fixed_vs_reference"):
        assert set(data["evidence"][key]) == {"max_abs", "max_rel"}
    assert data["evidence"]["tolerance"]["rtol"] > 0


# TL201 / TL202 ---------------------------------------------------------------------------------------


def test_tl201_input_without_grad_is_confirmed_with_the_none_gradients(verified):
    finding = verified.one("tl201_raw_features")
    v = finding.verify
    assert v["status"] == "confirmed"
    # both checkpointed Linear layers lose their gradients; the head after them keeps its own
    assert sorted(v["evidence"]["none_gradients"]) == [
        "blocks.0.bias",
        "blocks.0.weight",
        "blocks.1.bias",
        "blocks.1.weight",
    ]
    assert "blocks.0.weight" in v["detail"]
    assert v["evidence"]["as_written_vs_reference"]["max_rel"] == 1.0  # a missing gradient counts as zero
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0
    assert finding.fix.applicability is Applicability.VERIFIED


def test_tl201_frozen_embedding_lora_is_confirmed(verified):
    v = verified.one("tl201_frozen_embedding_lora").verify
    assert v["status"] == "confirmed"
    # the frozen base weights have no gradient anyway: only the adapters are missing theirs
    assert sorted(v["evidence"]["none_gradients"]) == [
        "layers.0.lora_a.weight",
        "layers.0.lora_b.weight",
        "layers.1.lora_a.weight",
        "layers.1.lora_b.weight",
    ]
    assert "`self.gradient_checkpointing` set to True" in v["detail"]


def test_tl201_pure_function_is_not_reproduced(verified):
    finding = verified.one("tl201_pure_function")
    assert finding.verify["status"] == "not-reproduced"
    assert finding.verify["evidence"]["as_written_vs_reference"]["max_rel"] == 0.0
    assert finding.verify["evidence"]["gradients_compared"] == 4  # fc1 and fc2, weight and bias


def test_tl201_input_from_trainable_embedding_is_not_reproduced(verified):
    assert verified.one("tl201_trainable_embedding").verify["status"] == "not-reproduced"


def test_tl201_keyword_argument_raises_under_reentrant(verified):
    finding = verified.one("tl201_keyword_argument")
    v = finding.verify
    assert v["status"] == "confirmed"
    assert "Unexpected keyword arguments: scale" in v["detail"]
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0
    assert finding.fix.applicability is Applicability.VERIFIED


def test_tl201_checkpointed_method_uses_the_users_layers(verified):
    v = verified.one("tl201_method_of_self").verify
    assert v["status"] == "confirmed"
    assert set(v["evidence"]["none_gradients"]) == {
        "qkv.weight",
        "qkv.bias",
        "out.weight",
        "out.bias",
        "norm.weight",
        "norm.bias",
    }


def test_tl201_unbindable_name_is_not_executable_naming_it(verified):
    finding = verified.one("tl201_unbindable")
    assert finding.verify["status"] == "not-executable"
    assert "config.embedding_multiplier" in finding.verify["detail"]
    assert finding.fix.applicability is Applicability.UNSAFE


def test_tl202_checkpoint_sequential_on_inputs_is_confirmed(verified):
    v = verified.one("tl202_sequential_on_inputs").verify
    assert v["status"] == "confirmed"
    # the first segment is checkpointed on an input that does not require grad
    assert sorted(v["evidence"]["none_gradients"]) == ["stages.0.proj.bias", "stages.0.proj.weight"]
    assert v["evidence"]["fixed_vs_reference"]["max_rel"] == 0.0


def test_tl202_input_that_requires_grad_is_not_reproduced(verified):
    assert verified.one("tl202_after_trainable_layer").verify["status"] == "not-reproduced"


# TL203 -----------------------------------------------------------------------------------------------


def test_tl203_counter_runs_twice(verified):
    v = verified.one("tl203_counter").verify
    assert v["status"] == "confirmed"
    line = line_of("tl203_counter", "self.calls += 1")
    assert v["evidence"]["executions"] == {f"the statement on line {line}": {"checkpointed": 2, "plain": 1}}
    assert "self.calls" in v["detail"]


def test_tl203_batchnorm_running_statistics_update_again(verified):
    v = verified.one("tl203_batchnorm").verify
    assert v["status"] == "confirmed"
    assert any("running_mean" in name for name in v["evidence"]["state_differs"])


def test_tl203_global_counter(verified):
    v = verified.one("tl203_global_step").verify
    assert v["status"] == "confirmed"
    assert v["evidence"]["globals"] == {"STEP": {"checkpointed": 2.0, "plain": 1.0}}


def test_tl203_outer_list_grows_again(verified):
    v = verified.one("tl203_aux_losses").verify
    assert v["status"] == "confirmed"
    counts = v["evidence"]["executions"][f"the statement on line {line_of('tl203_aux_losses', 'aux.append')}"]
    assert counts["plain"] == 2  # two stand-in layers
    assert counts["checkpointed"] > counts["plain"]


def test_tl203_side_effect_after_the_last_saved_tensor_is_not_repeated(verified):
    # non-reentrant checkpoint stops recomputing once every saved tensor is back
    v = verified.one("tl203_after_last_op").verify
    assert v["status"] == "not-reproduced"
    line = line_of("tl203_after_last_op", "TRACE.append")
    assert v["evidence"]["executions"][f"the statement on line {line}"] == {"checkpointed": 1, "plain": 1}


def test_tl203_unbindable_attribute_is_named(verified):
    v = verified.one("tl203_unbindable").verify
    assert v["status"] == "not-executable"
    assert "self.calls" in v["detail"]


# fixtures ------------------------------------------------------------------------------------------

PLANTED = [
    ("fixtures/bad_gpt_amp.py", "TL203"),
    ("fixtures/bad_gpt_amp.py", "TL201"),
]


@pytest.mark.parametrize(("path", "rule"), PLANTED)
def test_planted_fixture_mistakes_are_confirmed(verified, path, rule):
    verified.assert_confirmed(path, rule)


@pytest.mark.cuda
def test_cuda_path():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    findings, sources = SNIPPETS.findings(["tl201_raw_features"])
    (finding,) = verify_findings(findings, sources, device="cuda", timeout=60)
    assert finding.verify["device"] == "cuda", finding.verify
    assert finding.verify["status"] == "confirmed", finding.verify["detail"]
