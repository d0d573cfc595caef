"""The value a number or flag has in the user's file, and where the file sets it.

Probes bind a hyper-parameter (``max_norm``, ``enabled``, ``init_scale``, the accumulation count) to
the file's own value before they fall back to a synthetic one: a literal, a parameter default, a
single literal assignment in the function, a module constant, ``self.x`` set in ``__init__`` (from a
literal or from a parameter's default), a field of a class in the file (dataclass or plain config
class), or an argparse default. Only values that are literals in the file are returned, so that the
probe never runs code of the user's just to learn a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from trainlint.model import FileModel, Scope, attr_name, dotted, keyword
from trainlint.verify.source import is_literal, unpacked_value

# objects whose fields hold the run's settings: ``config.clip`` is looked up among class fields
CONFIG_HEADS = frozenset(
    {"config", "cfg", "conf", "hparams", "hp", "opt", "opts", "settings", "train_config"}
)


@dataclass(frozen=True)
class FileValue:
    code: str  # the literal as written
    where: str  # how the file sets it, for the probe's notes

    def note(self, name: str) -> str:
        return f"`{name}` = {self.code} ({self.where})"


def file_value(model: FileModel, scope: Scope, expr: cst.BaseExpression | str) -> FileValue | None:
    """The literal value of ``expr`` (an expression or dotted text) as the file defines it, or None."""
    if isinstance(expr, cst.BaseExpression):
        if is_literal(expr):
            return FileValue(model.code(expr), "written")
        path = dotted(expr)
    else:
        path = expr
    if not path:
        return None
    parts = path.split(".")
    if len(parts) == 1:
        return _name_value(model, scope, path)
    if parts[0] == "self" and len(parts) == 2:
        found = _self_value(model, scope, parts[1])
        if found is not None:
            return found
    last = parts[-1]
    if any(p.lower() in CONFIG_HEADS or p.lower().endswith("config") for p in parts[:-1]):
        found = _class_field(model, last)
        if found is not None:
            return found
    default = argparse_defaults(model).get(last)
    if default is not None:
        return FileValue(default, "argparse default")
    return None


def _literal(model: FileModel, values: list[cst.BaseExpression]) -> str | None:
    """The one literal the values agree on (several equal assignments count as one)."""
    codes = {model.code(v) for v in values}
    if len(codes) == 1 and all(is_literal(v) for v in values):
        return codes.pop()
    return None


def _name_value(model: FileModel, scope: Scope, name: str) -> FileValue | None:
    binding = model.lookup(name, scope)
    if binding is None:
        return None
    if binding.kind == "param" and isinstance(binding.node, cst.Param):
        default = binding.node.default
        if default is not None and is_literal(default):
            return FileValue(model.code(default), f"default of the parameter `{name}`")
        return None
    owner = _owner(model, scope, name)
    if owner is None:
        return None
    bindings = owner.bindings.get(name, [])
    values = [b.value if b.value is not None else unpacked_value(b.node, name) for b in bindings]
    values = [v for v in values if v is not None]
    if len(values) != len(bindings):
        return None  # also bound by a loop, an import or a with: not one value
    code = _literal(model, values)
    if code is None:
        return None
    return FileValue(code, "module constant" if owner is model.module_scope else "set in this function")


def _owner(model: FileModel, scope: Scope, name: str) -> Scope | None:
    current: Scope | None = scope
    while current is not None:
        if name in current.global_names:
            return model.module_scope
        if (current.kind != "class" or current is scope) and name in current.bindings:
            return current
        current = current.parent
    return None


def _self_value(model: FileModel, scope: Scope, attr: str) -> FileValue | None:
    cls = scope.enclosing_class
    if cls is None:
        return None
    values = cls.self_attrs.get(attr, [])
    if not values:
        field_value = _literal(model, [b.value for b in cls.bindings.get(attr, []) if b.value is not None])
        return FileValue(field_value, f"class attribute of `{cls.name}`") if field_value else None
    code = _literal(model, values)
    if code is not None:
        return FileValue(code, f"set in `{cls.name}`")
    if len(values) == 1 and isinstance(values[0], cst.Name):
        init = model.method(cls, "__init__")
        init_scope = model.scope_for(init) if init is not None else None
        if init_scope is not None:
            found = _name_value(model, init_scope, values[0].value)
            if found is not None and found.where.startswith("default"):
                if _passed_by_construction(model, cls.name, values[0].value):
                    return None  # the file builds the class with another value: the default is unused
                return FileValue(found.code, f"set in `{cls.name}.__init__` from the {found.where}")
    return None


def _passed_by_construction(model: FileModel, class_name: str, param: str) -> bool:
    """The file builds ``class_name`` passing ``param`` by keyword a value that is not a literal."""
    for site in model.calls:
        call = site.node
        if isinstance(call, cst.Call) and (dotted(call.func) or "").rsplit(".", 1)[-1] == class_name:
            kw = keyword(call, param)
            if kw is not None and not is_literal(kw.value):
                return True
    return False


def _class_field(model: FileModel, attr: str) -> FileValue | None:
    """``attr`` as a field of a class in the file (``grad_clip: float = 1.0``), when every class
    that has such a field agrees on its value."""
    found: dict[str, str] = {}
    for stmt in model.module.body:
        if not isinstance(stmt, cst.ClassDef):
            continue
        scope = model.scope_for(stmt)
        if scope is None:
            continue
        values = [b.value for b in scope.bindings.get(attr, []) if b.value is not None]
        code = _literal(model, values) if values else None
        if code is not None:
            found[stmt.name.value] = code
    if len(set(found.values())) == 1:
        owner = next(iter(found))
        return FileValue(found[owner], f"field of `{owner}`")
    return None


FALSE_WORDS, TRUE_WORDS = ("false", "no", "off", "0"), ("true", "yes", "on", "1")


def _parsed_default(model: FileModel, call: cst.Call, default: cst.BaseExpression) -> str | None:
    """The value a string default has once argparse applies ``type=`` to it (it does, for string
    defaults): ``int``/``float`` convert it, ``bool`` makes any non-empty string True, a converter of
    the file's own (``str2bool``) reads the usual words; None when the outcome is not known."""
    kind = keyword(call, "type")
    if kind is None or not isinstance(default, cst.SimpleString):
        return model.code(default)
    text = default.evaluated_value
    converter = dotted(kind.value)
    if converter == "str" or not isinstance(text, str):
        return model.code(default)
    if converter in ("int", "float"):
        try:
            return repr(int(text) if converter == "int" else float(text))
        except ValueError:
            return None
    if converter == "bool":
        return repr(bool(text))
    if text.strip().lower() in FALSE_WORDS + TRUE_WORDS:
        return repr(text.strip().lower() in TRUE_WORDS)
    return None


