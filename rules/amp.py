"""TL1xx: mixed precision and loss scaling (``torch.amp.GradScaler``, autocast, 16-bit storage)."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.events import Event, Training, first_arg, grad_disabled_function, in_grad_disabled_block
from trainlint.model import (
    LINE_BREAK,
    FileModel,
    Frame,
    Scope,
    Site,
    attr_name,
    dotted,
    exclusive,
    keyword,
    positional,
    receiver,
    walk,
    walk_scope,
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
    method_call_pattern,
)

# ----------------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------------


def line_of(model: FileModel, node: cst.CSTNode) -> int:
    return model.position(node).start.line


def indentation(model: FileModel, statement: cst.CSTNode) -> str | None:
    """The whitespace before ``statement`` on its first line, or None if it does not start a line."""
    pos = model.position(statement)
    lines = model.source.splitlines()
    if pos.start.line - 1 >= len(lines):
        return None
    prefix = lines[pos.start.line - 1][: pos.start.column]
    return prefix if prefix.strip() == "" else None


def source_text(model: FileModel, node: cst.CSTNode) -> str:
    """The exact source text of ``node``'s range (without leading lines or a trailing comment)."""
    pos = model.position(node)
    lines = model.source.splitlines(keepends=True)
    if pos.start.line == pos.end.line:
        return lines[pos.start.line - 1][pos.start.column : pos.end.column]
    first = lines[pos.start.line - 1][pos.start.column :]
    middle = lines[pos.start.line : pos.end.line - 1]
    last = lines[pos.end.line - 1][: pos.end.column]
    return first + "".join(middle) + last


def block_of(root: cst.CSTNode, statement: cst.CSTNode) -> cst.CSTNode | None:
    """The block (indented block or module) whose body lists ``statement`` directly."""
    for node in walk(root):
        if isinstance(node, cst.IndentedBlock | cst.Module) and any(s is statement for s in node.body):
            return node
    return None


def whole_lines(model: FileModel, node: cst.CSTNode) -> list[str]:
    """The physical lines ``node`` spans, trailing comment included, without their line breaks."""
    pos = model.position(node)
    return model.lines[pos.start.line - 1 : pos.end.line]


def ends_file(model: FileModel, node: cst.CSTNode) -> bool:
    """``node`` sits on the file's last line and that line has no line break."""
    return model.position(node).end.line == len(model.lines) and model.lines[-1] != ""


def line_indent(model: FileModel, node: cst.CSTNode) -> str | None:
    """The whitespace before ``node`` on its first line, or None when something else precedes it."""
    prefix = whole_lines(model, node)[0][: model.position(node).start.column]
    return prefix if prefix.strip(" \t\f") == "" else None


def reindented(model: FileModel, statement: cst.CSTNode, indent: str) -> str | None:
    """The whole lines of ``statement`` (trailing comment included), each line that starts with the
    statement's own indentation moved to ``indent``, each ending in a newline: the content of a
    ``delete_lines`` edit that puts the statement somewhere else. None when the statement does not
    start its line or a string literal spans lines (re-indenting would change the string)."""
    own = line_indent(model, statement)
    if own is None:
        return None
    for node in walk(statement):
        if isinstance(node, cst.SimpleString | cst.FormattedString) and LINE_BREAK.search(model.code(node)):
            return None
    lines = whole_lines(model, statement)
    return "".join((indent + line[len(own) :] if line.startswith(own) else line) + "\n" for line in lines)


def loop_frames(frames: tuple[Frame, ...]) -> list[int]:
    return [id(f.node) for f in frames if f.kind == "loop"]


def if_frames(frames: tuple[Frame, ...]) -> set[tuple[int, str]]:
    return {(id(f.node), f.branch) for f in frames if f.kind == "if"}


def runs_with(inner: Site, outer: Site) -> bool:
    """Each run of ``inner`` is followed by ``outer`` in the same iteration: same loops, and every
    condition around ``outer`` also holds around ``inner``."""
    return loop_frames(inner.frames) == loop_frames(outer.frames) and if_frames(outer.frames) <= if_frames(
        inner.frames
    )


def related_callees(model: FileModel, site: Site) -> list[cst.FunctionDef]:
    """The file's own function or method a call site calls (``helper()``, ``self.helper()``)."""
    call = site.node
    assert isinstance(call, cst.Call)
    func = call.func
    if isinstance(func, cst.Name):
        found = model.definition(func.value, site.scope)
        return [found] if isinstance(found, cst.FunctionDef) else []
    if isinstance(func, cst.Attribute) and dotted(func.value) == "self":
        cls = site.scope.enclosing_class
        if cls is not None:
            found = model.method(cls, func.attr.value)
            return [found] if found is not None else []
    return []


def helper_does(model: FileModel, training: Training, site: Site, kind: str) -> bool:
    """Whether a call of the file's own function/method runs an event of ``kind`` (one level deep)."""
    for fn in related_callees(model, site):
        scope = model.scope_for(fn)
        if scope is not None and training.events_in(scope, kind):
            return True
    return False


def optimizer_text(step: Event) -> str | None:
    """``opt`` in ``scaler.step(opt)``, when it is a plain name or attribute chain."""
    arg = first_arg(step.call, "optimizer")
    return dotted(arg) if arg is not None else None


# ----------------------------------------------------------------------------------------------------
# TL101 clip-before-unscale
# ----------------------------------------------------------------------------------------------------


