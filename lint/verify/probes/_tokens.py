"""Token-mean losses (TL301, TL502): the flagged division, the statements that compute what it divides
(for TL502 also the loop body's running totals when the division sits under the accumulation
condition), the model calls on token data (climbing into a method of the class the loop calls with
token data, see ``_members``), and the per-microbatch bindings of token names."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst

from trainlint.model import FileModel, attr_name, dotted, split_lines, walk
from trainlint.model.losses import Division, divisions
from trainlint.verify.context import ProbeContext, TextEdit
from trainlint.verify.probes._members import (
    LOSS_MEMBER,
    Helper,
    Members,
    class_method,
    helper,
    helper_role,
    member_roles,
)
from trainlint.verify.source import (
    NotExecutable,
    analyse_names,
    code_of,
    finding_span,
    is_literal,
    node_span,
)
from trainlint.verify.values import file_value
from trainlint.verify.window import (
    Binder,
    Region,
)

TOKEN_INPUTS = {"input_ids", "ids", "idx", "x", "X", "tokens", "inputs", "input", "token_ids", "src"}

TOKEN_LABELS = {"labels", "label", "targets", "target", "y", "Y", "tgt", "label_ids"}

TOKEN_MASKS = {"attention_mask", "mask", "attn_mask"}

BATCH_NAMES = {"batch", "micro_batch", "microbatch", "inputs_dict", "data", "sample", "mb"}

DATA_CALLS = ("next", "to", "cuda", "pin_memory", "get_batch", "load", "sample", "collate", "items", "fetch")


def division_at(ctx: ProbeContext) -> Division:
    span = finding_span(ctx.finding)
    for division in divisions(ctx.model):
        if node_span(ctx.model, division.node) == span:
            return division
    raise NotExecutable(f"the flagged division at line {ctx.finding.line} was not found")


def _loads_data(model: FileModel, stmt: cst.CSTNode) -> bool:
    for node in walk(stmt):
        if isinstance(node, cst.Call):
            name = attr_name(node) or ""
            if any(part in name for part in DATA_CALLS if len(part) > 4) or name in DATA_CALLS:
                return True
    return False


def _assigned(stmt: cst.CSTNode) -> set[str]:
    out: set[str] = set()
    for node in walk(stmt):
        targets: list[cst.CSTNode] = []
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, cst.AnnAssign | cst.AugAssign):
            targets = [node.target]
        for target in targets:
            for n in walk(target):
                if isinstance(n, cst.Name):
                    out.add(n.value)
    return out


def model_call_mode(window: cst.Module, call_name: str) -> str:
    """How the window uses what the model returns: a tuple, an output object, or logits."""
    for node in walk(window):
        if isinstance(node, cst.Assign) and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == call_name:
                target = node.targets[0].target
                if isinstance(target, cst.Tuple | cst.List):
                    return "tuple"
                if isinstance(target, cst.Name):
                    code = window.code
                    r = target.value
                    if f"{r}.loss" in code or f'{r}["loss"]' in code or f"{r}['loss']" in code:
                        return "output"
                    if f"{r}.logits" in code or f"{r}[0]" in code:
                        return "output"
        if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Call):
            if dotted(node.value.func) == call_name and node.attr.value in ("loss", "logits"):
                return "output"
    return "logits"


def model_calls(window: cst.Module) -> list[str]:
    """Dotted names called with token data (``model(input_ids)``, ``self.model(**batch)``)."""
    tokenish = TOKEN_INPUTS | TOKEN_LABELS | TOKEN_MASKS | BATCH_NAMES
    out = []
    for node in walk(window):
        if isinstance(node, cst.Call):
            name = dotted(node.func)
            if name is None or name.split(".")[-1] in ("backward", "view", "reshape", "size", "float"):
                continue
            used = {n.value for a in node.args for n in walk(a.value) if isinstance(n, cst.Name)}
            if used & tokenish and name not in out:
                out.append(name)
    return out


def library_callable(model: FileModel, scope, name: str) -> bool:
    """``F.cross_entropy``, ``criterion = nn.CrossEntropyLoss()``, the file's own functions: called
    with token data, but not the model."""
    expr = cst.parse_expression(name)
    if model.qualname(expr, scope) is not None or LOSS_MEMBER.search(name.rsplit(".", 1)[-1]):
        return True  # ``self._loss_fn(logits, labels)``: the loss, not the model
    if "." not in name:
        for _, callee in model.call_values(expr, scope):
            if callee and (callee.endswith("Loss") or callee.startswith("torch.nn.functional")):
                return True
    return False


def _earlier(model: FileModel, body: list, index: int, needed: set[str]) -> tuple[int, set[str]]:
    """The first statement of ``body`` before ``index`` that computes a name ``needed`` (directly or
    through the statements it needs), data loading left out; and the names needed then."""
    start = index
    for i in range(index - 1, -1, -1):
        candidate = body[i]
        if not (_assigned(candidate) & needed) or _loads_data(model, candidate):
            continue
        if isinstance(candidate, cst.BaseCompoundStatement) and not isinstance(candidate, cst.With):
            continue
        start = i
        needed |= set(analyse_names(code_of(body[i:index])).free)
    return start, needed


def _backward_slice(model: FileModel, statements: list, needed: set[str]) -> list:
    """The statements (last to first) that compute a name ``needed``, directly or through each other;
    data loading left out."""
    kept = []
    for candidate in reversed(statements):
        if not (_assigned(candidate) & needed) or _loads_data(model, candidate):
            continue
        if isinstance(candidate, cst.BaseCompoundStatement) and not isinstance(candidate, cst.With | cst.If):
            continue
        kept.insert(0, candidate)
        needed |= set(analyse_names(code_of([candidate])).free)
    return kept


def _climbed(ctx: ProbeContext, stmt: cst.CSTNode, needed: set[str]) -> tuple[list, int, set[str]] | None:
    """When the division sits under a condition of the loop (``if (i + 1) % accum == 0: loss =
    total / n``) and the loop body before it builds what it divides (``total += ...``): that body,
    the index of the condition in it, and the names needed."""
    block = ctx.tree.parent.get(id(stmt))
    condition = ctx.tree.parent.get(id(block))
    if not isinstance(condition, cst.If) or condition.body is not block:
        return None
    try:
        _, outer = ctx.tree.block_of(condition)
    except NotExecutable:
        return None
    index = [id(s) for s in outer].index(id(condition))
    if not any(_assigned(s) & needed for s in outer[:index]):
        return None
    return outer, index, needed


def division_statements(
    ctx: ProbeContext, division, *, climb: bool = False
) -> tuple[cst.CSTNode, list[Region], list[TextEdit], dict[str, str]]:
    """The statement holding a loss division and the earlier statements of its block that compute
    what it divides (data loading left out): (statement, regions, edits blanking skipped lines, the
    start values of running totals). A division under the loop's accumulation condition climbs out of
    it (with ``climb``): the loop body's statements that build the totals come first, then the
    division, run once."""
    model = ctx.model
    stmt = ctx.tree.statement_of(division.node)
    _, body = ctx.tree.block_of(stmt)
    index = [id(s) for s in body].index(id(stmt))
    start, needed = _earlier(model, body, index, set(analyse_names(code_of([stmt])).free))
    kept = [s for s in body[start : index + 1] if s is stmt or s is body[start] or not _loads_data(model, s)]
    groups = [kept]
    initial: dict[str, str] = {}
    climbed = _climbed(ctx, body[start], needed) if climb else None
    if climbed is not None:
        outer, at, needed = climbed
        sliced = _backward_slice(model, outer[:at], set(needed))
        groups[:0] = [[s] for s in sliced]  # each statement on its own: those in between are left out
        initial = _start_values(ctx, division, outer[at], sliced)
    regions: list[Region] = []
    keep_lines: set[int] = set()
    for group in groups:
        regions.append(Region(model.position(group[0]).start.line, model.position(group[-1]).end.line))
        keep_lines |= {
            ln for s in group for ln in range(model.position(s).start.line, model.position(s).end.line + 1)
        }
    lines = split_lines(model.source, keepends=True)
    # statements skipped inside the regions (data loading) are blanked out
    blank = [
        TextEdit(ln, 1, ln, len(lines[ln - 1].rstrip("\r\n")) + 1, "")
        for region in regions
        for ln in range(region.start, region.end + 1)
        if ln not in keep_lines and lines[ln - 1].strip()
    ]
    return stmt, regions, blank, initial


def _start_values(ctx: ProbeContext, division, condition: cst.CSTNode, stmts: list) -> dict[str, str]:
    """The literal each running total the loop body updates in place (``num_tokens += n``) starts
    from before the loop (``num_tokens = 0``)."""
    model = ctx.model
    scope = division.site.scope
    updated = {
        n.target.value
        for s in stmts
        for n in walk(s)
        if isinstance(n, cst.AugAssign) and isinstance(n.target, cst.Name)
    }
    loop = next((a for a in ctx.tree.ancestors(condition) if isinstance(a, cst.For | cst.While)), None)
    before = model.position(loop).start.line if loop is not None else model.position(condition).start.line
    out: dict[str, str] = {}
    for site in model.assigns:
        node = site.node
        if site.scope is not scope or not isinstance(node, cst.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0].target
        if (
            isinstance(target, cst.Name)
            and target.value in updated
            and model.position(node).start.line < before
        ):
            if is_literal(node.value):
                out[target.value] = model.code(node.value)
    return out


# keys a batch dict may hold the token ids under (``batch["tokens"]``): the synthetic batch's
# ``input_ids`` is given under the key the code reads
IDS_KEYS = frozenset({"tokens", "ids", "idx", "input_tokens", "token_ids", "src", "inputs"})


def _ids_keys(code: str, name: str) -> list[str]:
    """The ids keys the code reads from the batch dict ``name`` (``batch["tokens"]``)."""
    out: list[str] = []
    for node in walk(cst.parse_module(code)):
        if isinstance(node, cst.Subscript) and dotted(node.value) == name and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                key = index.value.evaluated_value
                if isinstance(key, str) and key in IDS_KEYS and key not in out:
                    out.append(key)
    return out


def token_lines(free: list[str], code: str = "") -> list[str]:
    """Bind the token-data names a loss window reads to the current microbatch ``__tl_mb__``."""
    out = []
    for name in free:
        if name in TOKEN_INPUTS:
            out.append(f"{name} = __tl_mb__['input_ids']")
        elif name in TOKEN_LABELS:
            out.append(f"{name} = __tl_mb__['labels']")
        elif name in TOKEN_MASKS:
            out.append(f"{name} = __tl_mb__['attention_mask']")
        elif name in BATCH_NAMES:
            aliases = "".join(f", {k!r}: __tl_mb__['input_ids']" for k in _ids_keys(code, name))
            out.append(f"{name} = {{**__tl_mb__{aliases}}}" if aliases else f"{name} = dict(__tl_mb__)")
    return out


def loss_target(division, stmt: cst.CSTNode) -> str | None:
    """The name to backpropagate after the division's statement (None when it backpropagates)."""
    stmt_code = code_of([stmt])
    if "backward(" in stmt_code:
        return None
    target = None
    if isinstance(division.node, cst.AugAssign) and isinstance(division.node.target, cst.Name):
        target = division.node.target.value
    elif isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
        t = stmt.body[0].targets[0].target
        target = t.value if isinstance(t, cst.Name) else None
    if target is None:
        raise NotExecutable("the divided loss is neither assigned to a name nor backpropagated")
    return target


