"""``trainlint server``: the Language Server, over stdio (the handlers are in ``handlers``).

Imported by the command line for ``trainlint server`` only; pygls and lsprotocol, the ``lsp`` extra,
are imported when the server starts, so that a missing extra is one line saying how to install it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

DEBOUNCE_S = 0.25
MISSING = 'trainlint server needs the lsp extra (pygls, lsprotocol): pip install "trainlint[lsp]"'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trainlint server", description="A Language Server for trainlint, over stdio."
    )
    parser.add_argument("--stdio", action="store_true", help="talk over stdin/stdout (the only transport)")
    parser.add_argument(
        "--debounce",
        type=float,
        default=DEBOUNCE_S,
        metavar="SECONDS",
        help=f"wait this long after the last change before linting (default: {DEBOUNCE_S})",
    )
    args = parser.parse_args(argv)
    if args.debounce < 0:
        parser.error("--debounce must not be negative")
    try:
        from trainlint.lsp.handlers import build_server
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in ("pygls", "lsprotocol", "cattrs", "attrs"):
            raise
        print(f"trainlint: {MISSING} ({exc.name} is missing)", file=sys.stderr)
        return 2
    build_server(args.debounce).start_io()
    return 0


if __name__ == "__main__":  # pragma: no cover - `python -m trainlint.lsp.server`
    raise SystemExit(main())
