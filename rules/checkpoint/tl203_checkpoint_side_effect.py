"""TL203 checkpoint-side-effect."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
)
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
from trainlint.model.crossfile import class_side_effects, classes_built_by_name, constructed_class
from trainlint.model.project import Fact
from trainlint.model.targets import Target, called_functions, factory_arguments, resolve_checkpoint_target
from trainlint.model.vocab import BATCHNORM_CLASSES
from trainlint.rules.checkpoint._shared import (
    checkpoint_calls,
    checkpoint_sites,
    constant_value,
    self_attr_callee,
)


class CheckpointSideEffect(Rule):
    id = "TL203"
    name = "checkpoint-side-effect"
    severity = Severity.WARNING
    probe = True
    CHECKPOINT = "checkpoint-call"
    EFFECT = "side-effect"
    summary = "A function run under checkpoint() has side effects, which happen again when it is recomputed."
    # Every finding needs torch's checkpoint (see TL201); the side effects have too many forms to require.
    tokens = ("checkpoint",)
    requires = (("utils",), ("torch",), tuple(a + "utils" for a in ".\t\n\r\f (,"))
    # The code must name torch's checkpoint function: the last part of ``torch.utils.checkpoint.checkpoint``
    # is imported or read as an attribute (of anything but ``self``), from a ``torch`` import.
    gate = (("ref:checkpoint", "ref:checkpoint_sequential"), ("import:torch",))
    doc = RuleDoc(
        what=(
            "Finds the function passed to `torch.utils.checkpoint.checkpoint` (a def, a nested def, "
            "`self.method`, a submodule's `forward`, `functools.partial`, a lambda, and functions it "
            "calls directly in the same file) and reports statements in it with side effects: writes to "
            "`global`/`nonlocal` names or to attributes and items of objects not created in the "
            "function (`self.count += 1`, `CACHE[key] = x`), mutating calls on outer containers "
            "(`append`, `extend`, `update`, `pop`, ...), `print`, logging and experiment trackers, file "
            "or network I/O, reseeding, in-place changes of parameters or buffers, and BatchNorm layers. "
            "Across the project: a module of a class defined in another file (BatchNorm submodules, "
            "global or registry writes, collectives in its forward), and a module that is a parameter "
            "or loop variable in a file that builds its layers by name (`globals()[name]`), any of whose "
            "named classes may be the one checkpointed."
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
        """
        from torch.utils.checkpoint import checkpoint

        def block(x):
            h = x * 2
            h += 1
            return h

        y = checkpoint(block, x, use_reentrant=False)
        """,
        # mutating a container created inside the function
        """
        from torch.utils.checkpoint import checkpoint

        def block(x):
            outs = []
            outs.append(x)
            cache = {}
            cache['a'] = x
            return outs[0]

        y = checkpoint(block, x, use_reentrant=False)
        """,
        # side effects outside the checkpointed function
        """
        from torch.utils.checkpoint import checkpoint

        def block(x):
            return x * 2

        print('start')
        LOG.append(1)
        y = checkpoint(block, x, use_reentrant=False)
        """,
        # a user's own function called checkpoint
        """
        def checkpoint(fn, x):
            return fn(x)

        def block(x):
            print(x)
            return x

        y = checkpoint(block, x)
        """,
        # tensor .add is not a mutation when its value is used
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        class M(torch.nn.Module):
            def inner(self, x, r):
                return x.add(r)

            def forward(self, x, r):
                return checkpoint(self.inner, x, r, use_reentrant=False)
        """,
        # a side effect in a method that is not the checkpointed one
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        class M(torch.nn.Module):
            def inner(self, x):
                return self.lin(x)

            def forward(self, x):
                self.calls += 1
                return checkpoint(self.inner, x, use_reentrant=False)
        """,
        # guarded by is_grad_enabled under the reentrant variant: runs once, during recomputation
        """
        import torch
        from torch.utils.checkpoint import checkpoint

        def block(x):
            if torch.is_grad_enabled():
                STATS.append(x.sum())
            return x

        y = checkpoint(block, x, use_reentrant=True)
        """,
        # BatchNorm without running statistics
        """
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.bn = nn.BatchNorm2d(8, track_running_stats=False)

            def inner(self, x):
                return self.bn(x)

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=False)
        """,
        # LayerNorm and dropout are not side effects
        """
        import torch
        from torch import nn
        from torch.utils.checkpoint import checkpoint

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln = nn.LayerNorm(8)

            def inner(self, x):
                return self.ln(x)

            def forward(self, x):
                return checkpoint(self.inner, x, use_reentrant=False)
        """,
    )
    invalid = (
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            CACHE = {}

            def block(x):
                CACHE['last'] = x
                return x * 2

            y = checkpoint(block, x, use_reentrant=False)
            """,
            line=5,
        ),
        Invalid(
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
            line=6,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            STEP = 0

            def block(x):
                global STEP
                STEP = STEP + 1
                return x

            y = checkpoint(block, x, use_reentrant=False)
            """,
            line=6,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint

            def run(layers, x, aux):
                def exec_func(h):
                    for layer in layers:
                        h = layer(h)
                        aux.append(layer.aux_loss)
                    return h
                return checkpoint(exec_func, x, use_reentrant=False)
            """,
            line=7,
        ),
        Invalid(
            """
            import logging
            from torch.utils.checkpoint import checkpoint
            logger = logging.getLogger(__name__)

            def block(x):
                logger.info('block %s', x.shape)
                return x

            y = checkpoint(block, x, use_reentrant=False)
            """,
            line=6,
        ),
        Invalid(
            """
            import functools
            from torch.utils.checkpoint import checkpoint

            def block(x, scale):
                print(scale)
                return x * scale

            y = checkpoint(functools.partial(block, scale=2), x, use_reentrant=False)
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            from torch.utils.checkpoint import checkpoint

            def block(x):
                torch.manual_seed(0)
                return torch.nn.functional.dropout(x)

            y = checkpoint(block, x, use_reentrant=False)
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            from torch import nn
            from torch.utils.checkpoint import checkpoint

            class M(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.bn = nn.BatchNorm2d(8)

                def inner(self, x):
                    return self.bn(x)

                def forward(self, x):
                    return checkpoint(self.inner, x, use_reentrant=False)
            """,
            line=11,
        ),
        Invalid(
            """
            import torch
            from torch.utils.checkpoint import checkpoint

            class M(torch.nn.Module):
                def inner(self, x):
                    self.ema.mul_(0.9).add_(x.detach().mean())
                    return x

                def forward(self, x):
                    return checkpoint(self.inner, x, use_reentrant=False)
            """,
            line=6,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            TRACE = []

            def helper(x):
                TRACE.append(x)
                return x

            def block(x):
                return helper(x) * 2

            y = checkpoint(block, x, use_reentrant=False)
            """,
            line=5,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint
            SEEN = []
            y = checkpoint(lambda t: SEEN.append(t) or t, x, use_reentrant=False)
            """,
            line=3,
        ),
        Invalid(
            """
            from torch.utils.checkpoint import checkpoint

            def create_custom_forward(module, out):
                def custom_forward(*inputs):
                    out.extend(inputs)
                    return module(*inputs)
                return custom_forward

            h = checkpoint(create_custom_forward(layer, outs), h, use_reentrant=False)
            """,
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        yield from self._in_this_file(model)
        yield from self._closed_over_batchnorm(model)
        if model.project is not None:
            yield from self._in_other_files(model)

    def _in_other_files(self, model: FileModel) -> Iterator[Diagnostic]:
        """A module built from a class of another project file, checkpointed here, whose forward has
        a side effect there: reported here, where the checkpoint call can change, with the effect as
        a related location in the other file."""
        for site, call in [*checkpoint_calls(model), *_stored_partial_calls(model)]:
            args = factory_arguments(model, site)
            if not args and resolve_checkpoint_target(model, site) is not None:
                continue
            if not args:
                args = positional(call)
                if model.qualname(call.func, site.scope) == "functools.partial":
                    args = args[1:]
            fact, effects = None, []
            for fact in _layer_classes(model, args[0], site.scope) if args else ():
                effects = class_side_effects(model, fact)
                if effects:
                    break
            if fact is not None and effects:
                first = effects[0]
                yield Diagnostic(
                    call,
                    f"`{model.code(args[0])}` is a `{fact.name}`, whose forward runs under checkpoint() "
                    f"here: {first.what} ({first.path}, line {first.line}), and recomputation during "
                    "backward repeats it; checkpoint a part without the side effect, or move the effect out.",
                    elsewhere=tuple(e.related(CheckpointSideEffect.EFFECT) for e in effects),
                )
            elif fact is None and args and _unknown_layer(model, args[0], site.scope):
                yield from self._layer_built_by_name(model, call, args[0])

    @staticmethod
    def _closed_over_batchnorm(model: FileModel) -> Iterator[Diagnostic]:
        """``checkpoint(make_forward(self.bn), x)``: a factory of this file returns a closure that
        runs the BatchNorm layer it is given."""
        for site, call in checkpoint_calls(model):
            for module in factory_arguments(model, site):
                made = [
                    v for v, callee in model.call_values(module, site.scope) if callee in BATCHNORM_CLASSES
                ]
                if made and not _stats_off(made):
                    yield Diagnostic(
                        call,
                        f"`{model.code(module)}` is a BatchNorm layer that the checkpointed closure runs: its "
                        "running statistics update again when backward recomputes it; keep the BatchNorm "
                        "out of the checkpointed part.",
                        related=(
                            (made[0], "the BatchNorm layer is built here", CheckpointSideEffect.EFFECT),
                        ),
                    )
                    break

    @staticmethod
    def _layer_built_by_name(
        model: FileModel, call: cst.Call, layer: cst.BaseExpression
    ) -> Iterator[Diagnostic]:
        """The checkpointed module is a parameter or a loop variable, and the file builds its layers
        from names (``globals()[name]``): any class the builder names may be checkpointed here."""
        for fact in classes_built_by_name(model):
            effects = class_side_effects(model, fact)
            if effects:
                first = effects[0]
                yield Diagnostic(
                    call,
                    f"`{model.code(layer)}` is a layer this file builds by name (`globals()[...]`), such as "
                    f"`{fact.name}`, whose forward runs under checkpoint() here: {first.what} "
                    f"({first.path}, line {first.line}), and recomputation during backward repeats it; "
                    "checkpoint only layers without such effects.",
                    elsewhere=tuple(e.related(CheckpointSideEffect.EFFECT) for e in effects),
                )
                return

    def _in_this_file(self, model: FileModel) -> Iterator[Diagnostic]:
        reported: set[int] = set()
        for site, call, target in checkpoint_sites(model):
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
                    related = [(call, "checkpointed here", CheckpointSideEffect.CHECKPOINT)]
                    if via_site is not None:
                        related.append((via_site.node, "called from the checkpointed function here"))
                    yield Diagnostic(
                        node,
                        f"This {what}, inside `{name}` which runs under checkpoint() at line {line}: "
                        "recomputation during backward repeats it; move it out of the checkpointed function.",
                        related=tuple(related),
                    )


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


GRAD_ENABLED = frozenset({"torch.is_grad_enabled"})


def _stored_partial_calls(model: FileModel) -> Iterator[tuple[Site, cst.Call]]:
    """Calls of a ``functools.partial(checkpoint, ...)`` kept under a name or on ``self`` and called
    later with the module (``self.ckpt = partial(checkpoint, use_reentrant=False)``, ``self.ckpt(m, x)``)."""
    partials = {id(call) for _site, call in checkpoint_calls(model) if len(positional(call)) == 1}
    if not partials:
        return
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if dotted(call.func) is not None and any(
            id(v) in partials for v in model.values_of(call.func, site.scope)
        ):
            yield site, call


def _layer_classes(model: FileModel, expr: cst.BaseExpression, scope: Scope, depth: int = 0) -> list[Fact]:
    """The classes of other project files whose instance the checkpointed ``expr`` may hold: one built
    here (``self.block = Block()``), the elements of the container a loop variable walks
    (``for blk in self.blocks`` with ``nn.ModuleList([Block() ...])``), or, for a parameter, what
    the file's calls of its function pass."""
    fact = constructed_class(model, expr, scope)
    if fact is not None or not isinstance(expr, cst.Name) or depth > 1:
        return [fact] if fact is not None else []
    binding = model.lookup(expr.value, scope)
    out: list[Fact] = []
    if binding is not None and binding.kind == "other" and isinstance(binding.node, cst.For):
        source = binding.node.iter
        for value in [source, *model.values_of(source, scope)]:
            for node in walk(value):
                if (
                    isinstance(node, cst.Call)
                    and (inner := constructed_class(model, node, scope)) is not None
                ):
                    out.append(inner)
    elif binding is not None and binding.kind == "param" and isinstance(scope.node, cst.FunctionDef):
        function = scope.node
        names = [p.name.value for p in (*function.params.posonly_params, *function.params.params)]
        if scope.parent is not None and scope.parent.kind == "class" and names[:1] == ["self"]:
            names = names[1:]
        index = names.index(expr.value) if expr.value in names else -1
        for site in model.calls:
            if index < 0 or model.local_callee(site) is not function:
                continue
            passed = positional(site.node)  # type: ignore[arg-type]
            if index < len(passed):
                out += _layer_classes(model, passed[index], site.scope, depth + 1)
    return out


def _unknown_layer(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
    """A name whose module is not known here: a parameter of the function or a loop variable."""
    if not isinstance(expr, cst.Name):
        return False
    binding = model.lookup(expr.value, scope)
    if binding is None:
        return False
    return binding.kind == "param" or (binding.kind == "other" and isinstance(binding.node, cst.For))


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
        if what is None and any(c in BATCHNORM_CLASSES for c in self_attr_callee(model, call, scope)):
            if not _stats_off([v for v in model.values_of(call.func, scope) if isinstance(v, cst.Call)]):
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


def _stats_off(batchnorms: list[cst.Call]) -> bool:
    """A BatchNorm built with ``track_running_stats=False``: no running statistics to update."""
    return any(
        (kw := keyword(v, "track_running_stats")) is not None
        and isinstance(kw.value, cst.Name)
        and kw.value.value == "False"
        for v in batchnorms
    )


def _is_reentrant(call: cst.Call, model: FileModel, site: Site) -> bool:
    arg = keyword(call, "use_reentrant")
    if arg is None:
        return not has_star_kwargs(call)
    return constant_value(model, arg.value, site) is not False