# names whose ``.backward(loss)`` stands in for ``loss.backward()`` (Accelerate, Fabric, DeepSpeed)
BACKWARD_OWNERS = ("accelerator", "fabric", "engine", "model_engine")


def stand_in_lm(model: FileModel, scope, window: cst.Module, caller: str, notes: list[str]) -> str:
    """The language-model stand-in for ``caller``: its output width is the file's own vocabulary
    size when the window reshapes the logits by one (``logits.view(-1, VOCAB)``), so that the
    user's reshape and the labels fit."""
    mode = model_call_mode(window, caller)
    for node in walk(window):
        if not (
            isinstance(node, cst.Call) and attr_name(node) in ("view", "reshape") and len(node.args) == 2
        ):
            continue
        width = node.args[1].value
        found = file_value(model, scope, width) if dotted(width) else None
        if found is not None and found.code.isdigit():
            note = f"the stand-in model's vocabulary is {found.note(dotted(width) or '')}"
            if note not in notes:
                notes.append(note)
            return f"__tl__.TinyLM({mode!r}, vocab={found.code})"
    return f"__tl__.TinyLM({mode!r})"


@dataclass
class TokenCalls:
    """The model calls on token data of a window: ``callers`` (dotted names, each with the statements
    it was found in), and the class's helper methods the window calls with token data (the model call
    is inside them), which run as written."""

    parsed: cst.Module
    callers: list[str]
    found_in: dict[str, cst.Module] = field(default_factory=dict)
    helpers: list[Helper] = field(default_factory=list)

    def stand_ins(self, model: FileModel, scope, notes: list[str]) -> dict[str, str]:
        return {c: stand_in_lm(model, scope, self.found_in[c], c, notes) for c in self.callers}

    def members(self, model: FileModel, scope, window: str, roles: dict[str, str]) -> Members:
        """The helpers' definitions and roles, and the ``self.`` members the window and the helpers
        read, built or stood in."""
        codes = [window, *(h.body.code for h in self.helpers)]
        given = {**roles, **{h.name: helper_role(h) for h in self.helpers}}
        out = member_roles(model, scope, codes, given)
        out.definitions[:0] = [h.code for h in self.helpers]
        out.roles = {**{h.name: helper_role(h) for h in self.helpers}, **out.roles}
        for h in self.helpers:
            note = f"`{h.name}(...)` (a method of this class) runs as written on the stand-in model"
            out.notes.insert(0, note)
        return out


