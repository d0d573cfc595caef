"""Synthetic stand-ins for what a probe program cannot build from the file alone: layers, config
values, data, a tiny model with a loss per step, a GradScaler, token batches, a language model, and
the loop helpers (schedulers, loaders, context managers) a loop probe replaces."""

from __future__ import annotations

import inspect
import math
import re

import torch

from . import capture, state
from .known import ACTIVATIONS, KNOWN_HELPERS
from .sandbox import Unbound


def _quiet_profiler_marks() -> None:
    """NVTX range markers raise on a build of PyTorch without CUDA; they only annotate profiles, so
    there they do nothing (model code calls them in ``forward``)."""
    nvtx = torch.cuda.nvtx
    try:
        nvtx.range_push("trainlint")
        nvtx.range_pop()
    except RuntimeError:
        for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
            setattr(nvtx, name, lambda *args, **kwargs: None)


_quiet_profiler_marks()

# Sizes of every synthetic tensor: batch, sequence, width, vocabulary.
B, T, D, V = 2, 6, 8, 16


class Layer(torch.nn.Module):
    """A shape-keeping layer with parameters: Linear(D, D) on the first tensor argument (ids go
    through an embedding), other arguments are accepted and ignored."""

    def __init__(self, outputs: int = 1) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(D, D)
        self.outputs = outputs

    def forward(self, *args, **kwargs):
        x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if x is None:
            raise TypeError("stand-in layer called without a tensor")
        if not x.is_floating_point():
            x = torch.nn.functional.one_hot(x.long() % D, D).to(self.proj.weight.dtype)
        if x.shape[-1] != D:
            raise TypeError(f"stand-in layer expects width {D}, got shape {tuple(x.shape)}")
        y = torch.tanh(self.proj(x))
        if self.outputs > 1:
            return (y, *[None] * (self.outputs - 1))
        return y