class ClipBeforeUnscale(Rule):
    id = "TL101"
    name = "clip-before-unscale"
    severity = Severity.ERROR
    probe = "tl101"
    summary = "Gradient clipping on gradients that are still multiplied by the GradScaler's loss scale."
    # Every finding needs a clip (`clip_grad` in the call or its import, `utils` of torch.nn.utils), a
    # scaled backward `x.scale(...).backward()` and the scaler's `x.step(...)`. A method call's name
    # always stands between `.` or whitespace and `(`, whitespace, `)`, `\` or `#`, however it is laid
    # out: the last groups ask that of each method (which skips `grad_scale`, `scaled`, prose).
    tokens = ("clip_grad",)
    requires = (
        ("utils",),
        ("backward",),
        ("scale",),
        ("step",),
        method_call_pattern("scale"),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `torch.nn.utils.clip_grad_norm_`, `clip_grad_value_` and `clip_grads_with_norm_` "
            "(under any import alias) when they run after a loss-scaled backward "
            "(`scaler.scale(loss).backward()` with a `torch.amp.GradScaler`) and before "
            "`scaler.step(...)`, with no `scaler.unscale_(optimizer)` earlier on that path. An "
            "`unscale_` that only comes after the clip is reported too. The scaler is recognised by "
            "its construction (`torch.amp.GradScaler`, `torch.cuda.amp.GradScaler`, `torch.GradScaler`, "
            "FSDP's `ShardedGradScaler`, whatever `enabled=` says), through `self.scaler` assigned "
            "anywhere in the class, or by use (a parameter called as `x.scale(loss).backward()` and "
            "`x.step(...)`). Helpers that unscale by themselves, such as Accelerate's "
            "`accelerator.clip_grad_norm_`, Lightning's `self.clip_gradients` or apex's "
            "`amp.scale_loss` context, are not reported."
        ),
        why=(
            "A GradScaler multiplies the loss by a large factor (65536 = 2^16 at the start) so that "
            "small fp16 gradients do not underflow; every gradient is multiplied by the same factor "
            "until `unscale_` divides it back out. Clipping in between compares the *scaled* gradients "
            "with your threshold. Say the true gradient norm is 3.0 and `max_norm=1.0`: the clip sees a "
            "norm of 3.0 * 65536 ≈ 196608, rescales by 1/196608, and after `scaler.step` unscales the "
            "gradient its norm is 1/65536 ≈ 0.000015 instead of 1.0. Every step is clipped, and the "
            "update is about 65536 times smaller than intended; the loss barely moves and nothing "
            "raises. With `clip_grad_value_(params, 0.5)` every scaled component above 0.5 (that is, "
            "every true component above 0.5/65536 ≈ 0.0000076) is cut, which also destroys the "
            "direction of the update."
        ),
        example=(
            "scaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        use_instead=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        fix_safety=(
            "The fix inserts `scaler.unscale_(optimizer)` (with the optimizer passed to `scaler.step`) "
            "just before the clip, in the same block, or moves a later `unscale_` there. It is safe: "
            "`scaler.step` skips its own unscaling when `unscale_` already ran, so the update is the "
            "one the author meant, and the inf/NaN check still happens. No fix is offered when the "
            "optimizer is not a plain name, when the clip could run more often than `scaler.step` "
            "(for example on every micro-step of an accumulation loop, where a second `unscale_` "
            "before `update()` would raise), or when several optimizers are stepped."
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-unscaled-gradients",
        ),
    )
    valid = (
        # PyTorch's recipe "Working with Unscaled Gradients"
        "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x, y in data:\n"
        "    optimizer.zero_grad()\n    with torch.autocast('cuda', dtype=torch.float16):\n"
        "        loss = loss_fn(model(x), y)\n    scaler.scale(loss).backward()\n"
        "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
        "    scaler.step(optimizer)\n    scaler.update()",
        # PyTorch's gradient accumulation recipe
        "import torch\nscaler = torch.cuda.amp.GradScaler()\nfor i, (x, y) in enumerate(data):\n"
        "    with torch.autocast('cuda'):\n        loss = loss_fn(model(x), y) / iters_to_accumulate\n"
        "    scaler.scale(loss).backward()\n    if (i + 1) % iters_to_accumulate == 0:\n"
        "        scaler.unscale_(optimizer)\n        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\n"
        "        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()",
        # the scaled backward is in the other branch
        "import torch\nscaler = torch.amp.GradScaler()\nif use_amp:\n    scaler.scale(loss).backward()\n"
        "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\n    scaler.step(opt)\n"
        "    scaler.update()\nelse:\n    loss.backward()\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\n"
        "    opt.step()",
        # Accelerate unscales inside its own clip helper
        "from accelerate import Accelerator\naccelerator = Accelerator(mixed_precision='fp16')\n"
        "accelerator.backward(loss)\naccelerator.clip_grad_norm_(model.parameters(), 1.0)\noptimizer.step()",
        # Lightning's helper
        "import torch\nclass M(LightningModule):\n    def configure_gradient_clipping(self, opt, clip_val, algo):\n"
        "        self.clip_gradients(opt, gradient_clip_val=clip_val, gradient_clip_algorithm=algo)",
        # apex unscales when the context exits
        "import torch\nfrom apex import amp\nwith amp.scale_loss(loss, optimizer) as scaled_loss:\n"
        "    scaled_loss.backward()\ntorch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)\n"
        "optimizer.step()",
        # a scaler-less fp32 loop
        "import torch\nloss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\noptimizer.step()",
        # timm's NativeScaler: unscale_ under the same condition as the clip
        "import torch\nclass NativeScaler:\n    def __init__(self):\n"
        "        self._scaler = torch.cuda.amp.GradScaler()\n"
        "    def __call__(self, loss, optimizer, clip_grad=None, parameters=None):\n"
        "        self._scaler.scale(loss).backward()\n        if clip_grad is not None:\n"
        "            self._scaler.unscale_(optimizer)\n"
        "            torch.nn.utils.clip_grad_norm_(parameters, clip_grad)\n"
        "        self._scaler.step(optimizer)\n        self._scaler.update()",
        # DummyGradScaler method definitions are not calls
        "import torch\nclass DummyGradScaler:\n    def scale(self, loss):\n        return loss\n"
        "    def unscale_(self, optimizer):\n        pass\n    def step(self, optimizer):\n"
        "        torch.nn.utils.clip_grad_norm_(params, 1.0)\n        optimizer.step()",
        # clip after the step belongs to another rule (TL108)
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(opt)\n"
        "scaler.update()\ntorch.nn.utils.clip_grad_norm_(params, 1.0)",
        # unscale_ done in the file's own helper method
        "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.amp.GradScaler()\n"
        "    def unscale(self):\n        self.scaler.unscale_(self.opt)\n    def train_step(self, loss):\n"
        "        self.scaler.scale(loss).backward()\n        self.unscale()\n"
        "        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"
        "        self.scaler.step(self.opt)\n        self.scaler.update()",
        # a user's own function called clip_grad_norm_
        "import torch\ndef clip_grad_norm_(params, m):\n    pass\nscaler = torch.amp.GradScaler()\n"
        "scaler.scale(loss).backward()\nclip_grad_norm_(params, 1.0)\nscaler.step(opt)\nscaler.update()",
    )
    invalid = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nscaler.step(opt)\nscaler.update()",
            line=4,
        ),
        # alias import, torch.cuda.amp scaler with enabled=
        Invalid(
            "from torch.cuda.amp import GradScaler\nfrom torch.nn.utils import clip_grad_norm_ as clip\n"
            "scaler = GradScaler(enabled=args.amp)\nfor x in data:\n    scaler.scale(loss).backward()\n"
            "    clip(model.parameters(), 1.0)\n    scaler.step(opt)\n    scaler.update()",
            line=6,
        ),
        # self.scaler assigned in __init__, used in another method (minGPT-ddp)
        Invalid(
            "import torch\nclass Trainer:\n    def __init__(self, cfg):\n"
            "        self.scaler = torch.amp.GradScaler(enabled=cfg.use_amp)\n"
            "    def run_batch(self, loss):\n        if self.cfg.use_amp:\n"
            "            self.scaler.scale(loss).backward()\n"
            "            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"
            "            self.scaler.step(self.optimizer)\n            self.scaler.update()\n"
            "        else:\n            loss.backward()\n"
            "            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)\n"
            "            self.optimizer.step()",
            line=8,
        ),
        # the clip is inside `if max_norm:`
        Invalid(
            "import torch\nscaler = torch.GradScaler()\nscaler.scale(loss).backward()\nif max_norm:\n"
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)\nscaler.step(opt)\nscaler.update()",
            line=5,
        ),
        # unscale_ comes after the clip
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\nscaler.unscale_(opt)\n"
            "scaler.step(opt)\nscaler.update()",
            line=4,
        ),
        # the scaler is a parameter, recognised by its use
        Invalid(
            "import torch.nn as nn\ndef train_step(model, opt, scaler, loss):\n    scaler.scale(loss).backward()\n"
            "    nn.utils.clip_grad_value_(model.parameters(), 0.5)\n    scaler.step(opt)\n    scaler.update()",
            line=4,
        ),
        # unscale_ in the other branch of an if/else does not cover the clip
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nif log_grads:\n"
            "    scaler.unscale_(opt)\nelse:\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\n"
            "scaler.step(opt)\nscaler.update()",
            line=7,
        ),
        # accumulation: clip on every micro-step, step under the condition
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor i, batch in enumerate(loader):\n"
            "    scaler.scale(model(batch)).backward()\n"
            "    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "    if (i + 1) % accum == 0:\n        scaler.step(opt)\n        scaler.update()",
            line=5,
        ),
        # scaler built as `GradScaler() if amp else None`; the clip runs after either backward
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler() if amp else None\nif scaler is not None:\n"
            "    scaler.scale(loss).backward()\nelse:\n    loss.backward()\n"
            "torch.nn.utils.clip_grad_norm_(params, 1.0)\nif scaler is not None:\n    scaler.step(opt)\n"
            "    scaler.update()",
            line=7,
        ),
        # module path torch.nn.utils.clip_grad
        Invalid(
            "import torch\nfrom torch.nn.utils.clip_grad import clip_grad_norm_\n"
            "scaler = torch.amp.GradScaler('cuda')\nscaler.scale(loss).backward()\n"
            "total = clip_grad_norm_(params, 1.0)\nscaler.step(opt)\nscaler.update()",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for clip in training.of_kind("clip"):
            yield from self._check_clip(model, training, clip)

    def _check_clip(self, model: FileModel, training: Training, clip: Event) -> Iterator[Diagnostic]:
        site = clip.site
        events = training.events_in(site.scope, "scaled_backward", "unscale", "scaler_step", "clip")

        def on_path(e: Event) -> bool:
            return not exclusive(e.site.frames, site.frames)

        steps = [e for e in events if e.kind == "scaler_step" and on_path(e)]
        later_steps = [e for e in steps if e.order > clip.order]
        if not later_steps:
            return
        backwards = [e for e in events if e.kind == "scaled_backward" and e.order < clip.order and on_path(e)]
        if backwards:
            backward = backwards[-1]
            window_start = backward.order
        else:
            # The scaled backward may sit in another method of the same trainer class.
            found = self._backward_elsewhere(model, training, site, later_steps)
            if found is None:
                return
            backward, window_start = found, -1
        if any(window_start < e.order < clip.order for e in steps):
            return  # the clip follows a step: not this rule's concern
        unscales = [e for e in events if e.kind == "unscale" and on_path(e)]
        # only an unscale_ after the scaled backward counts: one before it leaves these gradients scaled
        if any(window_start < e.order < clip.order for e in unscales):
            return
        if any(
            window_start < other.order < clip.order and helper_does(model, training, other, "unscale")
            for other in model.calls_in(site.scope)
            if not exclusive(other.frames, site.frames)
        ):
            return
        step = later_steps[0]
        later_unscales = [e for e in unscales if clip.order < e.order < step.order]
        # Only the first clip of a window gets the fix: a second inserted unscale_ would raise.
        first_clip = not any(
            e.kind == "clip" and on_path(e) and window_start < e.order < clip.order for e in events
        )
        scaler = step.key or backward.key or "scaler"
        clip_name = attr_name(clip.call) or "clip"
        related = ((backward.call, "scaled backward here"),)
        if later_unscales:
            moved = later_unscales[0]
            message = (
                f"`{clip_name}` runs before `{scaler}.unscale_(...)` on line {line_of(model, moved.call)}, "
                "so it clips gradients still multiplied by the loss scale; move the `unscale_` call "
                "before the clip."
            )
            fix = self._move_fix(model, site, moved)
        else:
            optimizer = optimizer_text(step)
            message = (
                f"`{clip_name}` runs on gradients still multiplied by the GradScaler's loss scale, so "
                f"the threshold is compared with scaled values; call "
                f"`{scaler}.unscale_({optimizer or 'optimizer'})` before clipping."
            )
            fix = self._insert_fix(model, site, later_steps, scaler, optimizer) if first_clip else None
        yield Diagnostic(clip.call, message, related=related, fix=fix)

    @staticmethod
    def _backward_elsewhere(
        model: FileModel, training: Training, site: Site, steps: list[Event]
    ) -> Event | None:
        """A scaled backward on the same scaler in another method of the class (``self.scaler``) or
        another function (a module-level scaler), when that scaler is never unscaled anywhere."""
        keys = {e.key for e in steps if e.key}
        if len(keys) != 1:
            return None
        (key,) = keys
        if any(e.key == key for e in training.of_kind("unscale")):
            return None
        head = key.split(".")[0]
        cls = site.scope.enclosing_class
        for event in training.of_kind("scaled_backward"):
            if event.key != key or event.site.scope is site.scope:
                continue
            if head == "self":
                if cls is not None and event.site.scope.enclosing_class is cls:
                    return event
                continue
            here = model.lookup(head, site.scope)
            there = model.lookup(head, event.site.scope)
            if here is not None and here is there and here.kind != "param":
                return event
        return None

    @staticmethod
    def _insertion_point(model: FileModel, site: Site) -> tuple[cst.CSTNode, str] | None:
        statement = site.statement
        if not isinstance(statement, cst.SimpleStatementLine) and any(
            f.node is statement for f in site.frames
        ):
            return None  # `if x: clip(...)` on one line: an insertion before it would be unconditional
        if isinstance(statement, cst.SimpleStatementLine) and not any(
            node is site.node for node in walk(statement.body[0])
        ):
            return (
                None  # `backward(); clip(...)` on one line: inserting before the line precedes the backward
            )
        indent = indentation(model, statement)
        if indent is None:
            return None
        return statement, indent

    def _insert_fix(
        self, model: FileModel, site: Site, steps: list[Event], scaler: str, optimizer: str | None
    ) -> FixSpec | None:
        if optimizer is None or {optimizer_text(s) for s in steps} != {optimizer}:
            return None
        if not all(runs_with(site, s.site) for s in steps[:1]):
            return None
        point = self._insertion_point(model, site)
        if point is None:
            return None
        statement, indent = point
        return FixSpec(
            Applicability.SAFE,
            f"Insert `{scaler}.unscale_({optimizer})` before the clip",
            (TextEditSpec(statement, "before", f"{scaler}.unscale_({optimizer})\n{indent}"),),
        )

    def _move_fix(self, model: FileModel, site: Site, moved: Event) -> FixSpec | None:
        """Swap the clip with an ``unscale_`` statement that directly follows it in the same block."""
        statement = moved.site.statement
        clip_statement = site.statement
        if not (
            isinstance(statement, cst.SimpleStatementLine)
            and isinstance(clip_statement, cst.SimpleStatementLine)
            and len(statement.body) == 1
            and isinstance(statement.body[0], cst.Expr)
            and statement.body[0].value is moved.call
        ):
            return None
        block = block_of(site.scope.node, clip_statement)
        if block is None:
            return None
        body = list(block.body)
        index = next(i for i, s in enumerate(body) if s is clip_statement)
        if index + 1 >= len(body) or body[index + 1] is not statement:
            return None
        return FixSpec(
            Applicability.SAFE,
            "Move the `unscale_` call before the clip",
            (
                TextEditSpec(clip_statement, "replace", source_text(model, statement)),
                TextEditSpec(statement, "replace", source_text(model, clip_statement)),
            ),
        )


# ----------------------------------------------------------------------------------------------------
# TL105 half-instead-of-autocast
# ----------------------------------------------------------------------------------------------------

# Module methods that return the module itself, so a chain of them still denotes the module.
MODULE_CHAIN = frozenset({"cuda", "to", "half", "bfloat16", "cpu", "train", "requires_grad_", "xpu", "mps"})
# Wrappers whose ``.parameters()`` are the wrapped module's own parameters.
PARAMETER_SHARING_WRAPPERS = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "torch.nn.DataParallel",
        "torch.nn.parallel.DataParallel",
        "torch.compile",
    }
)
# Whatever keeps fp32 master weights for a 16-bit model (matched on the last component, since these
# are often vendored copies): apex, DeepSpeed, Megatron, MS-AMP.
MASTER_WEIGHT_CALLS = frozenset(
    {"FP16_Optimizer", "Float16OptimizerWithFloat16Params", "MixedPrecisionOptimizer", "FP16_Module"}
)
MASTER_WEIGHT_INITIALIZERS = ("apex.amp.initialize", "deepspeed.initialize", "msamp.initialize")
PARAM_CONTAINERS = frozenset(
    {
        "builtins.list",
        "builtins.tuple",
        "builtins.filter",
        "builtins.sorted",
        "itertools.chain",
        "builtins.iter",
    }
)


def dtype_label(model: FileModel, training: Training, call: cst.Call, scope: Scope) -> str:
    name = attr_name(call)
    if name == "half":
        return "fp16"
    if name == "bfloat16":
        return "bf16"
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value == "dtype":
            text = model.qualname(arg.value, scope) or ""
            values = model.values_of(arg.value, scope) if isinstance(arg.value, cst.Name) else []
            texts = [text, *(model.qualname(v, scope) or "" for v in values)]
            if any(t.endswith("bfloat16") for t in texts):
                return "bf16"
            if any(t.endswith(("float16", ".half")) for t in texts):
                return "fp16"
    return "16-bit"


def chain_contains(expr: cst.BaseExpression, target: cst.Call) -> bool | None:
    """Whether ``target`` is a link of the module-method chain ``expr`` (``Net().cuda().half()``).

    None when the chain converts back to full precision (``.float()``) or to eval after ``target``.
    """
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        if expr is target:
            return True
        name = expr.func.attr.value
        if name in ("float", "double", "eval"):
            return None
        if name not in MODULE_CHAIN:
            return False
        expr = expr.func.value
    return False


