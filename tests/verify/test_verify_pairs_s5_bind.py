"""``--verify`` on checkpoint code shaped like real training code (issue 14): a checkpoint function
handed out by the file's own factory, ``functools.partial(checkpoint, ...)`` returned by a factory,
whole numbers that are not in the file.

Each test asserts the verdict and that the detail names what the probe synthesised (the stand-in block,
the number it chose); the not-executable ones name the one thing in the user's terms.
"""

from __future__ import annotations

import pytest
from conftest import Snippets

from trainlint.verify import torch_available

pytestmark = pytest.mark.skipif(not torch_available(), reason="--verify needs torch")

VERIFY_RULES = ("TL101", "TL201", "TL204")
VERIFY_FIXTURES = ()
VERIFY_TIMEOUT = 60

SNIPPETS = Snippets()
pair = SNIPPETS.pair


# TL201: `checkpoint = get_checkpoint_fn()` (the file's factory returns torch's checkpoint) in a
# chunked loop whose chunk size is a parameter (annotated vs only counted with `range`)
pair(
    "tl201_factory_checkpoint",
    "TL201",
    """
    from typing import Optional

    from torch.utils.checkpoint import checkpoint as torch_checkpoint


    def get_checkpoint_fn():
        return torch_checkpoint


    def checkpoint_blocks(blocks, x, blocks_per_ckpt: Optional[int]):
        if blocks_per_ckpt is None:
            for block in blocks:
                x = block(x)
            return x
        checkpoint = get_checkpoint_fn()
        for s in range(0, len(blocks), blocks_per_ckpt):
            for block in blocks[s : s + blocks_per_ckpt]:
                x = checkpoint(block, x)
        return x
    """,
    "blocks_per_ckpt: Optional[int])",
    "blocks_per_ckpt)",
)
# TL201 shaped like efficient_densenet: a layer built with its sizes passed down from the model's
# defaults (`growth_rate=12` through `_DenseBlock`), images (BatchNorm2d wants 4-D inputs), `*features`;
# the checkpoint taken only for inputs that require grad vs always
pair(
    "tl201_dense_layer",
    "TL201",
    """
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint as cp


    def _bn_function_factory(norm, relu, conv):
        def bn_function(*inputs):
            return conv(relu(norm(torch.cat(inputs, 1))))

        return bn_function


    class _DenseLayer(nn.Module):
        def __init__(self, num_input_features, growth_rate, bn_size, efficient=False):
            super().__init__()
            self.norm1 = nn.BatchNorm2d(num_input_features)
            self.relu1 = nn.ReLU()
            self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1)
            self.efficient = efficient

        def forward(self, *prev_features):
            bn_function = _bn_function_factory(self.norm1, self.relu1, self.conv1)
            if self.efficient and any(f.requires_grad for f in prev_features):
                return cp.checkpoint(bn_function, *prev_features)
            return bn_function(*prev_features)


    class _DenseBlock(nn.Module):
        def __init__(self, num_layers, num_input_features, bn_size, growth_rate):
            super().__init__()
            for i in range(num_layers):
                layer = _DenseLayer(num_input_features + i * growth_rate, growth_rate=growth_rate, bn_size=bn_size)
                self.add_module("denselayer%d" % (i + 1), layer)


    class DenseNet(nn.Module):
        def __init__(self, growth_rate=12, bn_size=4):
            super().__init__()
            self.block = _DenseBlock(2, 24, bn_size=bn_size, growth_rate=growth_rate)
    """,
    "if self.efficient and any(f.requires_grad for f in prev_features):",
    "if self.efficient:",
)
# TL201 shaped like DeepSpeedExamples' Hugging Face copies: `transformers` not installed (its base
# class's methods, an activation table, a chunking helper), settings read with defaults of the file's
# own (`getattr(config, "x", "absolute")`, `is None`, `> 1`, a flag named as a parameter default), every
# input of `forward` optional; run through the model (an embedding feeds the checkpoint) vs entered
# at the encoder (its input a batch)
pair(
    "tl201_hf_copy",
    "TL201",
    """
    import torch
    import torch.nn as nn
    import torch.utils.checkpoint
    from transformers_not_here.activations import ACT2FN
    from transformers_not_here.modeling_utils import PreTrainedModel, apply_chunking_to_forward


    def _expand(mask, use_bias_mask=False):
        return mask


    class Layer(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.dense = nn.Linear(config.hidden_size, config.hidden_size)
            self.act = ACT2FN[config.hidden_act]
            self.mode = getattr(config, "position_embedding_type", "absolute")
            self.use_bias_mask = config.use_bias_mask

        def ff(self, h):
            return self.act(self.dense(h))

        def forward(self, h):
            if self.mode != "absolute" or self.use_bias_mask:
                raise ValueError("relative positions are not supported")
            return apply_chunking_to_forward(self.ff, 0, 1, h)


    class Encoder(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.layers = nn.ModuleList([Layer(config) for _ in range(2)])
            self.gradient_checkpointing = False

        def forward(self, hidden_states):
            if self.config.rope_scaling is not None or self.config.pretraining_tp > 1:
                raise ValueError("not supported")
            for layer in self.layers:
                if self.gradient_checkpointing and self.training:
                    hidden_states = torch.utils.checkpoint.checkpoint(layer, hidden_states)
                else:
                    hidden_states = layer(hidden_states)
            return hidden_states


    class Model(PreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.encoder = Encoder(config)
            self.post_init()

        def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None):
            if inputs_embeds is None:
                inputs_embeds = self.embed(input_ids)
            return self.encoder(inputs_embeds)
    """,
    "            return self.encoder(inputs_embeds)",
    "            return inputs_embeds",
)
# TL204: the factory returns partial(checkpoint, preserve_rng_state=<off with dropout>) vs a method
# that keeps the partial on the module (nothing returns it)
pair(
    "tl204_partial_factory",
    "TL204",
    """
    from functools import partial

    from torch.utils.checkpoint import checkpoint


    def checkpoint_function(cfg):
        preserve = cfg.dropout == 0.0
        return partial(checkpoint, preserve_rng_state=preserve, use_reentrant=False)
    """,
    "return partial(",
    "keep = partial(",
)