class RowBatchNorm(torch.nn.Module):
    """BatchNorm1d over the last dimension of a (..., D) tensor (keeps running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(D)

    def forward(self, x, *args, **kwargs):
        shape = x.shape
        return self.bn(x.reshape(-1, shape[-1])).reshape(shape)


def layer(kind: str = "", **kwargs) -> torch.nn.Module:
    """A stand-in of the given torch.nn kind with the synthetic width (literal options kept)."""
    return place(_layer(kind, **kwargs))


def _layer(kind: str = "", **kwargs) -> torch.nn.Module:
    nn = torch.nn
    if kind in ("Linear", "LazyLinear"):
        return nn.Linear(D, D, bias=kwargs.get("bias", True))
    if kind in ("Conv1d", ""):
        return Layer()
    if kind == "Embedding":
        return nn.Embedding(V, D)
    if kind in ("LayerNorm", "RMSNorm", "GroupNorm"):
        return nn.LayerNorm(D) if kind != "RMSNorm" else nn.RMSNorm(D)
    if kind in ("BatchNorm1d", "BatchNorm2d", "SyncBatchNorm"):
        return RowBatchNorm()
    if kind in ("Dropout", "Dropout1d", "Dropout2d", "AlphaDropout"):
        return nn.Dropout(kwargs.get("p", 0.1))
    if kind in ("GELU", "ReLU", "SiLU", "Tanh", "Sigmoid", "Identity", "Softmax", "LeakyReLU", "Mish"):
        return getattr(nn, kind)(**kwargs)
    return Layer()


# Small values for constructor parameters and config fields, chosen by exact name (then by the shape
# of the name, ``_SIZE_PATTERNS``). Pairs, not a dict: two sizes may be equal (2 * D == V).
_SIZES: tuple[tuple[object, tuple[str, ...]], ...] = (
    (
        D,
        (
            "dim",
            "d",
            "d_model",
            "model_dim",
            "hidden",
            "hidden_size",
            "hidden_dim",
            "n_embd",
            "embed_dim",
            "embedding_dim",
            "emb_dim",
            "embed_size",
            "emb_size",
            "width",
            "channels",
            "in_channels",
            "out_channels",
            "in_features",
            "out_features",
            "features",
            "num_features",
            "in_dim",
            "out_dim",
            "n_state",
            "d_hidden",
            "size",
            "input_size",
            "output_size",
            "input_dim",
            "output_dim",
            "head_dim",
        ),
    ),
    (
        2 * D,
        (
            "intermediate_size",
            "ffn_dim",
            "ffn_hidden_size",
            "mlp_dim",
            "d_ff",
            "ff_dim",
            "hidden_features",
            "n_inner",
            "inner_dim",
            "dim_feedforward",
            "mlp_hidden_dim",
        ),
    ),
    (V, ("vocab", "vocab_size", "n_vocab", "num_embeddings", "num_tokens", "n_tokens", "padded_vocab_size")),
    (
        2,
        (
            "depth",
            "layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "num_hidden_layers",
            "n_blocks",
            "num_blocks",
            "heads",
            "n_head",
            "n_heads",
            "nhead",
            "num_heads",
            "num_attention_heads",
            "mlp_ratio",
            "segments",
            "chunks",
            "n_chunks",
            "expansion",
            "ffn_mult",
        ),
    ),
    (1, ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_query_groups")),
    (
        2 * T,
        (
            "block_size",
            "max_len",
            "max_seq_len",
            "seq_len",
            "context_length",
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_length",
            "seq_length",
        ),
    ),
    (3, ("num_classes", "n_classes", "num_labels", "n_labels")),
    (
        0.1,
        (
            "dropout",
            "p",
            "drop",
            "pdrop",
            "resid_pdrop",
            "attn_pdrop",
            "embd_pdrop",
            "drop_rate",
            "attn_drop",
            "proj_drop",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "attention_dropout",
            "hidden_dropout",
            "dropout_rate",
            "dropout_p",
            "dropout_prob",
        ),
    ),
    (1e-5, ("eps", "epsilon", "layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "norm_eps")),
    (0.02, ("initializer_range", "init_std")),
)
_BY_NAME = {name: value for value, names in _SIZES for name in names}
_BY_NAME.update(
    {"hidden_act": "gelu", "activation": "gelu", "act_fn": "gelu", "bias": True, "use_bias": True}
)
_CONFIG_NAMES = (
    "config",
    "cfg",
    "conf",
    "args",
    "hparams",
    "params",
    "opt",
    "opts",
    "model_args",
    "model_config",
)


_MISSING = object()


def arg(name: str, written=_MISSING):
    """A small value for a constructor parameter or config field called ``name``; configs
    (``config``, ``cfg``, ``args``) become a ``Config`` that answers the same way. ``written`` is the
    literal the file passes: flags and strings are kept, sizes known by name are made small, other
    numbers are kept when small."""
    low = name.lower().rsplit(".", 1)[-1]
    if written is not _MISSING and (isinstance(written, bool | str) or written is None):
        return written
    if low in _CONFIG_NAMES:
        return Config(name)
    if low in _BY_NAME:
        return _BY_NAME[low]
    if written is not _MISSING and isinstance(written, int | float) and abs(written) <= 64:
        return written
    for pattern, value in _SIZE_PATTERNS:
        if pattern.search(low):
            capture.sized_by_pattern[name] = value  # named in the detail (``compare.result``)
            return value
    return Unset(name)


class Unset(Unbound):
    """A setting whose value is neither in the file nor known by its name. Asked only whether it is
    on (``if args.sparse_attention:``), it is off, as an optional feature left unset is; the choice
    is named in the detail. Any other use is reported as unbound."""

    def __bool__(self) -> bool:
        capture.sized_by_pattern[object.__getattribute__(self, "_tl_name")] = False
        return False


# sizes for names the table above does not list, by the shape of the name (``type_vocab_size``,
# ``num_input_features``, ``pad_token_id``); the first pattern that matches decides
_SIZE_PATTERNS = (
    (re.compile(r"(kernel|patch|window|pool)_size$|stride$"), 1),
    (re.compile(r"resolution$"), (8, 8)),  # a feature map's (H, W): the trial input shapes' 8 x 8
    (re.compile(r"vocab(_size)?$|^n_?tokens$"), V),
    (re.compile(r"(_token_id|_idx|_index)$"), 0),
    (re.compile(r"(drop|dropout)(_prob|_rate|_p)?$|_pdrop$"), 0.1),
    (re.compile(r"^(n|num)_\w*(layers|blocks|heads|groups|experts)$"), 2),
    (re.compile(r"(eps|epsilon)$"), 1e-5),
    (re.compile(r"accum"), 4),  # an accumulation count
    (
        re.compile(
            r"(_size|_dim|_features|_channels|_width|_embd|_hidden|_planes)$|^(d|n)_(model|embd|hidden)$"
        ),
        D,
    ),
)


class Config:
    """A configuration object whose size fields get small values by name; any other field is
    unbound (its use is reported)."""

    def __init__(self, name: str = "config") -> None:
        object.__setattr__(self, "_tl_name", name)
        object.__setattr__(self, "_tl_set", {})

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        values = object.__getattribute__(self, "_tl_set")
        if attr in values:
            return values[attr]
        if attr.startswith("_"):
            return Unbound(attr)
        name = f"{object.__getattribute__(self, '_tl_name')}.{attr}"
        default = _field_defaults.get(attr, _MISSING)
        # the file reads it with a default of its own (a bound it compares with yields to a size
        # known by name: `config.n_layer > 1` keeps two layers)
        if default is not _MISSING and not (type(default) is int and attr.lower() in _BY_NAME):
            capture.sized_by_pattern[name] = _field_defaults[attr]
            return _field_defaults[attr]
        value = arg(name)
        if isinstance(value, Config):  # a nested config keeps what is set on it (self.args.x = 4)
            values[attr] = value
        return value

    def __setattr__(self, attr: str, value) -> None:
        object.__getattribute__(self, "_tl_set")[attr] = value

    def get(self, key, default=None):
        value = getattr(self, key)
        return default if isinstance(value, Unbound) else value


_field_defaults: dict[str, object] = {}


def config_defaults(defaults: dict[str, object]) -> None:
    """Settings fields the file reads with its own default (``getattr(config, "x", "absolute")``, a
    field tested ``is None``): settings stand-ins answer them with it."""
    _field_defaults.clear()
    _field_defaults.update(defaults)


def config_as(cls: type, name: str = "config") -> Config:
    """A settings stand-in that is an instance of the file's own settings class ``cls`` (the code
    checks it with ``isinstance``); its fields still come by name, its ``__init__`` is not run."""
    kind = type(
        cls.__name__, (Config, cls), {"__getattr__": Config.__getattr__, "__setattr__": Config.__setattr__}
    )
    made = object.__new__(kind)
    Config.__init__(made, name)
    return made


def set_path(root, path: str, value) -> None:
    """``root.a.b = value`` for a value the file sets; ``a`` becomes a settings object unless the probe
    built it already (``self.config.grad_clip`` with ``self`` a stand-in)."""
    *heads, last = path.split(".")
    obj = root
    for head in heads:
        inner = getattr(obj, head, None)
        if inner is None or isinstance(inner, Unbound):
            inner = Config(head)
            setattr(obj, head, inner)
        obj = inner
    setattr(obj, last, value)


def layers(n: int = 2, kind: str = "") -> torch.nn.ModuleList:
    return torch.nn.ModuleList([layer(kind) for _ in range(n)])


def set_on(root, class_name: str, attr: str, value) -> None:
    """Set a flag on every sub-module of the given class (a condition below the entry module)."""
    if isinstance(root, torch.nn.Module):
        for module in root.modules():
            if type(module).__name__ == class_name:
                setattr(module, attr, value)


def place(module):
    """Move a module built by the snippet's own code to the probe's device."""
    if isinstance(module, torch.nn.Module) and state.DEVICE != "cpu":
        module.to(state.DEVICE)
    return module


def sequential(functions, x):
    """What ``checkpoint_sequential(functions, segments, x)`` computes, without checkpointing."""
    for fn in functions:
        x = fn(x)
    return x


def param(name: str = "w") -> torch.nn.Parameter:
    """A weight passed as an argument: a (D, D) parameter (a vector for biases)."""
    if name in ("b", "bias"):
        return torch.nn.Parameter(0.1 * torch.randn(D, device=state.DEVICE))
    return torch.nn.Parameter(torch.randn(D, D, device=state.DEVICE) / math.sqrt(D))


def data(kind: str = "float", **kwargs):
    """Synthetic data tensors: they do not require grad, like batches from a loader, unless a probe
    runs the other state too (``state.INPUTS_REQUIRE_GRAD``)."""
    if kind == "ids":
        return torch.randint(0, V, (B, T), device=state.DEVICE)
    if kind == "mask":
        return torch.ones(B, T, dtype=torch.long, device=state.DEVICE)
    if kind == "labels":
        return torch.randint(0, V, (B, T), device=state.DEVICE)
    if kind == "positions":
        return torch.arange(T, device=state.DEVICE).unsqueeze(0).expand(B, T)
    shape = _float_shape[0] or (B, T, D)
    return torch.randn(*shape, device=state.DEVICE).requires_grad_(state.INPUTS_REQUIRE_GRAD)


# the shape of synthetic float inputs: (B, T, D) unless a probe found another by trial (an image
# model's (B, C, H, W)); ``drivers.run_variants`` sets it
_float_shape: list[tuple[int, ...] | None] = [None]
TRIAL_SHAPES = ((B, D, 8, 8), (B, 8, 8, D), (B, 3, 16, 16), (B, D))


def float_shape(shape: tuple[int, ...] | None) -> None:
    _float_shape[0] = shape


# --------------------------------------------------------------------------------------------------
# training-step stand-ins: a tiny model, a loss per step, a GradScaler with a large fixed scale

STEPS = 3
LONG_STEPS = 30  # TL105: many small steps, so that rounding losses add up
LOSS_SCALE = 4096.0  # 2**12: large, exact in binary, and no fp16 overflow for the tiny model


class Output:
    """A model output object (``out.loss``, ``out.logits``; ``out[0]`` as in Hugging Face)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)

    def __getitem__(self, index):
        values = [v for v in self.__dict__.values() if v is not None]
        return values[index]

    def __iter__(self):
        return iter([v for v in self.__dict__.values() if v is not None])