def token_callers(model: FileModel, scope, window: str) -> TokenCalls:
    """The names the window calls with token data that are the user's model (not a loss function or
    a helper of the file); a method of the class called with token data is climbed into: the model
    calls inside it are the callers."""
    parsed = cst.parse_module(window)
    calls = TokenCalls(parsed, [])
    for name in model_calls(parsed):
        func = class_method(model, scope, name)  # ``self._loss_step(batch)`` is climbed into
        if func is None and library_callable(model, scope, name):
            continue
        inner: list[str] = []
        if func is not None:
            found = helper(func, name)
            inner = [
                c
                for c in model_calls(found.body)
                if not library_callable(model, scope, c) and class_method(model, scope, c) is None
            ]
            if inner:
                calls.helpers.append(found)
        for caller in inner or [name]:
            if caller not in calls.callers:
                calls.callers.append(caller)
                calls.found_in[caller] = found.body if inner else parsed
    if not calls.callers:
        raise NotExecutable("no model call on token data found before the division")
    return calls


def token_window_binder(
    model: FileModel, scope, window: str, stand_ins: dict[str, str], members: Members | None = None
) -> tuple[Binder, list[str]]:
    """Bind a token-loss window's free names: the model calls to ``stand_ins``, token data to the
    current batch ``__tl_mb__``, a scaler disabled, an accelerator's backward to a plain one, the
    class's members to ``members``' roles. Returns the binder and the lines that bind the token data
    (run once per batch)."""
    roles = dict(stand_ins)
    if members is not None:
        roles.update(members.roles)
    names = analyse_names(window)
    per_batch = token_lines(names.free, window)
    bound = {line.split(" = ")[0] for line in per_batch}
    free = list(names.free)
    attrs = list(names.attrs)
    if members is not None and members.definitions:
        extra = analyse_names(members.code())
        free.extend(n for n in extra.free if n not in free)
        attrs.extend(a for a in extra.attrs if a not in attrs)
    for n in free:
        if n == "scaler" and n not in roles:
            roles[n] = "__tl__.scaler(enabled=False)"
        if n in BACKWARD_OWNERS and n not in roles:
            roles[n] = "__tl__.Backward()"
    binder = Binder(model, scope, roles=roles)
    binder.bind([n for n in free if n not in bound and not n.startswith("__tl")], attrs)
    assert binder.carry is not None
    return binder, per_batch
