"""TL405 materialized-attention-scores."""

from __future__ import annotations

from collections.abc import Iterator

import libcst as cst

from trainlint.api import Diagnostic, Invalid, Rule, RuleDoc, Severity
from trainlint.model import (
    FileModel,
    Scope,
    attr_name,
    dotted,
    grad_disabled_function,
    int_value,
    positional,
    walk,
    walk_scope,
)
from trainlint.model.vocab import SDPA


class MaterializedAttentionScores(Rule):
    id = "TL405"
    name = "materialized-attention-scores"
    severity = Severity.INFO
    summary = "Attention written out by hand stores the full sequence x sequence score matrix for backward."
    # Prefilter: a softmax, a score product (`@` or `matmul`) of a transposed key (`transpose`,
    # `swapaxes`, `mT`), in a class whose base ends with `Module`.
    tokens = ("softmax",)
    requires = (("@", "matmul"), ("transpose", "swapaxes", "mT"), ("Module",))
    # A method of a module class with a softmax, a score product and a second product, in a file that
    # does not surely call the fused kernel.
    gate_check = "gate_attention_scores.hand_written_attention"
    doc = RuleDoc(
        what=(
            "Reports the score product `q @ k.transpose(-2, -1)` (or `torch.matmul(q, k.transpose(...))`, "
            "`k.mT`) of attention written out by hand, when the scores go through a softmax whose result "
            "multiplies the values, inside a method of a module class, and every step in between is "
            "one the fused kernel also performs (scaling, an additive bias or mask, `masked_fill`, "
            "dtype casts, dropout). Not reported when the file calls `scaled_dot_product_attention` "
            "anywhere (the hand-written path is then a fallback or a deliberate variant), for "
            "variants the kernel cannot express (talking-heads projections across heads, "
            "probabilities re-weighted after the softmax), nor in functions decorated with "
            "`torch.no_grad()` / `torch.inference_mode()`."
        ),
        why=(
            "Autograd keeps the softmax output (and usually the scores and the dropout mask) for the "
            "backward pass, one value per query-key pair. For batch 8, 32 heads and 4096 tokens that "
            "is 8 x 32 x 4096 x 4096 values, 4.3 billion, or 8.6 GB in bf16 for a single layer; it "
            "grows with the square of the sequence length. "
            "`torch.nn.functional.scaled_dot_product_attention` computes the same result with fused "
            "kernels that never store the matrix."
        ),
        example=(
            "att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
            "att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n"
            "att = F.softmax(att, dim=-1)\n"
            "y = att @ v"
        ),
        use_instead="y = F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        references=(
            "https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html",
            "`trainlint memory` names the module and line that hold the activation peak, without a GPU: "
            'README, "`trainlint memory`"',
        ),
    )
    _HEAD = "import math\nimport torch\nimport torch.nn.functional as F\nfrom torch import nn\n\nclass Attn(nn.Module):\n"
    valid = (
        # cross-covariance attention: a channels x channels map of L2-normalised q and k
        """
        import torch.nn as nn
        import torch.nn.functional as F

        class XCA(nn.Module):
            def forward(self, q, k, v):
                attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.temperature
                return attn.softmax(dim=-1) @ v
        """,
        # the fused kernel
        _HEAD
        + "    def forward(self, q, k, v):\n        return F.scaled_dot_product_attention(q, k, v, is_causal=True)",
        # nanoGPT: a fallback for old PyTorch next to the fused path
        _HEAD + "    def forward(self, q, k, v):\n        if self.flash:\n"
        "            return F.scaled_dot_product_attention(q, k, v, is_causal=True)\n"
        "        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
        "        att = F.softmax(att, dim=-1)\n        return att @ v",
        # inference only
        _HEAD + "    @torch.no_grad()\n    def forward(self, q, k, v):\n"
        "        return F.softmax(q @ k.transpose(-2, -1), dim=-1) @ v",
        # a plain matmul without softmax (a bilinear score, not attention)
        _HEAD + "    def forward(self, a, b):\n        return a @ b.transpose(-2, -1)",
        # softmax over a projection, not over q @ k^T
        _HEAD
        + "    def forward(self, x, v):\n        w = F.softmax(self.proj(x), dim=-1)\n        return w @ v",
        # talking-heads attention mixes the heads before and after the softmax: no fused equivalent
        _HEAD + "    def forward(self, q, k, v):\n        attn = q @ k.transpose(-2, -1)\n"
        "        attn = self.proj_l(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)\n        attn = attn.softmax(dim=-1)\n"
        "        attn = self.proj_w(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)\n        return attn @ v",
        # the probabilities are re-weighted after the softmax (gated positional attention)
        _HEAD
        + "    def forward(self, q, k, v, pos):\n        patch = (q @ k.transpose(-2, -1)).softmax(dim=-1)\n"
        "        gate = self.gating.sigmoid()\n        attn = (1.0 - gate) * patch + gate * pos\n"
        "        attn /= attn.sum(dim=-1, keepdim=True)\n        return attn @ v",
        # another module of the file uses the fused kernel: this variant is deliberate
        _HEAD
        + "    def forward(self, q, k, v):\n        a = F.softmax(q @ k.transpose(-2, -1), dim=-1)\n        return a @ v\n\n"
        "class Fast(nn.Module):\n    def forward(self, q, k, v):\n        return F.scaled_dot_product_attention(q, k, v)",
        # class-token attention: one query, scores linear in the length
        _HEAD
        + "    def forward(self, x):\n        q = self.wq(x[:, 0:1, ...])\n        k, v = self.wk(x), self.wv(x)\n"
        "        attn = (q @ k.transpose(-2, -1)).softmax(dim=-1)\n        return attn @ v",
        # a free function outside any module class (a reference implementation in a test)
        """
        import torch

        def reference_attention(q, k, v):
            return torch.softmax(q @ k.transpose(-2, -1), dim=-1) @ v
        """,
    )
    invalid = (
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n"
            "        att = att.masked_fill(self.mask == 0, float('-inf'))\n"
            "        att = F.softmax(att, dim=-1)\n        att = self.attn_dropout(att)\n        return att @ v",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        return F.softmax(q @ k.transpose(-1, -2) / 8, dim=-1) @ v",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n"
            "        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)\n"
            "        probs = scores.softmax(dim=-1)\n        return torch.matmul(probs, v)",
            line=8,
        ),
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n        w = q @ k.mT\n"
            "        w = torch.softmax(w, dim=-1)\n        out = w @ v\n        return out",
            line=8,
        ),
        Invalid(
            """
            import torch
            import pytorch_lightning as pl

            class Block(pl.LightningModule):
                def attend(self, q, k, v, mask):
                    s = q @ k.transpose(-2, -1)
                    s = s.masked_fill(mask, -1e9)
                    p = s.softmax(-1)
                    return p @ v
            """,
            line=6,
        ),
        Invalid(
            _HEAD + "    def forward(self, x):\n        q, k, v = self.qkv(x).chunk(3, dim=-1)\n"
            "        attn = (q @ k.transpose(-2, -1)) * self.scale\n        attn = attn.softmax(dim=-1)\n"
            "        attn = self.attn_drop(attn)\n        x = (attn @ v).transpose(1, 2)\n        return x",
            line=9,
        ),
    )

    invalid = (
        *invalid,
        # relative-position bias added to the scores, a head mask on the probabilities (BERT style)
        Invalid(
            _HEAD + "    def forward(self, q, k, v, mask, head_mask):\n"
            "        scores = torch.matmul(q, k.transpose(-1, -2))\n"
            "        scores = scores / math.sqrt(self.head_size) + mask\n"
            "        probs = F.softmax(scores, dim=-1)\n        probs = self.dropout(probs)\n"
            "        probs = probs * head_mask\n        return torch.matmul(probs, v)",
            line=8,
        ),
        # softmax in float32 then cast back
        Invalid(
            _HEAD + "    def forward(self, q, k, v):\n        w = q @ k.transpose(2, 3) * self.scale\n"
            "        w = F.softmax(w.float(), dim=-1).type_as(q)\n        return torch.matmul(w, v)",
            line=8,
        ),
    )

    def check(self, model: FileModel) -> Iterator[Diagnostic]:
        if self._file_uses_sdpa(model):
            return
        # Only functions that call a softmax can hold hand-written attention: walk just those.
        with_softmax: dict[int, Scope] = {}
        for site in model.calls:
            call = site.node
            assert isinstance(call, cst.Call)
            if attr_name(call) in ("softmax", "log_softmax") and self._is_softmax(model, call, site.scope):
                with_softmax.setdefault(id(site.scope), site.scope)
        for scope in with_softmax.values():
            cls = scope.enclosing_class
            function = scope.node
            if scope.kind != "function" or cls is None or not isinstance(function, cst.FunctionDef):
                continue
            products = [n for n in walk_scope(function) if self._score_product(model, n, scope) is not None]
            if not products:
                continue
            if not self._is_module_class(cls.node) or grad_disabled_function(model, function, scope):
                continue
            statements = _statement_index(function)
            for product in products:
                if self._single_query(model, product, scope) or self._channel_attention(
                    model, product, scope
                ):
                    continue
                if self._softmax_then_values(model, scope, function, statements, product):
                    yield Diagnostic(
                        product,
                        "Attention written out by hand stores the full sequence x sequence score matrix "
                        "for backward (memory grows with the square of the length); use "
                        "`torch.nn.functional.scaled_dot_product_attention`.",
                    )

    @classmethod
    def _channel_attention(cls, model: FileModel, product: cst.CSTNode, scope: Scope) -> bool:
        """Cross-covariance attention (XCiT, EdgeNeXt): q and k are L2-normalised along the tokens and
        multiplied as channels x channels, so the map does not grow with the sequence length."""
        operands = cls._score_product(model, product, scope)
        if operands is None:
            return False

        def normalized(expr: cst.CSTNode) -> bool:
            values = model.values_of(expr, scope) if isinstance(expr, cst.Name) else [expr]
            return any(
                isinstance(node, cst.Call)
                and model.qualname(node.func, scope) == "torch.nn.functional.normalize"
                for value in values
                for node in walk(value)
            )

        return all(normalized(operand) for operand in operands)

    @staticmethod
    def _single_query(model: FileModel, product: cst.CSTNode, scope: Scope) -> bool:
        """The queries are one token (``self.wq(x[:, 0:1])``, a class-token attention): the scores
        grow linearly with the length, there is no square matrix to save."""
        if isinstance(product, cst.BinaryOperation):
            query = product.left
        elif isinstance(product, cst.Call) and product.args:
            query = product.args[0].value
        else:
            return False
        values = model.values_of(query, scope) if isinstance(query, cst.Name) else [query]
        for value in values:
            for node in walk(value):
                if isinstance(node, cst.Subscript):
                    for element in node.slice:
                        inner = element.slice
                        if (
                            isinstance(inner, cst.Slice)
                            and (inner.lower is None or int_value(inner.lower) == 0)
                            and int_value(inner.upper) == 1
                        ):
                            return True
        return False

    @staticmethod
    def _score_product(
        model: FileModel, node: cst.CSTNode, scope: Scope
    ) -> tuple[cst.CSTNode, cst.CSTNode] | None:
        """(q, k^T) for ``q @ k.transpose(-2, -1)`` / ``torch.matmul(q, k.transpose(...))``."""
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
            left, right = node.left, node.right
        elif (
            isinstance(node, cst.Call)
            and attr_name(node) == "matmul"
            and len(node.args) == 2
            and model.qualname(node.func, scope) == "torch.matmul"
        ):
            left, right = node.args[0].value, node.args[1].value
        else:
            return None
        if isinstance(right, cst.Attribute) and right.attr.value == "mT":
            return left, right
        if isinstance(right, cst.Call) and attr_name(right) in ("transpose", "swapaxes"):
            args = [int_value(a) for a in positional(right)]
            if len(args) == 2 and None not in args and {args[0], args[1]} in ({-2, -1}, {2, 3}):
                return left, right
        return None

    @staticmethod
    def _is_module_class(cls: cst.CSTNode) -> bool:
        assert isinstance(cls, cst.ClassDef)
        return any((dotted(b.value) or "").endswith("Module") for b in cls.bases)

    @staticmethod
    def _file_uses_sdpa(model: FileModel) -> bool:
        """The file calls the fused kernel somewhere: attention written by hand elsewhere in it is a
        deliberate fallback or a variant the kernel cannot express."""
        return bool(model.calls_to(*SDPA))

    def _softmax_then_values(
        self,
        model: FileModel,
        scope: Scope,
        function: cst.FunctionDef,
        statements: dict[int, int],
        product: cst.CSTNode,
    ) -> bool:
        """The scores go through a softmax whose result multiplies the values, with only steps that
        ``scaled_dot_product_attention`` can express in between: scaling, an additive bias or mask,
        ``masked_fill``, dtype casts, dropout. Anything else (talking-heads projections across heads,
        re-weighting the probabilities) means the fused kernel is no replacement."""
        start = statements.get(id(product), -1)
        smalls = sorted(
            (
                (statements.get(id(small), -1), small)
                for line in walk_scope(function)
                if isinstance(line, cst.SimpleStatementLine)
                for small in line.body
            ),
            key=lambda pair: pair[0],
        )
        scores: set[str] = set()
        probs: set[str] = set()
        softmax_roots: set[int] = set()
        for index, small in smalls:
            if index < start:
                continue
            for node in walk(small):
                if isinstance(node, cst.Call) and self._is_softmax(model, node, scope):
                    source = _softmax_input(node)
                    if source is not None and _expressible(source, {id(product)}, scores, "scores"):
                        softmax_roots.add(id(node))
            for node in walk(small):
                left = None if node is product else self._matmul_left(model, node, scope)
                if left is not None and softmax_roots and _expressible(left, softmax_roots, probs, "probs"):
                    return True
            value: cst.BaseExpression | None = None
            targets: set[str] = set()
            if isinstance(small, cst.Assign):
                targets = {t.target.value for t in small.targets if isinstance(t.target, cst.Name)}
                value = small.value
            elif isinstance(small, cst.AugAssign) and isinstance(small.target, cst.Name):
                # ``t /= x`` is ``t = t / x``
                targets = {small.target.value}
                operator = AUG_OPERATORS.get(type(small.operator))
                value = cst.BinaryOperation(small.target, operator(), small.value) if operator else None
            for names, roots, mode in ((scores, {id(product)}, "scores"), (probs, softmax_roots, "probs")):
                if value is not None and _expressible(value, roots, names, mode):
                    names |= targets
                else:
                    names -= targets
        return False

    @staticmethod
    def _matmul_left(model: FileModel, node: cst.CSTNode, scope: Scope) -> cst.CSTNode | None:
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
            return node.left
        if isinstance(node, cst.Call) and node.args and model.qualname(node.func, scope) == "torch.matmul":
            return node.args[0].value
        return None

    @staticmethod
    def _is_softmax(model: FileModel, call: cst.Call, scope: Scope) -> bool:
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "softmax":
            qual = model.qualname(call.func, scope)
            return qual is None or qual in SOFTMAX
        return model.qualname(call.func, scope) in SOFTMAX


