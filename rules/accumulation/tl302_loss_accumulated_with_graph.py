"""TL302 loss-accumulated-with-graph."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import libcst as cst

from trainlint.api import (
    Applicability,
    Diagnostic,
    FixSpec,
    Invalid,
    Rule,
    RuleDoc,
    Severity,
    TextEditSpec,
    call_pattern,
)
from trainlint.model import (
    FileModel,
    Scope,
    Site,
    attr_name,
    dotted,
    grad_disabled,
    in_loop,
    innermost_loop,
    walk,
)
from trainlint.model.crossfile import backward_returned, related_elsewhere
from trainlint.model.losses import backward_calls, names_reach_backward, snippet
from trainlint.model.training import is_step_count_name
from trainlint.rules.accumulation._losses import backward_losses
from trainlint.rules.accumulation._uses import Uses, name_references, parent_map


class LossAccumulatedWithGraph(Rule):
    id = "TL302"
    name = "loss-accumulated-with-graph"
    severity = Severity.WARNING
    probe = True
    BACKWARD = "backward"
    summary = "A running loss total keeps every iteration's autograd graph alive."
    # Prefilter: a backward call (``call_pattern``) and an addition to a total (`+=`, `t = t + x`,
    # `.append(x)`); in the code (``gate``), the call (a helper of this file that runs one holds one)
    # and the addition in a `for`/`while` statement, which every finding is, the cross-file ones too.
    tokens = ("backward",)
    requires = (call_pattern("backward"), ("+", "append"))
    gate = (("call:backward", "call:manual_backward"), ("loop:+=", "loop:append"))
    # a helper of another file (or a base's method) may backpropagate the loss it returns (`loss = step(b)`)
    project_requires = (
        ("+", "append"),
        ("for", "while"),
        re.compile(r"loss\w*\s*=\s*[\w.]+\(|\+=\s*[\w.]+\(|append\((?<!\wappend\()\s*[\w.]+\("),
    )
    project_gate = gate[1:]
    gate_check = "gate_loss_totals.total_may_hold_loss_graph"  # a loss added in its backward's loop
    project_gate_check = "gate_loss_totals.returned_loss_may_be_kept"  # a call added that may be one
    # a cross-file finding asks only about what those calls (their instances' classes, ``self``'s bases)
    # resolve to: an imported helper that returns its loss, reached through none of them, plays no part
    project_callees = "gate_loss_totals.kept_loss_callees"
    fact_words = ("backward",)  # (a returned loss is one whose `.backward()` the function called)

    @classmethod
    def wants_fact(cls, kind: str, facts: dict[str, Any]) -> bool:
        if kind == "class":
            return "returns_loss_methods" in facts
        return kind == "function" and "returns_loss" in facts

    has_fix = True
    doc = RuleDoc(
        what=(
            "Reports a running total or list inside a loop that collects a loss tensor that is "
            "backpropagated in the same loop (`total += loss`, `total = total + loss`, "
            "`losses.append(loss)`) without `.item()`, `.detach()`, `float()` or `.tolist()`. A "
            "total that is itself backpropagated later (`sum(losses).backward()`), one reset on each "
            "iteration, and additions under `torch.no_grad()` are not reported."
        ),
        why=(
            "A loss tensor carries its `grad_fn`, and adding it to a total makes the total's "
            "`grad_fn` point at it, so the autograd graph of every iteration stays reachable until "
            "the total is dropped. The graph nodes alone are kept even after `backward()` freed the "
            "saved tensors; when the addition happens before `backward()`, or the graph is retained, "
            "the saved activations stay too. With 200 MB of saved activations per step, a "
            "100-step epoch would pin 20 GB; in the lighter case the process still leaks thousands "
            "of graph nodes per step, and memory climbs steadily over an epoch until it runs out "
            "or the epoch ends."
        ),
        example=(
            "total_loss = 0.0\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    total_loss += loss"
        ),
        use_instead=(
            "total_loss = 0.0\n"
            "for x, y in loader:\n"
            "    loss = criterion(model(x), y)\n"
            "    loss.backward()\n"
            "    optimizer.step()\n"
            "    optimizer.zero_grad()\n"
            "    total_loss += loss.item()  # or loss.detach() to avoid a sync per step"
        ),
        fix_safety=(
            "The fix appends `.detach()` (not `.item()`, which waits for the GPU on every "
            "iteration) to the loss where it is added or appended. It looks at every use of the "
            "total in the same function. When the total starts as a Python number or an empty list "
            "and each use also works with a number (arithmetic, comparisons, f-strings, `print`, "
            "`float`, `sum`, `len`, `math`/`numpy`/`statistics`, logger and `add_scalar` calls), the "
            "fix is unsafe: the total becomes a 0-d tensor, which those uses take but code that "
            "needs a real float (`json.dumps`, `isinstance`) does not. Otherwise "
            "(`torch.stack(losses)`, `total.item()`, `dist.all_reduce(total)`) it is safe: the total "
            "keeps its value, dtype, device and type and only stops recording the graph, which "
            "nothing needs (the rule only reports totals that are not backpropagated in the "
            "function); it is marked unsafe when the total leaves the function (returned, stored on "
            "`self` or in a container), where code out of sight might still differentiate it."
        ),
        references=(
            "https://pytorch.org/docs/stable/notes/faq.html#my-model-reports-cuda-runtime-error-2-out-of-memory",
        ),
    )
    valid = (
        """
        total = 0.0
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            total += loss.item()
        """,
        """
        total = 0.0
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            total += loss.detach()
        """,
        """
        total = 0.0
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            total += float(loss)
        """,
        """
        losses = []
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            losses.append(loss.detach().cpu())
        """,
        # the total is what gets backpropagated: keeping the graph is the point
        """
        total = 0
        for chunk in chunks:
            total = total + model(chunk).loss
        total.backward()
        """,
        """
        losses = []
        for head in heads:
            loss = crit(head(h), y)
            losses.append(loss)
        torch.stack(losses).sum().backward()
        """,
        # building one loss from parts, then backward
        """
        for x, y in loader:
            loss = crit(model(x), y)
            loss += 0.01 * aux_loss
            loss.backward()
        """,
        # eval loop: no backward, under no_grad
        """
        import torch
        with torch.no_grad():
            for x, y in val_loader:
                loss = crit(model(x), y)
                val_loss += loss

        """,
        # converted to a float before being added
        """
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            loss = loss.item()
            total += loss
        """,
        # reset on every iteration: the graph lives for one iteration only
        """
        for batch in loader:
            running = 0
            for chunk in batch:
                l = model(chunk).loss
                l.backward()
                running += l
            print(running)
        """,
        # a step function's micro-step loop: the list lives for one optimizer step
        """
        def train_step(model, it):
            losses = []
            for _ in range(args.gradient_accumulation_steps):
                loss = model(next(it)).loss
                loss.backward()
                losses.append(loss)
            return torch.stack(losses).mean().item()
        """,
        # accumulated under no_grad
        """
        import torch
        for x, y in loader:
            loss = crit(model(x), y)
            loss.backward()
            with torch.no_grad():
                total += loss
        """,
        # an eval loop after the training loop, in the same epoch loop (accelerate's examples): the
        # loss there comes from a no_grad forward, and no iteration of it makes a graph
        """
        import torch
        for epoch in range(E):
            for batch in train_loader:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
            losses = []
            for batch in eval_loader:
                with torch.no_grad():
                    outputs = model(**batch)
                loss = outputs.loss
                losses.append(loss)
        """,
        # a predicate whose name ends in "backward" is not a backward (torch/_functorch/partitioners.py)
        """
        output_values = []
        for x in outputs:
            if _must_be_in_backward(x):
                continue
            output_values.append(x)
        """,
        # ... even when it appends the training loop's last loss by mistake: one graph, not one per step
        """
        import torch
        for epoch in range(E):
            for batch in train_loader:
                loss = model(**batch).loss
                accelerator.backward(loss)
            losses = []
            for batch in eval_loader:
                with torch.no_grad():
                    outputs = model(**batch)
                losses.append(gather(loss.repeat(bs)))
        """,
    )
    invalid = (
        # added in a loop of its own inside the training loop
        Invalid(
            """
            history = []
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                for log in loggers:
                    history.append(loss)
            """,
            line=6,
        ),
        # added once per epoch, after the epoch's loop: one graph per epoch stays alive
        Invalid(
            """
            history = []
            for epoch in range(E):
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                history.append(loss)
            """,
            line=6,
        ),
        # reset once per epoch, accumulated over the whole data loader
        Invalid(
            """
            for epoch in range(3):
                running_loss = 0.0
                for x, y in train_loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    running_loss += loss
            """,
            line=6,
        ),
        Invalid(
            """
            total_loss = 0
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                total_loss += loss
            """,
            line=5,
        ),
        Invalid(
            """
            losses = []
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                losses.append(loss)
            """,
            line=5,
        ),
        Invalid(
            """
            epoch_loss = 0
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                epoch_loss = epoch_loss + loss
            """,
            line=5,
        ),
        # .cpu() and .float() keep the graph
        Invalid(
            """
            hist = []
            for x, y in loader:
                loss = crit(model(x), y)
                scaler.scale(loss).backward()
                hist.append(loss.float().cpu())
            """,
            line=5,
        ),
        # HF style .loss through accelerator.backward
        Invalid(
            """
            def train(model, loader, accelerator):
                tr_loss = 0.0
                for batch in loader:
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    tr_loss += outputs.loss
                return tr_loss / len(loader)
            """,
            line=6,
        ),
        # the scaled loss added before backward
        Invalid(
            """
            for step, batch in enumerate(loader):
                loss = model(**batch).loss / accum
                self.total_loss += loss
                loss.backward()
            """,
            line=3,
        ),
        # a dict of running totals
        Invalid(
            """
            stats = {'loss': 0}
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                stats['loss'] += loss
            """,
            line=5,
        ),
        Invalid(
            """
            while step < max_steps:
                loss = crit(model(x), y)
                fabric.backward(loss)
                running_loss += loss * x.size(0)
                step += 1
            """,
            line=4,
        ),
        # unsafe fix: detach (no sync per step) when every use takes a number; the total becomes a tensor
        Invalid(
            """
            total_loss = 0.0
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                # running total for the log
                total_loss += loss  # summed over the epoch
            print(f"loss {total_loss / len(loader):.4f}")
            """,
            unsafe_fix="""
            total_loss = 0.0
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                # running total for the log
                total_loss += loss.detach()  # summed over the epoch
            print(f"loss {total_loss / len(loader):.4f}")
            """,
        ),
        # unsafe fix: detach for every reference of the loss
        Invalid(
            """
            def epoch(model, loader, writer):
                running = 0
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    running += loss * x.size(0) + (  # weighted
                        loss
                    )
                writer.add_scalar("loss", running / len(loader))
            """,
            unsafe_fix="""
            def epoch(model, loader, writer):
                running = 0
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    running += loss.detach() * x.size(0) + (  # weighted
                        loss.detach()
                    )
                writer.add_scalar("loss", running / len(loader))
            """,
        ),
        # safe fix: detach when the list is stacked
        Invalid(
            """
            import torch

            losses = []
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                losses.append(loss)  # keep for the epoch mean
            epoch_loss = torch.stack(losses).mean().item()
            """,
            fix="""
            import torch

            losses = []
            for x, y in loader:
                loss = crit(model(x), y)
                loss.backward()
                losses.append(loss.detach())  # keep for the epoch mean
            epoch_loss = torch.stack(losses).mean().item()
            """,
        ),
        # safe fix: detach when a method follows the loss
        Invalid(
            """
            hist = []
            for x, y in loader:
                loss = crit(model(x), y)
                scaler.scale(loss).backward()
                # keep a copy on the host
                hist.append(loss.float().cpu())
            """,
            fix="""
            hist = []
            for x, y in loader:
                loss = crit(model(x), y)
                scaler.scale(loss).backward()
                # keep a copy on the host
                hist.append(loss.detach().float().cpu())
            """,
        ),
        # safe fix: detach when the total is reduced as a tensor
        Invalid(
            """
            import torch
            import torch.distributed as dist

            def train(model, loader):
                total = torch.zeros((), device="cuda")
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    total += loss  # on the device
                dist.all_reduce(total)
                print(total.item())
            """,
            fix="""
            import torch
            import torch.distributed as dist

            def train(model, loader):
                total = torch.zeros((), device="cuda")
                for x, y in loader:
                    loss = crit(model(x), y)
                    loss.backward()
                    total += loss.detach()  # on the device
                dist.all_reduce(total)
                print(total.item())
            """,
        ),
        # unsafe fix: detach unsafe when the total is returned
        Invalid(
            """
            def train(model, loader, accelerator):
                tr_loss = 0.0
                for batch in loader:
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    tr_loss = tr_loss + outputs.loss  # running sum
                return tr_loss / len(loader)
            """,
            unsafe_fix="""
            def train(model, loader, accelerator):
                tr_loss = 0.0
                for batch in loader:
                    outputs = model(**batch)
                    accelerator.backward(outputs.loss)
                    tr_loss = tr_loss + outputs.loss.detach()  # running sum
                return tr_loss / len(loader)
            """,
        ),
        # unsafe fix: detach unsafe on an attribute
        Invalid(
            """
            class Trainer:
                def fit(self, loader):
                    for batch in loader:
                        loss = self.model(batch).loss
                        loss.backward()
                        # kept on the trainer
                        self.total_loss += loss
            """,
            unsafe_fix="""
            class Trainer:
                def fit(self, loader):
                    for batch in loader:
                        loss = self.model(batch).loss
                        loss.backward()
                        # kept on the trainer
                        self.total_loss += loss.detach()
            """,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        losses_by_scope: dict[int, list[tuple[str, Site]]] = {}
        for site, target, added, statement in self._additions(model):
            if (
                not site.inside("loop")
                or grad_disabled(model, site, decorators=False)
                or self._window_loop(site)
            ):
                continue
            scope = site.scope
            returned = self._returned_loss(model, added, site, target)
            if returned is not None:
                yield returned
                continue
            if id(scope) not in losses_by_scope:
                losses_by_scope[id(scope)] = backward_losses(model, scope)
            loop = innermost_loop(site)
            for key, backward in losses_by_scope[id(scope)]:
                # graphs pile up only when one loop holds both: the backward inside the addition's loop
                # or the addition inside the backward's (an eval loop after the training loop, both in
                # the epoch loop, makes no new graph per iteration)
                backward_loop = innermost_loop(backward)
                if key == target or not (
                    (loop is not None and in_loop(backward, loop))
                    or (backward_loop is not None and in_loop(site, backward_loop))
                ):
                    continue
                if not self._attached_reference(model, added, key, site):
                    continue
                if self._total_is_backpropagated(model, site, target) or self._reset_in_loop(
                    model, site, target
                ):
                    continue
                yield Diagnostic(
                    statement,
                    f"{snippet(model, statement, 'This running total')} keeps every iteration's autograd "
                    f"graph alive through `{key}`; accumulate `{key}.item()` or `{key}.detach()` instead.",
                    related=(
                        (backward.node, "the loss is backpropagated here", LossAccumulatedWithGraph.BACKWARD),
                    ),
                    fix=detach_fix(model, site, target, added, key, is_list=isinstance(statement, cst.Call)),
                    elsewhere=related_elsewhere(backward_returned(model, backward), self.BACKWARD),
                )
                break

    def _returned_loss(
        self, model: FileModel, added: cst.BaseExpression, site: Site, target: str
    ) -> Diagnostic | None:
        """``total += self.train_step(batch)``: the added call (not detached) runs the backward of the
        loss it returns, in this file's class, a base class or a helper of another project file."""
        calls = list(_attached_calls(model, added, site.scope)) if model.project is not None else []
        sites = {id(s.node): s for s in model.calls_in(site.scope)} if calls else {}
        for call in calls:
            call_site = sites.get(id(call))
            where = backward_returned(model, call_site) if call_site is not None else None
            if where is None or self._total_is_backpropagated(model, site, target):
                continue
            if self._reset_in_loop(model, site, target):
                return None
            name = snippet(model, call.func, "the call")
            return Diagnostic(
                site.node,
                f"{snippet(model, site.node, 'This running total')} keeps every iteration's autograd "
                f"graph alive: {name} returns the loss it backpropagated; accumulate its `.item()` or "
                "`.detach()` instead.",
                related=((call, "the loss is backpropagated inside this call", self.BACKWARD),),
                fix=FixSpec(
                    Applicability.UNSAFE,
                    "Detach the returned loss",
                    (TextEditSpec(call, "after", ".detach()"),),
                ),
                elsewhere=related_elsewhere(where, self.BACKWARD),
            )
        return None

    @staticmethod
    def _additions(model: FileModel) -> Iterator[tuple[Site, str, cst.BaseExpression, cst.CSTNode]]:
        """(site, running total as dotted text, the added expression, the statement to report)."""
        for site in model.augassigns:
            node = site.node
            assert isinstance(node, cst.AugAssign)
            key = _target_key(node.target)
            if isinstance(node.operator, cst.AddAssign) and key is not None:
                yield site, key, node.value, node
        for site in model.assigns:
            node = site.node
            if not isinstance(node, cst.Assign) or len(node.targets) != 1:
                continue
            key = _target_key(node.targets[0].target)
            value = node.value
            if (
                key is not None
                and isinstance(value, cst.BinaryOperation)
                and isinstance(value.operator, cst.Add)
            ):
                if _target_key(value.left) == key:
                    yield site, key, value.right, node
                elif _target_key(value.right) == key:
                    yield site, key, value.left, node
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) == "append" and isinstance(call.func, cst.Attribute) and len(call.args) == 1:
                key = _target_key(call.func.value)
                if key is not None:
                    yield site, key, call.args[0].value, call

    @staticmethod
    def _attached_reference(model: FileModel, added: cst.BaseExpression, key: str, site: Site) -> bool:
        """``key`` occurs in ``added`` outside any detaching call, and its value at this point is not a
        number taken out of the graph (``loss = loss.item()`` earlier in the loop)."""
        if all(detached for _node, detached in _references(model, added, key, site.scope, False)):
            return False
        if "." not in key:
            earlier = [
                s
                for s in model.assigns
                if s.scope is site.scope
                and s.order < site.order
                and isinstance(s.node, cst.Assign)
                and any((_target_key(t.target) or "").split("[")[0] == key for t in s.node.targets)
            ]
            # ``output['loss'] = output['loss'].detach()`` before ``outputs.append(output)``: the
            # tensor the backward ran on is no longer held (the key is the container's name)
            if earlier and _is_detaching(model, earlier[-1].node.value, site.scope):  # type: ignore[union-attr]
                return False
        return True

    @staticmethod
    def _total_is_backpropagated(model: FileModel, site: Site, target: str) -> bool:
        head = target.split(".")[0].split("[")[0]
        for backward in backward_calls(model, site.scope):
            for n in walk(backward.node):
                if isinstance(n, cst.Name) and n.value == head and not head == "self":
                    return True
                if dotted(n) == target:
                    return True
        return names_reach_backward(model, site.scope, {head}, site.order) if head != "self" else False

    @staticmethod
    def _window_loop(site: Site) -> bool:
        """The addition's only loop is the micro-step loop of one window (``for _ in
        range(accum_steps)``): a total local to the step lives for one optimizer step, not the run."""
        loops = site.inside("loop")
        if len(loops) != 1 or not isinstance(loops[0].node, cst.For):
            return False
        return any(
            isinstance(n, cst.Name | cst.Attribute)
            and is_step_count_name((dotted(n) or "").rsplit(".", 1)[-1])
            for n in walk(loops[0].node.iter)
        )

    @staticmethod
    def _reset_in_loop(model: FileModel, site: Site, target: str) -> bool:
        """``target = ...`` (a plain assignment) inside a loop around the addition: the total then
        lives for one iteration of that loop only. Not when the addition's own loop walks a data
        loader: a total reset once per epoch still holds a whole epoch of graphs."""
        loop_frames = [f for f in site.frames if f.kind == "loop"]
        innermost = loop_frames[-1].node if loop_frames else None
        if isinstance(innermost, cst.For) and any(
            isinstance(n, cst.Name | cst.Attribute)
            and "loader" in (dotted(n) or "").rsplit(".", 1)[-1].lower()
            for n in walk(innermost.iter)
        ):
            return False
        loops = {id(f.node) for f in loop_frames}
        for other in model.assigns:
            if other is site or other.scope is not site.scope or not isinstance(other.node, cst.Assign):
                continue
            if not any(id(f.node) in loops for f in other.frames):
                continue
            for t in other.node.targets:
                if _target_key(t.target) == target:
                    value = other.node.value
                    if not (isinstance(value, cst.BinaryOperation) and _target_key(value.left) == target):
                        return True
        return False