def argparse_defaults(model: FileModel) -> dict[str, str]:
    """``dest -> default source`` for ``add_argument("--max-norm", default=1.0)`` calls with literal
    defaults anywhere in the file."""
    out: dict[str, str] = {}
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if attr_name(call) != "add_argument":
            continue
        flags = [a.value for a in call.args if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        dest_kw = keyword(call, "dest")
        default = keyword(call, "default")
        action = keyword(call, "action")
        value = None
        if default is not None and is_literal(default.value):
            value = _parsed_default(model, call, default.value)
        elif action is not None and isinstance(action.value, cst.SimpleString):
            kind = action.value.evaluated_value
            value = {"store_true": "False", "store_false": "True"}.get(str(kind))
        if value is None:
            continue
        names = []
        if dest_kw is not None and isinstance(dest_kw.value, cst.SimpleString):
            names.append(str(dest_kw.value.evaluated_value))
        else:
            long = [str(f.evaluated_value) for f in flags if str(f.evaluated_value).startswith("--")]
            short = [str(f.evaluated_value) for f in flags]
            chosen = long[0] if long else (short[0] if short else "")
            names.append(chosen.lstrip("-").replace("-", "_"))
        for name in names:
            if name:
                out[name] = value
    return out


def runtime_read(model: FileModel, expr: cst.BaseExpression) -> str | None:
    """How the file reads a setting at run time, as written (``conf["trainer"]["clip"]``,
    ``cfg.get("clip", 1.0)``, ``args.clip``), when ``expr`` is such a read: subscripts with literal
    keys and attributes over a name, or ``.get`` of a literal key on one. Its value is not in the file,
    so a probe sweeps it rather than giving up."""
    node = expr
    if (
        isinstance(node, cst.Call)
        and attr_name(node) == "get"
        and node.args
        and is_literal(node.args[0].value)
    ):
        node = node.func.value  # type: ignore[attr-defined]
    while isinstance(node, cst.Subscript | cst.Attribute):
        if isinstance(node, cst.Subscript):
            keys = [e.slice for e in node.slice]
            if not all(isinstance(k, cst.Index) and is_literal(k.value) for k in keys):
                return None
        node = node.value
    if not isinstance(node, cst.Name) or node is expr:
        return None
    return model.code(expr)
