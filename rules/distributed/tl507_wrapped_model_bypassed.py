"""TL507 wrapped-model-bypassed."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import FileModel, Scope, Site, dotted, grad_disabled, innermost_loop
from trainlint.model.vocab import DDP_CLASSES
from trainlint.rules.distributed._sharding import Wrap, same_owner, wraps


class WrappedModelBypassed(Rule):
    id = "TL507"
    name = "wrapped-model-bypassed"
    severity = Severity.ERROR
    probe = True
    WRAP = "wrap"
    summary = "The module wrapped in DistributedDataParallel is called directly in the training loop."
    # A finding needs a `DistributedDataParallel(...)` call (its imported name is in the text even when
    # it is called as `DDP`) and a backward in the scope of the call it reports.
    tokens = ("DistributedDataParallel",)
    requires = (("backward",),)
    # In the code: a call of torch's DDP class (by its name, or a name bound to it).
    gate = (("call:DistributedDataParallel", "alias:DistributedDataParallel"), ("import:torch",))
    # And a wrap assigned to a name, and a call of the wrapped module (or of its `.module`) in a loop of a
    # scope with a backward, not before the wrap, in no loop that calls the wrapper.
    gate_check = "gate_wrapped_model.wrapped_module_may_be_called"
    doc = RuleDoc(
        what=(
            "Reports a call of the module that was passed to `DistributedDataParallel` under another "
            "name (`ddp_model = DDP(model)`, then `model(x)`) inside a loop of a function that also runs "
            "a backward, after the wrap and outside `torch.no_grad()`, when the wrapped name is not "
            "called in that loop. `model = DDP(model)` (one name) is never reported. The same for the "
            "module inside the wrapper, reached through its `.module` attribute: `model.module(x)`, or a "
            "name assigned from it (`raw = model.module if isinstance(model, DDP) else model`, "
            '`getattr(model, "module", model)`), also when the wrap binds a global of the script that '
            "the training function reads."
        ),
        why=(
            "DDP all-reduces gradients through hooks that only its own `forward` arms. Calling the "
            "inner module runs the same layers without them: each rank keeps its local gradients, the "
            "optimizers step on different values and the replicas drift apart from the first step. "
            "With 4 ranks whose local gradients differ by 10% the parameters differ after one step "
            "by 10% of the update and keep diverging; checkpoints saved from rank 0 hold one rank's "
            "model, trained on a quarter of the data."
        ),
        example=(
            "ddp_model = DDP(model, device_ids=[rank])\n"
            "for x, y in loader:\n"
            "    loss = F.cross_entropy(model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()"
        ),
        use_instead=(
            "ddp_model = DDP(model, device_ids=[rank])\n"
            "for x, y in loader:\n"
            "    loss = F.cross_entropy(ddp_model(x), y)\n"
            "    loss.backward()\n"
            "    opt.step()"
        ),
        references=(
            "https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html",
        ),
    )
    _HEAD = "import torch\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
    valid = (
        # the wrapped model called
        _HEAD
        + "ddp_model = DDP(model)\nfor x, y in loader:\n    ddp_model(x).sum().backward()\n    opt.step()",
        # one name for both
        _HEAD + "model = DDP(model)\nfor x, y in loader:\n    model(x).sum().backward()\n    opt.step()",
        # evaluation of the inner module without grad
        _HEAD + "ddp_model = DDP(model)\nfor x, y in loader:\n    ddp_model(x).sum().backward()\n"
        "with torch.no_grad():\n    for x, y in val_loader:\n        model(x)",
        # a call before the wrap (a warm-up, a shape check)
        _HEAD + "for x in warmup:\n    model(x)\nddp_model = DDP(model)\nfor x, y in loader:\n"
        "    ddp_model(x).sum().backward()",
        # no training in that function
        _HEAD
        + "def evaluate(model, loader):\n    for x in loader:\n        model(x)\n"
        + "ddp_model = DDP(model)\nfor x, y in loader:\n    ddp_model(x).sum().backward()",
        # both called in the loop (e.g. a frozen reference pass next to the trained one)
        _HEAD + "ddp_model = DDP(model)\nfor x, y in loader:\n    ref = model(x)\n"
        "    (ddp_model(x) - ref.detach()).sum().backward()",
        # the inner module for generation without grad
        _HEAD + "model = DDP(net)\nraw = getattr(model, 'module', model)\nfor x in loader:\n"
        "    with torch.no_grad():\n        samples = raw(x)\n    model(samples).sum().backward()",
    )
    invalid = (
        Invalid(
            _HEAD + "ddp_model = DDP(model, device_ids=[rank])\nfor x, y in loader:\n"
            "    loss = torch.nn.functional.cross_entropy(model(x), y)\n    loss.backward()\n    opt.step()",
            line=5,
        ),
        Invalid(
            """
            import torch.nn.parallel

            def train(net, loader, opt):
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
                for epoch in range(3):
                    for batch in loader:
                        out = net(batch)
                        out.loss.backward()
                        opt.step()
            """,
            line=7,
        ),
        Invalid(
            """
            from torch.nn.parallel import DistributedDataParallel

            class Trainer:
                def __init__(self, model):
                    self.model = model
                    self.ddp = DistributedDataParallel(self.model)

                def fit(self, loader):
                    for batch in loader:
                        loss = self.model(batch).mean()
                        loss.backward()
                        self.opt.step()
            """,
            line=10,
        ),
        Invalid(
            _HEAD
            + "ddp = DDP(model.cuda(), device_ids=[0])\nddp = DDP(model)\nscaler = torch.amp.GradScaler()\n"
            "while True:\n    logits, loss = model(X, Y)\n    scaler.scale(loss).backward()\n"
            "    scaler.step(opt)\n    scaler.update()",
            line=7,
        ),
        Invalid(
            _HEAD + "dist_model = DDP(module=model)\nfor x, y in loader:\n    with torch.autocast('cuda'):\n"
            "        y_hat = model(x)\n    crit(y_hat, y).backward()",
            line=6,
        ),
        Invalid(
            _HEAD + "def main():\n    ddp_model = DDP(model)\n    for step in range(100):\n"
            "        pred = model(x)\n        pred.sum().backward()",
            line=6,
        ),
        Invalid(
            _HEAD + "def train(loader):\n    raw = model.module if isinstance(model, DDP) else model\n"
            "    for x in loader:\n        raw(x).sum().backward()\n"
            "if __name__ == '__main__':\n    model = DDP(net)\n    train(loader)",
            line=6,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        every = wraps(model, DDP_CLASSES)
        found = [w for w in every if w.inner and w.inner != w.outer]
        if not every:
            return
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            name = dotted(call.func)
            if name is None:
                continue
            for wrap in every:
                if wrap in found and name == wrap.inner and self._bypasses(model, site, wrap):
                    what = "the module wrapped by DistributedDataParallel"
                elif _unwraps(model, name, site.scope, wrap.outer) and self._bypasses(
                    model, site, wrap, globals_too=True
                ):
                    what = "the module inside DistributedDataParallel (its `.module`)"
                else:
                    continue
                yield Diagnostic(
                    call,
                    f"`{name}` is {what} as `{wrap.outer}`: calling it directly skips DDP's gradient "
                    f"all-reduce, so the ranks drift apart; call `{wrap.outer}(...)` in training.",
                    related=((wrap.site.node, "wrapped here", WrappedModelBypassed.WRAP),),
                )
                break

    @staticmethod
    def _bypasses(model: FileModel, site: Site, wrap: Wrap, *, globals_too: bool = False) -> bool:
        if not (same_owner(site.scope, wrap) or (globals_too and _global_wrap(model, site.scope, wrap))):
            return False
        if site.scope is wrap.site.scope and site.order < wrap.site.order:
            return False
        loop = innermost_loop(site)
        if loop is None or grad_disabled(model, site):
            return False
        if not model.training.events_in(site.scope, "backward", "scaled_backward"):
            return False
        for other in model.calls_in(site.scope):
            node = other.node
            assert isinstance(node, cst.Call)
            if dotted(node.func) == wrap.outer and any(f.node is loop.node for f in other.frames):
                return False
        return True


def _global_wrap(model: FileModel, scope: Scope, wrap: Wrap) -> bool:
    """The wrap binds a module-level name that ``scope`` reads as that global (a training function of a
    script whose ``__main__`` block wraps the model)."""
    if wrap.site.scope is not model.module_scope or "." in wrap.outer:
        return False
    binding = model.lookup(wrap.outer, scope)
    return binding is not None and binding in model.module_scope.bindings.get(wrap.outer, ())


def _module_of(expr: cst.BaseExpression, outer: str) -> bool:
    """``expr`` is DDP's inner module of ``outer``: ``outer.module``, either branch of ``outer.module
    if isinstance(outer, DDP) else outer``, or ``getattr(outer, "module", outer)``."""
    if isinstance(expr, cst.IfExp):
        return _module_of(expr.body, outer) or _module_of(expr.orelse, outer)
    if isinstance(expr, cst.Call) and dotted(expr.func) == "getattr" and len(expr.args) >= 2:
        attr = expr.args[1].value
        return (
            dotted(expr.args[0].value) == outer
            and isinstance(attr, cst.SimpleString)
            and attr.evaluated_value == "module"
        )
    return dotted(expr) == f"{outer}.module"


def _unwraps(model: FileModel, name: str, scope: Scope, outer: str) -> bool:
    """The called ``name`` is DDP's inner module of ``outer``: ``outer.module(x)`` itself, or a name
    (or ``self.`` attribute) assigned from it (``actor = model.module if ... else model``)."""
    if name == f"{outer}.module":
        return True
    head, _, attr = name.partition(".")
    if attr and (head != "self" or "." in attr):
        return False
    expr = cst.Attribute(cst.Name(head), cst.Name(attr)) if attr else cst.Name(head)
    return any(_module_of(value, outer) for value in model.values_of(expr, scope))
