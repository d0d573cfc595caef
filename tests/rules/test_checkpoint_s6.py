"""Session 6 review items of the checkpoint rules: TL203's cross-file "registry write" fact counts only
containers the forward does not make itself; TL204 reads a wrapper's keyword-only parameters as such
and, for torch's ``checkpoint_wrapper``, looks at the wrapped blocks' own classes when it can."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from trainlint.cli import run
from trainlint.model.summary import summarize


def project(root: Path, files: dict[str, str]) -> None:
    (root / "pyproject.toml").write_text("[project]\nname = 'p'\n")
    for name, code in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(code))


def findings(
    root: Path, target: str, rule: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> list[dict]:
    monkeypatch.chdir(root)
    capsys.readouterr()
    assert run(["--format", "json", "--no-cache", "--select", rule, target]) in (0, 1)
    return [f for f in json.loads(capsys.readouterr().out)["findings"] if f["rule"] == rule]


# -- TL203: the forward's registry writes ----------------------------------------------------------------
BLOCK = """
    from torch import nn
    REGISTRY = {}

    class Block(nn.Module):
        def forward(self, x, cache):
            out = {}
            out["a"] = x
            for i, part in enumerate(x):
                seen = [None]
                seen[0] = part
            (pair := [0, 0])[0] = 1
            %s
            return out["a"]
    """


def effects(line: str) -> list[str]:
    summary = summarize(textwrap.dedent(BLOCK % line))
    assert summary is not None
    return [what for what, *_ in summary["classes"]["Block"]["forward_effects"]]


def test_a_container_made_in_forward_is_no_registry() -> None:
    assert effects("pass") == []


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ('REGISTRY["last"] = x', "writes to `REGISTRY[...]`"),
        ('REGISTRY["n"] += 1', "writes to `REGISTRY[...]`"),
        ("cache[0] = x", "writes to `cache[...]`"),  # the caller's container, as TL203 counts in a file
    ],
)
def test_writes_to_containers_not_made_in_forward_still_count(line: str, what: str) -> None:
    assert effects(line) == [what]


def test_a_global_rebound_in_forward_still_counts() -> None:
    summary = summarize(
        textwrap.dedent(
            """
            from torch import nn
            TABLE = {}

            class Block(nn.Module):
                def forward(self, x):
                    global TABLE
                    TABLE = {}
                    TABLE["x"] = x
                    return x
            """
        )
    )
    assert summary is not None
    assert [w for w, *_ in summary["classes"]["Block"]["forward_effects"]] == [
        "writes the global `TABLE`",
        "writes to `TABLE[...]`",
    ]


MAIN_203 = """
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from blocks import Block

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)
    """


@pytest.mark.parametrize(("write", "expected"), [('out["a"] = x', 0), ('CACHE["a"] = x', 1)])
def test_tl203_cross_file_registry_write(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    write: str,
    expected: int,
) -> None:
    block = f"""
        from torch import nn
        CACHE = {{}}

        class Block(nn.Module):
            def forward(self, x):
                out = {{}}
                {write}
                return x
        """
    project(tmp_path, {"main.py": MAIN_203, "blocks.py": block})
    found = findings(tmp_path, "main.py", "TL203", monkeypatch, capsys)
    assert len(found) == expected
    if expected:
        assert "writes to `CACHE[...]`" in found[0]["message"]


# -- TL204: a wrapper's keyword-only preserve_rng_state -------------------------------------------------
MAIN_204 = """
    import torch
    from utils.ckpt import checkpointed

    def block(x):
        return torch.nn.functional.dropout(x, 0.1)

    def step(x, y):
        return %s
    """


@pytest.mark.parametrize(
    ("wrapper", "call", "expected"),
    [
        # after *args: the extra positional arguments go to *args, the default stays False
        ("def checkpointed(fn, *args, preserve_rng_state=False)", "checkpointed(block, x, y)", 1),
        ("def checkpointed(fn, x, *, keep=True, preserve_rng_state=False)", "checkpointed(block, x)", 1),
        (
            "def checkpointed(fn, *args, preserve_rng_state=False)",
            "checkpointed(block, x, preserve_rng_state=True)",
            0,
        ),
        # a positional parameter: the caller's third argument is its own value
        ("def checkpointed(fn, x, preserve_rng_state=False)", "checkpointed(block, x, True)", 0),
    ],
)
def test_tl204_wrapper_keyword_only_flag(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    wrapper: str,
    call: str,
    expected: int,
) -> None:
    utils = f"""
        from torch.utils.checkpoint import checkpoint

        {wrapper}:
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
        """
    if "*args" not in wrapper:
        utils = utils.replace("*args", "x")
    project(tmp_path, {"main.py": MAIN_204 % call, "utils/__init__.py": "", "utils/ckpt.py": utils})
    found = findings(tmp_path, "main.py", "TL204", monkeypatch, capsys)
    assert [(f["line"], f["related"][0]["path"]) for f in found] == [(9, "utils/ckpt.py")] * expected


# -- TL204: torch's checkpoint_wrapper on a model's own blocks --------------------------------------------
BLOCKS_204 = """
    from torch import nn

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class Dropped(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.drop = nn.Dropout(p) if p > 0 else nn.Identity()

    class DroppedMore(Dropped):  # an isinstance test of Dropped rules it out too
        def __init__(self, p):
            super().__init__(p)
            self.extra = nn.Dropout(p)

    class Residual(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.drop = nn.Dropout(p)

    class Nested(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.stream = Residual(p)
    """

MODEL_204 = """
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from blocks import %s

    class Net(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.blocks = %s

        def wrap(self):
            for i, block in enumerate(self.blocks.values()):
                %s
                block = checkpoint_wrapper(block, preserve_rng_state=False)
                self.blocks.register_module(str(i), block)
    """


@pytest.mark.parametrize(
    ("imported", "built", "guard", "expected"),
    [
        # the blocks are Plain ones: the imported Dropped is not among them (before: reported)
        ("Plain, Dropped", "nn.ModuleDict({str(i): Plain() for i in range(4)})", "pass", None),
        ("Plain, Dropped", "nn.ModuleDict({str(i): Dropped(0.1) for i in range(4)})", "pass", "`Dropped`"),
        # the blocks' class is not known: any imported block class with a dropout may be one
        ("Plain, Dropped", "cfg.build_blocks()", "pass", "`Dropped`"),
        # ... less those the code rules out just before (before: reported, naming Dropped)
        (
            "Plain, Dropped",
            "cfg.build_blocks()",
            "if isinstance(block, Dropped):\n                    raise ValueError()",
            None,
        ),
        (
            "Plain, DroppedMore, Dropped",
            "cfg.build_blocks()",
            "if isinstance(block, (Plain, Dropped)):\n                    raise ValueError()",
            None,
        ),
        # a dropout one level down, in a submodule of another project class
        (
            "Dropped, Nested",
            "cfg.build_blocks()",
            "if isinstance(block, Dropped):\n                    raise ValueError()",
            "`Nested.stream`, a `Residual`",
        ),
        # (the file names a dropout: the prefilter wants a word of randomness in the file, or an
        # imported class with a dropout submodule of its own)
        (
            "Nested",
            "nn.ModuleDict({str(i): Nested(cfg.dropout) for i in range(4)})",
            "pass",
            "`Nested.stream`, a `Residual`",
        ),
    ],
)
def test_tl204_checkpoint_wrapper_on_the_models_blocks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    imported: str,
    built: str,
    guard: str,
    expected: str | None,
) -> None:
    project(tmp_path, {"model.py": MODEL_204 % (imported, built, guard), "blocks.py": BLOCKS_204})
    found = findings(tmp_path, "model.py", "TL204", monkeypatch, capsys)
    assert len(found) == (expected is not None)
    if expected is not None:
        assert f"the dropout of {expected}" in found[0]["message"]
        assert {r["path"] for r in found[0]["related"]} >= {"blocks.py"}