def chain_root(expr: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        expr = expr.func.value
    return expr


def converted_module(conversion: Event) -> str | None:
    """The dotted name that holds the converted module: the assignment target of the chain, or the
    receiver of a conversion written as a statement (tensors' ``.half()`` is not in place, so a bare
    statement only makes sense for a module)."""
    statement = conversion.site.statement
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    call = conversion.call
    if isinstance(small, cst.Expr):
        if chain_contains(small.value, call):
            return dotted(chain_root(small.value))
        return None
    if isinstance(small, cst.Assign) and len(small.targets) == 1:
        value, target = small.value, small.targets[0].target
    elif isinstance(small, cst.AnnAssign) and small.value is not None:
        value, target = small.value, small.target
    else:
        return None
    if chain_contains(value, call):
        return dotted(target)
    return None


def master_weight_machinery(model: FileModel) -> bool:
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        callee = model.callee(site) or dotted(call.func) or ""
        if callee.rsplit(".", 1)[-1] in MASTER_WEIGHT_CALLS:
            return True
        if callee.startswith(MASTER_WEIGHT_INITIALIZERS):
            return True
    return False


def yields_parameters(model: FileModel, expr: cst.CSTNode, key: str, scope: Scope, depth: int = 0) -> bool:
    """Whether ``expr`` evaluates to ``key``'s own parameter objects (not copies of them): directly,
    in param groups, filtered comprehensions, ``list``/``filter``/``chain``, or through local names."""
    if depth > 4:
        return False
    if isinstance(expr, cst.Call):
        name = attr_name(expr)
        if name in ("parameters", "named_parameters") and dotted(receiver(expr)) == key:
            return True
        if model.qualname(expr.func, scope) in PARAM_CONTAINERS:
            return any(yields_parameters(model, a.value, key, scope, depth + 1) for a in expr.args)
        return False
    if isinstance(expr, cst.List | cst.Tuple | cst.Set):
        return any(yields_parameters(model, e.value, key, scope, depth + 1) for e in expr.elements)
    if isinstance(expr, cst.Dict):
        return any(
            isinstance(e, cst.DictElement) and yields_parameters(model, e.value, key, scope, depth + 1)
            for e in expr.elements
        )
    if isinstance(expr, cst.ListComp | cst.GeneratorExp | cst.SetComp):
        if not isinstance(expr.elt, cst.Name):
            return False  # `p.detach().clone().float()`: a copy, e.g. hand-written fp32 master weights
        comp: cst.CompFor | None = expr.for_in
        while comp is not None:
            if yields_parameters(model, comp.iter, key, scope, depth + 1):
                return True
            comp = comp.inner_for_in
        return False
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, cst.Add):
        return yields_parameters(model, expr.left, key, scope, depth + 1) or yields_parameters(
            model, expr.right, key, scope, depth + 1
        )
    if isinstance(expr, cst.Name):
        return any(yields_parameters(model, v, key, scope, depth + 1) for v in model.values_of(expr, scope))
    return False


def inference_context(model: FileModel, site: Site) -> bool:
    """Under ``no_grad``/``inference_mode``: a ``with`` block, or a decorated function around the site."""
    if in_grad_disabled_block(model, site):
        return True
    scope: Scope | None = site.scope
    while scope is not None and scope.kind == "function":
        node = scope.node
        assert isinstance(node, cst.FunctionDef)
        if grad_disabled_function(model, node, scope.parent or scope):
            return True
        scope = scope.parent
    return False


