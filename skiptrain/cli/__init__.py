"""The ``skiptrain`` command line.

Each subsystem owns its subcommands: a module listed in ``COMMAND_MODULES`` exposes
``register(subparsers)``, which adds its parsers and sets ``func`` (called with the parsed args).
Expected user errors (bad config, missing data set, corrupt checkpoint, ...) derive from
:class:`skiptrain.errors.UserError` and are printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import UserError

COMMAND_MODULES = [
    "skiptrain.cli.data",        # prepare
    "skiptrain.cli.train",       # train, eval, generate, demo
    "skiptrain.cli.schedule",    # simulate
    "skiptrain.cli.checkpoint",  # ckpt ls|inspect|verify|reshard, export
    "skiptrain.cli.launch",      # launch (multi-process skip-pipeline runtime)
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skiptrain",
        description="Train transformer LMs across far-apart, unequal, unreliable machines.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # subsystem not present in this build
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"skiptrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"skiptrain {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
