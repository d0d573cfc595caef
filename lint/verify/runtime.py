"""The child side of ``--verify``: stand-ins, capture, comparison and the drivers that run probe programs.

This file runs only inside the child process. It imports nothing from trainlint (the parent loads it by
path), only the standard library and torch. Each probe arrives as a dict with one program per variant
(``as_written``, ``reference``, ``fixed``); every program is executed in a fresh namespace, defines
``__tl_run__`` and the driver named by the probe compares what the variants computed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
import traceback
import warnings

import torch

# Sizes of every synthetic tensor: batch, sequence, width, vocabulary.
B, T, D, V = 2, 6, 8, 16
DEVICE = "cpu"
LOW_DTYPE = torch.bfloat16


# --------------------------------------------------------------------------------------------------
# errors raised into user code


class UnboundName(BaseException):
    """A name the harness could not bind was used by the snippet."""


class ProbeTimeout(BaseException):
    pass


class Unbound:
    """Stand-in for a name that could not be bound: any use raises ``UnboundName``."""

    touched: list[str] = []

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_tl_name", name)

    def _fail(self, *args, **kwargs):
        name = object.__getattribute__(self, "_tl_name")
        Unbound.touched.append(name)
        raise UnboundName(name)

    def __getattr__(self, attr):
        name = object.__getattribute__(self, "_tl_name")
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Unbound(f"{name}.{attr}")

    __call__ = _fail
    __bool__ = _fail
    __iter__ = _fail
    __len__ = _fail
    __getitem__ = _fail
    __setitem__ = _fail
    __index__ = _fail
    __int__ = _fail
    __float__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _fail
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _fail
    __pow__ = __rpow__ = __matmul__ = __rmatmul__ = __neg__ = __pos__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = _fail
    __eq__ = __ne__ = _fail  # ``dtype == "float16"`` must not quietly be False
    __contains__ = _fail
    __hash__ = object.__hash__
    __enter__ = __exit__ = _fail

    def __repr__(self) -> str:
        return f"<unbound {object.__getattribute__(self, '_tl_name')}>"


# --------------------------------------------------------------------------------------------------
# process set-up


def setup_process(device: str) -> None:
    global DEVICE, LOW_DTYPE
    DEVICE = device
    LOW_DTYPE = torch.float16 if device == "cuda" else torch.bfloat16
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    _block_network()
    _install_token_counter()
    if device == "cpu":
        _cpu_only_patches()


def _block_network() -> None:
    import socket

    def refuse(*args, **kwargs):
        raise OSError("network access is disabled while trainlint runs a probe")

    socket.socket.connect = refuse  # type: ignore[method-assign]
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]


def _cpu_only_patches() -> None:
    """Let code written for a GPU run on the CPU: ``.cuda()`` keeps tensors where they are, CUDA
    autocast becomes CPU autocast with bf16, CUDA GradScalers become CPU ones."""

    def keep(self, *args, **kwargs):
        return self

    torch.Tensor.cuda = keep  # type: ignore[method-assign]
    torch.nn.Module.cuda = keep  # type: ignore[method-assign]

    orig_to_tensor = torch.Tensor.to
    orig_to_module = torch.nn.Module.to

    def _strip(args, kwargs):
        args = tuple("cpu" if _is_cuda(a) else a for a in args)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        return args, kwargs

    def tensor_to(self, *args, **kwargs):
        args, kwargs = _strip(args, kwargs)
        return orig_to_tensor(self, *args, **kwargs)

    def module_to(self, *args, **kwargs):
        args, kwargs = _strip(args, kwargs)
        return orig_to_module(self, *args, **kwargs)

    torch.Tensor.to = tensor_to  # type: ignore[method-assign]
    torch.nn.Module.to = module_to  # type: ignore[method-assign]

    orig_autocast = torch.autocast

    class cpu_autocast(orig_autocast):
        def __init__(self, device_type="cpu", dtype=None, enabled=True, cache_enabled=None):
            if device_type == "cuda":
                device_type = "cpu"
            if dtype in (torch.float16, None):
                dtype = torch.bfloat16
            super().__init__(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    torch.autocast = cpu_autocast  # type: ignore[misc]
    torch.amp.autocast = cpu_autocast  # type: ignore[misc]

    def cuda_amp_autocast(enabled=True, dtype=torch.float16, cache_enabled=True):
        return cpu_autocast("cpu", dtype=dtype, enabled=enabled)

    torch.cuda.amp.autocast = cuda_amp_autocast  # type: ignore[assignment]
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]


def _is_cuda(value) -> bool:
    if isinstance(value, str):
        return value.startswith("cuda")
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return False


def seed(n: int = 0) -> None:
    import random

    random.seed(n)
    torch.manual_seed(n)
    try:
        import numpy

        numpy.random.seed(n)
    except ImportError:
        pass


# --------------------------------------------------------------------------------------------------
# stand-ins


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


# Small values for constructor parameters and config fields, chosen by exact name. A name that is
# none of these is left unbound (any use reports it) rather than guessed.
_SIZES: dict[object, tuple[str, ...]] = {
    D: (
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
    2 * D: (
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
    V: ("vocab", "vocab_size", "n_vocab", "num_embeddings", "num_tokens", "n_tokens", "padded_vocab_size"),
    2: (
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
    1: ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_query_groups"),
    2 * T: (
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
    3: ("num_classes", "n_classes", "num_labels", "n_labels"),
    0.1: (
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
    1e-5: ("eps", "epsilon", "layer_norm_eps", "rms_norm_eps", "layer_norm_epsilon", "norm_eps"),
    0.02: ("initializer_range", "init_std"),
}
_BY_NAME = {name: value for value, names in _SIZES.items() for name in names}
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
    return Unbound(name)


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
        value = arg(f"{object.__getattribute__(self, '_tl_name')}.{attr}")
        if isinstance(value, Config):  # a nested config keeps what is set on it (self.args.x = 4)
            values[attr] = value
        return value

    def __setattr__(self, attr: str, value) -> None:
        object.__getattribute__(self, "_tl_set")[attr] = value

    def get(self, key, default=None):
        value = getattr(self, key)
        return default if isinstance(value, Unbound) else value


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
    if isinstance(module, torch.nn.Module) and DEVICE != "cpu":
        module.to(DEVICE)
    return module


def sequential(functions, x):
    """What ``checkpoint_sequential(functions, segments, x)`` computes, without checkpointing."""
    for fn in functions:
        x = fn(x)
    return x


def param(name: str = "w") -> torch.nn.Parameter:
    """A weight passed as an argument: a (D, D) parameter (a vector for biases)."""
    if name in ("b", "bias"):
        return torch.nn.Parameter(0.1 * torch.randn(D, device=DEVICE))
    return torch.nn.Parameter(torch.randn(D, D, device=DEVICE) / math.sqrt(D))


def data(kind: str = "float", **kwargs):
    """Synthetic data tensors (they never require grad, like batches from a loader)."""
    if kind == "ids":
        return torch.randint(0, V, (B, T), device=DEVICE)
    if kind == "mask":
        return torch.ones(B, T, dtype=torch.long, device=DEVICE)
    if kind == "labels":
        return torch.randint(0, V, (B, T), device=DEVICE)
    if kind == "positions":
        return torch.arange(T, device=DEVICE).unsqueeze(0).expand(B, T)
    return torch.randn(B, T, D, device=DEVICE)


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


def tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, D)).to(DEVICE)


def step_batch(step: int, growing: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and regression targets for one step; with ``growing`` the targets (and so the gradient
    norms) grow from step to step."""
    gen = torch.Generator(device="cpu").manual_seed(100 + step)
    x = torch.randn(4, D, generator=gen)
    y = torch.randn(4, D, generator=gen) * ((1.0 + step) if growing else 0.5)
    return x.to(DEVICE), y.to(DEVICE)


def loss(model: torch.nn.Module, step: int, growing: bool = True) -> torch.Tensor:
    """A regression loss of the tiny model on this step's batch, forward under autocast."""
    x, y = step_batch(step, growing)
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32:  # parameters stored in 16 bits: the forward runs in that dtype
        out = model(x.to(dtype))
    else:
        with torch.autocast(device_type=DEVICE, dtype=LOW_DTYPE):
            out = model(x)
    return ((out.float() - y) ** 2).mean()


