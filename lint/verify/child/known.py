"""Helpers of libraries the child cannot import (Hugging Face's ``transformers``, timm), known by name:
each stands for what the library computes, and its use is named in the detail (``standins.Missing``)."""

from __future__ import annotations

import torch

from .sandbox import UnboundName


def _unchunked(forward_fn, _chunk_size, _chunk_dim, *tensors):
    return forward_fn(*tensors)


def _extended_mask(mask, *_shape, **_options):
    """A [batch, seq] padding mask as an additive [batch, 1, 1, seq] attention bias."""
    if mask.dim() == 2:
        mask = mask[:, None, None, :]
    dtype = torch.get_default_dtype()
    return (1.0 - mask.to(dtype)) * torch.finfo(dtype).min


def _head_mask(head_mask, num_layers, *_options):
    return [None] * num_layers if head_mask is None else head_mask


def _activation_class(name):
    """timm's ``get_act_layer``: a class given is kept, None is None, a known name is torch's class."""
    if name is None or isinstance(name, type):
        return name
    if isinstance(name, str) and name.lower() in ACTIVATIONS:
        return ACTIVATIONS[name.lower()]
    raise UnboundName(f"get_act_layer({name!r})")


def _ntuple(n: int):
    def to_tuple(x):
        return tuple(x) if isinstance(x, list | tuple) else (x,) * n

    return to_tuple


# helpers of a library the child cannot import, known by name and standing for what they compute
# (Hugging Face's `apply_chunking_to_forward` without chunking, the extended attention mask)
KNOWN_HELPERS = {
    "apply_chunking_to_forward": ("as a call without chunking", _unchunked),
    "get_extended_attention_mask": ("as the usual additive attention mask", _extended_mask),
    "get_head_mask": ("as no head mask", _head_mask),
    "to_2tuple": ("as (x, x)", _ntuple(2)),
    "ndgrid": ("as torch.meshgrid(..., indexing='ij')", lambda *t: torch.meshgrid(*t, indexing="ij")),
    "get_act_layer": ("as torch's activation of that name", lambda name="gelu": _activation_class(name)),
    "to_3tuple": ("as (x, x, x)", _ntuple(3)),
}

ACTIVATIONS = {
    "gelu": torch.nn.GELU,
    "gelu_new": torch.nn.GELU,
    "gelu_pytorch_tanh": torch.nn.GELU,
    "relu": torch.nn.ReLU,
    "silu": torch.nn.SiLU,
    "swish": torch.nn.SiLU,
    "tanh": torch.nn.Tanh,
    "sigmoid": torch.nn.Sigmoid,
}
