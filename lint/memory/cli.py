"""``trainlint memory``: arguments, the run, the output; exit 0 on a bill, 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainlint.procs import pending_exit

EXIT_OK, EXIT_USAGE = 0, 2

DESCRIPTION = """\
The memory bill of a training setup, per rank, for each parallelism option, without a GPU.

The model is built on fake tensors (no weight is allocated) and two training steps run on the CPU under
a tracker that sorts every tensor into weights, gradients, fp32 master copy, optimizer state,
activations and temporaries. The single-process bill is then projected per rank for DDP, ZeRO-1/2/3,
FSDP hybrid shard and CPU offload.

WARNING: --model, --input and a pkg.module:Class --optimizer import and run your code (from the
current folder), as training would."""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, raised so main() can return it
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    from trainlint.memory.train import PRECISIONS

    p = _Parser(
        prog="trainlint memory", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_argument_group("model")
    src.add_argument("--model", metavar="MODULE:FACTORY", help="a function returning the nn.Module")
    src.add_argument("--model-kwargs", metavar="JSON", default="{}", help="keyword arguments for the factory")
    src.add_argument("--hf", metavar="CONFIG", help="a Hugging Face config (local path) instead of --model")
    src.add_argument("--config", metavar="FILE.toml", help="read these options from a TOML file (flags win)")
    run = p.add_argument_group("step")
    run.add_argument(
        "--input", metavar="MODULE:FUNC", help="make_batch(batch_size, seq_len) -> tensor/tuple/dict"
    )
    run.add_argument("--input-shape", metavar="DIMS", help="shape of one float sample, e.g. 3,32,32")
    run.add_argument("--batch-size", type=int, default=1, help="micro-batch size per rank (default 1)")
    run.add_argument("--seq-len", type=int, help="sequence length of token inputs")
    run.add_argument("--precision", choices=PRECISIONS, default="fp32")
    run.add_argument("--optimizer", default="AdamW", help="a torch.optim class, or MODULE:CLASS")
    run.add_argument("--optimizer-kwargs", metavar="JSON", default="{}")
    run.add_argument("--checkpointing", action="store_true", help="checkpoint each block (non-reentrant)")
    run.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    par = p.add_argument_group("parallelism and output")
    par.add_argument("--world-size", type=int, default=8, help="ranks (default 8)")
    par.add_argument("--gpus-per-node", type=int, default=8, help="shard group of FSDP hybrid (default 8)")
    par.add_argument("--format", choices=("text", "json"), default="text")
    par.add_argument(
        "--plot", metavar="FILE", help="stacked bars per option, .png or .svg (needs matplotlib)"
    )
    return p


def _json_arg(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _UsageError(f"{flag} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise _UsageError(f"{flag} must be a JSON object, e.g. '{{\"lr\": 1e-4}}'")
    return value


def _apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Defaults from ``--config FILE.toml``: keys are the long option names (with - or _)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        table = tomllib.loads(Path(known.config).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise _UsageError(f"cannot read --config {known.config}: {e}") from e
    dests = {a.dest for a in parser._actions}
    values = {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in dests:
            raise _UsageError(f"--config {known.config}: unknown option {key!r}")
        values[dest] = json.dumps(value) if dest.endswith("kwargs") and isinstance(value, dict) else value
    parser.set_defaults(**values)


def _check(args: argparse.Namespace) -> None:
    if bool(args.model) == bool(args.hf):
        raise _UsageError("give exactly one of --model MODULE:FACTORY and --hf CONFIG")
    for flag in ("batch_size", "grad_accum", "world_size", "gpus_per_node", "seq_len"):
        value = getattr(args, flag)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise _UsageError(f"--{flag.replace('_', '-')} must be a positive integer")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg"):
        raise _UsageError("--plot must name a .png or .svg file")


def _setup(args: argparse.Namespace) -> Any:
    from trainlint.memory.train import Setup, SetupError, load_object

    kwargs = _json_arg(args.model_kwargs, "--model-kwargs")
    if args.hf:
        from trainlint.memory.hf import hf_factory

        build, _vocab = hf_factory(args.hf)
        label, labels = args.hf, True
        if args.seq_len is None and not args.input:
            raise SetupError("--hf needs --seq-len (or --input)")
    else:
        factory = load_object(args.model, "--model")
        label, labels = args.model, False

        def build() -> Any:
            return factory(**kwargs)

    shape = None
    if args.input_shape:
        try:
            shape = tuple(int(x) for x in args.input_shape.split(","))
        except ValueError as e:
            raise _UsageError(
                f"--input-shape must be integers separated by commas, got {args.input_shape!r}"
            ) from e
    return Setup(
        build=build,
        label=label,
        make_batch=load_object(args.input, "--input") if args.input else None,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        input_shape=shape,
        precision=args.precision,
        optimizer=args.optimizer,
        optimizer_kwargs=_json_arg(args.optimizer_kwargs, "--optimizer-kwargs"),
        checkpointing=args.checkpointing,
        grad_accum=args.grad_accum,
        labels=labels,
    )


def _describe(args: argparse.Namespace, setup: Any) -> dict[str, Any]:
    return {
        "model": setup.label,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "optimizer_kwargs": setup.optimizer_kwargs,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "grad_accum": args.grad_accum,
        "checkpointing": args.checkpointing,
        "world_size": args.world_size,
        "gpus_per_node": args.gpus_per_node,
    }


def main(argv: list[str] | None = None) -> int:
    """Run ``trainlint memory`` with ``argv``; returns the exit code."""
    from trainlint.run import quiet_torch_import

    quiet_torch_import()  # before build_parser(), whose import of trainlint.memory.train imports torch
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        _apply_config(parser, argv)
        args = parser.parse_args(argv)
        _check(args)
        return _run(args)
    except _UsageError as e:
        code = pending_exit(EXIT_USAGE)  # (holds when nobody reads the message: `2>&1 | true`)
        print(f"trainlint memory: error: {e}", file=sys.stderr)
        return code


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trainlint.memory import render
    from trainlint.memory.measure import measure
    from trainlint.memory.project import project_all
    from trainlint.memory.train import SetupError

    try:
        setup = _setup(args)
        measured, _info = measure(setup)
    except SetupError as e:
        raise _UsageError(str(e)) from e
    except Exception as e:  # the user's model failed in the step: one line, not a traceback
        from trainlint.memory.measure import describe_failure

        raise _UsageError(f"the training step failed: {describe_failure(e)}") from e
    data = render.to_dict(
        measured, project_all(measured, args.world_size, args.gpus_per_node), _describe(args, setup)
    )
    pending_exit(EXIT_OK)  # a reader that stops reading the report leaves it at that
    if args.format == "json":
        print(render.render_json(data))
    else:
        render.render_text(data, Console())
    sys.stdout.flush()  # a broken pipe shows here, not in the flush at exit
    if args.plot:
        try:
            render.plot(data, Path(args.plot))
        except render.PlotUnavailable as e:
            raise _UsageError(str(e)) from e
    return EXIT_OK


if __name__ == "__main__":
    # through the main entry point: a closed pipe, Ctrl-C and SIGTERM end it as `trainlint memory` does
    from trainlint.cli import main as _trainlint_main

    sys.exit(_trainlint_main(["memory", *sys.argv[1:]]))