class TinyModel(torch.nn.Sequential):
    """The probe's model. On one rank it is its own ``.module`` (the code reaches the model inside its
    DistributedDataParallel wrapper as ``ddp_model.module``)."""

    @property
    def module(self) -> torch.nn.Module:
        return self.__dict__.get("_tl_module", self)

    @module.setter
    def module(self, inner: torch.nn.Module) -> None:
        self.__dict__["_tl_module"] = inner  # not a sub-module: no cycle in `modules()`


def tiny_model() -> torch.nn.Module:
    return TinyModel(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D)).to(state.DEVICE)


def step_batch(step: int, growing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets for one step; with ``growing`` the targets (and so the gradient
    norms) grow from step to step."""
    gen = torch.Generator(device="cpu").manual_seed(100 + step)
    x = torch.randn(4, D, generator=gen)
    y = torch.randn(4, D, generator=gen) * ((1.0 + step) if growing else 0.5)
    return x.to(state.DEVICE), y.to(state.DEVICE)


def loss(model: torch.nn.Module, step: int, growing: bool = True) -> torch.Tensor:
    """A regression loss of the tiny model on this step's batch, forward under autocast."""
    x, y = step_batch(step, growing)
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # parameters stored in 16 bits: the forward runs in that dtype
        out = model(x.to(dtype))
    else:
        with torch.autocast(device_type=state.DEVICE, dtype=state.LOW_DTYPE):
            out = model(x)
    return ((out.float() - y) ** 2).mean()


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def scaler(enabled=True, init_scale=LOSS_SCALE, **kwargs):
    capture.records.setdefault("scaler_enabled", []).append(float(bool(enabled)))
    return torch.amp.GradScaler(
        state.DEVICE, init_scale=init_scale, growth_interval=10**6, enabled=bool(enabled)
    )


class Backward:
    """Stands for ``accelerator``/``fabric``: their ``backward(loss)`` is ``loss.backward()``."""

    def backward(self, loss, **kwargs):
        loss.backward()

    manual_backward = backward  # Lightning's ``self.manual_backward(loss)``


# --------------------------------------------------------------------------------------------------
# token batches for accumulation probes

# valid tokens per row, per microbatch (cycled): deliberately uneven, as padded data is
VALID_LENGTHS = [(6, 5), (2, 1), (5, 3), (1, 1), (6, 6), (3, 2), (4, 1), (2, 2)]


# the keywords a model takes its token ids by (torchtune's batches hold "tokens")
_IDS_KEYS = ("input_ids", "idx", "tokens", "input_tokens", "token_ids")


class TinyLM(torch.nn.Module):
    """A language model stand-in: embedding then a linear head over the vocabulary. Called as
    ``model(ids)`` it returns logits; in ``"output"`` mode an object with ``.logits`` and (given
    labels) ``.loss``, a token mean over labels that are not -100; in ``"tuple"`` mode
    ``(logits, loss)``."""

    def __init__(self, mode: str = "logits", vocab: int = V) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(max(V, vocab), D)  # the file's own ids may go up to vocab
        self.head = torch.nn.Linear(D, vocab)
        self.mode = mode
        self.to(state.DEVICE)

    def forward(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ids = next((kwargs[k] for k in _IDS_KEYS if k in kwargs), tensors[0] if tensors else None)
        labels = kwargs.get("labels", kwargs.get("targets", tensors[1] if len(tensors) > 1 else None))
        if ids is None:
            raise TypeError("stand-in language model called without token ids")
        logits = self.head(torch.tanh(self.embed(ids)))
        chunk = kwargs.get("lm_head_chunk_size")
        if isinstance(chunk, int) and chunk > 0 and self.mode == "logits":
            return list(logits.split(chunk, dim=1))  # the call asks for the head's output in chunks
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100
            )
        if self.mode == "tuple":
            return logits, loss
        if self.mode == "output":
            return Output(loss=loss, logits=logits)
        return logits


def token_batches(k: int, ignore: int = -100) -> list[dict]:
    """K microbatches of padded token ids; labels of padding are ``ignore`` (the loss's
    ``ignore_index``)."""
    capture.batch_valid.clear()
    out = []
    for i in range(k):
        lengths = VALID_LENGTHS[i % len(VALID_LENGTHS)]
        ids = torch.randint(1, V, (B, T))
        mask = torch.zeros(B, T, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        ids = ids * mask  # padding id 0
        labels = ids.masked_fill(mask == 0, ignore)
        capture.batch_valid[i] = int(mask.sum())
        out.append(
            {
                "input_ids": ids.to(state.DEVICE),
                "attention_mask": mask.to(state.DEVICE),
                "labels": labels.to(state.DEVICE),
            }
        )
    return out


def concat_batches(batches: list[dict]) -> dict:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def zero_all(module) -> None:
    if isinstance(module, torch.nn.Module):
        for p in module.parameters():
            p.grad = None


# One step's loss is multiplied by this: finite on its own, its gradients overflow fp32 once multiplied
# by the loss scale, as fp16 gradients overflow when the scale is too large for them.
OVERFLOW_FACTOR = 1e36


def micro_loss(model) -> torch.Tensor:
    """The loss of one microbatch: each call gets the next batch (per rank); on the overflow
    iteration the loss is made so large that its scaled gradients overflow."""
    k = capture.current_loop.get("loss_calls", 0)
    capture.current_loop["loss_calls"] = k + 1
    value = loss(model, k + 1000 * state.RANK, growing=False)
    if (
        capture.current_loop.get("overflow") is not None
        and capture.current_loop.get("iteration") == capture.current_loop["overflow"]
    ):
        value = value * OVERFLOW_FACTOR
    return value


class NoOp:
    """Stands for a learning-rate scheduler or progress bar: every method call does nothing."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_tl_name", name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return lambda *args, **kwargs: None


class NullContext:
    """Stands for a context manager the probe cannot build (``with ctx:``): entering it does nothing."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


class Missing(Unbound):
    """Stands for a name imported from a module the child cannot import (a library that is not
    installed, or the user's own package). What it does follows how the code uses it: a decorator
    (``@traced``, ``@register("x")``) leaves the function or class as it is, a base class is an
    ``nn.Module`` that takes any arguments, attributes are stand-ins of the same module, and a call
    with only literal arguments gives another stand-in. Anything that would need what the library
    does (a call on the program's objects, arithmetic, a truth value) is reported naming it. Every use is
    recorded in ``capture.stood_in`` so that the detail names the stand-in."""

    def __init__(self, name: str, origin: str) -> None:
        super().__init__(name)
        object.__setattr__(self, "_tl_origin", origin)

    def _used(self, how: str = "") -> None:
        name = object.__getattribute__(self, "_tl_name") + how
        if name.endswith("()"):
            return  # what a factory returned: the factory is named already
        origin = object.__getattribute__(self, "_tl_origin")
        capture.stood_in.setdefault(origin, [])
        if name not in capture.stood_in[origin]:
            capture.stood_in[origin].append(name)

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        name = object.__getattribute__(self, "_tl_name")
        return Missing(f"{name}.{attr}", object.__getattribute__(self, "_tl_origin"))

    def __call__(self, *args, **kwargs):
        name = object.__getattribute__(self, "_tl_name")
        if _LOSS_NAMES.search(name.rsplit(".", 1)[-1]) and len(args) >= 2:
            self._used(" (as a token-mean cross-entropy)")
            return token_mean_loss(*args[:2], **kwargs)
        last = name.rsplit(".", 1)[-1]
        known = KNOWN_HELPERS.get(last)
        if known is None and re.search(r"Output(WithPast\w*)?$|Output\w*Attentions$", last) and not args:
            known = ("as a model output holding what it is given", lambda **fields: Output(**fields))
        if known is not None:
            how, helper = known
            self._used(f" ({how})")
            return helper(*args, **kwargs)
        self._used()
        if len(args) == 1 and not kwargs and (isinstance(args[0], type) or inspect.isfunction(args[0])):
            return args[0]  # used as a decorator
        if not all(_descriptive(v) for v in [*args, *kwargs.values()]):
            # called on the program's objects (a model, tensors, an optimizer): what it would do to
            # them is unknown, and doing nothing could decide the verdict
            self._fail()
        name = object.__getattribute__(self, "_tl_name")
        return Missing(f"{name}()", object.__getattribute__(self, "_tl_origin"))  # a decorator factory

    def __getitem__(self, key):
        # an activation table looked up by name (`ACT2FN[config.hidden_act]`): torch's activation
        if isinstance(key, str) and key.lower() in ACTIVATIONS:
            self._used(f"[{key!r}] (as torch's {ACTIVATIONS[key.lower()].__name__})")
            return ACTIVATIONS[key.lower()]()
        self._fail()

    def __mro_entries__(self, bases):
        self._used()
        name = object.__getattribute__(self, "_tl_name")
        origin = object.__getattribute__(self, "_tl_origin")
        return (type(name.rsplit(".", 1)[-1], (MissingBase,), {"_tl_base": name, "_tl_origin": origin}),)


def _descriptive(value) -> bool:
    """An argument that describes rather than computes: a literal, a class, another stand-in (what
    decorator factories take: ``@add_docstrings(output_type=ModelOutput, config_class=...)``)."""
    if isinstance(value, list | tuple):
        return all(_descriptive(v) for v in value)
    return isinstance(value, str | int | float | bool | None | type | Missing)


# a loss the child cannot import, known by its name: called on (logits, targets) it is a token mean
_LOSS_NAMES = re.compile(r"cross_entropy|nll_loss")


def token_mean_loss(logits, targets, ignore_index: int = -100, **_options):
    """Cross-entropy averaged over the targets that are not ``ignore_index``; logits may come in chunks
    along the sequence (a list), as chunked heads give them."""
    if isinstance(logits, list | tuple):
        logits = torch.cat(list(logits), dim=-2)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=ignore_index
    )


class MissingBase(torch.nn.Module):
    """A base class from a module the child cannot import: a module that accepts any constructor
    arguments (a first non-tensor one is kept as ``config``, as model base classes do)."""

    _tl_base = "base class"
    _tl_origin = ""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()
        if args and not isinstance(args[0], torch.Tensor):
            self.config = args[0]

    def __getattr__(self, attr: str):
        try:
            return super().__getattr__(attr)
        except AttributeError:
            if attr.startswith("_"):
                raise
        # a method the library's base class provides (`self.post_init()`): a stand-in, named when used
        return Missing(f"{type(self)._tl_base}.{attr}", type(self)._tl_origin)


def on_path(folder: str) -> None:
    """Let the program import the user's own package from the project's folder (last on the path, so
    that it never shadows a library)."""
    import sys

    if folder not in sys.path:
        sys.path.append(folder)


def missing(name: str, target: str, own: bool = False) -> Missing:
    """The stand-in for ``name``, imported as ``target`` (a dotted path; relative for the user's own
    package). ``own``: the user's own package imported by its absolute name (``from timm.layers`` in
    timm), which does not import here (one of its dependencies is not installed)."""
    own = own or target.startswith(".")
    module = target.rsplit(".", 1)[0] if "." in target.lstrip(".") else target
    origin = f"`{module}`, the user's own package" if own else f"`{module.split('.')[0]}`, not installed here"
    qualified = name if target.startswith(name + ".") or target == name else target
    return Missing(qualified, origin)


class Loader(Unbound):
    """The iterable of the user's loop: only its length (the probe's iteration count) is known."""

    def __init__(self, name: str, length: int) -> None:
        super().__init__(name)
        object.__setattr__(self, "_tl_len", length)

    def __len__(self) -> int:
        return object.__getattribute__(self, "_tl_len")


def census(ns: dict) -> None:
    """Count the autograd nodes reachable from every tensor the program holds (TL302)."""
    roots: list[torch.Tensor] = []

    def collect(value, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            roots.append(value)
        elif depth > 3:
            return
        elif isinstance(value, list | tuple):
            for item in value[:100_000]:
                collect(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item, depth + 1)
        elif isinstance(value, Config):
            collect(object.__getattribute__(value, "_tl_set"), depth + 1)
        elif isinstance(value, Output):
            collect(dict(vars(value)), depth + 1)

    for key, value in list(ns.items()):
        if not key.startswith("__"):
            collect(value, 0)
    seen: dict[int, object] = {}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # keeps the wrapper alive, so that ids are not reused
        stack.extend(nxt for nxt, _ in getattr(node, "next_functions", ()))
    capture.current_loop.setdefault("census", []).append(len(seen))