DETACHING_METHODS = frozenset({"item", "detach", "detach_", "tolist", "numpy"})
DETACHING_FUNCTIONS = frozenset({"builtins.float", "builtins.int", "builtins.round"})


def _target_key(expr: cst.CSTNode) -> str | None:
    """``total``, ``self.total``, ``stats['loss']`` as text."""
    key = dotted(expr)
    if key is not None:
        return key
    if isinstance(expr, cst.Subscript):
        base = dotted(expr.value)
        if base is not None:
            return base + "[" + "".join(cst.Module([]).code_for_node(e) for e in expr.slice) + "]"
    return None


def _is_detaching(model: FileModel, expr: cst.BaseExpression, scope: Scope) -> bool:
    if isinstance(expr, cst.Call):
        if attr_name(expr) in DETACHING_METHODS and isinstance(expr.func, cst.Attribute):
            return True
        if model.qualname(expr.func, scope) in DETACHING_FUNCTIONS:
            return True
    return isinstance(expr, cst.Attribute) and expr.attr.value == "data"


def _attached_calls(model: FileModel, expr: cst.CSTNode, scope: Scope) -> Iterator[cst.Call]:
    """The calls in ``expr`` whose results no detaching call encloses."""
    if isinstance(expr, cst.BaseExpression) and _is_detaching(model, expr, scope):
        return
    if isinstance(expr, cst.Call):
        yield expr
    for child in expr.children:
        yield from _attached_calls(model, child, scope)


