"""TL2xx: activation checkpointing (``torch.utils.checkpoint``)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.events import CHECKPOINT_FUNCTIONS
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    attr_name,
    dotted,
    has_star_kwargs,
    keyword,
    positional,
    receiver,
    walk,
)
from trainlint.rule import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
)
from trainlint.targets import Target, called_functions, resolve_checkpoint_target

PARTIALS = ("functools.partial",)


def checkpoint_calls(model: FileModel) -> Iterator[tuple[Site, cst.Call]]:
    """Direct calls of torch's checkpoint functions, and ``functools.partial(checkpoint, ...)``.

    For a partial, the keywords bound at the partial count: its later calls are not reported again.
    """
    for site in model.calls_to(*CHECKPOINT_FUNCTIONS):
        assert isinstance(site.node, cst.Call)
        yield site, site.node
    for site in model.calls_to(*PARTIALS):
        call = site.node
        assert isinstance(call, cst.Call)
        args = positional(call)
        if args and model.resolves_to(args[0], site.scope, *CHECKPOINT_FUNCTIONS):
            yield site, call


def constant_value(model: FileModel, expr: cst.BaseExpression, site: Site) -> bool | None:
    """``True``/``False`` for a literal or a name bound once to one; None when unknown."""
    if isinstance(expr, cst.Name) and expr.value in ("True", "False"):
        return expr.value == "True"
    if isinstance(expr, cst.Name):
        values = model.values_of(expr, site.scope)
        if len(values) == 1:
            value = values[0]
            if isinstance(value, cst.Name) and value.value in ("True", "False"):
                return value.value == "True"
    return None


class CheckpointUseReentrant(Rule):
    id = "TL201"
    name = "checkpoint-use-reentrant"
    severity = Severity.WARNING
    probe = "tl201"
    summary = "torch.utils.checkpoint called without an explicit use_reentrant= argument."
    # Every finding needs a name that resolves to torch.utils.checkpoint.checkpoint[_sequential]: its
    # parts `torch`, `utils` and `checkpoint` are all written in the file (call, import or assignment),
    # and `utils` after `.`, whitespace, `(` or `,` (in `torch.utils`, `from torch import (nn, utils)`).
    tokens = ("checkpoint",)
    requires = (("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports calls of `torch.utils.checkpoint.checkpoint` and `checkpoint_sequential` (under any "
            "import alias, and `functools.partial` of them) that do not pass `use_reentrant=`. A call "
            "with a `**kwargs` splat is not reported, since the keyword may be inside it. A function of "
            "your own that happens to be called `checkpoint` is never reported."
        ),
        why=(
            "Without the keyword, PyTorch falls back to the old *reentrant* implementation and prints a "
            "deprecation warning. The reentrant variant only computes gradients for the tensor inputs "
            "that require grad: checkpoint a block whose input is the output of a frozen embedding (or "
            "raw token features) and none of the block's parameters get a gradient. With 24 "
            "checkpointed layers over a frozen embedding, all 24 layers receive `None` gradients and "
            "the optimizer silently skips them; the loss still goes down thanks to the head, so "
            "nothing looks broken. The reentrant variant also ignores keyword arguments to the "
            "function and does not support `torch.autograd.grad`."
        ),
        example=(
            "from torch.utils.checkpoint import checkpoint\n\n"
            "def forward(self, x):\n"
            "    for block in self.blocks:\n"
            "        x = checkpoint(block, x)\n"
            "    return x"
        ),
        use_instead=(
            "from torch.utils.checkpoint import checkpoint\n\n"
            "def forward(self, x):\n"
            "    for block in self.blocks:\n"
            "        x = checkpoint(block, x, use_reentrant=False)\n"
            "    return x"
        ),
        fix_safety=(
            "The fix adds `use_reentrant=False`. It is unsafe: the non-reentrant variant is the "
            "recommended one and fixes the missing-gradient case above, but it differs in corner cases "
            "(for example code that relies on the reentrant variant's detaching of inputs). Apply it "
            "with `--unsafe-fixes`, or let `--verify` show that the gradients match."
        ),
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        "import torch.utils.checkpoint\ny = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)",
        # the user's own function called checkpoint
        "def checkpoint(model, path):\n    torch.save(model.state_dict(), path)\n\ncheckpoint(model, 'a.pt')",
        # use_reentrant passed through a kwargs dict
        "from torch.utils.checkpoint import checkpoint\nkw = {'use_reentrant': False}\ny = checkpoint(f, x, **kw)",
        # use_reentrant through a module constant
        "from torch.utils.checkpoint import checkpoint\nREENTRANT = False\ny = checkpoint(f, x, use_reentrant=REENTRANT)",
        # a partial that binds the keyword
        "import functools\nfrom torch.utils.checkpoint import checkpoint\n"
        "ckpt = functools.partial(checkpoint, use_reentrant=False)\ny = ckpt(f, x)",
        # other libraries' checkpoint functions
        "import deepspeed\ny = deepspeed.checkpointing.checkpoint(f, x)",
        "from timm.models._manipulate import checkpoint\ny = checkpoint(block, x)",
        "from megatron.core import tensor_parallel\ny = tensor_parallel.checkpoint(f, False, x)",
        # a reference, not a call
        "from torch.utils.checkpoint import checkpoint\nself.ckpt_fn = checkpoint",
        # shadowed by a local def inside a class body method's module
        "from torch.utils.checkpoint import checkpoint\n\ndef checkpoint(state):\n    save(state)\n\ncheckpoint(s)",
    )
    invalid = (
        Invalid("from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)", line=2),
        Invalid("import torch\ny = torch.utils.checkpoint.checkpoint(f, x)", line=2),
        Invalid("import torch.utils.checkpoint as cp\ny = cp.checkpoint(f, x)", line=2),
        Invalid("from torch.utils import checkpoint\ny = checkpoint.checkpoint(f, x)", line=2),
        Invalid(
            "from torch.utils.checkpoint import checkpoint_sequential\ny = checkpoint_sequential(seq, 2, x)"
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint as ckpt\n\ndef f(self, x):\n    return ckpt(self.block, x)",
            line=4,
        ),
        Invalid(
            "import functools\nfrom torch.utils.checkpoint import checkpoint\n"
            "ckpt = functools.partial(checkpoint, preserve_rng_state=True)\ny = ckpt(f, x)",
            line=3,
        ),
        Invalid(
            "import torch\n\nclass Block(torch.nn.Module):\n    def forward(self, x):\n"
            "        from torch.utils.checkpoint import checkpoint\n        return checkpoint(self.inner, x)",
            line=6,
        ),
        Invalid(
            "import torch.utils.checkpoint\nimport torch\nfor blk in blocks:\n    x = torch.utils.checkpoint.checkpoint(\n        blk,\n        x,\n    )",
            line=4,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for _site, call in checkpoint_calls(model):
            if keyword(call, "use_reentrant") is not None or has_star_kwargs(call):
                continue
            fix = None
            if call.args:
                fix = FixSpec(
                    Applicability.UNSAFE,
                    "Pass use_reentrant=False",
                    (TextEditSpec(call.args[-1].value, "after", ", use_reentrant=False"),),
                )
            yield Diagnostic(
                call,
                "checkpoint() without `use_reentrant=`: the implicit default is the deprecated reentrant "
                "variant, which drops parameter gradients when no input requires grad; pass "
                "`use_reentrant=False`.",
                fix=fix,
            )


class CheckpointReentrantExplicit(Rule):
    id = "TL202"
    name = "checkpoint-reentrant-explicit"
    severity = Severity.INFO
    probe = "tl202"
    summary = "use_reentrant=True passed to torch.utils.checkpoint explicitly."
    # Every finding needs torch's checkpoint (see TL201) and a `True` (the literal or a constant's value).
    tokens = ("use_reentrant",)
    requires = (("True",), ("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    doc = RuleDoc(
        what="Reports `use_reentrant=True` passed to torch's checkpoint functions (a literal or a module constant).",
        why=(
            "The reentrant variant is a deliberate choice in some codebases, so this is only "
            "information. Keep in mind what it costs: if none of the tensor inputs requires grad "
            "(say the block's input comes from a frozen embedding), the block's parameters receive no "
            "gradient at all; keyword arguments to the checkpointed function are not supported; and "
            "the check that recomputation reproduced the forward pass is skipped."
        ),
        example="y = checkpoint(block, x, use_reentrant=True)",
        use_instead="y = checkpoint(block, x, use_reentrant=False)",
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=False)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=flag)",
        "def checkpoint(f, x, use_reentrant):\n    pass\ncheckpoint(f, x, use_reentrant=True)",
        "import deepspeed\ny = deepspeed.checkpointing.checkpoint(f, x, use_reentrant=True)",
        "from torch.utils.checkpoint import checkpoint\nREENTRANT = False\ny = checkpoint(f, x, use_reentrant=REENTRANT)",
        "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x)",
    )
    invalid = (
        Invalid(
            "from torch.utils.checkpoint import checkpoint\ny = checkpoint(f, x, use_reentrant=True)", line=2
        ),
        Invalid("import torch\ny = torch.utils.checkpoint.checkpoint(f, x, use_reentrant=True)", line=2),
        Invalid(
            "import torch.utils.checkpoint as cp\nREENTRANT = True\ny = cp.checkpoint(f, x, use_reentrant=REENTRANT)",
            line=3,
        ),
        Invalid(
            "import functools\nimport torch.utils.checkpoint\n"
            "ckpt = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=True)",
            line=3,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint_sequential\ny = checkpoint_sequential(m, 2, x, use_reentrant=True)"
        ),
        Invalid("from torch.utils import checkpoint\ny = checkpoint.checkpoint(f, x, use_reentrant=True)"),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for site, call in checkpoint_calls(model):
            arg = keyword(call, "use_reentrant")
            if arg is not None and constant_value(model, arg.value, site) is True:
                yield Diagnostic(
                    arg,
                    "use_reentrant=True selects the reentrant checkpoint: parameters get no gradient when "
                    "no input requires grad, and keyword arguments are not supported; prefer "
                    "`use_reentrant=False` unless you rely on it.",
                )


# -- TL203 / TL204: what runs inside the checkpointed function ---------------------------------------

MUTATORS_ANY_CONTEXT = frozenset({"append", "extend", "pop", "setdefault", "insert", "popitem"})
MUTATORS_STATEMENT = frozenset({"update", "add", "clear", "remove", "discard"})
LOG_METHODS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "log"})
LOGGER_NAMES = frozenset({"logger", "log", "logging", "_logger", "LOGGER", "LOG", "_log"})
IO_FUNCTIONS = frozenset(
    {
        "builtins.open",
        "builtins.print",
        "torch.save",
        "numpy.save",
        "numpy.savez",
        "numpy.savetxt",
        "json.dump",
        "pickle.dump",
        "os.write",
    }
)
IO_PREFIXES = ("requests.", "urllib.", "socket.", "http.client.", "wandb.", "mlflow.", "logging.")
SEEDING = frozenset(
    {
        "torch.manual_seed",
        "torch.random.manual_seed",
        "torch.cuda.manual_seed",
        "torch.cuda.manual_seed_all",
        "random.seed",
        "numpy.random.seed",
    }
)
BATCHNORMS = frozenset(
    f"torch.nn.{name}" for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")
) | frozenset(f"torch.nn.modules.batchnorm.{name}" for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"))
RANDOM_FUNCTIONS = frozenset(
    {
        "torch.rand",
        "torch.randn",
        "torch.randint",
        "torch.rand_like",
        "torch.randn_like",
        "torch.randint_like",
        "torch.randperm",
        "torch.bernoulli",
        "torch.multinomial",
        "torch.normal",
        "torch.poisson",
        "torch.nn.functional.dropout",
        "torch.nn.functional.dropout1d",
        "torch.nn.functional.dropout2d",
        "torch.nn.functional.dropout3d",
        "torch.nn.functional.alpha_dropout",
        "torch.nn.functional.feature_alpha_dropout",
        "torch.dropout",
    }
)
DROPOUT_MODULES = frozenset(
    f"torch.nn.{name}" for name in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout")
)
RANDOM_PREFIXES = ("random.", "numpy.random.")
GRAD_ENABLED = frozenset({"torch.is_grad_enabled"})


def _root_name(expr: cst.BaseExpression) -> str | None:
    while isinstance(expr, cst.Attribute | cst.Subscript | cst.Call):
        expr = expr.func if isinstance(expr, cst.Call) else expr.value
    return expr.value if isinstance(expr, cst.Name) else None


def _created_locally(name: str | None, scope: Scope) -> bool:
    """Bound in the function itself by assignment (not a parameter, not global/nonlocal)."""
    if name is None or name in scope.global_names or name in scope.nonlocal_names:
        return False
    bindings = scope.bindings.get(name, [])
    return bool(bindings) and all(b.kind not in ("param", "import") for b in bindings)


def _self_attr_callee(model: FileModel, call: cst.Call, scope: Scope) -> list[str | None]:
    """For ``self.bn(x)``, the resolved constructors assigned to ``self.bn`` in the class."""
    path = dotted(call.func)
    if path is None or not path.startswith("self.") or path.count(".") != 1:
        return []
    return [callee for _, callee in model.call_values(call.func, scope)]


def _under_grad_enabled_guard(model: FileModel, site: Site) -> bool:
    for frame in site.frames:
        if frame.kind == "if" and frame.branch == "body":
            test = frame.node.test  # type: ignore[attr-defined]
            for node in walk(test):
                if isinstance(node, cst.Call) and model.qualname(node.func, site.scope) in GRAD_ENABLED:
                    return True
    return False


def side_effects(model: FileModel, target: Target) -> Iterator[tuple[cst.CSTNode, Site, str]]:
    """(node, site, what it does) for each side effect directly in the target's body."""
    scope = target.scope
    for site in model.calls_in(scope):
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site)
        name = attr_name(call)
        recv = receiver(call)
        statement_level = isinstance(site.parent, cst.Expr)
        what = None
        if callee == "builtins.print":
            what = "prints"
        elif callee in SEEDING:
            what = "reseeds a random number generator"
        elif callee in IO_FUNCTIONS or (callee and callee.startswith(IO_PREFIXES)):
            what = "logs or does file/network I/O"
        elif recv is not None and name in LOG_METHODS and _root_name(recv) in LOGGER_NAMES:
            what = "logs"
        elif (
            recv is not None and name and name.startswith("add_") and "writer" in (dotted(recv) or "").lower()
        ):
            what = "logs to an experiment tracker"
        elif recv is not None and name in MUTATORS_ANY_CONTEXT | MUTATORS_STATEMENT:
            if (name in MUTATORS_ANY_CONTEXT or statement_level) and not _created_locally(
                _root_name(recv), scope
            ):
                what = f"mutates `{model.code(recv)}`, which is not created in the function"
        elif (
            recv is not None
            and name
            and name.endswith("_")
            and not name.startswith("_")
            and name != "requires_grad_"
            and _root_name(recv) == "self"
        ):
            what = f"changes `{model.code(recv)}` in place"
        if what is None and any(c in BATCHNORMS for c in _self_attr_callee(model, call, scope)):
            bn_calls = [v for v in model.values_of(call.func, scope) if isinstance(v, cst.Call)]
            stats_off = any(
                (kw := keyword(v, "track_running_stats")) is not None
                and isinstance(kw.value, cst.Name)
                and kw.value.value == "False"
                for v in bn_calls
            )
            if not stats_off:
                what = f"runs BatchNorm `{model.code(call.func)}`, whose running statistics update again"
        if what is not None:
            yield call, site, what
    for site in model.assigns + model.augassigns:
        if site.scope is not scope:
            continue
        node = site.node
        targets: list[cst.BaseExpression]
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        else:
            targets = [node.target]  # type: ignore[attr-defined]
        for tgt in targets:
            if isinstance(tgt, cst.Name):
                if tgt.value in scope.global_names or tgt.value in scope.nonlocal_names:
                    yield node, site, f"writes the outer name `{tgt.value}`"
            elif isinstance(tgt, cst.Attribute | cst.Subscript):
                if not _created_locally(_root_name(tgt), scope):
                    yield node, site, f"writes to `{model.code(tgt)}`, which is not created in the function"


