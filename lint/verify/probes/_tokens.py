"""Token-mean losses (TL301, TL502): the flagged division, the statements that compute what it divides,
the model calls on token data, and the per-microbatch bindings of token names."""

from __future__ import annotations

import libcst as cst

from trainlint.model import FileModel, attr_name, dotted, split_lines, walk
from trainlint.model.losses import Division, divisions
from trainlint.verify.context import ProbeContext, TextEdit
from trainlint.verify.source import (
    NotExecutable,
    analyse_names,
    code_of,
    finding_span,
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
    if model.qualname(expr, scope) is not None:
        return True
    if "." not in name:
        for _, callee in model.call_values(expr, scope):
            if callee and (callee.endswith("Loss") or callee.startswith("torch.nn.functional")):
                return True
    return False


def division_statements(ctx: ProbeContext, division) -> tuple[cst.CSTNode, list[Region], list[TextEdit]]:
    """The statement holding a loss division and the earlier statements of its block that compute
    what it divides (data loading left out): (statement, region, edits blanking skipped lines)."""
    model = ctx.model
    stmt = ctx.tree.statement_of(division.node)
    _, body = ctx.tree.block_of(stmt)
    index = [id(s) for s in body].index(id(stmt))
    start = index
    needed = set(analyse_names(code_of([stmt])).free)
    for i in range(index - 1, -1, -1):
        candidate = body[i]
        if not (_assigned(candidate) & needed) or _loads_data(model, candidate):
            continue
        if isinstance(candidate, cst.BaseCompoundStatement) and not isinstance(candidate, cst.With):
            continue
        start = i
        needed |= set(analyse_names(code_of(body[i : index + 1])).free)
    kept = [s for s in body[start : index + 1] if s is stmt or s is body[start] or not _loads_data(model, s)]
    regions = [Region(model.position(kept[0]).start.line, model.position(kept[-1]).end.line)]
    lines = split_lines(model.source, keepends=True)
    keep_lines = {
        ln for s in kept for ln in range(model.position(s).start.line, model.position(s).end.line + 1)
    }
    # statements skipped inside the region (data loading) are blanked out
    blank = [
        TextEdit(ln, 1, ln, len(lines[ln - 1].rstrip("\r\n")) + 1, "")
        for ln in range(regions[0].start, regions[0].end + 1)
        if ln not in keep_lines and lines[ln - 1].strip()
    ]
    return stmt, regions, blank


def token_lines(free: list[str]) -> list[str]:
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
            out.append(f"{name} = dict(__tl_mb__)")
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


def token_callers(model: FileModel, scope, window: str) -> tuple[cst.Module, list[str]]:
    """The parsed window and the names it calls with token data that are the user's model (not a loss
    function or a helper of the file)."""
    parsed = cst.parse_module(window)
    callers = [c for c in model_calls(parsed) if not library_callable(model, scope, c)]
    if not callers:
        raise NotExecutable("no model call on token data found before the division")
    return parsed, callers


def token_window_binder(
    model: FileModel, scope, window: str, stand_ins: dict[str, str]
) -> tuple[Binder, list[str]]:
    """Bind a token-loss window's free names: the model calls to ``stand_ins``, token data to the
    current batch ``__tl_mb__``, a scaler disabled, an accelerator's backward to a plain one. Returns
    the binder and the lines that bind the token data (run once per batch)."""
    roles = dict(stand_ins)
    names = analyse_names(window)
    per_batch = token_lines(names.free)
    bound = {line.split(" = ")[0] for line in per_batch}
    for n in names.free:
        if n == "scaler" and n not in roles:
            roles[n] = "__tl__.scaler(enabled=False)"
        if n in BACKWARD_OWNERS and n not in roles:
            roles[n] = "__tl__.Backward()"
    binder = Binder(model, scope, roles=roles)
    binder.bind([n for n in names.free if n not in bound and not n.startswith("__tl")], names.attrs)
    assert binder.carry is not None
    return binder, per_batch
