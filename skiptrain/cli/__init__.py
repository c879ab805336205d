"""The ``skiptrain`` command line.

Each subsystem owns its subcommands: a module listed in ``COMMAND_MODULES`` exposes
``register(subparsers)``, which adds its parsers and sets ``func`` (called with the parsed args).
Expected user errors (bad config, missing data set, corrupt checkpoint, ...) derive from
:class:`skiptrain.errors.UserError` and are printed as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from ..errors import UserError
from .options import check_output_files, refuse_empty_paths

COMMAND_MODULES = [
    "skiptrain.cli.data",        # prepare
    "skiptrain.cli.train",       # train, eval, generate, demo
    "skiptrain.cli.schedule",    # simulate
    "skiptrain.cli.checkpoint",  # ckpt ls|inspect|verify|reshard, export
    "skiptrain.cli.launch",      # launch (multi-process skip-pipeline runtime)
    "skiptrain.cli.hosts",       # coordinator, node (one run across hosts)
    "skiptrain.cli.watch",       # dashboard, status
]


#: OS errors that are a problem of the machine (permissions, a full disk), wherever they arise:
#: one line naming the path and the fix, like a UserError.
MACHINE_ERRORS = {
    errno.EACCES: "give this user access to it (chmod / chown) or pass another path",
    errno.EPERM: "give this user access to it (chmod / chown) or pass another path",
    errno.ENOSPC: "free disk space there, or pass a path on a disk with room",
    errno.EDQUOT: "free disk space there (your quota is used up), or pass a path on another disk",
    errno.EROFS: "pass a path on a writable file system",
}


def machine_error(e: OSError) -> str | None:
    """The one-line message of an OS error in :data:`MACHINE_ERRORS`, else None."""
    fix = MACHINE_ERRORS.get(e.errno)
    if fix is None:
        return None
    where = f"cannot use {e.filename!r}: " if e.filename else ""
    return f"{where}{e.strerror}; {fix}"


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


def _run_dir_writer(args: argparse.Namespace):
    """The one-writer lock of the run directory a command trains into (parsers that do set
    ``writes_run_dir``; a ``--join`` writes none)."""
    from contextlib import nullcontext

    from ..train.rundir import run_dir_writer

    out = getattr(args, "out", None)
    if not getattr(args, "writes_run_dir", False) or not out or getattr(args, "join", None):
        return nullcontext()
    return run_dir_writer(out)


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except KeyboardInterrupt:       # Ctrl-C while the commands' modules import
        print("skiptrain: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    try:
        refuse_empty_paths(args)
        if getattr(args, "resume", None) is not None and getattr(args, "overwrite", False):
            raise UserError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
        check_output_files(args)
        with _run_dir_writer(args):
            rc = args.func(args)
    except UserError as e:
        print(f"skiptrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"skiptrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        msg = machine_error(e)
        if msg is None:
            raise
        print(f"skiptrain {args.command}: error: {msg}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