def _references(
    model: FileModel, expr: cst.CSTNode, key: str, scope: Scope, detached: bool
) -> Iterator[tuple[cst.CSTNode, bool]]:
    """Occurrences of ``key`` in ``expr``, each with whether a detaching call encloses it."""
    if dotted(expr) == key:
        yield expr, detached
        return
    if isinstance(expr, cst.BaseExpression) and _is_detaching(model, expr, scope):
        detached = True
    for child in expr.children:
        yield from _references(model, child, key, scope, detached)


def detach_fix(
    model: FileModel, site: Site, target: str, added: cst.BaseExpression, key: str, is_list: bool
) -> FixSpec | None:
    """Append ``.detach()`` to every attached reference of ``key`` in ``added``."""
    refs = [node for node, detached in _references(model, added, key, site.scope, False) if not detached]
    if not refs:
        return None
    parents = parent_map(site.scope.node)
    receivers = any(
        isinstance(parents.get(id(ref)), cst.Attribute | cst.Subscript)
        and getattr(parents.get(id(ref)), "value", None) is ref
        for ref in refs
    )
    uses = Uses(model, site.scope, parents, name_references(parents, site.scope.node)).of_total(
        target, is_list
    )
    # ``.detach()``, never ``.item()``: ``.item()`` waits for the GPU on every iteration
    method = "detach"
    if not receivers and uses <= {"number"}:
        # the total turns from a Python number into a 0-d tensor: arithmetic, formatting and logging
        # take it, code that needs a real float (json, isinstance) would not
        applicability = Applicability.UNSAFE
    else:
        applicability = Applicability.UNSAFE if "escape" in uses else Applicability.SAFE
    return FixSpec(
        applicability,
        f"Accumulate `{key}.{method}()` instead of `{key}`",
        tuple(TextEditSpec(ref, "after", f".{method}()") for ref in refs),
    )
