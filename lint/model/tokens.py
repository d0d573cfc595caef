"""Token-level evidence: is a loss a mean over a variable number of valid tokens, and does the file pad
or mask its token data? Shared by the accumulation (TL301) and data-parallel (TL502) rules.

Two questions, answered from one file model:

- ``loss_origin(expr, scope, ...)``: traces a loss expression through the assignments of its scope to
  where it is computed (a cross-entropy call, a language model's ``.loss``, a hand-written masked mean)
  and says how it is reduced: a mean over this microbatch's valid tokens, a sum, unreduced, or already
  normalised by a count from elsewhere.
- ``padding``: places in the file that show token data with a variable number of valid tokens per
  batch (``ignore_index``, ``-100``, ``attention_mask``, ``pad_token_id``, padding data collators,
  prompt-masking data modules).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import libcst as cst

from trainlint.model.crossfile import Elsewhere, imported_fact, project_method, returned_callee, shown_path
from trainlint.model.filemodel import FileModel, Scope, Site
from trainlint.model.syntax import (
    attr_name,
    dotted,
    int_value,
    is_number,
    keyword,
    positional,
    receiver,
    string_value,
    walk,
)
from trainlint.model.vocab import (
    COUNT_METHODS,
    CROSS_ENTROPY_CLASSES,
    CROSS_ENTROPY_FUNCTIONS,
    LM_DATA,
    LM_SUFFIXES,
    MEAN_PRESERVING_METHODS,
    MODEL_WRAPPERS,
    PADDING_DATA,
    PADDING_PACKAGES,
    PADDING_WORDS,
    PER_EXAMPLE_SUFFIXES,
    TOKEN_LOSS_FUNCTIONS,
)

_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Evidence:
    node: cst.CSTNode
    what: str


@dataclass(frozen=True)
class LossOrigin:
    """Where a loss is computed and how it is reduced.

    ``reduction``: ``mean`` (averaged over this microbatch's valid tokens), ``sum``, ``none``
    (per-token, unreduced) or ``normalized`` (divided by a count from elsewhere: not a token mean).
    """

    node: cst.CSTNode
    what: str
    reduction: str
    elsewhere: Elsewhere | None = None  # where another project file computes it


def last_part(path: str | None) -> str:
    return path.rsplit(".", 1)[-1] if path else ""


def builds_language_model(facts: dict[str, Any]) -> bool:
    """Whether a function of another file (its summary ``facts``) returns a language model it builds
    (``return AutoModelForCausalLM.from_pretrained(name)``), by the last part of the callee as that file
    spells it: ``_class_kind`` counts a model such a builder returns as a language model (a callee
    imported there under another name is not seen here)."""
    returned = facts.get("returns")
    if not returned:
        return False
    callee = str(returned[0]).removesuffix(".from_pretrained").removesuffix(".from_config")
    return last_part(callee).endswith(LM_SUFFIXES)


def _is_minus_100(node: cst.CSTNode) -> bool:
    return (
        isinstance(node, cst.UnaryOperation)
        and isinstance(node.operator, cst.Minus)
        and isinstance(node.expression, cst.Integer)
        and node.expression.value == "100"
    )


def _non_negative_int(expr: cst.CSTNode) -> bool:
    return isinstance(expr, cst.Integer)


class TokenEvidence:
    """The token-level evidence of one file (built once per file model, see ``token_evidence``)."""

    def __init__(self, model: FileModel) -> None:
        self.model = model
        self._assigns: dict[tuple[int, str], list[tuple[Site, cst.BaseExpression, int | None]]] = {}
        for site in model.assigns:
            node = site.node
            if isinstance(node, cst.Assign):
                targets = [t.target for t in node.targets]
                value = node.value
            elif isinstance(node, cst.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for target in targets:
                if isinstance(target, cst.Name):
                    self._assigns.setdefault((id(site.scope), target.value), []).append((site, value, None))
                elif isinstance(target, cst.Tuple | cst.List):
                    for index, element in enumerate(target.elements):
                        if isinstance(element.value, cst.Name):
                            key = (id(site.scope), element.value.value)
                            self._assigns.setdefault(key, []).append((site, value, index))
        self.lm_names: list[cst.CSTNode] = []
        self.per_example_names: list[cst.CSTNode] = []
        self.padding: list[Evidence] = list(self._scan())

    # -- one pass over the file: padding / masking evidence and model class names ----------------------
    def _scan(self) -> Iterator[Evidence]:
        source = self.model.source
        # Walking a CST is slow; skip the walk when no word it looks for occurs in the text.
        padding_words = any(w in source for w in (*PADDING_WORDS, "ignore_index", "-100", "padding"))
        class_words = any(w in source for w in (*LM_SUFFIXES, *PER_EXAMPLE_SUFFIXES, *LM_DATA))
        if padding_words or class_words:
            yield from self._walk_file(padding_words)
        for scope in self.model.scopes:
            for bindings in scope.bindings.values():
                for binding in bindings:
                    if binding.kind == "import" and self._is_padding_data(binding.target):
                        yield Evidence(binding.node, f"`{last_part(binding.target)}`")
        for site in self.model.calls:
            callee = self.model.callee(site)
            if callee and "." in callee and self._is_padding_data(callee):
                yield Evidence(site.node, f"`{last_part(callee)}`")

    def _walk_file(self, padding_words: bool) -> Iterator[Evidence]:
        keyword_names: set[int] = set()
        for node in walk(self.model.module):
            if isinstance(node, cst.Name | cst.Attribute):
                name = node.value if isinstance(node, cst.Name) else node.attr.value
                if name.endswith(LM_SUFFIXES) or name in LM_DATA:
                    self.lm_names.append(node)
                elif name.endswith(PER_EXAMPLE_SUFFIXES):
                    self.per_example_names.append(node)
            if not padding_words:
                continue
            if isinstance(node, cst.Arg) and node.keyword is not None:
                keyword_names.add(id(node.keyword))
                name = node.keyword.value
                if name == "ignore_index" and not _non_negative_int(node.value):
                    # A segmentation "void" label (ignore_index=255) is not token padding.
                    yield Evidence(node, "`ignore_index`")
                elif name == "padding" and (
                    (isinstance(node.value, cst.Name) and node.value.value == "True")
                    or string_value(node.value) in ("max_length", "longest")
                ):
                    yield Evidence(node, "tokenizer padding")
                elif name in PADDING_WORDS:
                    yield Evidence(node, f"`{name}`")
            elif _is_minus_100(node):
                yield Evidence(node, "`-100` labels")
            elif isinstance(node, cst.Name) and id(node) not in keyword_names:
                if node.value in PADDING_WORDS:
                    yield Evidence(node, f"`{node.value}`")
            elif isinstance(node, cst.Attribute) and node.attr.value in PADDING_WORDS:
                yield Evidence(node, f"`{node.attr.value}`")
            elif isinstance(node, cst.SimpleString):
                value = string_value(node)
                if value and _WORD.match(value) and value in PADDING_WORDS:
                    yield Evidence(node, f"`{value}`")

    @staticmethod
    def _is_padding_data(qualname: str | None) -> bool:
        if not qualname:
            return False
        return qualname.split(".")[0] in PADDING_PACKAGES and last_part(qualname) in PADDING_DATA

    def padding_near(self, scope: Scope) -> Evidence | None:
        """The padding evidence to show for a finding in ``scope``: one inside it when there is one."""
        if not self.padding:
            return None
        ids = {id(n) for n in walk(scope.node)} if scope.kind != "module" else set()
        inside = [e for e in self.padding if id(e.node) in ids]
        return (inside or self.padding)[0]

    # -- which kind of model the file trains ---------------------------------------------------------
    def _model_kind(self, func: cst.BaseExpression, scope: Scope, depth: int = 0) -> str | None:
        """``lm``, ``per_example`` or None for the model called as ``func(...)``."""
        if depth > 4:
            return None
        model = self.model
        if isinstance(func, cst.Call):  # model built and called inline
            return self._class_kind(func, scope, depth)
        kinds = set()
        for value in model.values_of(func, scope):
            if isinstance(value, cst.Call):
                kind = self._class_kind(value, scope, depth)
                if kind:
                    kinds.add(kind)
        if len(kinds) == 1:
            return kinds.pop()
        return None

    def _class_kind(self, call: cst.Call, scope: Scope, depth: int) -> str | None:
        model = self.model
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("from_pretrained", "from_config"):
            func = func.value
        name = last_part(dotted(func))
        fact = imported_fact(model, func, scope) if model.project is not None else None
        made = returned_callee(model, fact) if fact is not None else None
        if made is not None:
            # a builder of another project file: the kind of the model it returns
            name = last_part(made[0].removesuffix(".from_pretrained").removesuffix(".from_config"))
        if name.endswith(LM_SUFFIXES):
            return "lm"
        if name.endswith(PER_EXAMPLE_SUFFIXES):
            return "per_example"
        qual = model.qualname(func, scope)
        if qual and qual.startswith("<local>."):
            cls = model.definition(qual.split(".")[1], scope)
            if isinstance(cls, cst.ClassDef):
                return "lm" if self._local_class_is_lm(cls) else "per_example"
        if name in MODEL_WRAPPERS:
            if isinstance(call.func, cst.Attribute) and name in (
                "to",
                "cuda",
                "half",
                "bfloat16",
                "float",
                "train",
            ):
                return self._model_kind(call.func.value, scope, depth + 1)
            args = positional(call)
            if args:
                return self._model_kind(args[0], scope, depth + 1)
        return None

    def _local_class_is_lm(self, cls: cst.ClassDef) -> bool:
        """A model class of this file whose methods compute a token-level cross-entropy."""
        cls_scope = self.model.scope_for(cls)
        for site in self.model.calls:
            scope: Scope | None = site.scope
            while scope is not None and scope is not cls_scope:
                scope = scope.parent
            if scope is None or site.scope is cls_scope:
                continue
            assert isinstance(site.node, cst.Call)
            origin = self._call_origin(site.node, site.scope, site, 3, set())
            if origin is not None and origin.reduction == "mean":
                return True
        return False

    def is_language_model_call(self, call: cst.Call, scope: Scope) -> bool:
        kind = self._model_kind(call.func, scope)
        if kind is not None:
            return kind == "lm"
        if self.per_example_names:
            return False
        if self.lm_names or self._shifted_targets(call) or self._masked_targets(call, scope):
            return True
        # labels set to -100 position by position: a loss over tokens (a causal LM built out of sight)
        return any(e.what == "`-100` labels" for e in self.padding)

    def _masked_targets(self, call: cst.Call, scope: Scope) -> bool:
        """An argument whose padding positions the scope overwrites with an ignore label before the
        call (``y[y == pad_id] = -1``, ``labels[mask == 0] = -100``): per-token targets, some ignored."""
        names = {a.value.value for a in call.args if isinstance(a.value, cst.Name)}
        for site in self.model.assigns:
            node = site.node
            if site.scope is not scope or not isinstance(node, cst.Assign) or not _is_negative(node.value):
                continue
            for target in node.targets:
                element = target.target
                if (
                    isinstance(element, cst.Subscript)
                    and isinstance(element.value, cst.Name)
                    and element.value.value in names
                    and any(isinstance(n, cst.Comparison) for n in walk(element))
                ):
                    return True
        return False

    def _shifted_targets(self, call: cst.Call) -> bool:
        """Next-token targets among the call's arguments (``y[..., 1:]``, ``tokens[:, 1:]``)."""
        for arg in call.args:
            for node in walk(arg.value):
                if isinstance(node, cst.Subscript) and _slices_from_one(node):
                    return True
        return False

    # -- loss origin ----------------------------------------------------------------------------------
    def loss_origin(self, expr: cst.BaseExpression, scope: Scope, site: Site) -> LossOrigin | None:
        """Where the loss ``expr`` (seen at ``site``) is computed and how it is reduced, or None."""
        return self._origin(expr, scope, site, 0, set())

    def _origin(
        self, expr: cst.BaseExpression, scope: Scope, site: Site, depth: int, seen: set[int]
    ) -> LossOrigin | None:
        if depth > 8:
            return None
        if isinstance(expr, cst.Name):
            return self._name_origin(expr.value, scope, site, depth, seen)
        if isinstance(expr, cst.Attribute) and expr.attr.value == "loss":
            return self._model_output_origin(expr.value, scope, site, expr)
        if isinstance(expr, cst.Subscript):
            key = _subscript_key(expr)
            if key == "loss" or key == 0:
                return self._model_output_origin(expr.value, scope, site, expr)
            if key is None and not isinstance(expr.slice[0].slice, cst.Slice):
                # ``per_token[mask]``: selecting valid tokens keeps a per-token loss per token
                inner = self._origin(expr.value, scope, site, depth + 1, seen)
                return inner if inner is not None and inner.reduction == "none" else None
            return None
        if isinstance(expr, cst.Call):
            return self._call_origin(expr, scope, site, depth, seen)
        if isinstance(expr, cst.BinaryOperation):
            return self._binop_origin(expr, scope, site, depth, seen)
        return None

    def _name_origin(
        self, name: str, scope: Scope, site: Site, depth: int, seen: set[int]
    ) -> LossOrigin | None:
        candidates = [
            (s, v, i)
            for s, v, i in self._assigns.get((id(scope), name), ())
            if s.order < site.order and s.statement is not site.statement and id(s.node) not in seen
        ]
        added = self._added_to(name, scope, site)
        if added:
            # ``running += loss_fn(...) * n``: the total holds what is added to it
            origin = self._origin(added[-1], scope, site, depth + 1, seen)
            if origin is not None:
                return origin
        frames = {id(f.node) for f in site.frames}
        for assign_site, value, index in reversed(candidates):
            seen = seen | {id(assign_site.node)}
            if index is None:
                origin = self._origin(value, scope, assign_site, depth + 1, seen)
            else:
                origin = self._tuple_element_origin(name, value, index, scope, assign_site, depth, seen)
            if origin is not None:
                return origin
            # An assignment that always runs before the reference hides the earlier ones.
            if all(f.kind != "if" or id(f.node) in frames for f in assign_site.frames):
                return None
        return None

    def _tuple_element_origin(
        self,
        name: str,
        value: cst.BaseExpression,
        index: int,
        scope: Scope,
        site: Site,
        depth: int,
        seen: set[int],
    ) -> LossOrigin | None:
        if isinstance(value, cst.Tuple | cst.List):
            if index < len(value.elements):
                return self._origin(value.elements[index].value, scope, site, depth + 1, seen)
            return None
        if "loss" in name.lower() and isinstance(value, cst.Call):
            local = self._local_function_origin(value, scope, depth, seen) if depth < 3 else None
            if local is not None:
                return local
            if self._looks_like_model(value.func, scope):
                # ``logits, loss = model(x, y)``: the model computes the loss itself.
                return self._model_call_origin(value, scope)
        return None

    def _looks_like_model(self, func: cst.BaseExpression, scope: Scope) -> bool:
        path = dotted(func)
        if path is None:
            return False
        if path == "self" or any(
            w in last_part(path).lower() for w in ("model", "net", "engine", "gpt", "llm")
        ):
            return True
        return any(isinstance(v, cst.Call) for v in self.model.values_of(func, scope))

    def _model_output_origin(
        self,
        output: cst.BaseExpression,
        scope: Scope,
        site: Site,
        at: cst.CSTNode,
    ) -> LossOrigin | None:
        call = output if isinstance(output, cst.Call) else None
        if isinstance(output, cst.Name):
            values = [
                (s, v)
                for s, v, i in self._assigns.get((id(scope), output.value), ())
                if i is None and s.order < site.order
            ]
            if values and isinstance(values[-1][1], cst.Call):
                call = values[-1][1]
        if call is None:
            return None
        if not (isinstance(at, cst.Attribute) or self._looks_like_model(call.func, scope)):
            # ``x[0]`` is a model output's loss only when ``x`` comes from a model.
            return None
        return self._model_call_origin(call, scope)

    def _model_call_origin(self, call: cst.Call, scope: Scope) -> LossOrigin | None:
        if keyword(call, "num_items_in_batch") is not None:
            # transformers divides the summed loss by the window's token count itself.
            return LossOrigin(call, "loss normalised by `num_items_in_batch`", "normalized")
        if attr_name(call) in COUNT_METHODS | MEAN_PRESERVING_METHODS:
            return None
        if not self.is_language_model_call(call, scope):
            return None
        return LossOrigin(
            call, "language-model loss (a mean over the batch's valid tokens) computed here", "mean"
        )

    def _call_origin(
        self, call: cst.Call, scope: Scope, site: Site, depth: int, seen: set[int]
    ) -> LossOrigin | None:
        model = self.model
        name = attr_name(call)
        if (
            isinstance(call.func, cst.Attribute)
            and name in MEAN_PRESERVING_METHODS | {"sum"}
            and not call.args[1:]
        ):
            inner = self._origin(call.func.value, scope, site, depth + 1, seen)
            if inner is None:
                return None
            if name == "sum" and inner.reduction == "none":
                return LossOrigin(inner.node, inner.what, "sum")
            if name == "mean" and inner.reduction == "none":
                return None
            return inner
        callee = model.qualname(call.func, scope)
        if callee in CROSS_ENTROPY_FUNCTIONS:
            return self._cross_entropy(call, None, scope)
        if callee in TOKEN_LOSS_FUNCTIONS:
            if keyword(call, "reduction") is not None:
                return self._cross_entropy(call, None, scope)
            return LossOrigin(
                call, "token cross-entropy (`ignore_index=-100` by default) computed here", "mean"
            )
        if isinstance(call.func, cst.Call):  # nn.CrossEntropyLoss(...)(logits, y)
            ctor_callee = model.qualname(call.func.func, scope)
            if ctor_callee in CROSS_ENTROPY_CLASSES:
                return self._cross_entropy(call, call.func, scope)
            return None
        ctor = self._criterion_constructor(call.func, scope)
        if ctor is not None:
            return self._cross_entropy(call, ctor, scope)
        if self._configured_token_loss(call.func, scope):
            return LossOrigin(call, "loss built from config, a mean over its non-ignored tokens", "mean")
        if depth < 3:
            local = self._local_function_origin(call, scope, depth, seen)
            if local is not None:
                return local
        return self._project_origin(call, scope)

    def _project_origin(self, call: cst.Call, scope: Scope) -> LossOrigin | None:
        """A function of another project file (or a base class's method there, ``self.compute_loss``)
        that returns a mean over its batch's valid tokens written by hand (``loss_sum / mask.sum()``)."""
        model = self.model
        if model.project is None:
            return None
        fact = project_method(model, call.func, scope)
        if fact is None or fact.kind != "function" or "returns_token_mean" not in fact.facts:
            return None
        line, column = fact.facts["returns_token_mean"]
        where = Elsewhere(
            shown_path(fact.path), line, column, f"`{fact.name}` averages over the valid tokens here"
        )
        return LossOrigin(call, f"`{fact.name}` returns a mean over the batch's valid tokens", "mean", where)

    def _criterion_constructor(self, func: cst.BaseExpression, scope: Scope) -> cst.Call | None:
        if dotted(func) is None:
            return None
        for value, callee in self.model.call_values(func, scope):
            if callee in CROSS_ENTROPY_CLASSES:
                return value
        return None

    def _added_to(self, name: str, scope: Scope, site: Site) -> list[cst.BaseExpression]:
        """What ``name += value`` adds to the name in ``scope`` before ``site``, in order."""
        return [
            other.node.value
            for other in self.model.augassigns
            if other.scope is scope
            and other.order < site.order
            and isinstance(other.node, cst.AugAssign)
            and isinstance(other.node.operator, cst.AddAssign)
            and isinstance(other.node.target, cst.Name)
            and other.node.target.value == name
        ]

    def _configured_token_loss(self, func: cst.BaseExpression, scope: Scope) -> bool:
        """``self._loss_fn`` built from config (``config.instantiate(cfg.loss)``) whose
        ``ignore_index`` the file reads: a token-level loss that skips ignored (padding) labels."""
        path = dotted(func)
        if path is None or f"{path}.ignore_index" not in self.model.source:
            return False
        return any(
            isinstance(value.func, cst.Attribute | cst.Name) and attr_name(value) == "instantiate"
            for value, _callee in self.model.call_values(func, scope)
        )

    def _local_function_origin(
        self, call: cst.Call, scope: Scope, depth: int, seen: set[int]
    ) -> LossOrigin | None:
        """One level into a loss function of this file: ``compute_loss(...)``, ``self.loss_fn(...)``."""
        model = self.model
        definition = model.local_function(call, scope)
        if definition is None or id(definition) in seen:
            return None
        inner_scope = model.scope_for(definition)
        if inner_scope is None:
            return None
        seen = seen | {id(definition)}
        for node in walk(definition.body):
            if isinstance(node, cst.Return) and node.value is not None:
                # Everything assigned in the function precedes its returns, as far as tracing goes.
                ret_site = Site(node, inner_scope, 1 << 60, (), node, None)
                value = node.value
                if isinstance(value, cst.Tuple) and value.elements:
                    value = value.elements[0].value
                origin = self._origin(value, inner_scope, ret_site, depth + 1, seen)
                if origin is not None:
                    return origin
        return None

    def _cross_entropy(self, call: cst.Call, ctor: cst.Call | None, scope: Scope) -> LossOrigin | None:
        reduction = "mean"
        for source in (ctor, call):
            if source is None:
                continue
            arg = keyword(source, "reduction")
            if arg is not None:
                value = string_value(arg.value)
                if value not in ("mean", "sum", "none"):
                    return None
                reduction = value
            size_average = keyword(source, "size_average")
            if size_average is not None and isinstance(size_average.value, cst.Name):
                if size_average.value.value == "False":
                    reduction = "sum"
        ignore = any(s is not None and keyword(s, "ignore_index") is not None for s in (ctor, call))
        args = positional(call)
        logits = args[0] if args else None
        if logits is None:
            kw = keyword(call, "input")
            logits = kw.value if kw is not None else None
        if reduction != "mean":
            # Summed or per-token: whether it becomes a token mean depends on what divides it.
            return LossOrigin(call, f"cross-entropy (reduction={reduction!r}) computed here", reduction)
        flattened = logits is not None and self._flattened_sequence(logits, scope)
        if not (ignore or flattened):
            return None
        return LossOrigin(call, "token-mean cross-entropy computed here", "mean")

    def _flattened_sequence(self, logits: cst.BaseExpression, scope: Scope, depth: int = 0) -> bool:
        """``x.view(-1, V)``, ``x.reshape(-1, x.size(-1))``, ``x.flatten(0, 1)``, also through one name."""
        if isinstance(logits, cst.Call) and isinstance(logits.func, cst.Attribute):
            name = logits.func.attr.value
            args = positional(logits)
            if name in ("view", "reshape") and len(args) == 2 and _is_minus_one(args[0]):
                return not _class_count(args[1])
            if name == "flatten":
                end = keyword(logits, "end_dim")
                if len(args) >= 2 and int_value(args[0]) == 0 and int_value(args[1]) in (1, -2):
                    return True
                if end is not None and int_value(end.value) in (1, -2):
                    return True
            if name in ("float", "contiguous", "to"):
                return self._flattened_sequence(logits.func.value, scope, depth)
        if isinstance(logits, cst.Name) and depth < 2:
            for value in self.model.values_of(logits, scope):
                if self._flattened_sequence(value, scope, depth + 1):
                    return True
        return False

    def _binop_origin(
        self, expr: cst.BinaryOperation, scope: Scope, site: Site, depth: int, seen: set[int]
    ) -> LossOrigin | None:
        if isinstance(expr.operator, cst.Divide):
            left = self._origin(expr.left, scope, site, depth + 1, seen)
            if left is None:
                return None
            if left.reduction in ("sum", "none"):
                if self.is_local_token_count(expr.right, scope, site):
                    return LossOrigin(expr, "loss averaged over this microbatch's valid tokens here", "mean")
                return LossOrigin(expr, left.what, "normalized")
            return left
        if isinstance(expr.operator, cst.Multiply | cst.Add | cst.Subtract):
            for side in (expr.left, expr.right):
                if is_number(side):
                    continue
                origin = self._origin(side, scope, site, depth + 1, seen)
                if origin is not None:
                    other = expr.right if side is expr.left else expr.left
                    if (
                        isinstance(expr.operator, cst.Multiply)
                        and origin.reduction == "mean"
                        and self.is_local_token_count(other, scope, site)
                    ):
                        # a token mean times the microbatch's token count is the microbatch's sum
                        return LossOrigin(expr, "token-mean loss scaled back to a sum of tokens here", "sum")
                    if isinstance(expr.operator, cst.Multiply) and origin.reduction == "none":
                        # ``per_token_loss * mask``: still per token.
                        return origin
                    return origin
        return None

    # -- token counts ---------------------------------------------------------------------------------
    def is_local_token_count(
        self, expr: cst.BaseExpression, scope: Scope, site: Site, depth: int = 0
    ) -> bool:
        """A count of valid tokens computed from this microbatch: ``mask.sum()``,
        ``(labels != -100).sum()``, ``torch.count_nonzero(...)``, or a name bound to one."""
        if depth > 3:
            return False
        for node in walk(expr):
            if isinstance(node, cst.Call) and attr_name(node) in COUNT_METHODS:
                return True
        if isinstance(expr, cst.Call) and attr_name(expr) in ("float", "clamp", "clamp_min", "max", "item"):
            inner = receiver(expr)
            if inner is not None:
                return self.is_local_token_count(inner, scope, site, depth + 1)
        if isinstance(expr, cst.Name):
            if any(
                self.is_local_token_count(v, scope, site, depth + 1)
                for v in self._added_to(expr.value, scope, site)
            ):
                return True
            for s, value, index in self._assigns.get((id(scope), expr.value), ()):
                if (
                    index is None
                    and s.order < site.order
                    and self.is_local_token_count(value, scope, s, depth + 1)
                ):
                    return True
        return False


def _is_negative(expr: cst.CSTNode) -> bool:
    """A negative integer literal: an ignore label (``-1``, ``-100``)."""
    return (
        isinstance(expr, cst.UnaryOperation)
        and isinstance(expr.operator, cst.Minus)
        and isinstance(expr.expression, cst.Integer)
    )


def _is_minus_one(expr: cst.CSTNode) -> bool:
    return int_value(expr) == -1


def _class_count(expr: cst.CSTNode) -> bool:
    """``num_labels``, ``self.num_classes``, ``n_classes``: the flattened axis is classes, not vocabulary."""
    text = (dotted(expr) or "").lower()
    return "label" in text or "class" in text


def _subscript_key(expr: cst.Subscript) -> str | int | None:
    if len(expr.slice) != 1:
        return None
    element = expr.slice[0].slice
    if isinstance(element, cst.Index):
        value = element.value
        if isinstance(value, cst.SimpleString):
            return string_value(value)
        return int_value(value)
    return None


def _slices_from_one(expr: cst.Subscript) -> bool:
    for element in expr.slice:
        inner = element.slice
        if isinstance(inner, cst.Slice) and int_value(inner.lower) == 1 and inner.upper is None:
            return True
    return False


def token_evidence(model: FileModel) -> TokenEvidence:
    """The file's ``TokenEvidence``, built on first use and kept on the file model."""
    cached = model.__dict__.get("_token_evidence")
    if cached is None:
        cached = TokenEvidence(model)
        model.__dict__["_token_evidence"] = cached
    return cached