# TL101 shaped like EveryDream2trainer: settings from a constructor argument (`args`, not in the file),
# parameter lists kept on the object, the step gated by an accumulation count, the optimizers in a
# list; the scaler switched by the unknown `args.amp` vs switched off in the file
pair(
    "tl101_trainer_object",
    "TL101",
    """
    import torch
    from torch.cuda.amp import GradScaler


    class Trainer:
        def __init__(self, args, unet):
            self.clip_grad_norm = args.clip_grad_norm
            self.grad_accum = args.grad_accum
            self.unet_params = unet.parameters()
            self.optimizers = []
            self.scaler = GradScaler(enabled=args.amp, init_scale=2**17.5)

        def _zero_grad(self):
            for optimizer in self.optimizers:
                optimizer.zero_grad()

        def step(self, loss, global_step):
            self.scaler.scale(loss).backward()
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(parameters=self.unet_params, max_norm=self.clip_grad_norm)
            if (global_step + 1) % self.grad_accum == 0:
                for optimizer in self.optimizers:
                    self.scaler.step(optimizer)
                self.scaler.update()
                self._zero_grad()
    """,
    "enabled=args.amp",
    "enabled=False",
)
# TL101 shaped like waifu-diffusion: two models clipped one after the other (two findings); an
# argparse flag whose string default goes through the file's own converter
SNIPPETS.add(
    "tl101_two_models",
    "TL101",
    """
    import argparse

    import torch


    def bool_t(x):
        return x.lower() in ("true", "1")


    parser = argparse.ArgumentParser()
    parser.add_argument("--fp16", type=bool_t, default="True")
    args = parser.parse_args()


    def train(unet, text_encoder, loader, optimizer):
        scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)
        for x in loader:
            loss = unet(x).pow(2).mean() + text_encoder(x).pow(2).mean()
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            torch.nn.utils.clip_grad_norm_(text_encoder.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
    """,
)


def test_every_snippet_is_reported_by_its_rule(verified):
    for name, (rule, _) in SNIPPETS.items():
        count = 2 if name == "tl101_two_models" else 1
        assert [f.rule for f in verified.get(name, [])] == [rule] * count, name