SOFTMAX = frozenset({"torch.softmax", "torch.nn.functional.softmax", "torch.nn.functional.log_softmax"})


def _statement_index(function: cst.FunctionDef) -> dict[int, int]:
    """For every node of the function body (nested defs excluded), the index of its statement in
    program order."""
    index: dict[int, int] = {}
    count = 0
    for node in walk_scope(function):
        if isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement):
            count += 1
            if isinstance(node, cst.SimpleStatementLine):
                for inner in walk(node):
                    index[id(inner)] = count
            else:
                # the header of a compound statement (an if test, a with item, a return's value)
                for child in node.children:
                    if not isinstance(child, cst.BaseSuite):
                        for inner in walk(child):
                            index.setdefault(id(inner), count)
    return index


AUG_OPERATORS = {
    cst.AddAssign: cst.Add,
    cst.SubtractAssign: cst.Subtract,
    cst.MultiplyAssign: cst.Multiply,
    cst.DivideAssign: cst.Divide,
}


SCORE_METHODS = frozenset(
    {"masked_fill", "masked_fill_", "float", "to", "type_as", "half", "bfloat16", "contiguous"}
)


PROB_METHODS = frozenset({"float", "to", "type_as", "half", "bfloat16", "contiguous"})


DROPOUT = frozenset({"torch.nn.functional.dropout", "torch.dropout"})