def _checkpoint_sites(model: FileModel) -> Iterator[tuple[Site, cst.Call, Target]]:
    for site, call in checkpoint_calls(model):
        target = resolve_checkpoint_target(model, site)
        if target is not None:
            yield site, call, target


def _is_reentrant(call: cst.Call, model: FileModel, site: Site) -> bool:
    arg = keyword(call, "use_reentrant")
    if arg is None:
        return not has_star_kwargs(call)
    return constant_value(model, arg.value, site) is not False


class CheckpointSideEffect(Rule):
    id = "TL203"
    name = "checkpoint-side-effect"
    severity = Severity.WARNING
    probe = "tl203"
    summary = "A function run under checkpoint() has side effects, which happen again when it is recomputed."
    # Every finding needs torch's checkpoint (see TL201); the side effects have too many forms to require.
    tokens = ("checkpoint",)
    requires = (("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    doc = RuleDoc(
        what=(
            "Finds the function passed to `torch.utils.checkpoint.checkpoint` (a def, a nested def, "
            "`self.method`, a submodule's `forward`, `functools.partial`, a lambda, and functions it "
            "calls directly in the same file) and reports statements in it with side effects: writes to "
            "`global`/`nonlocal` names or to attributes and items of objects not created in the "
            "function (`self.count += 1`, `CACHE[key] = x`), mutating calls on outer containers "
            "(`append`, `extend`, `update`, `pop`, ...), `print`, logging and experiment trackers, file "
            "or network I/O, reseeding, in-place changes of parameters or buffers, and BatchNorm layers."
        ),
        why=(
            "Activation checkpointing throws the block's activations away after the forward pass and "
            "runs the function *again* during backward to rebuild them. Everything the function does "
            "besides computing its output therefore happens twice per step (or a different number of "
            "times with the reentrant variant). A counter meant to count 1000 steps reads 2000; a list "
            "of auxiliary losses gets every entry twice, so an MoE balancing loss added from it is "
            "doubled; a BatchNorm with momentum 0.1 moves its running mean by 1 - 0.9^2 = 19% of the "
            "way per step instead of 10%, so the statistics used at evaluation drift from what training "
            "saw."
        ),
        example=(
            "def block(x):\n"
            "    self.stats.append(x.mean())\n"
            "    return self.mlp(x)\n\n"
            "y = checkpoint(block, x, use_reentrant=False)"
        ),
        use_instead=(
            "def block(x):\n"
            "    return self.mlp(x)\n\n"
            "y = checkpoint(block, x, use_reentrant=False)\n"
            "self.stats.append(y.detach().mean())"
        ),
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        # a pure function
        "from torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    h = x * 2\n    h += 1\n    return h\n\ny = checkpoint(block, x, use_reentrant=False)",
        # mutating a container created inside the function
        "from torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    outs = []\n    outs.append(x)\n    cache = {}\n    cache['a'] = x\n    return outs[0]\n\ny = checkpoint(block, x, use_reentrant=False)",
        # side effects outside the checkpointed function
        "from torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return x * 2\n\nprint('start')\nLOG.append(1)\ny = checkpoint(block, x, use_reentrant=False)",
        # a user's own function called checkpoint
        "def checkpoint(fn, x):\n    return fn(x)\n\ndef block(x):\n    print(x)\n    return x\n\ny = checkpoint(block, x)",
        # tensor .add is not a mutation when its value is used
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(torch.nn.Module):\n    def inner(self, x, r):\n        return x.add(r)\n\n    def forward(self, x, r):\n        return checkpoint(self.inner, x, r, use_reentrant=False)",
        # a side effect in a method that is not the checkpointed one
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(torch.nn.Module):\n    def inner(self, x):\n        return self.lin(x)\n\n    def forward(self, x):\n        self.calls += 1\n        return checkpoint(self.inner, x, use_reentrant=False)",
        # guarded by is_grad_enabled under the reentrant variant: runs once, during recomputation
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    if torch.is_grad_enabled():\n        STATS.append(x.sum())\n    return x\n\ny = checkpoint(block, x, use_reentrant=True)",
        # BatchNorm without running statistics
        "import torch\nfrom torch import nn\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.bn = nn.BatchNorm2d(8, track_running_stats=False)\n\n    def inner(self, x):\n        return self.bn(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False)",
        # LayerNorm and dropout are not side effects
        "import torch\nfrom torch import nn\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.ln = nn.LayerNorm(8)\n\n    def inner(self, x):\n        return self.ln(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False)",
    )
    invalid = (
        Invalid(
            "from torch.utils.checkpoint import checkpoint\nCACHE = {}\n\ndef block(x):\n    CACHE['last'] = x\n    return x * 2\n\ny = checkpoint(block, x, use_reentrant=False)",
            line=5,
        ),
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(torch.nn.Module):\n    def inner(self, x):\n        self.calls += 1\n        return self.lin(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False)",
            line=6,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint\nSTEP = 0\n\ndef block(x):\n    global STEP\n    STEP = STEP + 1\n    return x\n\ny = checkpoint(block, x, use_reentrant=False)",
            line=6,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint\n\ndef run(layers, x, aux):\n    def exec_func(h):\n        for layer in layers:\n            h = layer(h)\n            aux.append(layer.aux_loss)\n        return h\n    return checkpoint(exec_func, x, use_reentrant=False)",
            line=7,
        ),
        Invalid(
            "import logging\nfrom torch.utils.checkpoint import checkpoint\nlogger = logging.getLogger(__name__)\n\ndef block(x):\n    logger.info('block %s', x.shape)\n    return x\n\ny = checkpoint(block, x, use_reentrant=False)",
            line=6,
        ),
        Invalid(
            "import functools\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x, scale):\n    print(scale)\n    return x * scale\n\ny = checkpoint(functools.partial(block, scale=2), x, use_reentrant=False)",
            line=5,
        ),
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    torch.manual_seed(0)\n    return torch.nn.functional.dropout(x)\n\ny = checkpoint(block, x, use_reentrant=False)",
            line=5,
        ),
        Invalid(
            "import torch\nfrom torch import nn\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.bn = nn.BatchNorm2d(8)\n\n    def inner(self, x):\n        return self.bn(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False)",
            line=11,
        ),
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(torch.nn.Module):\n    def inner(self, x):\n        self.ema.mul_(0.9).add_(x.detach().mean())\n        return x\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False)",
            line=6,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint\nTRACE = []\n\ndef helper(x):\n    TRACE.append(x)\n    return x\n\ndef block(x):\n    return helper(x) * 2\n\ny = checkpoint(block, x, use_reentrant=False)",
            line=5,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint\nSEEN = []\ny = checkpoint(lambda t: SEEN.append(t) or t, x, use_reentrant=False)",
            line=3,
        ),
        Invalid(
            "from torch.utils.checkpoint import checkpoint\n\ndef create_custom_forward(module, out):\n    def custom_forward(*inputs):\n        out.extend(inputs)\n        return module(*inputs)\n    return custom_forward\n\nh = checkpoint(create_custom_forward(layer, outs), h, use_reentrant=False)",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        reported: set[int] = set()
        for site, call, target in _checkpoint_sites(model):
            line = model.position(call).start.line
            reentrant = _is_reentrant(call, model, site)
            bodies = [(target, None), *((t, s) for s, t in called_functions(model, target))]
            for body, via_site in bodies:
                for node, effect_site, what in side_effects(model, body):
                    # one finding per statement: `self.ema.mul_(0.9).add_(x)` is one side effect
                    if id(effect_site.statement) in reported:
                        continue
                    if reentrant and _under_grad_enabled_guard(model, effect_site):
                        continue
                    reported.add(id(effect_site.statement))
                    name = target.via
                    if via_site is not None:
                        name = f"{body.via}, called from {target.via}"
                    related = [(call, "checkpointed here")]
                    if via_site is not None:
                        related.append((via_site.node, "called from the checkpointed function here"))
                    yield Diagnostic(
                        node,
                        f"This {what}, inside `{name}` which runs under checkpoint() at line {line}: "
                        "recomputation during backward repeats it; move it out of the checkpointed function.",
                        related=tuple(related),
                    )


class CheckpointRngNotPreserved(Rule):
    id = "TL204"
    name = "checkpoint-rng-not-preserved"
    severity = Severity.ERROR
    probe = "tl204"
    summary = "preserve_rng_state=False on a checkpointed function that draws random numbers."
    # Every finding needs torch's checkpoint (see TL201), a `False`, and randomness: `rand*`/`random`,
    # `bernoulli`, `multinomial`, `normal`, `poisson` or a dropout (`dropout*`, `Dropout`, `AlphaDropout`).
    tokens = ("preserve_rng_state",)
    requires = (
        ("False",),
        ("rand", "bernoulli", "multinomial", "normal", "poisson", "ropout"),
        ("utils",),
        ("torch",),
        tuple(a + "utils" for a in ".\t\n\r\f (,"),
    )
    doc = RuleDoc(
        what=(
            "Reports a checkpoint call with `preserve_rng_state=False` whose function (resolved as for "
            "TL203) uses randomness: dropout modules or functions, `torch.rand*`, `torch.bernoulli`, "
            "`torch.multinomial`, `torch.normal`, `random.*`, `numpy.random.*`."
        ),
        why=(
            "Recomputation during backward draws new random numbers unless the RNG state is restored. "
            "The gradient is then computed for a different dropout mask than the one that produced "
            "the loss: with p = 0.1 on 4096 features, about 2 x 4096 x 0.1 x 0.9 = 737 positions differ "
            "between the two masks, and their gradients flow through units that were zero in the "
            "forward pass. Training still runs, on gradients of a function that was never evaluated."
        ),
        example="y = checkpoint(block_with_dropout, x, use_reentrant=False, preserve_rng_state=False)",
        use_instead="y = checkpoint(block_with_dropout, x, use_reentrant=False)",
        references=("https://pytorch.org/docs/stable/checkpoint.html",),
    )
    valid = (
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return torch.nn.functional.dropout(x, 0.1)\n\ny = checkpoint(block, x, use_reentrant=False)",
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return torch.relu(x)\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return torch.nn.functional.dropout(x, 0.1)\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=True)",
        "import torch\n\ndef checkpoint(fn, x, preserve_rng_state):\n    return fn(x)\n\ndef block(x):\n    return x * torch.rand_like(x)\n\ny = checkpoint(block, x, preserve_rng_state=False)",
        "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ny = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False)",
        "import torch\nfrom torch import nn\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.ln = nn.LayerNorm(8)\n\n    def inner(self, x):\n        return self.ln(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)",
    )
    invalid = (
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return torch.nn.functional.dropout(x, 0.1)\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
            line=7,
        ),
        Invalid(
            "import torch.nn.functional as F\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return F.dropout(x, 0.1, training=True)\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
            line=7,
        ),
        Invalid(
            "import torch\nfrom torch import nn\nfrom torch.utils.checkpoint import checkpoint\n\nclass M(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.drop = nn.Dropout(0.1)\n\n    def inner(self, x):\n        return self.drop(x)\n\n    def forward(self, x):\n        return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)",
            line=14,
        ),
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return x * torch.rand_like(x)\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
        ),
        Invalid(
            "import random\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return x * random.random()\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
        ),
        Invalid(
            "import numpy as np\nimport torch\nfrom torch.utils.checkpoint import checkpoint\n\ndef block(x):\n    return x + torch.from_numpy(np.random.randn(4))\n\ny = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)",
        ),
        Invalid(
            "import torch\nfrom torch.utils.checkpoint import checkpoint\n\ny = checkpoint(lambda t: torch.bernoulli(t), x, use_reentrant=False, preserve_rng_state=False)",
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        for site, call, target in _checkpoint_sites(model):
            arg = keyword(call, "preserve_rng_state")
            if arg is None or constant_value(model, arg.value, site) is not False:
                continue
            bodies = [target, *(t for _, t in called_functions(model, target))]
            for body in bodies:
                source = _randomness(model, body)
                if source is not None:
                    yield Diagnostic(
                        call,
                        f"preserve_rng_state=False, but `{target.via}` draws random numbers "
                        f"(`{source}`): recomputation uses different ones, so the gradients do not match "
                        "the forward pass; drop the argument.",
                        related=((arg, "RNG state not preserved here"),),
                    )
                    break


def _randomness(model: FileModel, target: Target) -> str | None:
    for site in model.calls_in(target.scope):
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site)
        if callee and (callee in RANDOM_FUNCTIONS or callee.startswith(RANDOM_PREFIXES)):
            return model.code(call.func)
        if any(c in DROPOUT_MODULES for c in _self_attr_callee(model, call, target.scope)):
            return model.code(call.func)
    return None