def test_tl101_settings_of_a_trainer_object_are_named_and_the_step_runs(verified):
    unknown, off = verified.pair("tl101_trainer_object")
    # before: "uses `self.unet_params`, which the harness cannot build"
    assert unknown["status"] == "confirmed", unknown["detail"]
    assert "`enabled=args.amp` is not in the file: taken as True (the scaler in use)" in unknown["detail"]
    assert unknown["evidence"]["loss_scale"] == 2**17.5  # `2**17.5` is a number the file writes
    assert (
        "the step's condition `(global_step + 1) % self.grad_accum == 0` taken as true" in unknown["detail"]
    )
    assert "`self.optimizers` holds the one optimizer the probe steps" in unknown["detail"]
    assert "`self._zero_grad()` after the step is not run" in unknown["detail"]
    assert unknown["evidence"]["sweep"]["name"] == "self.clip_grad_norm"
    # the scaler the file switches off: the clip sees true gradients, and the detail says so
    assert off["status"] == "not-reproduced", off["detail"]
    assert "the scaler is off: `enabled=False`" in off["detail"]


def test_tl101_each_of_two_clipped_models_is_probed_with_the_other_a_named_stand_in(verified):
    first, second = sorted(verified["tl101_two_models"], key=lambda f: f.line)
    for finding, other in ((first, "text_encoder"), (second, "unet")):
        v = finding.verify
        # before: "uses `text_encoder.parameters`" / "uses `args.fp16`" (the flag's default unread)
        assert v["status"] == "confirmed", v["detail"]
        assert f"`{other}` is a stand-in apart from the probe's model" in v["detail"]
        assert "`args.fp16` = True (argparse default)" in v["detail"]


def test_tl201_checkpoint_from_the_files_factory_runs_with_a_chosen_chunk_size(verified):
    for v in verified.pair("tl201_factory_checkpoint"):
        # before: "the flagged call at line N was not found in the file"
        assert v["status"] == "confirmed", v["detail"]
        assert v["evidence"]["none_gradients"]
        # the chunk size is not in the file: chosen (1 fits any number of blocks) and named
        assert v["evidence"]["sized_by_name"] == {"blocks_per_ckpt": 1}
        assert "`blocks_per_ckpt` = 1" in v["detail"]


def test_tl204_partial_returned_by_a_factory_is_applied_to_a_named_stand_in_block(verified):
    returned, kept = verified.pair("tl204_partial_factory")
    # before: "checkpoint bound through functools.partial: the probe runs direct calls only"
    assert returned["status"] == "confirmed", returned["detail"]
    assert "recomputation draws new random numbers" in returned["detail"]
    assert "with the RNG state preserved: gradients match the reference" in returned["detail"]
    assert "stand-in block (a Linear, then Dropout(p=0.1))" in returned["detail"]
    assert "`checkpoint_function`" in returned["detail"]
    assert kept["status"] == "not-executable", kept["detail"]
    assert "is not returned by a module-level function" in kept["detail"]
    assert "the probe runs direct calls only" not in kept["detail"]


def test_tl201_image_layer_sized_from_its_builders_and_input_shape_found_by_trial(verified):
    guarded, always = verified.pair("tl201_dense_layer")
    for v in (guarded, always):
        # before: "uses `growth_rate`, which the harness cannot build"
        assert "found by trial after (B, T, D) did not fit (ValueError: expected 4D input" in v["detail"]
        assert "growth_rate" not in v["evidence"].get("sized_by_name", {})  # 12, the model's default
    # the layer checkpoints only inputs that require grad: run that way, and said so
    assert guarded["status"] == "not-reproduced", guarded["detail"]
    assert "as a batch (no grad) the checkpoint call does not run" in guarded["detail"]
    assert always["status"] == "confirmed", always["detail"]
    assert always["evidence"]["none_gradients"]


def test_tl201_hugging_face_copy_without_transformers_runs_through_the_model(verified):
    through_model, encoder_only = verified.pair("tl201_hf_copy")
    # before: "uses `transformers_not_here.activations.ACT2FN`" / "uses `config.rope_scaling`"
    assert through_model["status"] == "not-reproduced", through_model["detail"]
    assert encoder_only["status"] == "confirmed", encoder_only["detail"]
    v = through_model
    for said in (
        "`transformers_not_here.activations.ACT2FN['gelu']` (as torch's GELU)",
        "`transformers_not_here.modeling_utils.apply_chunking_to_forward` (as a call without chunking)",
        "`transformers_not_here.modeling_utils.PreTrainedModel.post_init`",
    ):
        assert said in v["detail"]
    assert v["evidence"]["sized_by_name"] == {
        "config.position_embedding_type": "absolute",  # getattr's default in the file
        "config.use_bias_mask": False,  # `_expand(mask, use_bias_mask=False)`
        "config.rope_scaling": None,  # tested `is not None`: an optional feature, off
        "config.pretraining_tp": 1,  # `> 1`: the bound, branch off
    }