def _softmax_input(call: cst.Call) -> cst.BaseExpression | None:
    if isinstance(call.func, cst.Attribute) and call.func.attr.value == "softmax":
        # ``x.softmax(-1)`` (a tensor method) or ``F.softmax(x, -1)`` / ``torch.softmax(x, -1)``
        args = positional(call)
        if dotted(call.func.value) in ("F", "torch", "nn.functional", "torch.nn.functional") and args:
            return args[0]
        return call.func.value
    args = positional(call)
    return args[0] if args else None


def _mentions_tracked(expr: cst.CSTNode, roots: set[int], names: set[str]) -> bool:
    return any(id(n) in roots or (isinstance(n, cst.Name) and n.value in names) for n in walk(expr))


def _expressible(expr: cst.CSTNode, roots: set[int], names: set[str], mode: str) -> bool:
    """``expr`` is a tracked value (a root node or a tracked name) after steps that the fused
    attention kernel also performs (see ``_softmax_then_values``)."""
    if id(expr) in roots or (isinstance(expr, cst.Name) and expr.value in names):
        return True
    # scores take a scale, a bias or a mask; probabilities only a scale (a head mask)
    arithmetic = (
        (cst.Add, cst.Subtract, cst.Multiply, cst.Divide) if mode == "scores" else (cst.Multiply, cst.Divide)
    )
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, arithmetic):
        left = _expressible(expr.left, roots, names, mode)
        right = _expressible(expr.right, roots, names, mode)
        if left != right:
            other = expr.right if left else expr.left
            return not _mentions_tracked(other, roots, names)
        return False
    if isinstance(expr, cst.Call):
        func = expr.func
        name = attr_name(expr) or ""
        methods = SCORE_METHODS if mode == "scores" else PROB_METHODS
        if isinstance(func, cst.Attribute) and name in methods:
            return _expressible(func.value, roots, names, mode) and not any(
                _mentions_tracked(a.value, roots, names) for a in expr.args
            )
        if mode == "probs" and ("drop" in name.lower() or dotted(func) in DROPOUT):
            args = positional(expr)
            return bool(args) and _expressible(args[0], roots, names, mode)
    return False