class HalfInsteadOfAutocast(Rule):
    id = "TL105"
    name = "half-instead-of-autocast"
    severity = Severity.ERROR
    probe = "tl105"
    summary = (
        "A model converted to fp16/bf16 storage is then trained by an optimizer without fp32 master weights."
    )
    # Every finding needs a 16-bit conversion, an optimizer built from a class whose path has one of
    # the second group's names (`torch.optim.*`, `deepspeed.ops.adam.*`, `transformers.AdamW`...) and
    # its params reached through a `x.parameters()`/`x.named_parameters()` call (``method_call_pattern``).
    tokens = ("half", "bfloat16", "float16")
    requires = (
        ("parameters",),
        ("optim", "adam", "lamb", "AdamW", "Adafactor", "lion_pytorch"),
        method_call_pattern("parameters", "named_parameters"),
    )
    doc = RuleDoc(
        what=(
            "Reports a module converted to 16-bit storage (`model.half()`, `model.bfloat16()`, "
            "`model.to(torch.float16)`, `model.to(device, dtype=torch.bfloat16)`, chained as in "
            "`Net().cuda().half()`) whose parameters are then given to an optimizer (`torch.optim.*`, "
            "bitsandbytes, apex, `transformers.AdamW`, ...) in the same function, in the module's "
            "script code, or through `self.model` in the same class. Not reported: inference "
            "(no optimizer gets those parameters, `eval()`, `torch.no_grad()`/`inference_mode()`), "
            "tensors such as inputs and labels, a frozen 16-bit backbone whose trainable part stays "
            "fp32, optimizers that keep fp32 master weights (apex `FP16_Optimizer`, `amp.initialize`, "
            "`deepspeed.initialize`, Megatron's Float16 optimizer) and hand-written fp32 master copies."
        ),
        why=(
            "The optimizer adds each update to the 16-bit parameter, and the sum is rounded to 16 bits. "
            "bf16 keeps 8 significant bits, so just below 1.0 the representable numbers are 2^-8 ≈ "
            "0.0039 apart (and 2^-7 ≈ 0.0078 apart just above 1.0): a weight of 1.0 that receives an "
            "update of -0.001 (learning rate 1e-3 times a gradient of 1) becomes 0.999, which rounds "
            "back to 1.0. The update is lost, every step, for every weight whose update is small "
            "relative to its size; training stalls while the loss curve only flattens. fp16 has 11 "
            "significant bits (spacing 2^-11 ≈ 0.00049 just below 1.0), so an update of 1e-4 on a "
            "weight near 1 vanishes the same way, and Adam's epsilon (1e-8) is zero in fp16. On top of "
            "that, `GradScaler.unscale_` refuses fp16 gradients and raises `Attempting to unscale "
            "FP16 gradients`. Automatic mixed precision keeps the parameters and the optimizer state "
            "in fp32 and only runs the forward pass in 16 bits."
        ),
        example=(
            "model = Net().cuda().half()\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "loss = loss_fn(model(x.half()), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        use_instead=(
            "model = Net().cuda()\n"
            "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        references=(
            "https://pytorch.org/docs/stable/amp.html",
            "https://pytorch.org/docs/stable/notes/amp_examples.html",
        ),
    )
    valid = (
        # inference only: no optimizer
        "import torch\nmodel = Net().cuda().half()\nmodel.eval()\nwith torch.no_grad():\n    out = model(x.half())",
        # tensors, not modules
        "import torch\nmodel = Net().cuda()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "images = batch['image'].half()\nlabels = labels.to(torch.float16)\nloss = model(images)",
        # autocast, the right way
        "import torch\nmodel = Net().cuda()\nopt = torch.optim.AdamW(model.parameters())\n"
        "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)",
        # a frozen half backbone, trainable head in fp32
        "import torch\nbackbone = Backbone().cuda().half()\nbackbone.requires_grad_(False)\n"
        "head = torch.nn.Linear(512, 10).cuda()\nopt = torch.optim.SGD(head.parameters(), lr=0.1)",
        # apex FP16_Optimizer keeps fp32 master weights
        "import torch\nfrom apex.fp16_utils import FP16_Optimizer\nmodel = Net().cuda().half()\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\nopt = FP16_Optimizer(opt, static_loss_scale=128.0)",
        # DeepSpeed owns the precision
        "import torch, deepspeed\nmodel = model.half()\nopt = torch.optim.AdamW(model.parameters())\n"
        "engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)",
        # a hand-written fp32 master copy with manual loss scaling
        "import torch\nmodel = Net().cuda().half()\n"
        "master = [p.detach().clone().float() for p in model.parameters()]\n"
        "for p in master:\n    p.requires_grad = True\nopt = torch.optim.SGD(master, lr=0.1)\n"
        "(loss * 128.0).backward()",
        # the model is rebound by something else before the optimizer sees it
        "import torch\nfrom peft import get_peft_model\nmodel = base.to(torch.bfloat16)\n"
        "model = get_peft_model(model, config)\nopt = torch.optim.AdamW(model.parameters())",
        # converted after training, for export
        "import torch\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\ntrain(model, opt)\n"
        "model.half()\ntorch.save(model.state_dict(), 'fp16.pt')",
        # converted back to fp32 in the chain
        "import torch\nmodel = Net().half().float()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)",
        # a dtype that is not known to be 16-bit
        "import torch\ndtype = torch.float16 if args.fp16 else torch.float32\nmodel = model.to(dtype=dtype)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        # a method that converts for inference
        "import torch\nclass Runner:\n    def __init__(self):\n        self.model = Net()\n"
        "        self.opt = torch.optim.AdamW(self.model.parameters())\n    @torch.no_grad()\n"
        "    def export(self):\n        self.model.half()\n        return self.model.state_dict()",
    )
    invalid = (
        Invalid(
            "import torch\nmodel = Net().cuda().half()\nopt = torch.optim.AdamW(model.parameters())", line=2
        ),
        Invalid("import torch\nmodel.bfloat16()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)", line=2),
        Invalid(
            "import torch\nmodel = model.to(device, dtype=torch.bfloat16)\n"
            "opt = torch.optim.AdamW(model.parameters(), lr=1e-4)",
            line=2,
        ),
        Invalid(
            "import torch\nfrom torch import optim\nDTYPE = torch.float16\nmodel.to(DTYPE)\n"
            "opt = optim.Adam(model.parameters())",
            line=4,
        ),
        # self.model in a class, optimizer in another method
        Invalid(
            "import torch\nclass Trainer:\n    def __init__(self, net):\n        self.model = net.cuda().half()\n"
            "    def configure_optimizers(self):\n        return torch.optim.AdamW(self.model.parameters(), lr=1e-4)",
            line=4,
        ),
        # param groups through a name, bitsandbytes optimizer
        Invalid(
            "import torch\nimport bitsandbytes as bnb\nmodel = model.half()\n"
            "groups = [{'params': [p for n, p in model.named_parameters() if 'bias' not in n]}]\n"
            "opt = bnb.optim.AdamW8bit(groups, lr=1e-4)",
            line=3,
        ),
        # wrapped in DDP after the conversion: same parameters
        Invalid(
            "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
            "def main():\n    model = Net().to(torch.half)\n    model = DDP(model)\n"
            "    opt = torch.optim.SGD(model.parameters(), lr=0.1)",
            line=4,
        ),
        # transformers' AdamW, filtered parameters
        Invalid(
            "import torch\nfrom transformers import AdamW\ndef train(model):\n    model.half()\n"
            "    opt = AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-5)",
            line=4,
        ),
        # module-level model, optimizer built inside a function
        Invalid(
            "import torch\nmodel = Net().bfloat16()\ndef train():\n"
            "    opt = torch.optim.SGD(model.parameters(), lr=0.1)",
            line=2,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        conversions = training.of_kind("conversion")
        if not conversions or master_weight_machinery(model):
            return
        optimizers = training.of_kind("optimizer")
        if not optimizers:
            return
        for conversion in conversions:
            key = converted_module(conversion)
            if key is None or inference_context(model, conversion.site):
                continue
            found = self._optimizer_for(model, training, conversion.site, key, optimizers)
            if found is None:
                found = self._optimizer_in_caller(model, training, conversion.site, key, optimizers)
            if found is None:
                continue
            label = dtype_label(model, training, conversion.call, conversion.site.scope)
            yield Diagnostic(
                conversion.call,
                f"`{key}` is converted to {label} and its parameters are then trained by the optimizer on "
                f"line {line_of(model, found.call)}: updates smaller than the {label} spacing round away. "
                "Keep the parameters in fp32 and run the forward pass under `torch.autocast(...)`.",
                related=((found.call, "optimizer over the 16-bit parameters here"),),
            )

    def _optimizer_for(
        self, model: FileModel, training: Training, site: Site, key: str, optimizers: list[Event]
    ) -> Event | None:
        """The first optimizer built after ``site`` over ``key``'s own parameters: in the same scope,
        in another method of the class for ``self.x``, or in a function for a module-level model."""
        scope = site.scope
        cls = scope.enclosing_class if key.startswith("self.") else None
        if self._frozen_or_inference(model, training, site, key):
            return None
        for opt in optimizers:
            opt_scope = opt.site.scope
            if opt_scope is scope:
                if opt.order < site.order or exclusive(opt.site.frames, site.frames):
                    continue
                if self._rebound(model, site, key, site.order, opt.order):
                    continue
            elif cls is not None:
                if opt_scope.enclosing_class is not cls or self._rebound_in_class(model, cls, site, key):
                    continue
            elif scope.kind == "module" and "." not in key and opt_scope.kind == "function":
                binding = model.lookup(key, opt_scope)
                if binding is None or key not in scope.bindings or binding is not scope.bindings[key][-1]:
                    continue
                if self._rebound(model, site, key, site.order, None):
                    continue
            else:
                continue
            params = first_arg(opt.call, "params")
            if params is not None and yields_parameters(model, params, key, opt_scope):
                return opt
        return None

    def _optimizer_in_caller(
        self, model: FileModel, training: Training, site: Site, key: str, optimizers: list[Event]
    ) -> Event | None:
        """A module converted in a builder function that returns it (``return model`` or ``return
        tokenizer, model``), trained by the caller: ``tokenizer, model = build(name)`` then an
        optimizer over ``model.parameters()`` in the calling function."""
        function = site.scope.node
        if site.scope.kind != "function" or not isinstance(function, cst.FunctionDef):
            return None
        positions = set()
        for node in walk_scope(function):
            if isinstance(node, cst.Return) and node.value is not None:
                if dotted(node.value) == key:
                    positions.add(None)
                elif isinstance(node.value, cst.Tuple):
                    for index, element in enumerate(node.value.elements):
                        if dotted(element.value) == key:
                            positions.add((index, len(node.value.elements)))
        if len(positions) != 1 or self._frozen_or_inference(model, training, site, key):
            return None
        if self._rebound(model, site, key, site.order, None):
            return None
        (position,) = positions
        wanted = f"<local>.{function.name.value}"
        for call_site in model.calls:
            if model.callee(call_site) != wanted or call_site.scope is site.scope:
                continue
            binding = model.lookup(function.name.value, call_site.scope)
            if binding is None or binding.node is not function:
                continue
            statement = call_site.statement
            if not (
                isinstance(statement, cst.SimpleStatementLine) and isinstance(statement.body[0], cst.Assign)
            ):
                continue
            assign = statement.body[0]
            if assign.value is not call_site.node or len(assign.targets) != 1:
                continue
            target = assign.targets[0].target
            if position is None:
                caller_key = dotted(target)
            elif isinstance(target, cst.Tuple) and len(target.elements) == position[1]:
                caller_key = dotted(target.elements[position[0]].value)
            else:
                caller_key = None
            if caller_key is None or inference_context(model, call_site):
                continue
            found = self._optimizer_for(model, training, call_site, caller_key, optimizers)
            if found is not None:
                return found
        return None

    @staticmethod
    def _frozen_or_inference(model: FileModel, training: Training, site: Site, key: str) -> bool:
        """In the conversion's scope: the module or a part of it frozen (``requires_grad_(False)``, a
        loop setting ``p.requires_grad = False``), a part of it put back in fp32 (``.float()``: a frozen
        16-bit backbone with an fp32 head), or ``key.eval()`` with no ``train()`` and no backward."""

        def covers(text: str | None) -> bool:
            return text is not None and (text == key or text.startswith(key + "."))

        names = set()
        for other in model.calls_in(site.scope):
            call = other.node
            assert isinstance(call, cst.Call)
            target = dotted(receiver(call))
            if not covers(target):
                continue
            name = attr_name(call)
            if name == "requires_grad_" and call.args and dotted(call.args[0].value) == "False":
                return True
            if name == "float" and other.order > site.order:
                return True
            if target == key:
                names.add(name)
        if "eval" in names and "train" not in names and not training.events_in(site.scope, "backward"):
            return True
        for assign in model.assigns:
            node = assign.node
            if assign.scope is not site.scope or not isinstance(node, cst.Assign):
                continue
            freezes = dotted(node.value) == "False" and any(
                isinstance(t.target, cst.Attribute) and t.target.attr.value == "requires_grad"
                for t in node.targets
            )
            if not freezes:
                continue
            for frame in assign.frames:
                if frame.kind == "loop" and isinstance(frame.node, cst.For):
                    for sub in walk(frame.node.iter):
                        if (
                            isinstance(sub, cst.Call)
                            and attr_name(sub) in ("parameters", "named_parameters")
                            and covers(dotted(receiver(sub)))
                        ):
                            return True
        return False

    @staticmethod
    def _safe_rebinding(model: FileModel, value: cst.BaseExpression, key: str, scope: Scope) -> bool:
        """``model = model.cuda()``, ``model = DDP(model)``: still the same parameter objects."""
        links = []
        expr = value
        while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
            links.append(expr.func.attr.value)
            expr = expr.func.value
        if links and dotted(expr) == key and all(name in MODULE_CHAIN for name in links):
            return True
        if isinstance(value, cst.Call) and model.qualname(value.func, scope) in PARAMETER_SHARING_WRAPPERS:
            args = positional(value)
            inner = args[0] if args else None
            if inner is None:
                arg = keyword(value, "module") or keyword(value, "model")
                inner = arg.value if arg is not None else None
            return inner is not None and dotted(inner) == key
        return False

    def _rebound(self, model: FileModel, site: Site, key: str, start: int, end: int | None) -> bool:
        for assign in model.assigns:
            if assign.scope is not site.scope or assign.order <= start:
                continue
            if end is not None and assign.order >= end:
                continue
            if assign.statement is site.statement:
                continue
            node = assign.node
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if any(dotted(t) == key for t in targets):
                if node.value is None or not self._safe_rebinding(model, node.value, key, site.scope):
                    return True
        return False

    def _rebound_in_class(self, model: FileModel, cls: Scope, site: Site, key: str) -> bool:
        """With the optimizer in another method, any assignment to ``self.x`` outside the conversion's
        method (order unknown) or after it in that method may replace the converted module."""
        for assign in model.assigns:
            if assign.scope.enclosing_class is not cls or assign.statement is site.statement:
                continue
            node = assign.node
            targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
            if not any(dotted(t) == key for t in targets):
                continue
            if assign.scope is site.scope and assign.order < site.order:
                continue
            if node.value is None or not self._safe_rebinding(model, node.value, key, assign.scope):
                return True
        return False


# ----------------------------------------------------------------------------------------------------
# Phase 2 helpers: autocast regions, deletion edits
# ----------------------------------------------------------------------------------------------------

AUTOCAST_FUNCTIONS = frozenset(
    {
        "torch.autocast",
        "torch.amp.autocast",
        "torch.amp.autocast_mode.autocast",
        "torch.cuda.amp.autocast",
        "torch.cuda.amp.autocast_mode.autocast",
        "torch.cpu.amp.autocast",
        "torch.cpu.amp.autocast_mode.autocast",
    }
)
# Frameworks that do the loss scaling themselves when asked for fp16.
SCALING_FRAMEWORKS = (
    "accelerate",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "deepspeed",
    "apex",
    "colossalai",
    "megatron",
    "msamp",
)
INFINITIES = frozenset({"math.inf", "torch.inf", "numpy.inf", "np.inf"})


def autocast_call(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> cst.Call | None:
    """The autocast constructor call ``expr`` is, directly or through a local name (``ctx =
    nullcontext() if cpu else torch.autocast(...)``: the autocast branch counts)."""
    options: list[cst.BaseExpression] = [expr]
    if isinstance(expr, cst.Name | cst.Attribute) and not isinstance(expr, cst.Call):
        options = list(model.values_of(expr, scope))
    for option in options:
        branches = [option.body, option.orelse] if isinstance(option, cst.IfExp) else [option]
        for branch in branches:
            if isinstance(branch, cst.Call) and model.qualname(branch.func, scope) in AUTOCAST_FUNCTIONS:
                return branch
    return None


def literal_false(arg: cst.Arg | None) -> bool:
    return arg is not None and isinstance(arg.value, cst.Name) and arg.value.value == "False"


def autocast_dtype(model: FileModel, call: cst.Call, scope: Scope) -> str | None:
    """``"fp16"``, ``"bf16"`` or None (unknown) for an autocast constructor call."""
    callee = model.qualname(call.func, scope) or ""
    training = model.training
    args = positional(call)
    dtype_arg = keyword(call, "dtype")
    dtype = dtype_arg.value if dtype_arg is not None else None
    if dtype is None and callee in ("torch.autocast", "torch.amp.autocast") and len(args) > 1:
        dtype = args[1]
    if dtype is not None:
        if not training.is_low_precision_dtype(dtype, scope):
            return None
        texts = [model.qualname(dtype, scope) or ""]
        if isinstance(dtype, cst.Name):
            texts += [model.qualname(v, scope) or "" for v in model.values_of(dtype, scope)]
        kinds = {"bf16" if t.endswith("bfloat16") else "fp16" for t in texts if t}
        return kinds.pop() if len(kinds) == 1 else None
    if callee.startswith("torch.cuda.amp"):
        return "fp16"
    if callee.startswith("torch.cpu.amp"):
        return "bf16"
    device_arg = keyword(call, "device_type")
    device = device_arg.value if device_arg is not None else (args[0] if args else None)
    if isinstance(device, cst.SimpleString):
        text = device.evaluated_value
        if text == "cuda":
            return "fp16"
        if text == "cpu":
            return "bf16"
    return None


def autocast_frames(model: FileModel, site: Site) -> list[tuple[cst.Call, bool]]:
    """The autocast regions around ``site``, outermost first, each with whether it is enabled
    (``enabled=False`` turns a region off), including decorators of the enclosing function."""
    out: list[tuple[cst.Call, bool]] = []
    scope: Scope | None = site.scope
    decorated: list[tuple[cst.Call, bool]] = []
    while scope is not None and scope.kind == "function":
        node = scope.node
        assert isinstance(node, cst.FunctionDef)
        for deco in node.decorators:
            if isinstance(deco.decorator, cst.Call):
                call = autocast_call(model, deco.decorator, scope.parent or scope)
                if call is not None:
                    decorated.insert(0, (call, not literal_false(keyword(call, "enabled"))))
        scope = scope.parent
    out.extend(decorated)
    for frame in site.frames:
        if frame.kind == "with" and isinstance(frame.node, cst.With):
            for item in frame.node.items:
                call = autocast_call(model, item.item, site.scope)
                if call is not None:
                    out.append((call, not literal_false(keyword(call, "enabled"))))
    return out


def scope_autocasts(model: FileModel, scope: Scope) -> list[Site]:
    """Call sites of autocast constructors in ``scope`` (with-items, decorators, assigned contexts)."""
    return [site for site in model.calls_in(scope) if model.callee(site) in AUTOCAST_FUNCTIONS]


def delete_statement(model: FileModel, root: cst.CSTNode, statement: cst.CSTNode) -> TextEditSpec | None:
    """An edit removing ``statement`` with its whole lines (its trailing comment goes with it; the
    comment lines around it stay). ``pass`` stands in when it is its block's only statement."""
    block = block_of(root, statement)
    if block is None or line_indent(model, statement) is None:
        return None
    if len(block.body) == 1:
        return TextEditSpec(statement, "replace", "pass")
    return TextEditSpec(statement, "delete_lines", "")


def standalone_call(statement: cst.CSTNode, call: cst.Call) -> bool:
    """``statement`` is a line holding nothing but ``call``."""
    return (
        isinstance(statement, cst.SimpleStatementLine)
        and len(statement.body) == 1
        and isinstance(statement.body[0], cst.Expr)
        and statement.body[0].value is call
    )


def innermost_loop(site: Site) -> cst.CSTNode | None:
    loops = [f.node for f in site.frames if f.kind == "loop"]
    return loops[-1] if loops else None


def uses_scaling_framework(model: FileModel) -> bool:
    for scope in model.scopes:
        for bindings in scope.bindings.values():
            for b in bindings:
                if b.kind == "import" and b.target and b.target.split(".")[0] in SCALING_FRAMEWORKS:
                    return True
    return False


def scaler_in_file(model: FileModel) -> bool:
    """Any sign of loss scaling in the file: scaler events, a GradScaler, or an identifier spelled
    ``*scaler*`` (a scaler passed in from another file, ``loss = loss_scaler.scale(loss)``). Comments
    and strings do not count."""
    if "scaler" in model.source.lower():
        nodes = list(walk(model.module))
        definition_names = {id(n.name) for n in nodes if isinstance(n, cst.FunctionDef | cst.ClassDef)}
        if any(
            isinstance(n, cst.Name) and "scaler" in n.value.lower() and id(n) not in definition_names
            for n in nodes
        ):
            return True
    training = model.training
    if training.of_kind("scaled_backward", "unscale", "scaler_step"):
        return True
    names = {
        "torch.amp.GradScaler",
        "torch.cuda.amp.GradScaler",
        "torch.GradScaler",
        "torch.cpu.amp.GradScaler",
    }
    return any(
        (model.callee(site) or "") in names or (model.callee(site) or "").endswith("GradScaler")
        for site in model.calls
    )


# ----------------------------------------------------------------------------------------------------
# TL102 step-bypasses-scaler
# ----------------------------------------------------------------------------------------------------


class StepBypassesScaler(Rule):
    id = "TL102"
    name = "step-bypasses-scaler"
    severity = Severity.ERROR
    probe = "tl102"
    summary = (
        "optimizer.step() called directly after a loss-scaled backward instead of scaler.step(optimizer)."
    )
    # Every finding needs a scaled backward `x.scale(...).backward()` and a `.step()` (method calls:
    # ``method_call_pattern``).
    tokens = ("scale",)
    requires = (
        ("backward",),
        ("step",),
        method_call_pattern("scale"),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `optimizer.step()` called directly in a function (or script) whose loss went "
            "through `scaler.scale(loss).backward()` with no `scaler.step(...)` in between. Not "
            "reported when the direct step is the non-AMP branch of an `if` whose other branch calls "
            "`scaler.step`, when a plain backward of another loss precedes it, or for MS-AMP, whose "
            "optimizer handles the scale itself."
        ),
        why=(
            "After a scaled backward every gradient is multiplied by the loss scale (65536 at the "
            "start). `optimizer.step()` applies them as they are: with SGD at lr 0.01 a true gradient "
            "of 0.001 moves the weight by 0.01 * 0.001 * 65536 ≈ 0.66 instead of 0.00001. Adam hides "
            "the factor in its normalisation, but only until an fp16 overflow: `scaler.step` skips the "
            "update when a gradient is inf or NaN, a direct `step()` writes the NaN into the weights. "
            "And since `scaler.step` never ran, `scaler.update()` has nothing to look at (it raises "
            "'No inf checks were recorded prior to update')."
        ),
        example=("scaler.scale(loss).backward()\noptimizer.step()\nscaler.update()"),
        use_instead=("scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"),
        fix_safety=(
            "The fix replaces `optimizer.step()` by `scaler.step(optimizer)`. It is safe when the call "
            "has no arguments and a `scaler.update()` follows it under the same loop and conditions "
            "(each `scaler.step` needs an `update()` before the next one). Otherwise, for example "
            "with a closure argument or no `update()` in sight, it is offered as unsafe or not at all."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#gradient-scaling",),
    )
    valid = (
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(optimizer)\n"
        "scaler.update()",
        # non-AMP branch of an if/else
        "import torch\nscaler = torch.amp.GradScaler()\nif use_amp:\n    scaler.scale(loss).backward()\n"
        "    scaler.step(optimizer)\n    scaler.update()\nelse:\n    loss.backward()\n    optimizer.step()",
        # two ifs on the same flag
        "import torch\nscaler = torch.amp.GradScaler(enabled=amp)\nif amp:\n    scaler.scale(loss).backward()\n"
        "else:\n    loss.backward()\nif amp:\n    scaler.step(optimizer)\n    scaler.update()\nelse:\n"
        "    optimizer.step()",
        # the scheduler steps directly, the optimizer through the scaler
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(optimizer)\n"
        "scaler.update()\nscheduler.step()\nlr_scheduler.step()",
        # GAN: the generator's loss is not scaled
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss_d).backward()\nscaler.step(opt_d)\n"
        "scaler.update()\nloss_g.backward()\nopt_g.step()",
        # MS-AMP's optimizer handles the scale
        "import torch, msamp\nmodel, optimizer = msamp.initialize(model, optimizer, opt_level='O2')\n"
        "scaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\noptimizer.step()",
        # DummyGradScaler's own step method
        "class DummyGradScaler:\n    def scale(self, loss):\n        return loss\n    def step(self, optimizer):\n"
        "        optimizer.step()",
        # no scaler at all
        "import torch\nloss.backward()\noptimizer.step()",
        # a model engine, not an optimizer
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(optimizer)\n"
        "scaler.update()\nema.step()",
    )
    invalid = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\noptimizer.step()\n"
            "scaler.update()",
            line=4,
        ),
        Invalid(
            "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.cuda.amp.GradScaler()\n"
            "        self.optimizer = torch.optim.AdamW(self.model.parameters())\n"
            "    def step(self, loss):\n        self.scaler.scale(loss).backward()\n        self.optimizer.step()\n"
            "        self.scaler.update()",
            line=8,
        ),
        # the backward is scaled under a flag, the step is unconditional
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nif use_amp:\n    scaler.scale(loss).backward()\n"
            "else:\n    loss.backward()\noptimizer.step()",
            line=7,
        ),
        # accumulation loop
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor i, b in enumerate(loader):\n"
            "    scaler.scale(model(b) / accum).backward()\n    if (i + 1) % accum == 0:\n"
            "        opt.step()\n        scaler.update()\n        opt.zero_grad()",
            line=6,
        ),
        # scaler as a parameter, recognised by use
        Invalid(
            "def train_step(scaler, optimizer, loss):\n    scaler.scale(loss).backward()\n"
            "    scaler.unscale_(optimizer)\n    optimizer.step()\n    scaler.update()",
            line=4,
        ),
        # closure argument
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nopt = torch.optim.LBFGS(params)\n"
            "scaler.scale(loss).backward()\nopt.step(closure)\nscaler.update()",
            line=5,
        ),
        # second optimizer after the first went through the scaler
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(opt_a)\n"
            "opt_b.step()\nscaler.update()",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        if any((model.callee(s) or "").startswith("msamp.") for s in model.calls):
            return
        for step in training.of_kind("step"):
            site = step.site
            recv = receiver(step.call)
            if not training.is_optimizer_like(recv, site.scope):
                continue
            events = training.events_in(
                site.scope, "scaled_backward", "backward", "scaler_step", "update", "unscale"
            )

            def on_path(e: Event, site: Site = site) -> bool:
                return not exclusive(e.site.frames, site.frames)

            if any(e.kind == "scaler_step" and not on_path(e) for e in events):
                continue  # the direct step is the other branch of a scaler.step
            scaled = [
                e for e in events if e.kind == "scaled_backward" and e.order < step.order and on_path(e)
            ]
            if not scaled:
                continue
            backward = scaled[-1]
            between = [e for e in events if backward.order < e.order < step.order and on_path(e)]
            if any(e.kind == "scaler_step" and optimizer_text(e) == dotted(recv) for e in between):
                continue  # already stepped through the scaler: a double step is another problem
            if any(
                e.kind == "backward" and not exclusive(e.site.frames, backward.site.frames) for e in between
            ):
                continue  # a plain backward of another loss comes last
            scaler = backward.key or "scaler"
            optimizer = dotted(recv) or "optimizer"
            if any(e.kind == "unscale" for e in between):
                problem = (
                    "bypasses the GradScaler, so a step with inf/NaN gradients is applied instead of skipped"
                )
            else:
                problem = (
                    "applies gradients that are still multiplied by the loss scale and does not skip "
                    "inf/NaN steps"
                )
            yield Diagnostic(
                step.call,
                f"`{optimizer}.step()` {problem}; call `{scaler}.step({optimizer})` instead.",
                related=((backward.call, "scaled backward here"),),
                fix=self._fix(model, step, scaler, optimizer, [e for e in events if e.kind == "update"]),
            )

    @staticmethod
    def _fix(
        model: FileModel, step: Event, scaler: str, optimizer: str, updates: list[Event]
    ) -> FixSpec | None:
        updates = [
            u for u in updates if u.order > step.order and not exclusive(u.site.frames, step.site.frames)
        ]
        if not updates or dotted(receiver(step.call)) is None:
            return None
        call = step.call
        parts = [optimizer]
        for arg in call.args:
            prefix = f"{arg.keyword.value}=" if arg.keyword is not None else arg.star
            parts.append(prefix + model.code(arg.value))
        safe = not call.args and runs_with(step.site, updates[0].site)
        return FixSpec(
            Applicability.SAFE if safe else Applicability.UNSAFE,
            f"Replace with `{scaler}.step({optimizer})`",
            (TextEditSpec(call, "replace", f"{scaler}.step({', '.join(parts)})"),),
        )