def zero(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def snapshot(model: torch.nn.Module) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def scaler(enabled=True, **kwargs):
    return torch.amp.GradScaler(DEVICE, init_scale=LOSS_SCALE, growth_interval=10**6, enabled=bool(enabled))


_records: dict[str, list] = {}


def record(key: str, value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        _records.setdefault(key, []).append(float(value))
    else:
        _records.setdefault(key, []).append(None)
    return value


class Backward:
    """Stands for ``accelerator``/``fabric``: their ``backward(loss)`` is ``loss.backward()``."""

    def backward(self, loss, **kwargs):
        loss.backward()

    manual_backward = backward  # Lightning's ``self.manual_backward(loss)``


# --------------------------------------------------------------------------------------------------
# token batches for accumulation probes

# valid tokens per row, per microbatch (cycled): deliberately uneven, as padded data is
VALID_LENGTHS = [(6, 5), (2, 1), (5, 3), (1, 1), (6, 6), (3, 2), (4, 1), (2, 2)]
_micro = 0
_counting = False
_tokens_seen: dict[int, int] = {}
_batch_valid: dict[int, int] = {}


class TinyLM(torch.nn.Module):
    """A language model stand-in: embedding then a linear head over the vocabulary. Called as
    ``model(ids)`` it returns logits; in ``"output"`` mode an object with ``.logits`` and (given
    labels) ``.loss``, a token mean over labels that are not -100; in ``"tuple"`` mode
    ``(logits, loss)``."""

    def __init__(self, mode: str = "logits") -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V)
        self.mode = mode
        self.to(DEVICE)

    def forward(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ids = kwargs.get("input_ids", kwargs.get("idx", tensors[0] if tensors else None))
        labels = kwargs.get("labels", kwargs.get("targets", tensors[1] if len(tensors) > 1 else None))
        if ids is None:
            raise TypeError("stand-in language model called without token ids")
        logits = self.head(torch.tanh(self.embed(ids)))
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


def token_batches(k: int) -> list[dict]:
    _batch_valid.clear()
    out = []
    for i in range(k):
        lengths = VALID_LENGTHS[i % len(VALID_LENGTHS)]
        ids = torch.randint(1, V, (B, T))
        mask = torch.zeros(B, T, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        ids = ids * mask  # padding id 0
        labels = ids.masked_fill(mask == 0, -100)
        _batch_valid[i] = int(mask.sum())
        out.append(
            {"input_ids": ids.to(DEVICE), "attention_mask": mask.to(DEVICE), "labels": labels.to(DEVICE)}
        )
    return out


def concat_batches(batches: list[dict]) -> dict:
    return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


def begin_micro(i: int) -> None:
    global _micro
    _micro = i


def counting_pass(on: bool) -> None:
    global _counting
    _counting = on
    if on:
        _tokens_seen.clear()


def token_weight() -> float:
    """This microbatch's share of the window's valid tokens (as counted by its loss)."""
    counts = {i: _tokens_seen.get(i, _batch_valid.get(i, 0)) for i in _batch_valid}
    total = sum(counts.values())
    return counts.get(_micro, 0) / total if total else 0.0


def zero_all(module) -> None:
    if isinstance(module, torch.nn.Module):
        for p in module.parameters():
            p.grad = None


def _install_token_counter() -> None:
    """Count the targets each mean-reduced cross-entropy averages over (per microbatch)."""
    functional = torch.nn.functional
    for name in ("cross_entropy", "nll_loss"):
        original = getattr(functional, name)

        def counted(input, target, *args, _original=original, **kwargs):
            reduction = kwargs.get("reduction", "mean")
            ignore = kwargs.get("ignore_index", -100)
            if (
                _counting
                and reduction == "mean"
                and isinstance(target, torch.Tensor)
                and not target.is_floating_point()
            ):
                _tokens_seen[_micro] = _tokens_seen.get(_micro, 0) + int((target != ignore).sum())
            return _original(input, target, *args, **kwargs)

        setattr(functional, name, counted)


# --------------------------------------------------------------------------------------------------
# running a program and capturing what it computed

_hits: dict[str, int] = {}


def hit(key: str, value=None):
    _hits[key] = _hits.get(key, 0) + 1
    return value


def count(key: str) -> None:
    _hits[key] = _hits.get(key, 0) + 1


def tensors_in(value, prefix: str = "out") -> list[tuple[str, torch.Tensor]]:
    """Every floating tensor in an output (tensor, tuple, list, dict, dataclass-like object)."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            out.append((prefix, value))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out.extend(tensors_in(v, f"{prefix}[{i}]"))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.extend(tensors_in(v, f"{prefix}[{k!r}]"))
    elif hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module | type):
        for k, v in vars(value).items():
            if not k.startswith("_"):
                out.extend(tensors_in(v, f"{prefix}.{k}"))
    return out


def projection_loss(outputs: list[tuple[str, torch.Tensor]]) -> torch.Tensor | None:
    """A scalar that depends on every output element with fixed random weights (so that no
    gradient is accidentally symmetric)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    total = None
    for _, t in outputs:
        if not t.requires_grad:
            continue
        w = torch.randn(t.shape, generator=gen).to(t.device)
        term = (t.float() * w).sum()
        total = term if total is None else total + term
    return total


def named_parameters(roots: dict[str, object]) -> dict[str, torch.nn.Parameter]:
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for root_name, root in roots.items():
        modules = root if isinstance(root, list | tuple) else [root]
        for i, mod in enumerate(modules):
            if not isinstance(mod, torch.nn.Module):
                continue
            label = root_name.removeprefix("__tl_arg_")
            base = label if len(modules) == 1 else f"{label}[{i}]"
            for name, p in mod.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out[f"{base}.{name}" if base != "self" else name] = p
    return out


def detached(t: torch.Tensor | None):
    return None if t is None else t.detach().float().cpu().clone()


def describe_exception(exc: BaseException) -> str:
    if isinstance(exc, UnboundName):
        return f"uses `{exc.args[0]}`, which the harness cannot build"
    if type(exc) is NameError and getattr(exc, "name", None):
        return f"uses `{exc.name}`, which the harness cannot build (it is not defined in the file)"
    if isinstance(exc, SystemExit):
        return f"the snippet called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "the snippet raised KeyboardInterrupt"
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(
        ": "
    )


class VariantFailed(Exception):
    def __init__(self, exc: BaseException) -> None:
        super().__init__(describe_exception(exc))
        self.exc = exc


def exec_program(code: str, filename: str) -> dict:
    """Execute a variant program in a fresh namespace (user stdout goes to stderr). Its text is put
    in ``linecache`` so that ``inspect.getsource`` works (``torch.jit.script`` needs it). Any error
    of the user's carried code is raised as ``VariantFailed``."""
    import linecache

    ns: dict = {"__name__": "__trainlint_probe__", "__tl__": sys.modules[__name__]}
    Unbound.touched.clear()
    _hits.clear()
    _records.clear()
    _batch_valid.clear()
    _tokens_seen.clear()
    filename = f"<trainlint-probe-{filename.strip('<>')}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(keepends=True), filename)
    try:
        compiled = compile(code, filename, "exec")
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compiled, ns)
    except ProbeTimeout:
        raise
    except BaseException as exc:
        raise VariantFailed(exc) from exc
    if Unbound.touched:
        raise VariantFailed(UnboundName(Unbound.touched[0]))
    return ns


def call_user(fn, *args, **kwargs):
    """Run user code: stdout is redirected (probe results travel separately) and any exception,
    SystemExit included, is wrapped."""
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = fn(*args, **kwargs)
    except ProbeTimeout:
        raise
    except BaseException as exc:
        raise VariantFailed(exc) from exc
    if Unbound.touched:
        raise VariantFailed(UnboundName(Unbound.touched[0]))
    return value, [str(w.message) for w in caught]


# --------------------------------------------------------------------------------------------------
# comparison


def tolerance(dtype: torch.dtype) -> dict:
    if dtype in (torch.float16,):
        return {"rtol": 5e-3, "atol": 1e-5}
    if dtype in (torch.bfloat16,):
        return {"rtol": 2e-2, "atol": 1e-4}
    return {"rtol": 1e-5, "atol": 1e-7}


def compare(got: dict, ref: dict, tol: dict) -> dict:
    """Compare two name -> tensor-or-None maps. ``missing`` lists names whose value is None in
    ``got`` while ``ref`` has a tensor; max_rel is the largest |got-ref|_inf / |ref|_inf."""
    max_abs = 0.0
    max_rel = 0.0
    missing: list[str] = []
    extra: list[str] = []
    worst = None
    differing: list[str] = []
    for name, r in ref.items():
        g = got.get(name)
        if r is None and g is None:
            continue
        if r is not None and g is None:
            missing.append(name)
            g = torch.zeros_like(r)  # a missing gradient counts as zero in the numbers
        if r is None:
            extra.append(name)
            continue
        if g.shape != r.shape:
            differing.append(name)
            max_rel = math.inf
            continue
        diff = (g - r).abs()
        if not torch.isfinite(g).all():
            a = math.inf
        else:
            a = float(diff.max()) if diff.numel() else 0.0
        scale = float(r.abs().max()) if r.numel() else 0.0
        rel = a / scale if scale > 0 else (0.0 if a == 0 else math.inf)
        if a > tol["atol"] + tol["rtol"] * scale and name not in missing:
            differing.append(name)
        if rel > max_rel or (worst is None and a > 0):
            worst = name
        max_abs = max(max_abs, a)
        max_rel = max(max_rel, rel)
    return {
        "max_abs": _num(max_abs),
        "max_rel": _num(max_rel),
        "missing": missing,
        "extra": extra,
        "differing": differing,
        "worst": worst,
        "match": not missing and not extra and not differing,
    }


def _num(x: float):
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return float(f"{x:.6g}")


def evidence_numbers(cmp: dict) -> dict:
    return {"max_abs": cmp["max_abs"], "max_rel": cmp["max_rel"]}


def pct(x) -> str:
    if isinstance(x, str):
        return x
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{x:.2g}"


def short_list(names: list[str], n: int = 4) -> str:
    shown = ", ".join(f"`{x}`" for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


# --------------------------------------------------------------------------------------------------
# drivers


def run_grads_variant(ns: dict, roots: list[str]) -> dict:
    """Call ``__tl_run__`` (one forward), backpropagate a fixed projection of every output and
    capture outputs, parameter gradients and input gradients."""
    out, warns = call_user(ns["__tl_run__"])
    outputs = tensors_in(out)
    params = named_parameters({r: ns[r] for r in roots if r in ns})
    loss = projection_loss(outputs)
    if loss is not None:
        try:
            _, more = call_user(loss.backward)
            warns.extend(more)
        except VariantFailed:
            raise
    grads = {f"grad of {n}": detached(p.grad) for n, p in params.items() if p.requires_grad}
    for name, t in ns.get("__tl_inputs__", {}).items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            grads[f"grad of input {name}"] = detached(t.grad)
    return {
        "outputs": {n: detached(t) for n, t in outputs},
        "grads": grads,
        "hits": dict(_hits),
        "warnings": warns,
        "params": params,
    }


def run_variants(probe: dict, names: tuple[str, ...], run) -> tuple[dict, dict, int]:
    """Run each variant's program with ``run(ns)``. A variant may come with alternative programs
    (the user's own constructor, then stand-ins built from use): the first alternative whose
    reference runs is used for every variant. Returns (runs, failures, alternative index)."""
    programs = probe["programs"]
    alternatives = (
        programs["reference"] if isinstance(programs["reference"], list) else [programs["reference"]]
    )
    chosen = 0
    first_failure: str | None = None
    for index in range(len(alternatives)):
        try:
            ns = exec_program(_alt(programs["reference"], index), "reference")
            seed(1)
            reference = run(ns)
            chosen = index
            break
        except VariantFailed as exc:
            if isinstance(exc.exc, SystemExit):
                return {}, {"reference": str(exc)}, index
            if first_failure is None or (
                str(exc).startswith("uses `") and not first_failure.startswith("uses `")
            ):
                first_failure = str(exc)
    else:
        return {}, {"reference": first_failure or "no program"}, 0
    runs = {"reference": reference}
    failures: dict[str, str] = {}
    for name in names:
        if name == "reference" or name not in programs:
            continue
        try:
            ns = exec_program(_alt(programs[name], chosen), name)
            seed(1)
            runs[name] = run(ns)
        except VariantFailed as exc:
            failures[name] = str(exc)
            if isinstance(exc.exc, UnboundName | SystemExit):
                break
    return runs, failures, chosen


def _alt(program, index: int) -> str:
    return program[index] if isinstance(program, list) else program


def drive_grads(probe: dict) -> dict:
    """TL201/TL202: the checkpointed call as written vs without checkpoint (and with the fix)."""
    roots = probe.get("roots", ["self"])
    runs, failures, _ = run_variants(
        probe, ("reference", "as_written", "fixed"), lambda ns: run_grads_variant(ns, roots)
    )
    label = probe.get("call_label", "the checkpointed call")
    if "reference" in failures or "reference" not in runs:
        return not_executable(failures.get("reference") or failures.get("as_written", "no result"))
    if "as_written" in failures:
        text = failures["as_written"]
        if text.startswith("uses `") or text.startswith("the snippet called"):
            return not_executable(text)
        ev = {"exception": text}
        fixed = _fixed_outcome(runs, failures, {})
        if fixed:
            ev["fixed_vs_reference"] = fixed[0]
        return result(
            "confirmed",
            f"as written, {label} raises {text}; without checkpoint it runs"
            + (f"; {fixed[1]}" if fixed else ""),
            ev,
            fixed_matches=bool(fixed and fixed[2]),
        )
    aw, ref = runs["as_written"], runs["reference"]
    if probe.get("hit_key") and not aw["hits"].get(probe["hit_key"]):
        return not_executable(f"{label} did not run with the stand-in values")
    tol = tolerance(torch.float32)
    cmp_g = compare(aw["grads"], ref["grads"], tol)
    cmp_o = compare(aw["outputs"], ref["outputs"], tol)
    ev = {
        "as_written_vs_reference": evidence_numbers(_worse(cmp_g, cmp_o)),
        "tolerance": tol,
        "gradients_compared": len(ref["grads"]),
    }
    if cmp_g["missing"]:
        ev["none_gradients"] = [n.removeprefix("grad of ") for n in cmp_g["missing"]]
    fixed = _fixed_outcome(runs, failures, tol)
    if fixed:
        ev["fixed_vs_reference"] = fixed[0]
    notes = probe.get("notes", [])
    if cmp_g["match"] and cmp_o["match"]:
        detail = (
            f"as written, {label} gives the same outputs and gradients as without checkpoint "
            f"({len(ref['grads'])} gradients, max rel {cmp_g['max_rel']})"
        )
        if notes:
            detail += f" [{'; '.join(notes)}]"
        return result("not-reproduced", detail, ev, fixed_matches=bool(fixed and fixed[2]))
    if cmp_g["missing"]:
        names = [n.removeprefix("grad of ") for n in cmp_g["missing"]]
        detail = (
            f"as written, {len(names)} of {len(ref['grads'])} parameter gradients come back None "
            f"({short_list(names)})"
        )
        if any("requires_grad" in w for w in aw["warnings"]):
            detail += ": no input of the reentrant checkpoint requires grad"
    else:
        which = cmp_g if not cmp_g["match"] else cmp_o
        detail = (
            f"as written, {which['worst']} differs from the reference by {pct(which['max_rel'])} (max rel)"
        )
    if fixed:
        detail += f"; {fixed[1]}"
    if notes:
        detail += f" [{'; '.join(notes)}]"
    return result("confirmed", detail, ev, fixed_matches=bool(fixed and fixed[2]))


def _worse(a: dict, b: dict) -> dict:
    return a if (a["missing"] or not b["missing"]) and _rel(a) >= _rel(b) else b


def _rel(c: dict) -> float:
    return math.inf if isinstance(c["max_rel"], str) or c["missing"] else c["max_rel"]


def _fixed_outcome(runs: dict, failures: dict, tol: dict):
    if "fixed" in failures:
        return ({"exception": failures["fixed"]}, f"with the fix it raises {failures['fixed']}", False)
    if "fixed" not in runs:
        return None
    tol = tol or tolerance(torch.float32)
    cmp_g = compare(runs["fixed"]["grads"], runs["reference"]["grads"], tol)
    cmp_o = compare(runs["fixed"]["outputs"], runs["reference"]["outputs"], tol)
    ok = cmp_g["match"] and cmp_o["match"]
    worst = _worse(cmp_g, cmp_o)
    text = (
        f"with the fix: gradients match the reference (max rel {worst['max_rel']})"
        if ok
        else f"with the fix: still differs (max rel {worst['max_rel']})"
    )
    return (evidence_numbers(worst), text, ok)


def state_of(roots: dict) -> dict:
    """Buffers and plain attributes of the stand-in modules (to show state that changed)."""
    out = {}
    for root_name, root in roots.items():
        if isinstance(root, torch.nn.Module):
            for name, buf in root.named_buffers():
                if buf.is_floating_point():
                    out[f"{root_name}.{name}"] = detached(buf)
            for mod_name, mod in root.named_modules():
                for key, value in vars(mod).items():
                    if key.startswith("_") or key == "training":
                        continue
                    if isinstance(value, bool | int | float):
                        out[f"{root_name}.{mod_name + '.' if mod_name else ''}{key}"] = torch.tensor(
                            float(value)
                        )
                    elif isinstance(value, list | dict | set):
                        out[f"{root_name}.{mod_name + '.' if mod_name else ''}{key} (length)"] = torch.tensor(
                            float(len(value))
                        )
    return out


def drive_side_effects(probe: dict) -> dict:
    """TL203: one forward+backward under checkpoint vs plain; count each side effect."""
    roots = probe.get("roots", ["self"])
    keys = probe["counters"]
    watch = probe.get("watch", [])

    def run(ns: dict) -> dict:
        out = run_grads_variant(ns, roots)
        out["state"] = state_of({r: ns[r] for r in roots if r in ns})
        out["globals"] = {
            k.removeprefix("__tl_arg_"): float(len(v)) if isinstance(v, list | dict | set) else float(v)
            for k, v in ns.items()
            if (k in watch and isinstance(v, list | dict | set | int | float))
            or (k.startswith("__tl_arg_") and isinstance(v, list | dict | set))
        }
        return out

    runs, failures, _ = run_variants(probe, ("reference", "as_written"), run)
    if "reference" in failures:
        return not_executable(failures["reference"])
    if "as_written" in failures:
        text = failures["as_written"]
        if text.startswith("uses `") or text.startswith("the snippet called"):
            return not_executable(text)
        return result("confirmed", f"as written, the checkpointed call raises {text}", {"exception": text})
    aw, ref = runs["as_written"], runs["reference"]
    label_call = probe.get("call_label", "the checkpoint call")
    if probe.get("hit_key") and not aw["hits"].get(probe["hit_key"]):
        return not_executable(f"{label_call} did not run with the stand-in values")
    counts = {
        label: {"checkpointed": aw["hits"].get(key, 0), "plain": ref["hits"].get(key, 0)}
        for key, label in keys.items()
    }
    changed = compare(aw["state"], ref["state"], tolerance(torch.float32))
    glob = {k: (aw["globals"].get(k), ref["globals"].get(k)) for k in ref["globals"]}
    glob_diff = [k for k, (a, b) in glob.items() if a != b]
    ev: dict = {"executions": counts, "state_vs_plain": evidence_numbers(changed)}
    if changed["differing"]:
        ev["state_differs"] = changed["differing"]
    if glob_diff:
        ev["globals"] = {k: {"checkpointed": glob[k][0], "plain": glob[k][1]} for k in glob_diff}
    if all(c["plain"] == 0 for c in counts.values()):
        return not_executable("the flagged statement did not run in the plain forward with the stand-ins")
    diff = [label for label, c in counts.items() if c["checkpointed"] != c["plain"]]
    if diff or changed["differing"] or glob_diff:
        parts = [
            f"{label} ran {counts[label]['checkpointed']} times under checkpoint vs "
            f"{counts[label]['plain']} without"
            for label in diff
        ]
        if changed["differing"]:
            parts.append(f"state differs afterwards: {short_list(changed['differing'])}")
        parts.extend(f"`{k}` ends at {glob[k][0]:g} instead of {glob[k][1]:g}" for k in glob_diff)
        return result("confirmed", "in one forward+backward, " + "; ".join(parts), ev)
    label, c = next(iter(counts.items()))
    return result(
        "not-reproduced",
        f"in one forward+backward, {label} ran {c['checkpointed']} time(s) under checkpoint, "
        f"as often as without it, and the state afterwards is the same",
        ev,
    )


def drive_step(probe: dict) -> dict:
    """TL101: the step window as written vs the same window without loss scaling; compares the
    parameter updates after a few steps, and the gradient norm the clip saw."""

    def run(ns: dict) -> dict:
        call_user(lambda: None)
        before, after = ns["__tl_before__"], ns["__tl_after__"]
        return {
            "update": {f"update of {n}": after[n] - before[n] for n in before},
            "records": {k: list(v) for k, v in _records.items()},
        }

    def run_program(name: str):
        return run(exec_program(probe["programs"][name], name))

    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for name in ("reference", "as_written", "fixed"):
        if name not in probe["programs"]:
            continue
        try:
            runs[name] = run_program(name)
        except VariantFailed as exc:
            failures[name] = str(exc)
            if name == "reference" or _is_binding(exc):
                return not_executable(str(exc))
    if "as_written" in failures:  # not the hazard this probe measures
        return not_executable(f"as written, the step raises {failures['as_written']}")
    tol = {"rtol": 1e-3, "atol": 1e-7}
    aw, ref = runs["as_written"], runs["reference"]
    cmp = compare(aw["update"], ref["update"], tol)
    ev: dict = {
        "as_written_vs_reference": evidence_numbers(cmp),
        "tolerance": tol,
        "steps": STEPS,
        "loss_scale": LOSS_SCALE,
    }
    seen_aw = [x for x in aw["records"].get("clip", []) if x is not None]
    seen_ref = [x for x in ref["records"].get("clip", []) if x is not None]
    if seen_aw and seen_ref:
        ev["clip_saw_norm"] = {
            "as_written": [_num(x) for x in seen_aw],
            "reference": [_num(x) for x in seen_ref],
        }
    fixed_ok = False
    fixed_text = ""
    if "fixed" in failures:
        fixed_text = f"; with the fix it raises {failures['fixed']}"
        ev["fixed_vs_reference"] = {"exception": failures["fixed"]}
    elif "fixed" in runs:
        fcmp = compare(runs["fixed"]["update"], ref["update"], tol)
        ev["fixed_vs_reference"] = evidence_numbers(fcmp)
        fixed_ok = fcmp["match"]
        fixed_text = f"; with the fix: max rel {fcmp['max_rel']}" + (
            " (matches)" if fixed_ok else " (still differs)"
        )
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    norm_text = ""
    if seen_aw and seen_ref:
        norm_text = (
            f"; the clip saw a gradient norm of {seen_aw[0]:.4g} instead of {seen_ref[0]:.4g}"
            f" (loss scale {LOSS_SCALE:g})"
        )
    if cmp["match"]:
        return result(
            "not-reproduced",
            f"over {STEPS} steps the update matches the unscaled reference (max rel {cmp['max_rel']})"
            + norm_text
            + fixed_text
            + note_text,
            ev,
            fixed_matches=fixed_ok,
        )
    return result(
        "confirmed",
        f"over {STEPS} steps the update differs from the unscaled reference by {pct(cmp['max_rel'])} (max rel)"
        + norm_text
        + fixed_text
        + note_text,
        ev,
        fixed_matches=fixed_ok,
    )


def drive_accumulation(probe: dict) -> dict:
    """TL301: gradients accumulated over uneven microbatches as written vs one big batch."""
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for name in ("reference", "as_written", "fixed"):
        program = probe["programs"].get(name)
        if program is None:
            continue
        try:
            counting_pass(True)  # as written and reference: record the counts, for the evidence
            ns = exec_program(program, name)
        except VariantFailed as exc:
            failures[name] = str(exc)
        else:
            params = named_parameters({f"m{i}": m for i, m in enumerate(ns.get("__tl_modules__", []))})
            runs[name] = {
                "grads": {f"grad of {n.split('.', 1)[1]}": detached(p.grad) for n, p in params.items()},
                "tokens": dict(_tokens_seen),
            }
        finally:
            counting_pass(False)
        if name in failures and (name == "reference" or failures[name].startswith(("uses `", "the snippet"))):
            return not_executable(failures[name])
    if "as_written" in failures:
        return not_executable(failures["as_written"])
    tol = {"rtol": 1e-4, "atol": 1e-7}
    aw, ref = runs["as_written"], runs["reference"]
    cmp = compare(aw["grads"], ref["grads"], tol)
    tokens = [aw["tokens"].get(i, _batch_valid.get(i, 0)) for i in sorted(_batch_valid)]
    ev: dict = {
        "as_written_vs_reference": evidence_numbers(cmp),
        "tolerance": tol,
        "microbatches": len(tokens),
        "valid_tokens_per_microbatch": tokens,
    }
    fixed_ok = False
    fixed_text = ""
    if "fixed" in failures:
        ev["fixed_vs_reference"] = {"exception": failures["fixed"]}
        fixed_text = f"; the token-weighted fix raises {failures['fixed']}"
    elif "fixed" in runs:
        fcmp = compare(runs["fixed"]["grads"], ref["grads"], tol)
        ev["fixed_vs_reference"] = evidence_numbers(fcmp)
        fixed_ok = fcmp["match"]
        fixed_text = (
            f"; weighting each microbatch by its share of the window's tokens: max rel {fcmp['max_rel']}"
            + (" (matches)" if fixed_ok else " (still differs)")
        )
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    counts = ", ".join(str(t) for t in tokens)
    if cmp["match"]:
        return result(
            "not-reproduced",
            f"microbatches with {counts} valid tokens: the accumulated gradient matches one big batch "
            f"(max rel {cmp['max_rel']})" + fixed_text + note_text,
            ev,
            fixed_matches=fixed_ok,
        )
    return result(
        "confirmed",
        f"microbatches with {counts} valid tokens: the accumulated gradient differs from one big batch's "
        f"token mean by {pct(cmp['max_rel'])} (max rel)" + fixed_text + note_text,
        ev,
        fixed_matches=fixed_ok,
    )


def drive_half(probe: dict) -> dict:
    """TL105: 16-bit parameters trained as written vs fp32 parameters with an autocast forward."""
    runs: dict[str, dict] = {}
    for name in ("reference", "as_written"):
        try:
            ns = exec_program(probe["programs"][name], name)
        except VariantFailed as exc:
            text = str(exc)
            if name == "reference" or "unscale FP16 gradients" not in text:
                return not_executable(text)
            return result(
                "confirmed",
                f"training the converted parameters raises {text} (the GradScaler refuses 16-bit gradients)",
                {"exception": text},
            )
        before, after = ns["__tl_before__"], ns["__tl_after__"]
        runs[name] = {
            "moved": {f"movement of {n}": after[n] - before[n] for n in before},
            "dtype": ns.get("__tl_dtype__", "?"),
        }
    aw, ref = runs["as_written"], runs["reference"]
    tol = {"rtol": 0.1, "atol": 1e-6}
    cmp = compare(aw["moved"], ref["moved"], tol)
    bad = sum(int((~torch.isfinite(t)).sum()) for t in aw["moved"].values())
    diff_norm = math.sqrt(sum(float(((aw["moved"][n] - ref["moved"][n]) ** 2).sum()) for n in ref["moved"]))
    frozen = sum(int((t == 0).sum()) for t in aw["moved"].values())
    total = sum(t.numel() for t in aw["moved"].values())
    ref_frozen = sum(int((t == 0).sum()) for t in ref["moved"].values())
    aw_norm = math.sqrt(sum(float((t**2).sum()) for t in aw["moved"].values()))
    ref_norm = math.sqrt(sum(float((t**2).sum()) for t in ref["moved"].values()))
    ev = {
        "as_written_vs_reference": evidence_numbers(cmp),
        "tolerance": tol,
        "steps": LONG_STEPS,
        "parameter_dtype": aw["dtype"].replace("torch.", ""),
        "entries_never_updated": {"as_written": frozen, "reference": ref_frozen, "of": total},
        "movement_norm": {"as_written": _num(aw_norm), "reference": _num(ref_norm)},
    }
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    dtype = ev["parameter_dtype"]
    if bad:
        ev["non_finite_entries"] = bad
        return result(
            "confirmed",
            f"after {LONG_STEPS} steps {bad} of {total} {dtype} parameter entries are NaN or inf "
            "(the fp32 reference stays finite)" + note_text,
            ev,
        )
    rel = diff_norm / ref_norm if ref_norm > 0 else math.inf
    ev["movement_rel_error"] = _num(rel)
    summary = (
        f"after {LONG_STEPS} steps the {dtype} parameters moved {aw_norm / ref_norm:.1%} as far as the fp32 "
        f"reference, {frozen} of {total} entries never changed (reference: {ref_frozen})"
        if ref_norm > 0
        else f"after {LONG_STEPS} steps the reference did not move"
    )
    if rel <= tol["rtol"]:
        return result(
            "not-reproduced",
            summary
            + f"; the movement matches within {pct(tol['rtol'])} (relative error {pct(rel)})"
            + note_text,
            ev,
        )
    return result(
        "confirmed", summary + f"; the movement is off by {pct(rel)} (relative error)" + note_text, ev
    )


# --------------------------------------------------------------------------------------------------
# loop probes: the user's loop body run for a few iterations (TL102, TL103, TL104, TL302, TL303, TL501)

RANK = 0
WORLD = 1
# One step's loss is multiplied by this: finite on its own, its gradients overflow fp32 once multiplied
# by the loss scale, as fp16 gradients overflow when the scale is too large for them.
OVERFLOW_FACTOR = 1e36
_loop: dict = {}


def begin_run(model, overflow_iteration: int | None = None) -> None:
    """Start recording a loop run on ``model`` (the tiny model whose parameters are compared)."""
    _loop.clear()
    _loop.update(
        names={id(p): n for n, p in model.named_parameters()},
        model=model,
        iteration=0,
        loss_calls=0,
        steps=[],
        overflow=overflow_iteration,
        before_overflow=None,
        census=[],
        forwards=0,
        allreduces=0,
    )


def iteration(t: int) -> None:
    _loop["iteration"] = t
    if _loop.get("overflow") == t and _loop.get("before_overflow") is None:
        _loop["before_overflow"] = snapshot(_loop["model"])


def micro_loss(model) -> torch.Tensor:
    """The loss of one microbatch: each call gets the next batch (per rank); on the overflow
    iteration the loss is made so large that its scaled gradients overflow."""
    k = _loop.get("loss_calls", 0)
    _loop["loss_calls"] = k + 1
    value = loss(model, k + 1000 * RANK, growing=False)
    if _loop.get("overflow") is not None and _loop.get("iteration") == _loop["overflow"]:
        value = value * OVERFLOW_FACTOR
    return value


def watch(optimizer, label: str = "optimizer"):
    """Record the gradients an optimizer applies each time it really steps (a GradScaler that skips
    a step never calls it)."""
    if not hasattr(optimizer, "register_step_pre_hook"):
        return optimizer

    def pre(opt, args, kwargs):
        names = _loop.get("names", {})
        grads = {}
        for group in opt.param_groups:
            for p in group["params"]:
                grads[f"grad of {names.get(id(p), f'parameter {len(grads)}')}"] = detached(p.grad)
        _loop.setdefault("steps", []).append(
            {
                "optimizer": label,
                "iteration": _loop.get("iteration", 0),
                "forwards": _loop.get("forwards", 0),
                "allreduces": _loop.get("allreduces", 0),
                "grads": grads,
            }
        )

    optimizer.register_step_pre_hook(pre)
    return optimizer


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
    _loop.setdefault("census", []).append(len(seen))


def _loop_run(ns: dict) -> dict:
    model = _loop.get("model")
    params = snapshot(model) if model is not None else {}
    return {
        "before": ns.get("__tl_before__", {}),
        "after": params,
        "before_overflow": _loop.get("before_overflow"),
        "steps": list(_loop.get("steps", [])),
        "census": list(_loop.get("census", [])),
        "iterations": ns.get("__tl_iterations__"),
        "loss_calls": _loop.get("loss_calls", 0),
    }


def _non_finite(params: dict) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in params.values())


def _compare_finite(got: dict, ref: dict, tol: dict) -> dict:
    """``compare`` where entries that are NaN/inf on both sides at the same places count as equal."""
    g2, r2 = {}, {}
    for name, r in ref.items():
        g = got.get(name)
        if isinstance(g, torch.Tensor) and isinstance(r, torch.Tensor) and g.shape == r.shape:
            both = ~torch.isfinite(g) & ~torch.isfinite(r)
            g = torch.where(both, torch.zeros_like(g), g)
            r = torch.where(both, torch.zeros_like(r), r)
        g2[name], r2[name] = g, r
    return compare(g2, r2, tol)


def _updates(run: dict, until: str = "after") -> dict:
    before, after = run["before"], run[until]
    if after is None:
        return {}
    return {f"update of {n}": after[n] - before[n] for n in before if n in after}


def _loop_variants(probe: dict) -> tuple[dict, dict]:
    runs: dict[str, dict] = {}
    failures: dict[str, dict] = {}
    for name in ("reference", "as_written", "fixed"):
        program = probe["programs"].get(name)
        if program is None:
            continue
        _loop.clear()
        try:
            ns = exec_program(program, name)
            runs[name] = _loop_run(ns)
        except VariantFailed as exc:
            failures[name] = {
                "text": str(exc),
                "iteration": _loop.get("iteration", 0),
                "binding": _is_binding(exc),
            }
            if _is_binding(exc):
                break
    return runs, failures


def _expected_failure(probe: dict, text: str) -> bool:
    return any(part in text for part in probe.get("expect", []))


def _norm_ratio(got: dict, ref: dict) -> float:
    num = math.sqrt(sum(float((t.double() ** 2).sum()) for t in got.values() if t is not None))
    den = math.sqrt(sum(float((t.double() ** 2).sum()) for t in ref.values() if t is not None))
    return num / den if den > 0 else math.inf


def _loop_comparison(aw: dict, ref: dict, tol: dict) -> tuple[dict, list[str], bool]:
    """Evidence and sentences for two loop runs; True when they differ."""
    ev: dict = {}
    parts: list[str] = []
    differs = False
    n_aw, n_ref = len(aw["steps"]), len(ref["steps"])
    ev["optimizer_steps"] = {"as_written": n_aw, "reference": n_ref}
    if n_aw != n_ref:
        differs = True
        parts.append(f"the optimizer stepped {n_aw} times instead of {n_ref}")
    worst = None
    per_step = []
    for index, (sa, sr) in enumerate(zip(aw["steps"], ref["steps"], strict=False)):
        cmp = _compare_finite(sa["grads"], sr["grads"], tol)
        per_step.append(cmp["max_rel"])
        if not cmp["match"] and worst is None:
            worst = (index, cmp)
    if per_step:
        ev["applied_gradient_max_rel"] = per_step
    if worst is not None:
        differs = True
        index, cmp = worst
        ratio = _norm_ratio(aw["steps"][index]["grads"], ref["steps"][index]["grads"])
        ev["applied_gradient_norm_ratio"] = _num(ratio)
        if ratio == 0:
            size = "; no gradient was left for the step"
        elif math.isfinite(ratio):
            size = f"; its norm is {ratio:.4g} times the documented one"
        else:
            size = ""
        parts.append(
            f"the gradient applied at step {index + 1} differs by {pct(cmp['max_rel'])} (max rel){size}"
        )
    if ref.get("before_overflow") is not None and aw.get("before_overflow") is not None:
        early = _compare_finite(_updates(aw, "before_overflow"), _updates(ref, "before_overflow"), tol)
        ev["update_before_overflow_vs_reference"] = evidence_numbers(early)
        if not early["match"]:
            differs = True
            parts.append(f"the update before the overflow step differs by {pct(early['max_rel'])} (max rel)")
    update = _compare_finite(_updates(aw), _updates(ref), tol)
    ev["as_written_vs_reference"] = evidence_numbers(update)
    bad_aw, bad_ref = _non_finite(aw["after"]), _non_finite(ref["after"])
    total = sum(t.numel() for t in ref["after"].values())
    if bad_aw or bad_ref:
        ev["non_finite_parameters"] = {"as_written": bad_aw, "reference": bad_ref, "of": total}
    if bad_aw != bad_ref:
        differs = True
        parts.append(f"{bad_aw} of {total} parameter entries end up NaN/inf (reference: {bad_ref})")
    elif not update["match"]:
        differs = True
        parts.append(f"the final update differs by {pct(update['max_rel'])} (max rel)")
    return ev, parts, differs


def drive_loop(probe: dict) -> dict:
    """TL102/TL103/TL104/TL303: the user's loop statements as written vs the documented order (and the
    fix), run for a few iterations on the tiny model; compares the gradients each optimizer step
    applied and the final parameters, or reports the documented exception."""
    runs, failures = _loop_variants(probe)
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    iterations = probe.get("iterations", 0)
    header = f"over {iterations} iterations"
    if probe.get("accumulation"):
        header += f" (accumulation count {probe['accumulation']})"
    for name in ("reference", "as_written", "fixed"):
        if name in failures and (name == "reference" or failures[name]["binding"]):
            return not_executable(failures[name]["text"])
    tol = {"rtol": 1e-3, "atol": 1e-7}
    ev: dict = {"tolerance": tol, "iterations": iterations, "loss_scale": LOSS_SCALE}
    if probe.get("overflow_iteration") is not None:
        ev["overflow_iteration"] = probe["overflow_iteration"] + 1
    fixed_ok = False
    fixed_text = ""
    if "fixed" in failures:
        ev["fixed_vs_reference"] = {"exception": failures["fixed"]["text"]}
        fixed_text = f"; with the fix it raises {failures['fixed']['text'].rstrip('.')}"
    elif "fixed" in runs:
        fev, fparts, fdiff = _loop_comparison(runs["fixed"], runs["reference"], tol)
        ev["fixed_vs_reference"] = fev["as_written_vs_reference"]
        fixed_ok = not fdiff
        fixed_text = "; with the fix: " + ("matches the documented order" if fixed_ok else "; ".join(fparts))
    if "as_written" in failures:
        failure = failures["as_written"]
        if not _expected_failure(probe, failure["text"]):
            return not_executable(f"as written, the loop raises {failure['text']}" + note_text)
        ev["exception"] = failure["text"]
        ev["failing_iteration"] = failure["iteration"] + 1
        return result(
            "confirmed",
            f"as written, iteration {failure['iteration'] + 1} raises {failure['text'].rstrip('.')}; in the documented "
            f"order the same {iterations} iterations run" + fixed_text + note_text,
            ev,
            fixed_matches=fixed_ok,
        )
    aw, ref = runs["as_written"], runs["reference"]
    if not ref["steps"]:
        return not_executable("the optimizer never stepped in the documented order with the stand-ins")
    cev, parts, differs = _loop_comparison(aw, ref, tol)
    ev.update(cev)
    if probe.get("overflow_iteration") is not None:
        notes = [
            *notes,
            f"the loss of iteration {probe['overflow_iteration'] + 1} is multiplied by {OVERFLOW_FACTOR:g} so that "
            "its scaled gradients overflow, as fp16 gradients do when the scale is too large",
        ]
        note_text = f" [{'; '.join(notes)}]"
    if not differs:
        return result(
            "not-reproduced",
            f"{header}, the loop as written applies the same {len(ref['steps'])} optimizer step(s) as the "
            f"documented order (max rel {cev['as_written_vs_reference']['max_rel']})"
            + fixed_text
            + note_text,
            ev,
            fixed_matches=fixed_ok,
        )
    return result(
        "confirmed",
        f"{header}, as written " + "; ".join(parts) + fixed_text + note_text,
        ev,
        fixed_matches=fixed_ok,
    )


def drive_graph(probe: dict) -> dict:
    """TL302: live autograd nodes after each iteration, as written vs with the added loss detached."""
    runs, failures = _loop_variants(probe)
    for name in ("reference", "as_written"):
        if name in failures:
            return not_executable(failures[name]["text"])
    aw, ref = runs["as_written"], runs["reference"]
    counts_aw, counts_ref = aw["census"], ref["census"]
    if len(counts_aw) < 3 or len(counts_ref) < 3:
        return not_executable("the loop did not run long enough to measure its graph")
    # growth per iteration after the first one (the first iteration builds the steady state)
    span = len(counts_aw) - 2
    growth_aw = (counts_aw[-1] - counts_aw[1]) / span
    growth_ref = (counts_ref[-1] - counts_ref[1]) / span
    ev = {
        "live_autograd_nodes": {"as_written": counts_aw, "reference": counts_ref},
        "growth_per_iteration": {"as_written": _num(growth_aw), "reference": _num(growth_ref)},
        "iterations": len(counts_aw) - 1,
    }
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    label = probe.get("total_label", "the running total")
    if growth_aw > growth_ref:
        return result(
            "confirmed",
            f"after {len(counts_aw) - 1} iterations {counts_aw[-1]} autograd nodes are alive as written vs "
            f"{counts_ref[-1]} with the loss detached: {label} keeps about {growth_aw - growth_ref:.0f} more "
            "per iteration" + note_text,
            ev,
        )
    return result(
        "not-reproduced",
        f"the number of live autograd nodes does not grow with iterations ({counts_aw[1]} → {counts_aw[-1]}; "
        f"with the loss detached {counts_ref[1]} → {counts_ref[-1]})" + note_text,
        ev,
    )


def drive_rng(probe: dict) -> dict:
    """TL204: the checkpoint with ``preserve_rng_state=False`` vs the plain call (and with the RNG
    state preserved): gradients computed for a different random draw than the forward used."""
    roots = probe.get("roots", ["self"])
    runs, failures, _ = run_variants(
        probe, ("reference", "as_written", "fixed"), lambda ns: run_grads_variant(ns, roots)
    )
    label = probe.get("call_label", "the checkpointed call")
    if "reference" in failures or "reference" not in runs:
        return not_executable(failures.get("reference") or failures.get("as_written", "no result"))
    if "as_written" in failures:
        return not_executable(f"as written, {label} raises {failures['as_written']}")
    aw, ref = runs["as_written"], runs["reference"]
    if probe.get("hit_key") and not aw["hits"].get(probe["hit_key"]):
        return not_executable(f"{label} did not run with the stand-in values")
    tol = tolerance(torch.float32)
    cmp_g = compare(aw["grads"], ref["grads"], tol)
    cmp_o = compare(aw["outputs"], ref["outputs"], tol)
    ev: dict = {
        "as_written_vs_reference": evidence_numbers(_worse(cmp_g, cmp_o)),
        "outputs_vs_reference": evidence_numbers(cmp_o),
        "tolerance": tol,
        "gradients_compared": len(ref["grads"]),
    }
    if cmp_g["missing"]:
        ev["none_gradients"] = [n.removeprefix("grad of ") for n in cmp_g["missing"]]
    fixed = _fixed_outcome(runs, failures, tol)
    if fixed:
        ev["fixed_vs_reference"] = fixed[0]
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    fixed_text = f"; {fixed[1].replace('with the fix', 'with the RNG state preserved')}" if fixed else ""
    if cmp_g["match"] and cmp_o["match"]:
        return result(
            "not-reproduced",
            f"as written, {label} gives the same outputs and gradients as the plain forward+backward "
            f"({len(ref['grads'])} gradients, max rel {cmp_g['max_rel']}): the function drew no random "
            "numbers that matter here" + fixed_text + note_text,
            ev,
            fixed_matches=bool(fixed and fixed[2]),
        )
    which = cmp_g if not cmp_g["match"] else cmp_o
    return result(
        "confirmed",
        f"as written, recomputation draws new random numbers: {which['worst']} differs from the plain "
        f"forward+backward by {pct(which['max_rel'])} (max rel) while the forward outputs "
        + ("match" if cmp_o["match"] else "differ")
        + fixed_text
        + note_text,
        ev,
        fixed_matches=bool(fixed and fixed[2]),
    )


# --------------------------------------------------------------------------------------------------
# data parallelism: a real two-process gloo group on the loopback interface (TL501, TL502)

DIST_WORLD = 2
DIST_TIMEOUT_S = 15.0  # a collective that waits longer than this fails (a rank that stopped early)
WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('trainlint_verify_runtime', sys.argv[1])\n"
    "mod = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = mod\n"
    "spec.loader.exec_module(mod)\n"
    "raise SystemExit(mod.main(sys.argv[2:]))\n"
)
_sync_plan: dict[int, bool] | None = None
_pool = None


class DistUnavailable(Exception):
    """The two-process group could not run the job (a worker died, or it ran out of time)."""


class _Pool:
    """Two worker processes (ranks 0 and 1) in one gloo process group, kept for the probes of this
    child. Jobs and results travel through files in a private directory; the group's rendezvous is a
    ``FileStore`` there, and gloo is bound to the loopback interface: nothing leaves the machine."""

    def __init__(self) -> None:
        import subprocess
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="trainlint-dist-", dir=os.getcwd())
        self.jobs = 0
        self.started = time.monotonic()
        env = dict(os.environ)
        loopback = "lo0" if sys.platform == "darwin" else "lo"
        env.update({"GLOO_SOCKET_IFNAME": loopback, "MASTER_ADDR": "127.0.0.1", "TP_SOCKET_IFNAME": loopback})
        path = os.path.abspath(__file__)
        self.procs = []
        for rank in range(DIST_WORLD):
            with open(os.path.join(self.dir, f"stderr{rank}"), "wb") as err:
                self.procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-c",
                            WORKER_BOOT,
                            path,
                            "--worker",
                            str(rank),
                            str(DIST_WORLD),
                            self.dir,
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        env=env,
                        cwd=self.dir,
                    )
                )

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _tail(self) -> str:
        lines: list[str] = []
        for rank in range(DIST_WORLD):
            try:
                with open(os.path.join(self.dir, f"stderr{rank}"), encoding="utf-8", errors="replace") as fh:
                    lines.extend(ln for ln in fh.read().splitlines() if ln.strip())
            except OSError:
                pass
        return " | ".join(lines[-2:])[-300:]

    def run(self, job: dict, budget: float) -> list[dict]:
        number = self.jobs
        self.jobs += 1
        path = os.path.join(self.dir, f"job{number}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(job, fh)
        os.replace(path + ".tmp", path)
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(f"{number}\n".encode())
            proc.stdin.flush()
        deadline = time.monotonic() + budget
        results: list[dict | None] = [None] * DIST_WORLD
        while True:
            for rank in range(DIST_WORLD):
                out = os.path.join(self.dir, f"result{number}-{rank}.json")
                if results[rank] is None and os.path.exists(out):
                    with open(out, encoding="utf-8") as fh:
                        results[rank] = json.load(fh)
            if all(r is not None for r in results):
                return results  # type: ignore[return-value]
            if not self.alive():
                raise DistUnavailable(
                    f"a data-parallel worker process stopped ({self._tail() or 'no message'})"
                )
            if time.monotonic() > deadline:
                raise DistUnavailable(f"the two-process run did not finish within {budget:g}s")
            time.sleep(0.02)

    def close(self) -> None:
        import shutil

        for proc in self.procs:
            try:
                proc.kill()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except Exception:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def _close_pool() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def run_distributed(job: dict) -> list[dict]:
    """Run ``job`` on both ranks; the pool is started on first use and replaced after a failure. The
    probe's own alarm ends a run that takes too long (the pool's deadline is only a fallback)."""
    global _pool
    remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    budget = (remaining + 5.0) if remaining > 0 else 60.0
    if _pool is None or not _pool.alive():
        _close_pool()
        _pool = _Pool()
    try:
        results = _pool.run(job, budget)
    except BaseException:
        _close_pool()
        raise
    failed = [r for r in results if r.get("failed")]
    same = all(
        (r.get("status"), r.get("detail")) == (results[0].get("status"), results[0].get("detail"))
        for r in results
    )
    if failed and (not same or any(r.get("status") == "error" for r in failed)):
        _close_pool()  # the ranks may disagree about which collectives ran: start afresh
    return results


def ddp(module: torch.nn.Module) -> torch.nn.Module:
    """The module in a real ``DistributedDataParallel`` over the gloo group; counts the gradient
    all-reduces (one per bucket and synchronised backward) and, for the reference run, switches
    gradient synchronisation on only for the microbatches after which the optimizer steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    class CountingDDP(DistributedDataParallel):
        def forward(self, *args, **kwargs):
            index = _loop.get("forwards", 0)
            _loop["forwards"] = index + 1
            if _sync_plan is not None:
                self.require_backward_grad_sync = bool(_sync_plan.get(index, True))
            return super().forward(*args, **kwargs)

    wrapped = CountingDDP(module)

    def hook(state, bucket):
        _loop["allreduces"] = _loop.get("allreduces", 0) + 1
        return allreduce_hook(state, bucket)

    wrapped.register_comm_hook(None, hook)
    return wrapped


def unwrap(module):
    return getattr(module, "module", module)


def rank_batch() -> dict:
    """This rank's token batch: the ranks hold different numbers of valid tokens."""
    return token_batches(WORLD)[RANK]


def all_ranks_batch() -> dict:
    """Every rank's batch in one (the single-process reference)."""
    return concat_batches(token_batches(DIST_WORLD))


def global_count(value):
    """A token count summed over the ranks (what the documented fix all-reduces)."""
    import torch.distributed as dist

    count = torch.as_tensor(value, device=DEVICE).detach().clone().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(count)
    return count


def _windows(steps: list[dict]) -> list[int]:
    out, before = [], 0
    for step in steps:
        out.append(step["allreduces"] - before)
        before = step["allreduces"]
    return out


def _job_sync(probe: dict) -> dict:
    """TL501 on one rank: the loop as written, then with synchronisation only on the microbatches
    after which the optimizer steps (what ``no_sync`` on the others gives)."""
    global _sync_plan
    runs: dict[str, dict] = {}
    for name in ("as_written", "reference"):
        _loop.clear()
        if name == "reference":
            stepped = {s["forwards"] - 1 for s in runs["as_written"]["steps"]}
            _sync_plan = {j: j in stepped for j in range(runs["as_written"]["forwards"])}
        try:
            ns = exec_program(probe["programs"][name], name)
            runs[name] = _loop_run(ns)
            runs[name]["forwards"] = _loop.get("forwards", 0)
        except VariantFailed as exc:
            text = str(exc) if name == "as_written" else f"with no_sync, {exc}"
            return {"failed": True, **not_executable(text)}
        finally:
            _sync_plan = None
    aw, ref = runs["as_written"], runs["reference"]
    if not aw["steps"]:
        return not_executable("the optimizer never stepped in the loop with the stand-ins")
    tol = {"rtol": 1e-4, "atol": 1e-7}
    cev, parts, differs = _loop_comparison(aw, ref, tol)
    per_aw, per_ref = _windows(aw["steps"]), _windows(ref["steps"])
    ev = {
        "world_size": WORLD,
        "backend": "gloo",
        "iterations": probe.get("iterations"),
        "allreduces_per_step": {"as_written": per_aw, "with_no_sync": per_ref},
        "tolerance": tol,
        **cev,
    }
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    same = "the gradients applied are the same" if not differs else "; ".join(parts)
    max_rel = max([0.0, *(x for x in cev.get("applied_gradient_max_rel", []) if isinstance(x, float))])
    counts = ", ".join(str(c) for c in per_aw)
    if sum(per_aw) > sum(per_ref):
        detail = (
            f"on {WORLD} processes (gloo), the {len(per_aw)} optimizer step(s) were preceded by {counts} gradient "
            f"all-reduce(s) each as written vs {', '.join(str(c) for c in per_ref)} with synchronisation only on "
            f"the last microbatch (no_sync on the others); {same} (max rel {_num(max_rel)})"
        )
        return result("confirmed", detail + note_text, ev)
    return result(
        "not-reproduced",
        f"on {WORLD} processes (gloo), as written each optimizer step needs {counts} all-reduce(s), as many as "
        f"with no_sync: every microbatch ends an accumulation window here" + note_text,
        ev,
    )


def _grads_of(ns: dict) -> dict:
    params = named_parameters({f"m{i}": unwrap(m) for i, m in enumerate(ns.get("__tl_modules__", []))})
    return {f"grad of {n.split('.', 1)[1]}": detached(p.grad) for n, p in params.items()}


def _job_tokens(probe: dict) -> dict:
    """TL502 on one rank: this rank's batch through the user's loss code under DDP (as written and
    with the token count all-reduced), and on rank 0 the single-process reference over every rank's
    batch."""
    runs: dict[str, dict] = {}
    tokens = 0
    for name in ("as_written", "fixed", "reference"):
        program = probe["programs"].get(name)
        if program is None or (name == "reference" and RANK != 0):
            continue
        try:
            counting_pass(True)
            ns = exec_program(program, name)
            runs[name] = {"grads": _grads_of(ns)}
            if name == "as_written":  # the count as the user's code computed it
                seen = [x for x in _records.get("tokens", []) if x is not None]
                tokens = _num(seen[0]) if seen else _batch_valid.get(RANK, 0)
        except VariantFailed as exc:
            if name == "fixed":
                runs[name] = {"exception": str(exc)}
                continue
            return {"failed": True, "tokens": tokens, **not_executable(str(exc))}
        finally:
            counting_pass(False)
    if RANK != 0:
        return {"tokens": tokens}
    tol = {"rtol": 1e-4, "atol": 1e-7}
    aw, ref = runs["as_written"], runs["reference"]
    cmp = compare(aw["grads"], ref["grads"], tol)
    ev: dict = {
        "world_size": WORLD,
        "backend": "gloo",
        "as_written_vs_reference": evidence_numbers(cmp),
        "tolerance": tol,
    }
    fixed_ok = False
    fixed_text = ""
    if "fixed" in runs:
        if "exception" in runs["fixed"]:
            ev["fixed_vs_reference"] = {"exception": runs["fixed"]["exception"]}
            fixed_text = f"; with the count all-reduced it raises {runs['fixed']['exception']}"
        else:
            fcmp = compare(runs["fixed"]["grads"], ref["grads"], tol)
            ev["fixed_vs_reference"] = evidence_numbers(fcmp)
            fixed_ok = fcmp["match"]
            fixed_text = (
                f"; with the count all-reduced (and the loss multiplied by the world size): max rel "
                f"{fcmp['max_rel']}" + (" (matches)" if fixed_ok else " (still differs)")
            )
    notes = probe.get("notes", [])
    note_text = f" [{'; '.join(notes)}]" if notes else ""
    if cmp["match"]:
        return {
            "tokens": tokens,
            **result(
                "not-reproduced",
                "the averaged gradient matches the global token mean over all ranks "
                f"(max rel {cmp['max_rel']})" + fixed_text + note_text,
                ev,
                fixed_matches=fixed_ok,
            ),
        }
    return {
        "tokens": tokens,
        **result(
            "confirmed",
            f"the gradient DDP averages differs from the global token mean by {pct(cmp['max_rel'])} (max rel)"
            + fixed_text
            + note_text,
            ev,
            fixed_matches=fixed_ok,
        ),
    }


DIST_JOBS = {"ddp_sync": _job_sync, "ddp_tokens": _job_tokens}


def drive_distributed(probe: dict) -> dict:
    """TL501/TL502: run the probe on both ranks of the gloo group and report rank 0's verdict."""
    try:
        results = run_distributed(probe)
    except DistUnavailable as exc:
        return not_executable(f"the two-process gloo run failed: {exc}")
    first = results[0]
    out = {k: v for k, v in first.items() if k not in ("failed", "tokens")}
    out["device"] = "cpu"  # the ranks run on the CPU (gloo) whatever device the other probes use
    if "status" not in out:
        return result("error", "rank 0 of the data-parallel run gave no result", {})
    if probe["driver"] == "ddp_tokens" and out["status"] in ("confirmed", "not-reproduced"):
        tokens = [r.get("tokens", 0) for r in results]
        out["evidence"]["valid_tokens_per_rank"] = tokens
        shown = " and ".join(f"{t:g}" for t in tokens)
        out["detail"] = f"on {DIST_WORLD} processes (gloo) whose token counts are {shown}: " + out["detail"]
    return out


def worker_main(argv: list[str]) -> int:
    """One rank of the data-parallel pool: join the group, then run jobs named on stdin."""
    import datetime

    import torch.distributed as dist

    global RANK, WORLD
    rank, world, directory = int(argv[0]), int(argv[1]), argv[2]
    RANK, WORLD = rank, world
    setup_process("cpu")
    store = dist.FileStore(os.path.join(directory, "store"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S)
    )
    for line in sys.stdin:
        number = line.strip()
        if not number.isdigit():
            break
        with open(os.path.join(directory, f"job{number}.json"), encoding="utf-8") as fh:
            job = json.load(fh)
        seed(0)
        started = time.perf_counter()
        try:
            out = DIST_JOBS[job["driver"]](job)
        except BaseException as exc:  # a bug in the harness
            out = {
                "failed": True,
                **result(
                    "error",
                    f"harness error on rank {rank}: {type(exc).__name__}: {exc}",
                    {"traceback": traceback.format_exc()[-2000:]},
                ),
            }
        out["elapsed_s"] = round(time.perf_counter() - started, 3)
        path = os.path.join(directory, f"result{number}-{rank}.json")
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            json.dump(out, fh)
        os.replace(path + ".tmp", path)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    return 0


def _is_binding(exc: VariantFailed) -> bool:
    return isinstance(exc.exc, UnboundName | SystemExit) or (
        type(exc.exc) is NameError and bool(getattr(exc.exc, "name", None))
    )


def not_executable(detail: str) -> dict:
    return result("not-executable", detail, {})


def result(status: str, detail: str, evidence: dict, fixed_matches: bool = False) -> dict:
    return {"status": status, "detail": detail, "evidence": evidence, "fixed_matches": fixed_matches}


# --------------------------------------------------------------------------------------------------
# the child's main loop

DRIVERS = {
    "grads": drive_grads,
    "side_effects": drive_side_effects,
    "step": drive_step,
    "accumulation": drive_accumulation,
    "half": drive_half,
    "loop": drive_loop,
    "graph": drive_graph,
    "rng": drive_rng,
    "ddp_sync": drive_distributed,
    "ddp_tokens": drive_distributed,
}


def register(name: str):
    def deco(fn):
        DRIVERS[name] = fn
        return fn

    return deco


def _alarm(signum, frame):
    raise ProbeTimeout()


def run_probe(probe: dict, timeout: float) -> dict:
    driver = DRIVERS.get(probe["driver"])
    if driver is None:
        return result("error", f"unknown probe driver {probe['driver']!r}", {})
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    started = time.perf_counter()
    try:
        out = driver(probe)
    except ProbeTimeout:
        out = not_executable(f"the snippet did not finish within {timeout:g}s (it may loop forever)")
    except VariantFailed as exc:
        out = not_executable(str(exc))
    except BaseException as exc:  # a bug in the harness
        out = result(
            "error",
            f"harness error: {type(exc).__name__}: {exc}",
            {"traceback": traceback.format_exc()[-2000:]},
        )
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    out["elapsed_s"] = round(time.perf_counter() - started, 3)
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    try:
        return _main(argv)
    finally:
        _close_pool()


def _main(argv: list[str]) -> int:
    spec_path, result_path = argv[0], argv[1]
    with open(spec_path, encoding="utf-8") as fh:
        job = json.load(fh)
    requested = device = job["device"]
    if device in ("auto", "cuda"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # `--device cuda` on a machine without CUDA still runs, on the CPU, and every verdict says so.
    fallback_note = (
        "--device cuda was asked for but CUDA is not available: ran on cpu. "
        if requested == "cuda" and device == "cpu"
        else ""
    )
    setup_process(device)
    for probe in job["probes"]:
        with open(result_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"id": probe["id"], "started": True}) + "\n")
        seed(0)
        out = run_probe(probe, float(job["timeout"]))
        out["id"] = probe["id"]
        out.setdefault("device", device)
        if fallback_note:
            out["detail"] = fallback_note + out.get("detail", "")
        out["torch"] = torch.__version__.split("+")[0]
        with open(result_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(out) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    return 0


if __name__ == "__main__":
    # Results go to a file, so that whatever user code prints can never be mistaken for one.
    raise SystemExit(main(sys.argv[1:]))
