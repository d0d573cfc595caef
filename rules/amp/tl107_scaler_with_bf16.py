"""TL107 scaler-with-bf16."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import (
    Diagnostic,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    method_call_pattern,
)
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    Training,
    keyword,
)
from trainlint.model.vocab import (
    AUTOCAST_FUNCTIONS,
)
from trainlint.rules.amp._shared import autocast_dtype


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
    # In the tree: a scaled backward in a scope with no autocast that surely is not bf16, and one that may
    # be bf16 there (or, when no autocast of the file surely is not, anywhere).
    gate_check = "gate_scaler_steps.scaled_backward_may_meet_bf16"
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
        """
        import torch
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda', dtype=torch.float16):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # default cuda autocast is fp16
        """
        import torch
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda'):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # nanoGPT: enabled only for fp16
        """
        import torch
        ptdtype = torch.bfloat16
        scaler = torch.amp.GradScaler(enabled=(dtype == 'float16'))
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # the dtype is configurable
        """
        import torch
        dtype = torch.bfloat16 if bf16 else torch.float16
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda', dtype=dtype):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # both dtypes in the function
        """
        import torch
        def f():
            scaler = torch.amp.GradScaler()
            with torch.autocast('cuda', dtype=torch.bfloat16):
                a = enc(x)
            with torch.autocast('cuda', dtype=torch.float16):
                loss = dec(a)
            scaler.scale(loss).backward()
        """,
        # bf16 without a scaler
        """
        import torch
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
        """,
        # no autocast at all
        """
        import torch
        scaler = torch.amp.GradScaler()
        scaler.scale(model(x.to(torch.bfloat16))).backward()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler('cuda')
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = model(x)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            from torch.cuda.amp import GradScaler
            scaler = GradScaler()
            def train(x):
                with torch.amp.autocast(device_type='cuda', dtype=torch.bfloat16):
                    loss = model(x)
                scaler.scale(loss).backward()
            """,
            line=7,
        ),
        Invalid(
            """
            import torch
            class T:
                def __init__(self):
                    self.scaler = torch.amp.GradScaler()
                def forward_loss(self, x):
                    with torch.autocast('cuda', dtype=torch.bfloat16):
                        return self.model(x)
                def step(self, x):
                    self.scaler.scale(self.forward_loss(x)).backward()
            """,
            line=9,
        ),
        Invalid(
            """
            import torch
            DTYPE = torch.bfloat16
            scaler = torch.amp.GradScaler(enabled=True)
            with torch.autocast(device_type='cuda', dtype=DTYPE):
                loss = model(x)
            scaler.scale(loss).backward()
            """,
            line=6,
        ),
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler('cpu')
            with torch.cpu.amp.autocast():
                loss = model(x)
            scaler.scale(loss).backward()
            """,
            line=5,
        ),
        Invalid(
            """
            import torch
            scaler = torch.amp.GradScaler()
            with torch.autocast('cuda', torch.bfloat16):
                loss = model(x)
            scaler.scale(loss).backward()
            """,
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


def scope_autocasts(model: FileModel, scope: Scope) -> list[Site]:
    """Call sites of autocast constructors in ``scope`` (with-items, decorators, assigned contexts)."""
    return [site for site in model.calls_in(scope) if model.callee(site) in AUTOCAST_FUNCTIONS]


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
