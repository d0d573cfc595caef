"""TL109 fp16-autocast-without-scaler."""

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
    Site,
    dotted,
    receiver,
    walk,
)
from trainlint.model.vocab import (
    GRAD_SCALERS,
    SCALER_CLASS_SUFFIX,
    SCALING_FRAMEWORKS,
)
from trainlint.rules.amp._shared import autocast_dtype, autocast_frames


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
    # In the code: the backward call (an event).
    gate = (("call:backward",),)
    # In the tree: no identifier naming a scaler, no scaling framework's import, and a backward in (or
    # whose receiver's name an earlier assignment of its scope binds in) a region that may be fp16 autocast.
    gate_check = "gate_autocast_backward.fp16_backward_may_lack_scaler"
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
        """
        import torch
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
        """,
        """
        import torch
        scaler = torch.amp.GradScaler()
        with torch.autocast('cuda'):
            loss = model(x)
        scaler.scale(loss).backward()
        """,
        # cpu autocast defaults to bf16
        """
        import torch
        with torch.autocast('cpu'):
            loss = model(x)
        loss.backward()
        """,
        # unknown device
        """
        import torch
        with torch.autocast(device_type=device):
            loss = model(x)
        loss.backward()
        """,
        # Accelerate scales
        """
        import torch
        from accelerate import Accelerator
        with torch.autocast('cuda'):
            loss = model(x)
        accelerator.backward(loss)
        loss2.backward()
        """,
        # the backward's loss was not computed under autocast
        """
        import torch
        with torch.autocast('cuda'):
            feats = model(x)
        loss2 = other(y)
        loss2.backward()
        """,
        # disabled autocast
        """
        import torch
        with torch.autocast('cuda', enabled=False):
            loss = model(x)
        loss.backward()
        """,
        # the scaler is created elsewhere in the file (a trainer class)
        """
        import torch
        class T:
            def __init__(self):
                self.scaler = torch.cuda.amp.GradScaler()
            def eval_grad(self, x):
                with torch.autocast('cuda'):
                    loss = self.model(x)
                loss.backward()
        """,
    )
    invalid = (
        Invalid(
            """
            import torch
            with torch.autocast('cuda', dtype=torch.float16):
                loss = model(x)
            loss.backward()
            """,
            line=4,
        ),
        Invalid(
            """
            from torch.cuda.amp import autocast
            for x, y in data:
                with autocast():
                    out = model(x)
                    loss = crit(out, y)
                loss = loss / accum
                loss.backward()
            """,
            line=7,
        ),
        Invalid(
            """
            import torch
            def step(model, x):
                with torch.amp.autocast('cuda'):
                    loss = model(x).mean()
                loss.backward()
            """,
            line=5,
        ),
        # backward inside the region (also TL106)
        Invalid(
            """
            import torch
            with torch.autocast(device_type='cuda', dtype=torch.half):
                loss = model(x)
                loss.backward()
            """,
            line=4,
        ),
        # tuple target
        Invalid(
            """
            import torch
            with torch.autocast('cuda'):
                logits, loss = model(x, y)
            (loss * 2).backward()
            """,
            line=4,
        ),
        # enabled from a flag: on the fp16 path there is no scaler
        Invalid(
            """
            import torch
            with torch.autocast('cuda', enabled=args.amp):
                out = model(x)
                loss = out.loss
            loss.backward()
            """,
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
    return any(
        (model.callee(site) or "") in GRAD_SCALERS or (model.callee(site) or "").endswith(SCALER_CLASS_SUFFIX)
        for site in model.calls
    )
