"""Whether a file can hold TL110's finding, read from CPython's tree before libcst is asked: FSDP's mixed
precision policy built with a 16-bit ``param_dtype`` and no ``reduce_dtype``."""

from __future__ import annotations

import ast

from trainlint.model.gate_calls import BINDERS, Bindings, binding, last_name, names_bound_to

_POLICIES = frozenset({"MixedPrecision", "MixedPrecisionPolicy"})
# the last part of every name in ``vocab.LOW_PRECISION_DTYPES``
_LOW_PRECISION = frozenset({"float16", "half", "bfloat16"})


def policy_may_lack_reduce_dtype(tree: ast.Module) -> bool:
    """Whether some call of a policy class (by its name, or a name bound to it) has no ``**`` splat, a
    ``param_dtype`` (the first positional argument, else the keyword) that may be a 16-bit dtype, and no
    ``reduce_dtype`` but None. TL110 reports only such calls (``FileModel.calls_to`` resolves a callee
    through imports and assignments of names: each name bound to the class that way is followed here)."""
    calls: list[ast.Call] = []
    bindings: Bindings = []
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Call:
            calls.append(node)  # type: ignore[arg-type]
        elif kind in BINDERS:
            binding(node, bindings)
    if not calls:
        return False
    names = names_bound_to(_POLICIES, bindings)
    return any(_may_lack_reduce_dtype(call) for call in calls if last_name(call.func) in names)


def _may_lack_reduce_dtype(call: ast.Call) -> bool:
    keywords = {k.arg: k.value for k in call.keywords}
    if None in keywords:  # a ``**`` splat may hold the keyword
        return False
    reduce = keywords.get("reduce_dtype")
    if reduce is not None and not (type(reduce) is ast.Constant and reduce.value is None):
        return False
    positional = [a for a in call.args if type(a) is not ast.Starred]
    dtype = positional[0] if positional else keywords.get("param_dtype")
    if dtype is None:
        return False
    # a dotted name resolves to a 16-bit dtype only when its last part is one; a plain name may be bound
    # to one (imported, or assigned only 16-bit dtypes); anything else resolves to no name
    if type(dtype) is ast.Attribute:
        return dtype.attr in _LOW_PRECISION
    return type(dtype) is ast.Name