# ----------------------------------------------------------------------------------------------------
# TL103 scaler-update-per-microstep
# ----------------------------------------------------------------------------------------------------


class ScalerUpdatePerMicrostep(Rule):
    id = "TL103"
    name = "scaler-update-per-microstep"
    severity = Severity.WARNING
    probe = "tl103"
    summary = (
        "scaler.update() runs on every micro-step while scaler.step() runs once per accumulation window."
    )
    # Every finding needs `x.update()` and `x.step(...)` on a scaler, which is one by a `GradScaler`
    # construction or by a `x.scale(...)` call (``method_call_pattern``).
    tokens = ("update",)
    requires = (
        ("step",),
        ("scale", "GradScaler"),
        method_call_pattern("update"),
        method_call_pattern("step"),
        method_call_pattern("scale", or_tokens=("GradScaler",)),
    )
    doc = RuleDoc(
        what=(
            "Reports `scaler.update()` that runs on every iteration of a loop in which "
            "`scaler.step(...)` runs only under a gradient-accumulation condition (`(i + 1) % accum "
            "== 0`, `step % accum == 0 or last`, `accelerator.sync_gradients`, a flag computed from a "
            "modulo, a counter that is reset)."
        ),
        why=(
            "`update()` consumes the inf/NaN checks that `scaler.step` (or `unscale_`) recorded since "
            "the last update and picks the next scale. On a micro-step where nothing was stepped it "
            "raises `AssertionError: No inf checks were recorded prior to update` (unless the scaler "
            "is disabled, which is why a run without AMP does not notice). Code that silences this by "
            "calling `unscale_` on every micro-step is worse off: each `unscale_` divides the whole "
            "accumulated gradient by the scale again, so with a scale of 65536 and 4 micro-steps the "
            "first micro-step's gradient ends up divided by 65536^3 ≈ 2.8e14 and is erased. The scale "
            "must stay fixed for the whole window and be updated once, right after `scaler.step`."
        ),
        example=(
            "for i, batch in enumerate(loader):\n"
            "    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        scaler.step(optimizer)\n"
            "        optimizer.zero_grad()\n"
            "    scaler.update()"
        ),
        use_instead=(
            "for i, batch in enumerate(loader):\n"
            "    scaler.scale(loss_fn(model(batch)) / accum).backward()\n"
            "    if (i + 1) % accum == 0:\n"
            "        scaler.step(optimizer)\n"
            "        scaler.update()\n"
            "        optimizer.zero_grad()"
        ),
        references=("https://pytorch.org/docs/stable/notes/amp_examples.html#gradient-accumulation",),
    )
    valid = (
        # PyTorch's accumulation recipe
        "import torch\nscaler = torch.amp.GradScaler()\nfor i, (x, y) in enumerate(data):\n"
        "    scaler.scale(loss_fn(model(x), y) / n).backward()\n    if (i + 1) % n == 0:\n"
        "        scaler.step(optimizer)\n        scaler.update()\n        optimizer.zero_grad()",
        # no accumulation: both every iteration
        "import torch\nscaler = torch.amp.GradScaler()\nfor x in data:\n    scaler.scale(loss).backward()\n"
        "    scaler.step(opt)\n    scaler.update()",
        # accumulation by `continue`: both after it
        "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
        "    scaler.scale(loss).backward()\n    if (i + 1) % accum != 0:\n        continue\n"
        "    scaler.step(opt)\n    scaler.update()",
        # nanoGPT: accumulation by an inner loop
        "import torch\nscaler = torch.amp.GradScaler()\nwhile True:\n    for micro in range(accum):\n"
        "        scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()",
        # flag from a modulo guards both
        "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
        "    sync = (i + 1) % accum == 0\n    scaler.scale(loss).backward()\n    if sync:\n"
        "        scaler.step(opt)\n        scaler.update()",
        # the step is under a non-accumulation condition (skip on a flag), update beside it
        "import torch\nscaler = torch.amp.GradScaler()\nfor x in data:\n    scaler.scale(loss).backward()\n"
        "    if not skip_step:\n        scaler.step(opt)\n    scaler.update()",
        # accelerate-style sync flag guards both
        "import torch\nscaler = torch.amp.GradScaler()\nfor x in data:\n    scaler.scale(loss).backward()\n"
        "    if accelerator.sync_gradients:\n        scaler.step(opt)\n        scaler.update()",
        # an update() of something that is not a scaler
        "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
        "    scaler.scale(loss).backward()\n    if (i + 1) % accum == 0:\n        scaler.step(opt)\n"
        "        scaler.update()\n    pbar.update(1)\n    meter.update(loss.item())",
    )
    invalid = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor i, (x, y) in enumerate(data):\n"
            "    scaler.scale(loss_fn(model(x), y) / n).backward()\n    if (i + 1) % n == 0:\n"
            "        scaler.step(optimizer)\n        optimizer.zero_grad()\n    scaler.update()",
            line=8,
        ),
        Invalid(
            "import torch\nscaler = torch.cuda.amp.GradScaler()\nfor step, batch in enumerate(loader):\n"
            "    scaler.scale(model(batch)).backward()\n"
            "    if step % accum == 0 or step == len(loader) - 1:\n        scaler.step(opt)\n"
            "        opt.zero_grad()\n    scaler.update()",
            line=8,
        ),
        Invalid(
            "import torch\ndef train(model, loader, opt, scaler, accelerator):\n    for batch in loader:\n"
            "        scaler.scale(model(batch)).backward()\n        if accelerator.sync_gradients:\n"
            "            scaler.step(opt)\n        scaler.update()",
            line=7,
        ),
        # a flag computed from a modulo
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
            "    is_update_step = (i + 1) % accum == 0\n    scaler.scale(loss).backward()\n"
            "    if is_update_step:\n        scaler.step(opt)\n    scaler.update()",
            line=8,
        ),
        # a counter that is reset
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\ncount = 0\nfor x in data:\n"
            "    scaler.scale(loss).backward()\n    count += 1\n    if count == accum:\n"
            "        scaler.step(opt)\n        count = 0\n    scaler.update()",
            line=10,
        ),
        # self.scaler in a trainer, update under an unrelated flag
        Invalid(
            "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.amp.GradScaler()\n"
            "    def fit(self, loader):\n        for i, b in enumerate(loader):\n"
            "            self.scaler.scale(self.model(b)).backward()\n"
            "            if (i + 1) % self.accum == 0:\n                self.scaler.step(self.opt)\n"
            "            if self.use_amp:\n                self.scaler.update()",
            line=11,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for update in training.of_kind("update"):
            site = update.site
            loop = innermost_loop(site)
            if loop is None:
                continue
            if training.under_accumulation(site, loop) is not None:
                continue
            for step in training.events_in(site.scope, "scaler_step"):
                if innermost_loop(step.site) is not loop or exclusive(step.site.frames, site.frames):
                    continue
                if update.key and step.key and update.key != step.key:
                    continue
                condition = training.under_accumulation(step.site, loop)
                if condition is None:
                    continue
                yield Diagnostic(
                    update.call,
                    f"`{update.key or 'scaler'}.update()` runs on every micro-step but `scaler.step()` only "
                    f"when the accumulation condition on line {line_of(model, condition.node)} holds; "
                    "move `update()` next to `step()` so the scale stays fixed for the whole window.",
                    related=((step.call, "scaler.step under the accumulation condition here"),),
                )
                break


# ----------------------------------------------------------------------------------------------------
# TL104 unscale-twice
# ----------------------------------------------------------------------------------------------------


class UnscaleTwice(Rule):
    id = "TL104"
    name = "unscale-twice"
    severity = Severity.ERROR
    probe = "tl104"
    summary = "scaler.unscale_(optimizer) called twice for one optimizer without scaler.update() in between."
    # Every finding needs `x.unscale_(...)` on a scaler: one by a `GradScaler` construction or by a
    # `x.scale(...)` call (``method_call_pattern``; `unscale_` itself is not a `.scale`).
    tokens = ("unscale_",)
    requires = (
        method_call_pattern("unscale_"),
        method_call_pattern("scale", or_tokens=("GradScaler",)),
    )
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports a second `scaler.unscale_(opt)` for the same scaler and optimizer with no "
            "`scaler.update()` between the two (including an `unscale_` inside the file's own helper "
            "called before it), and an `unscale_` that runs on every micro-step of an accumulation "
            "loop whose `update()` runs only at the end of the window."
        ),
        why=(
            "`unscale_` divides the gradients in place by the current scale and records that it did; "
            "a second call before `update()` raises `RuntimeError: unscale_() has already been called "
            "on this optimizer since the last update()`. If it did not raise, gradients scaled by "
            "65536 would be divided twice and end up 65536 times too small. In an accumulation loop "
            "the failure appears on the second micro-step, so a quick test with `accum=1` passes and "
            "the real run crashes."
        ),
        example=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "log_grad_norm(model)\n"
            "scaler.unscale_(optimizer)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        use_instead=(
            "scaler.scale(loss).backward()\n"
            "scaler.unscale_(optimizer)\n"
            "log_grad_norm(model)\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        fix_safety=(
            "The fix deletes the line of the second `unscale_` call (with its trailing comment; a "
            "`pass` takes its place when it is the only statement of its block). It is safe: the "
            "gradients are already unscaled at that point, so the call can only raise, and removing "
            "it changes nothing else. It is offered only when the call stands alone on its line; the "
            "per-micro-step form has no automatic fix, because moving `unscale_` under the "
            "accumulation condition needs a decision about the clip that uses it."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#torch.amp.GradScaler.unscale_",),
    )
    valid = (
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.unscale_(opt)\n"
        "torch.nn.utils.clip_grad_norm_(params, 1.0)\nscaler.step(opt)\nscaler.update()",
        # a loop: update between two iterations' unscale_
        "import torch\nscaler = torch.amp.GradScaler()\nfor x in data:\n    scaler.scale(loss).backward()\n"
        "    scaler.unscale_(opt)\n    scaler.step(opt)\n    scaler.update()",
        # two optimizers
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.unscale_(opt_a)\n"
        "scaler.unscale_(opt_b)\nscaler.step(opt_a)\nscaler.step(opt_b)\nscaler.update()",
        # other branches of an if/else
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nif clip:\n"
        "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\nelse:\n"
        "    scaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()",
        # accumulation recipe: unscale_ under the condition
        "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
        "    scaler.scale(loss).backward()\n    if (i + 1) % k == 0:\n        scaler.unscale_(opt)\n"
        "        scaler.step(opt)\n        scaler.update()",
        # update between the two
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(a).backward()\nscaler.unscale_(opt)\n"
        "scaler.step(opt)\nscaler.update()\nscaler.scale(b).backward()\nscaler.unscale_(opt)\n"
        "scaler.step(opt)\nscaler.update()",
        # DummyGradScaler definitions
        "class DummyGradScaler:\n    def unscale_(self, optimizer):\n        pass\n"
        "    def step(self, optimizer):\n        self.unscale_(optimizer)\n        self.unscale_(optimizer)",
        # different functions
        "import torch\nscaler = torch.amp.GradScaler()\ndef a():\n    scaler.unscale_(opt)\n"
        "def b():\n    scaler.unscale_(opt)",
    )
    invalid = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.unscale_(opt)\n"
            "log(norm(params))\nscaler.unscale_(opt)\nscaler.step(opt)\nscaler.update()",
            line=6,
        ),
        Invalid(
            "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.amp.GradScaler()\n"
            "    def step(self, loss):\n        self.scaler.scale(loss).backward()\n"
            "        self.scaler.unscale_(self.opt)\n        if self.clip:\n"
            "            self.scaler.unscale_(self.opt)\n"
            "            torch.nn.utils.clip_grad_norm_(self.params, 1.0)\n"
            "        self.scaler.step(self.opt)\n        self.scaler.update()",
            line=9,
        ),
        # through the file's own helper
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\ndef clip_grads(opt):\n    scaler.unscale_(opt)\n"
            "    torch.nn.utils.clip_grad_norm_(params, 1.0)\ndef train_step(loss, opt):\n"
            "    scaler.scale(loss).backward()\n    clip_grads(opt)\n    scaler.unscale_(opt)\n"
            "    scaler.step(opt)\n    scaler.update()",
            line=9,
        ),
        # every micro-step, update only at the end of the window
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor i, x in enumerate(data):\n"
            "    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n"
            "    torch.nn.utils.clip_grad_norm_(params, 1.0)\n    if (i + 1) % accum == 0:\n"
            "        scaler.step(opt)\n        scaler.update()",
            line=5,
        ),
        # parameter scaler
        Invalid(
            "def step(scaler, optimizer, loss):\n    scaler.scale(loss).backward()\n"
            "    scaler.unscale_(optimizer)\n    scaler.unscale_(optimizer)\n    scaler.step(optimizer)\n"
            "    scaler.update()",
            line=4,
        ),
        # inside a loop, both per iteration
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nfor x in data:\n    scaler.scale(loss).backward()\n"
            "    scaler.unscale_(optimizer=opt)\n    if clip:\n        scaler.unscale_(opt)\n"
            "    scaler.step(opt)\n    scaler.update()",
            line=7,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for unscale in training.of_kind("unscale"):
            yield from self._check(model, training, unscale)

    def _check(self, model: FileModel, training: Training, unscale: Event) -> Iterator[Diagnostic]:
        site = unscale.site
        optimizer = optimizer_text(unscale)
        events = training.events_in(site.scope, "unscale", "update")

        def on_path(e: Site) -> bool:
            return not exclusive(e.frames, site.frames)

        updates = [e for e in events if e.kind == "update" and on_path(e.site)]
        earlier: Site | None = None
        for e in events:
            if (
                e.kind == "unscale"
                and e.order < unscale.order
                and on_path(e.site)
                and e.key == unscale.key
                and optimizer_text(e) == optimizer
            ):
                earlier = e.site
        if earlier is None:
            for other in model.calls_in(site.scope):
                if (
                    other.order < unscale.order
                    and on_path(other)
                    and self._helper_unscales(model, training, other, unscale)
                ):
                    earlier = other
        if earlier is not None:
            if any(earlier.order < u.order < unscale.order for u in updates):
                return
            fix = None
            delete = (
                delete_statement(model, site.scope.node, site.statement)
                if standalone_call(site.statement, unscale.call)
                else None
            )
            if delete is not None:
                fix = FixSpec(Applicability.SAFE, "Remove the second `unscale_` call", (delete,))
            yield Diagnostic(
                unscale.call,
                f"`{unscale.key or 'scaler'}.unscale_({optimizer or '...'})` was already called on line "
                f"{line_of(model, earlier.node)} with no `update()` in between: this raises a RuntimeError; "
                "remove the second call.",
                related=((earlier.node, "first unscale_ here"),),
                fix=fix,
            )
            return
        # Every micro-step: the same call runs again before the window's update().
        loop = innermost_loop(site)
        if loop is None or training.under_accumulation(site, loop) is not None:
            return
        in_loop = [u for u in updates if innermost_loop(u.site) is loop]
        if in_loop and all(training.under_accumulation(u.site, loop) is not None for u in in_loop):
            yield Diagnostic(
                unscale.call,
                f"`{unscale.key or 'scaler'}.unscale_(...)` runs on every micro-step but `update()` only at "
                "the end of the accumulation window: the second micro-step raises a RuntimeError; move "
                "`unscale_` under the same condition as `scaler.step`.",
                related=((in_loop[0].call, "update under the accumulation condition here"),),
            )

    @staticmethod
    def _helper_unscales(model: FileModel, training: Training, site: Site, unscale: Event) -> bool:
        for fn in related_callees(model, site):
            scope = model.scope_for(fn)
            if scope is None:
                continue
            inner = training.events_in(scope, "unscale", "update")
            if any(e.kind == "update" for e in inner):
                continue
            if any(e.kind == "unscale" and e.key == unscale.key for e in inner):
                return True
        return False


