"""Facts about one file, read-only for rules and probes; imports nothing from trainlint above it.

- ``syntax``: traversal, dotted names, call arguments, literal values;
- ``text``: the one line splitter (the parser's line numbers), offsets, indentation, block text;
- ``filemodel``: ``FileModel`` with its scopes, bindings and call sites, name resolution;
- ``flow``: loops, branches and autograd state around a site;
- ``switches``: the feature flag (``if args.deepspeed:``) whose branch holds a site;
- ``training``: roles (scaler, optimizer) and training events (``EventKind``);
- ``tokens``: token-level loss and padding evidence; ``targets``: what a checkpoint call runs;
- ``vocab``: every name list matched against code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainlint.model.filemodel import BUILTIN_NAMES, Binding, FileModel, Frame, Scope, Site
    from trainlint.model.flow import (
        exclusive,
        frames_inside,
        grad_disabled,
        grad_disabled_function,
        in_loop,
        innermost_loop,
        runs_with,
        share_loop,
    )
    from trainlint.model.switches import Switch, switch_of, switches_of
    from trainlint.model.syntax import (
        attr_name,
        block_of,
        children,
        dotted,
        first_arg,
        has_star_kwargs,
        int_value,
        is_number,
        keyword,
        literal_false,
        positional,
        receiver,
        standalone_call,
        string_value,
        walk,
        walk_scope,
    )
    from trainlint.model.text import (
        LINE_BREAK,
        ends_file,
        indentation,
        line_indent,
        line_of,
        line_starts,
        reindented,
        source_text,
        split_lines,
        whole_lines,
    )
    from trainlint.model.training import Event, EventKind, Training, is_backward_call

# Loaded on first use: ``trainlint.model.text`` must not pull in libcst (the text reporter splits lines
# in runs answered from the cache, which never parse).
_HOME = {
    "BUILTIN_NAMES": "filemodel",
    "Binding": "filemodel",
    "Event": "training",
    "EventKind": "training",
    "FileModel": "filemodel",
    "Frame": "filemodel",
    "LINE_BREAK": "text",
    "Scope": "filemodel",
    "Site": "filemodel",
    "Switch": "switches",
    "Training": "training",
    "attr_name": "syntax",
    "block_of": "syntax",
    "children": "syntax",
    "dotted": "syntax",
    "ends_file": "text",
    "exclusive": "flow",
    "first_arg": "syntax",
    "frames_inside": "flow",
    "grad_disabled": "flow",
    "grad_disabled_function": "flow",
    "has_star_kwargs": "syntax",
    "in_loop": "flow",
    "indentation": "text",
    "innermost_loop": "flow",
    "int_value": "syntax",
    "is_backward_call": "training",
    "is_number": "syntax",
    "keyword": "syntax",
    "line_indent": "text",
    "line_of": "text",
    "line_starts": "text",
    "literal_false": "syntax",
    "positional": "syntax",
    "receiver": "syntax",
    "reindented": "text",
    "runs_with": "flow",
    "share_loop": "flow",
    "source_text": "text",
    "split_lines": "text",
    "standalone_call": "syntax",
    "string_value": "syntax",
    "switch_of": "switches",
    "switches_of": "switches",
    "walk": "syntax",
    "walk_scope": "syntax",
    "whole_lines": "text",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "BUILTIN_NAMES",
    "LINE_BREAK",
    "Binding",
    "Event",
    "EventKind",
    "FileModel",
    "Frame",
    "Scope",
    "Site",
    "Switch",
    "Training",
    "attr_name",
    "block_of",
    "children",
    "dotted",
    "ends_file",
    "exclusive",
    "first_arg",
    "frames_inside",
    "grad_disabled",
    "grad_disabled_function",
    "has_star_kwargs",
    "in_loop",
    "indentation",
    "innermost_loop",
    "int_value",
    "is_backward_call",
    "is_number",
    "keyword",
    "line_indent",
    "line_of",
    "line_starts",
    "literal_false",
    "positional",
    "receiver",
    "reindented",
    "runs_with",
    "share_loop",
    "source_text",
    "split_lines",
    "standalone_call",
    "string_value",
    "switch_of",
    "switches_of",
    "walk",
    "walk_scope",
    "whole_lines",
]
