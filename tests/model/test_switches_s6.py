"""The feature switch whose branch holds a call (``trainlint.model.switches``): the one fact TL504's
rule (is the receiver of ``.backward`` the engine?) and its probe (which flag to set) both ask."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from trainlint.model import FileModel, Site, switch_of, switches_of

CODE = textwrap.dedent(
    """
    def plain(args, model, loss):
        if args.deepspeed:
            model.backward(loss)
        else:
            loss.backward_plain()

    def negated(self, loss):
        if not self.use_deepspeed:
            loss.backward_negated_body()
        else:
            self.engine.backward_negated_else(loss)

    def other(args, model, loss, step):
        if step % 4 == 0:
            model.backward_modulo(loss)
        if args.fp16:
            model.backward_fp16(loss)
        if args.deepspeed and args.zero:
            model.backward_compound(loss)
        if deepspeed_available():
            model.backward_call(loss)

    def outer(args, model, loss):
        if args.DeepSpeed:
            def inner():
                model.backward_inner(loss)
        def helper():
            if cfg.use_deepspeed:
                model.backward_helper(loss)
        model.backward_outer(loss)

    def nested(args, model, loss):
        if args.deepspeed:
            if not args.no_deepspeed_engine:
                pass
            else:
                model.backward_twice(loss)
    """
)


@pytest.fixture(scope="module")
def sites() -> dict[str, Site]:
    model = FileModel.from_source(CODE, "t.py")
    out = {}
    for site in model.calls:
        call = site.node
        assert isinstance(call, cst.Call)
        if isinstance(call.func, cst.Attribute):
            out[call.func.attr.value] = site
    return out


@pytest.mark.parametrize(
    ("method", "name", "branch", "test"),
    [
        ("backward", "args.deepspeed", "body", "args.deepspeed"),
        ("backward_negated_else", "self.use_deepspeed", "orelse", "not self.use_deepspeed"),
        # a switch around a ``def`` holds the function's calls: the function exists only there
        ("backward_inner", "args.DeepSpeed", "body", "args.DeepSpeed"),
        ("backward_helper", "cfg.use_deepspeed", "body", "cfg.use_deepspeed"),
    ],
)
def test_the_switch_that_selects_the_call(
    sites: dict[str, Site], method: str, name: str, branch: str, test: str
) -> None:
    found = switch_of(sites[method], "deepspeed")
    assert found is not None
    assert (found.name, found.branch) == (name, branch)
    assert cst.Module([]).code_for_node(found.test) == test
    assert found.frame.node.test is found.test
    assert found.frame.branch == branch


@pytest.mark.parametrize(
    "method",
    [
        "backward_plain",  # the ``else`` of ``if args.deepspeed:``
        "backward_negated_body",  # the body of ``if not self.use_deepspeed:``
        "backward_modulo",  # not a flag
        "backward_fp16",  # a flag for something else
        "backward_compound",  # ``and`` of two flags: not a switch of its own
        "backward_call",  # a call, not a flag
        "backward_outer",  # beside the nested functions, not in them
    ],
)
def test_no_switch_selects_the_call(sites: dict[str, Site], method: str) -> None:
    assert switch_of(sites[method], "deepspeed") is None
    assert switches_of(sites[method], "deepspeed") == ()


def test_every_switch_on_the_way_outermost_first(sites: dict[str, Site]) -> None:
    found = switches_of(sites["backward_twice"], "deepspeed")
    assert [(s.name, s.branch) for s in found] == [
        ("args.deepspeed", "body"),
        ("args.no_deepspeed_engine", "orelse"),
    ]
    innermost = switch_of(sites["backward_twice"], "deepspeed")
    assert innermost is not None and innermost.name == "args.no_deepspeed_engine"


def test_the_word_is_the_flags_last_part(sites: dict[str, Site]) -> None:
    assert switch_of(sites["backward_fp16"], "fp16") is not None
    assert switch_of(sites["backward"], "args") is None  # ``args`` is the owner, not the flag