# ----------------------------------------------------------------------------------------------------
# TL106 backward-inside-autocast
# ----------------------------------------------------------------------------------------------------


class BackwardInsideAutocast(Rule):
    id = "TL106"
    name = "backward-inside-autocast"
    severity = Severity.WARNING
    summary = "backward() called inside an autocast region."
    # Every finding needs an autocast region and a `x.backward()` call (``method_call_pattern``).
    tokens = ("autocast",)
    requires = (("backward",), method_call_pattern("backward"))
    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports `.backward()` and `scaler.scale(loss).backward()` written inside a `with "
            "torch.autocast(...)`, `torch.amp.autocast(...)` or `torch.cuda.amp.autocast()` block "
            "(also through a context stored in a variable, such as nanoGPT's `ctx`, and in a "
            "function decorated with autocast). An inner `autocast(enabled=False)` turns the region off."
        ),
        why=(
            "Autocast is meant for the forward pass only. Backward ops already run in the dtype "
            "autocast chose for the matching forward ops, so the region buys nothing for the backward "
            "itself, while every autocast-eligible op placed beside it (the matmuls of a gradient "
            "penalty, an auxiliary forward for metrics) also runs in 16 bits: an fp16 matmul whose "
            "result exceeds 65504, the largest finite fp16 value, returns inf. PyTorch's "
            "documentation recommends leaving the context before calling backward."
        ),
        example=(
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "    loss.backward()"
        ),
        use_instead=(
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()"
        ),
        fix_safety=(
            "The fix moves the backward line (with its trailing comment) out of the `with` block to "
            "just after it, at the `with` statement's indentation; the only thing that now runs "
            "before it is the region's exit. It is offered only when the backward is the block's last "
            "statement and stands alone on its line, the block keeps another statement, every context "
            "manager of that `with` is an autocast (leaving a `model.no_sync()` or a timer as well "
            "would change more than precision), and no other enabled autocast region surrounds it. It "
            "is unsafe: the backward now runs with autocast off, which is the point, but code that "
            "runs during backward and follows the caller's autocast state (a custom "
            "`autograd.Function` without `custom_bwd`, hooks that compute, a `create_graph=True` "
            "backward for a gradient penalty) can then produce slightly different numbers."
        ),
        references=("https://pytorch.org/docs/stable/amp.html#torch.autocast",),
    )
    valid = (
        "import torch\nwith torch.autocast('cuda'):\n    loss = loss_fn(model(x), y)\nloss.backward()",
        "import torch\nwith torch.autocast('cuda'):\n    loss = model(x)\nscaler.scale(loss).backward()",
        # an inner region that is switched off
        "import torch\nwith torch.autocast('cuda'):\n    loss = model(x)\n"
        "    with torch.autocast('cuda', enabled=False):\n        loss.float().backward()",
        # another library's autocast
        "from accelerate import Accelerator\nwith accelerator.autocast():\n    loss = model(x)\n"
        "    accelerator.backward(loss)",
        # a user function called autocast
        "from contextlib import contextmanager\n@contextmanager\ndef autocast():\n    yield\n"
        "with autocast():\n    loss = model(x)\n    loss.backward()",
        # a no_grad block
        "import torch\nwith torch.no_grad():\n    out = model(x)\nloss.backward()",
        # nanoGPT: ctx is autocast, backward after it
        "import torch\nfrom contextlib import nullcontext\n"
        "ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(device_type=device_type, dtype=ptdtype)\n"
        "with ctx:\n    logits, loss = model(X, Y)\nscaler.scale(loss).backward()",
        # decorated forward, backward outside
        "import torch\nclass M(torch.nn.Module):\n    @torch.autocast('cuda')\n    def forward(self, x):\n"
        "        return self.net(x)\nloss = M()(x).sum()\nloss.backward()",
    )
    invalid = (
        # the scaled backward of a GradScaler loop, inside torch.amp.autocast
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\nfor x in loader:\n"
            "    with torch.amp.autocast('cuda'):\n        loss = model(x).mean()\n"
            "        scaler.scale(loss).backward()\n    scaler.step(opt)\n    scaler.update()",
            line=6,
        ),
        Invalid(
            "import torch\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = loss_fn(model(x), y)\n"
            "    loss.backward()",
            line=4,
        ),
        Invalid(
            "from torch.cuda.amp import autocast\nwith autocast():\n    loss = model(x)\n"
            "    scaler.scale(loss).backward()",
            line=4,
        ),
        Invalid(
            "import torch\nfor x, y in data:\n    with torch.amp.autocast(device_type='cuda'):\n"
            "        out = model(x)\n        loss = crit(out, y)\n        if train:\n            loss.backward()",
            line=7,
        ),
        # through a context variable
        Invalid(
            "import torch\nfrom contextlib import nullcontext\n"
            "ctx = nullcontext() if cpu else torch.autocast('cuda', dtype=torch.float16)\n"
            "with ctx:\n    loss = model(x)\n    scaler.scale(loss).backward()",
            line=6,
        ),
        # a decorated training step
        Invalid(
            "import torch\n@torch.autocast(device_type='cuda', dtype=torch.float16)\ndef train_step(x):\n"
            "    loss = model(x).mean()\n    loss.backward()",
            line=5,
        ),
        # inside several context managers
        Invalid(
            "import torch\nwith torch.no_grad(), torch.autocast('cpu'):\n    pass\n"
            "with timer(), torch.autocast('cpu', dtype=torch.bfloat16):\n    loss = model(x)\n"
            "    torch.autograd.backward(loss)",
            line=6,
        ),
        Invalid(
            "import torch\nwith torch.autocast('cuda'):\n    with torch.autocast('cuda', enabled=False):\n"
            "        loss = model(x.float())\n    loss.backward()",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for event in training.of_kind("backward", "scaled_backward"):
            regions = autocast_frames(model, event.site)
            if not regions:
                continue
            innermost, enabled = regions[-1]
            if not enabled:
                continue
            yield Diagnostic(
                event.call,
                "backward() runs inside an autocast region, which is meant for the forward pass only "
                "(backward ops already follow the dtype of their forward ops); call backward after the "
                "autocast block.",
                related=((innermost, "autocast region opened here"),),
                fix=self._move_out_fix(model, event, regions),
            )

    @staticmethod
    def _move_out_fix(model: FileModel, event: Event, regions: list[tuple[cst.Call, bool]]) -> FixSpec | None:
        """Dedent the backward line out of the ``with`` block it ends: the same as deleting it and
        inserting it after the block. Only for a ``with`` all of whose items are autocast (moving out
        of ``model.no_sync()`` or a timer would change more), that keeps another statement, and
        around which no other enabled autocast region remains."""
        site = event.site
        statement = site.statement
        if not site.frames or not standalone_call(statement, event.call):
            return None
        frame = site.frames[-1]
        block = frame.node.body if isinstance(frame.node, cst.With) else None
        if (
            frame.kind != "with"
            or not isinstance(block, cst.IndentedBlock)
            or len(block.body) < 2
            or block.body[-1] is not statement
        ):
            return None
        own = [autocast_call(model, item.item, site.scope) for item in frame.node.items]
        if any(call is None for call in own):
            return None
        outer = [(call, on) for call, on in regions if not any(call is mine for mine in own)]
        if outer and outer[-1][1]:
            return None  # still inside an enabled region after the move
        indent = line_indent(model, frame.node)
        content = reindented(model, statement, indent) if indent is not None else None
        if content is None:
            return None
        footer = [line.comment for line in block.footer if line.comment is not None]
        if footer:
            # comments indented under the block after its last statement stay inside the block
            anchor = footer[-1]
            kept = "".join(line + "\n" for line in whole_lines(model, anchor))
            edits = (
                TextEditSpec(statement, "delete_lines", ""),
                TextEditSpec(anchor, "delete_lines", kept + content),
            )
        else:
            edits = (TextEditSpec(statement, "delete_lines", content),)
            anchor = statement
        if ends_file(model, anchor):
            last = edits[-1]
            edits = (*edits[:-1], TextEditSpec(last.anchor, last.where, last.content[:-1]))
        return FixSpec(
            Applicability.UNSAFE,
            "Move the backward call after the autocast block",
            edits,
        )


# ----------------------------------------------------------------------------------------------------
# TL107 scaler-with-bf16
# ----------------------------------------------------------------------------------------------------


def scaler_constructions(
    model: FileModel, training: Training, key: str | None, scope: Scope
) -> list[cst.Call]:
    if key is None:
        return []
    expr = cst.parse_expression(key)
    out = []
    for value in model.values_of(expr, scope):
        for option in [value.body, value.orelse] if isinstance(value, cst.IfExp) else [value]:
            if isinstance(option, cst.Call) and (model.qualname(option.func, scope) or "").endswith(
                "GradScaler"
            ):
                out.append(option)
    return out


class ScalerWithBf16(Rule):
    id = "TL107"
    name = "scaler-with-bf16"
    severity = Severity.INFO
    summary = "A GradScaler used with bf16 autocast, where loss scaling is not needed."
    # Every finding needs a bf16 autocast: `bfloat16`, `torch.cpu.amp`, or a device string that is
    # `cpu` (spelled out, or only through an escape: `\x`, `\u`, `\U`, `\N`, octal `\1..`, a
    # backslash-newline); an autocast; and `x.scale(...).backward()` (``method_call_pattern``).
    tokens = ("bfloat16", "cpu", "\\x", "\\u", "\\U", "\\N", "\\1", "\\\n", "\\\r")
    requires = (
        ("autocast",),
        ("backward",),
        ("scale",),
        method_call_pattern("scale"),
        method_call_pattern("backward"),
    )
    doc = RuleDoc(
        what=(
            "Reports a loss-scaled backward (`scaler.scale(loss).backward()`) when every autocast in "
            "the same function (or, when the function has none, in the file) uses "
            "`dtype=torch.bfloat16` (or is `torch.cpu.amp.autocast`, whose default is bf16). A scaler "
            "built with `enabled=` set to anything but `True` is left alone: it is usually switched "
            "off for bf16 already."
        ),
        why=(
            "Loss scaling exists because fp16 has 5 exponent bits: numbers below 2^-24 ≈ 6e-8 flush "
            "to zero, and many gradients live there. bf16 keeps fp32's 8 exponent bits, so its "
            "smallest normal number is about 1e-38, the same as fp32: a gradient of 1e-10 survives "
            "without help. Multiplying by 65536 then only costs an extra pass over the gradients for "
            "the inf check, and the scaler may still skip steps and shrink its scale when a bf16 "
            "value overflows, hiding a real divergence as 'skipped steps'. Either drop the scaler or "
            "switch autocast to fp16 if that was the intent."
        ),
        example=(
            "scaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        use_instead=(
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        references=("https://pytorch.org/docs/stable/amp.html#gradient-scaling",),
    )
    valid = (
        # fp16 autocast needs the scaler
        "import torch\nscaler = torch.amp.GradScaler()\nwith torch.autocast('cuda', dtype=torch.float16):\n"
        "    loss = model(x)\nscaler.scale(loss).backward()",
        # default cuda autocast is fp16
        "import torch\nscaler = torch.amp.GradScaler()\nwith torch.autocast('cuda'):\n    loss = model(x)\n"
        "scaler.scale(loss).backward()",
        # nanoGPT: enabled only for fp16
        "import torch\nptdtype = torch.bfloat16\nscaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))\n"
        "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\nscaler.scale(loss).backward()",
        # the dtype is configurable
        "import torch\ndtype = torch.bfloat16 if bf16 else torch.float16\nscaler = torch.amp.GradScaler()\n"
        "with torch.autocast('cuda', dtype=dtype):\n    loss = model(x)\nscaler.scale(loss).backward()",
        # both dtypes in the function
        "import torch\ndef f():\n    scaler = torch.amp.GradScaler()\n"
        "    with torch.autocast('cuda', dtype=torch.bfloat16):\n        a = enc(x)\n"
        "    with torch.autocast('cuda', dtype=torch.float16):\n        loss = dec(a)\n"
        "    scaler.scale(loss).backward()",
        # bf16 without a scaler
        "import torch\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\nloss.backward()",
        # no autocast at all
        "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(model(x.to(torch.bfloat16))).backward()",
    )
    invalid = (
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\n"
            "scaler.scale(loss).backward()\nscaler.step(opt)\nscaler.update()",
            line=5,
        ),
        Invalid(
            "import torch\nfrom torch.cuda.amp import GradScaler\nscaler = GradScaler()\n"
            "def train(x):\n    with torch.amp.autocast(device_type='cuda', dtype=torch.bfloat16):\n"
            "        loss = model(x)\n    scaler.scale(loss).backward()",
            line=7,
        ),
        Invalid(
            "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.amp.GradScaler()\n"
            "    def forward_loss(self, x):\n        with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "            return self.model(x)\n    def step(self, x):\n"
            "        self.scaler.scale(self.forward_loss(x)).backward()",
            line=9,
        ),
        Invalid(
            "import torch\nDTYPE = torch.bfloat16\nscaler = torch.amp.GradScaler(enabled=True)\n"
            "with torch.autocast(device_type='cuda', dtype=DTYPE):\n    loss = model(x)\n"
            "scaler.scale(loss).backward()",
            line=6,
        ),
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler('cpu')\nwith torch.cpu.amp.autocast():\n"
            "    loss = model(x)\nscaler.scale(loss).backward()",
            line=5,
        ),
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nwith torch.autocast('cuda', torch.bfloat16):\n"
            "    loss = model(x)\nscaler.scale(loss).backward()",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        reported: set[int] = set()
        for backward in training.of_kind("scaled_backward"):
            scope = backward.site.scope
            if id(scope) in reported:
                continue
            constructions = scaler_constructions(model, training, backward.key, scope)
            if any(
                (arg := keyword(c, "enabled")) is not None
                and not (isinstance(arg.value, cst.Name) and arg.value.value == "True")
                for c in constructions
            ):
                continue
            autocasts = scope_autocasts(model, scope) or [
                site for other in model.scopes for site in scope_autocasts(model, other)
            ]
            if not autocasts:
                continue
            dtypes = {
                autocast_dtype(model, site.node, site.scope)
                for site in autocasts
                if isinstance(site.node, cst.Call)
            }
            if dtypes != {"bf16"}:
                continue
            reported.add(id(scope))
            yield Diagnostic(
                backward.call,
                "Loss scaling with bf16 autocast: bf16 has the exponent range of fp32, so gradients do "
                "not underflow and the GradScaler only adds work and skipped steps; drop the scaler or "
                "use fp16 autocast.",
                related=((autocasts[0].node, "bf16 autocast here"),),
            )


# ----------------------------------------------------------------------------------------------------
# TL108 clip-after-step
# ----------------------------------------------------------------------------------------------------


def is_infinite(model: FileModel, expr: cst.BaseExpression | None, scope: Scope) -> bool:
    """``float('inf')``, ``math.inf``, ``torch.inf``: a clip that only measures the norm."""
    if expr is None:
        return False
    if isinstance(expr, cst.Call) and model.qualname(expr.func, scope) == "builtins.float":
        args = positional(expr)
        return (
            bool(args)
            and isinstance(args[0], cst.SimpleString)
            and "inf" in str(args[0].evaluated_value).lower()
        )
    return model.qualname(expr, scope) in INFINITIES


class ClipAfterStep(Rule):
    id = "TL108"
    name = "clip-after-step"
    severity = Severity.WARNING
    summary = "Gradient clipping after the optimizer step that consumed those gradients."
    # Every finding needs a clip (`clip_grad`, `utils` of torch.nn.utils), a `x.backward()` before it
    # and a `x.step(...)` between them (``method_call_pattern``).
    tokens = ("clip_grad",)
    requires = (
        ("utils",),
        ("backward",),
        ("step",),
        method_call_pattern("backward"),
        method_call_pattern("step"),
    )
    doc = RuleDoc(
        what=(
            "Reports `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` that runs after "
            "`optimizer.step()` (or `scaler.step(optimizer)`) and before the next backward, with no "
            "other step after it that could use the clipped gradients. A `clip_grad_norm_` with an "
            "infinite threshold (`float('inf')`), which only measures the norm, is not reported."
        ),
        why=(
            "The optimizer has already applied the gradients, so clipping them afterwards changes "
            "nothing in that update; then `zero_grad()` (or the next backward) discards or overwrites "
            "them. A run that was meant to cap the update at a norm of 1.0 applies a gradient of norm "
            "250 unchanged, and a loss spike that clipping should have absorbed goes straight into "
            "the weights, while the loss curve gives no hint that clipping never took effect."
        ),
        example=(
            "loss.backward()\n"
            "optimizer.step()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "optimizer.zero_grad()"
        ),
        use_instead=(
            "loss.backward()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n"
            "optimizer.step()\n"
            "optimizer.zero_grad()"
        ),
        references=("https://pytorch.org/docs/stable/generated/torch.nn.utils.clip_grad_norm_.html",),
    )
    valid = (
        "import torch\nloss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\noptimizer.step()",
        # measuring the norm after the step
        "import torch\nloss.backward()\noptimizer.step()\n"
        "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf'))",
        # GAN: the clip is for the second optimizer, stepped after it
        "import torch\nloss_d.backward()\nopt_d.step()\nloss_g.backward()\n"
        "torch.nn.utils.clip_grad_norm_(gen.parameters(), 1.0)\nopt_g.step()",
        # step of one optimizer, clip then step of another, same backward
        "import torch\nloss.backward()\nopt_a.step()\ntorch.nn.utils.clip_grad_value_(b.parameters(), 0.5)\n"
        "opt_b.step()",
        # scheduler step is not the optimizer step
        "import torch\nloss.backward()\nscheduler.step()\ntorch.nn.utils.clip_grad_norm_(params, 1.0)\n"
        "optimizer.step()",
        # in a loop: clip at the top of the iteration, after the previous backward... and the step after it
        "import torch\nfor x in data:\n    loss = model(x)\n    loss.backward()\n"
        "    torch.nn.utils.clip_grad_norm_(params, 1.0)\n    optimizer.step()\n    optimizer.zero_grad()",
        # the step is in the other branch
        "import torch\nloss.backward()\nif skip:\n    torch.nn.utils.clip_grad_norm_(params, 1.0)\nelse:\n"
        "    optimizer.step()",
        # a step with no backward before it in the function
        "import torch\ndef finish(optimizer):\n    optimizer.step()\n    torch.nn.utils.clip_grad_norm_(params, 1.0)",
    )
    invalid = (
        Invalid(
            "import torch\nloss.backward()\noptimizer.step()\n"
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\noptimizer.zero_grad()",
            line=4,
        ),
        Invalid(
            "import torch\nscaler = torch.amp.GradScaler()\nscaler.scale(loss).backward()\nscaler.step(opt)\n"
            "scaler.update()\ntorch.nn.utils.clip_grad_norm_(params, 1.0)",
            line=6,
        ),
        Invalid(
            "import torch\nfor x in data:\n    loss = model(x)\n    loss.backward()\n    optimizer.step()\n"
            "    torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)\n    optimizer.zero_grad()",
            line=6,
        ),
        Invalid(
            "from torch.nn.utils import clip_grad_norm_\nclass T:\n    def __init__(self):\n"
            "        self.optimizer = torch.optim.AdamW(self.model.parameters())\n"
            "    def step(self, loss):\n        loss.backward()\n        self.optimizer.step()\n"
            "        if self.max_norm:\n            clip_grad_norm_(self.model.parameters(), self.max_norm)",
            line=9,
        ),
        Invalid(
            "import torch\nfor i, x in enumerate(data):\n    model(x).backward()\n    if (i + 1) % k == 0:\n"
            "        opt.step()\n        torch.nn.utils.clip_grad_norm_(params, 1.0)\n        opt.zero_grad()",
            line=6,
        ),
        Invalid(
            "import torch.nn as nn\ndef train(model, optimizer, loss):\n    loss.backward()\n"
            "    optimizer.step()\n    total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)\n"
            "    return total",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        for clip in training.of_kind("clip"):
            site = clip.site
            norm = positional(clip.call)[1:2] or [
                a.value for a in clip.call.args if a.keyword and a.keyword.value in ("max_norm", "clip_value")
            ]
            if norm and is_infinite(model, norm[0], site.scope):
                continue
            events = training.events_in(site.scope, "backward", "scaled_backward", "step", "scaler_step")
            on_path = [e for e in events if not exclusive(e.site.frames, site.frames)]
            backwards = [e for e in on_path if e.kind in ("backward", "scaled_backward")]
            before = [e for e in backwards if e.order < clip.order]
            if not before:
                continue
            last_backward = before[-1]

            def optimizer_step(e: Event) -> bool:
                if e.kind == "scaler_step":
                    return True
                return e.kind == "step" and training.is_optimizer_like(receiver(e.call), e.site.scope)

            # Only when the clip runs exactly on the iterations where the step ran (same loops, and
            # every condition of the step also guards the clip).
            steps = [
                e
                for e in on_path
                if optimizer_step(e)
                and last_backward.order < e.order < clip.order
                and runs_with(site, e.site)
            ]
            if not steps:
                continue
            next_backward = min((e.order for e in backwards if e.order > clip.order), default=None)
            if any(
                e.kind in ("step", "scaler_step")
                and e.order > clip.order
                and (next_backward is None or e.order < next_backward)
                and "sched" not in (dotted(receiver(e.call)) or "").lower()
                for e in on_path
            ):
                continue
            yield Diagnostic(
                clip.call,
                f"`{attr_name(clip.call)}` runs after the optimizer step on line {line_of(model, steps[-1].call)} "
                "has already applied the gradients, so it changes nothing; clip between backward and step.",
                related=((steps[-1].call, "optimizer step here"),),
            )


# ----------------------------------------------------------------------------------------------------
# TL109 fp16-autocast-without-scaler
# ----------------------------------------------------------------------------------------------------


class Fp16AutocastWithoutScaler(Rule):
    id = "TL109"
    name = "fp16-autocast-without-scaler"
    severity = Severity.WARNING
    summary = "fp16 autocast with a plain backward and no GradScaler: small gradients underflow to zero."
    # Every finding needs an fp16 autocast (`float16`, `half`, `torch.cuda.amp`, or a device string
    # that is `cuda`, spelled out or through an escape as for TL107) and a `x.backward()`
    # (``method_call_pattern``).
    tokens = ("autocast",)
    requires = (
        ("backward",),
        ("float16", "half", "cuda", "\\x", "\\u", "\\U", "\\N", "\\1", "\\\n", "\\\r"),
        method_call_pattern("backward"),
    )
    doc = RuleDoc(
        what=(
            "Reports a plain `loss.backward()` whose loss was computed under fp16 autocast "
            "(`torch.autocast('cuda')` and `torch.amp.autocast('cuda')` default to fp16, "
            "`torch.cuda.amp.autocast()` too, or an explicit `dtype=torch.float16`) in a file that "
            "uses no GradScaler. Not reported for bf16 autocast, an autocast whose dtype or device is "
            "not known, a file that uses a `GradScaler` (or any name containing `scaler`, such as a "
            "`loss_scaler` passed in from elsewhere), or code built on a framework that "
            "scales the loss itself (Accelerate, Lightning, DeepSpeed, apex, Megatron)."
        ),
        why=(
            "Under fp16 autocast the activations and their gradients are fp16, whose smallest "
            "positive value is 2^-24 ≈ 6e-8 (and which loses precision below 2^-14 ≈ 6e-5). "
            "Gradients of a loss averaged over a large batch are often that small: a gradient of "
            "1e-8 becomes exactly 0 and the layers below it receive nothing. A GradScaler multiplies "
            "the loss by 65536 before backward, which moves 1e-8 to 6.6e-4, comfortably inside "
            "fp16's range, and divides it back out in fp32 before the step."
        ),
        example=(
            "with torch.autocast('cuda', dtype=torch.float16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "loss.backward()\n"
            "optimizer.step()"
        ),
        use_instead=(
            "scaler = torch.amp.GradScaler('cuda')\n"
            "with torch.autocast('cuda', dtype=torch.float16):\n"
            "    loss = loss_fn(model(x), y)\n"
            "scaler.scale(loss).backward()\n"
            "scaler.step(optimizer)\n"
            "scaler.update()"
        ),
        references=("https://pytorch.org/docs/stable/amp.html#gradient-scaling",),
    )
    valid = (
        "import torch\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n    loss = model(x)\nloss.backward()",
        "import torch\nscaler = torch.amp.GradScaler()\nwith torch.autocast('cuda'):\n    loss = model(x)\n"
        "scaler.scale(loss).backward()",
        # cpu autocast defaults to bf16
        "import torch\nwith torch.autocast('cpu'):\n    loss = model(x)\nloss.backward()",
        # unknown device
        "import torch\nwith torch.autocast(device_type=device):\n    loss = model(x)\nloss.backward()",
        # Accelerate scales
        "import torch\nfrom accelerate import Accelerator\nwith torch.autocast('cuda'):\n    loss = model(x)\n"
        "accelerator.backward(loss)\nloss2.backward()",
        # the backward's loss was not computed under autocast
        "import torch\nwith torch.autocast('cuda'):\n    feats = model(x)\nloss2 = other(y)\nloss2.backward()",
        # disabled autocast
        "import torch\nwith torch.autocast('cuda', enabled=False):\n    loss = model(x)\nloss.backward()",
        # the scaler is created elsewhere in the file (a trainer class)
        "import torch\nclass T:\n    def __init__(self):\n        self.scaler = torch.cuda.amp.GradScaler()\n"
        "    def eval_grad(self, x):\n        with torch.autocast('cuda'):\n            loss = self.model(x)\n"
        "        loss.backward()",
    )
    invalid = (
        Invalid(
            "import torch\nwith torch.autocast('cuda', dtype=torch.float16):\n    loss = model(x)\nloss.backward()",
            line=4,
        ),
        Invalid(
            "from torch.cuda.amp import autocast\nfor x, y in data:\n    with autocast():\n"
            "        out = model(x)\n        loss = crit(out, y)\n    loss = loss / accum\n    loss.backward()",
            line=7,
        ),
        Invalid(
            "import torch\ndef step(model, x):\n    with torch.amp.autocast('cuda'):\n        loss = model(x).mean()\n"
            "    loss.backward()",
            line=5,
        ),
        # backward inside the region (also TL106)
        Invalid(
            "import torch\nwith torch.autocast(device_type='cuda', dtype=torch.half):\n    loss = model(x)\n"
            "    loss.backward()",
            line=4,
        ),
        # tuple target
        Invalid(
            "import torch\nwith torch.autocast('cuda'):\n    logits, loss = model(x, y)\n(loss * 2).backward()",
            line=4,
        ),
        # enabled from a flag: on the fp16 path there is no scaler
        Invalid(
            "import torch\nwith torch.autocast('cuda', enabled=args.amp):\n    out = model(x)\n"
            "    loss = out.loss\nloss.backward()",
            line=5,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        training = model.training
        if scaler_in_file(model) or uses_scaling_framework(model):
            return
        for backward in training.of_kind("backward"):
            site = backward.site
            recv = receiver(backward.call)
            if recv is None:
                continue
            names = {dotted(n) for n in walk(recv) if isinstance(n, cst.Name)} - {None}
            region = self._fp16_region(model, site)
            if region is None:
                for assign in model.assigns:
                    if assign.scope is not site.scope or assign.order > site.order:
                        continue
                    node = assign.node
                    targets = (
                        [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
                    )
                    bound = {dotted(n) for t in targets for n in walk(t) if isinstance(n, cst.Name)}
                    if bound & names:
                        found = self._fp16_region(model, assign)
                        if found is not None:
                            region = found
            if region is None:
                continue
            yield Diagnostic(
                backward.call,
                "The loss comes from fp16 autocast but is backpropagated without a GradScaler: gradients "
                "below about 6e-8 underflow to zero in fp16; use `torch.amp.GradScaler` (or bf16 autocast).",
                related=((region, "fp16 autocast here"),),
            )

    @staticmethod
    def _fp16_region(model: FileModel, site: Site) -> cst.Call | None:
        regions = autocast_frames(model, site)
        if not regions:
            return None
        call, enabled = regions[-1]
        if enabled and autocast_dtype(model, call, site.scope) == "fp16":
            return call
        return None
