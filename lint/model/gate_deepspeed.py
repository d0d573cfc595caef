"""Whether a file can hold TL504's finding, read from CPython's tree before libcst is asked: an engine's
``.backward(loss)`` and a division of a loss by the gradient-accumulation count somewhere in the file."""

from __future__ import annotations

import ast
import re

from trainlint.model.vocab import is_step_count_name

# Megatron's ``get_num_microbatches()``: the micro-batches of one step are the accumulation steps
MICRO_BATCH_COUNT = re.compile(r"(get_)?(num|n)_?micro_?batch(es)?", re.IGNORECASE)


def backward_and_step_count_division(tree: ast.Module) -> bool:
    """Whether the file calls ``x.backward(...)`` with a loss and without ``scale_wrt_gas=``, and divides
    something by an accumulation count (``/`` or ``/=``). TL504 reports such a call only when the loss
    it is given was divided that way: in the call, above it in its function, or in the return value of
    another function of the file (each a ``/`` or ``/=`` of the file, wherever the names lead)."""
    backward = divided = False
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.BinOp:
            divided = divided or (type(node.op) is ast.Div and counts_steps(node.right))  # type: ignore[attr-defined]
        elif kind is ast.AugAssign:
            divided = divided or (type(node.op) is ast.Div and counts_steps(node.value))  # type: ignore[attr-defined]
        elif kind is ast.Call and not backward:
            backward = _passes_a_loss_to_backward(node)  # type: ignore[arg-type]
        if backward and divided:
            return True
    return False


def _passes_a_loss_to_backward(call: ast.Call) -> bool:
    func = call.func
    if type(func) is not ast.Attribute or func.attr != "backward":
        return False
    keywords = {k.arg for k in call.keywords}
    if "scale_wrt_gas" in keywords:
        return False
    return any(type(a) is not ast.Starred for a in call.args) or "loss" in keywords


def counts_steps(expr: ast.expr) -> bool:
    """An accumulation count, as TL504 reads one: ``accum``, ``args.gradient_accumulation_steps``,
    ``cfg['grad_accum']``, ``engine.gradient_accumulation_steps()``, ``get_num_microbatches()`` (the last
    part of a dotted name; a superset where the rest is not a dotted name)."""
    if type(expr) is ast.Call:
        expr = expr.func  # type: ignore[attr-defined]
    if type(expr) is ast.Subscript:
        index = expr.slice  # type: ignore[attr-defined]
        if type(index) is ast.Constant and isinstance(index.value, (str, bytes)):
            # (libcst's reading keeps a string prefix: ``b"accum"`` says accum to it too)
            return is_step_count_name(str(index.value))
        return False
    last = expr.id if type(expr) is ast.Name else expr.attr if type(expr) is ast.Attribute else None  # type: ignore[attr-defined]
    return last is not None and (is_step_count_name(last) or MICRO_BATCH_COUNT.fullmatch(last) is not None)
