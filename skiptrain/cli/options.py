"""The options every command shares: --preset, --config, --set; the paths a command writes."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import build_config, preset_names
from ..errors import UserError


def add_config_args(p: argparse.ArgumentParser, default_preset: str | None = "small") -> None:
    p.add_argument("--preset", default=default_preset, help=f"named preset: {', '.join(preset_names())}")
    p.add_argument("--config", metavar="TOML", help="TOML file with [model], [train], ... sections")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config field, e.g. --set model.d_model=128 (repeatable)")


def config_from_args(args: argparse.Namespace, **shortcuts):
    """Preset < TOML < --set < explicit shortcut flags (e.g. --steps).  A ``--resume`` without
    ``--config`` takes the run's own ``OUT/config.toml`` as the base (the flags still apply)."""
    out = getattr(args, "out", None)
    if getattr(args, "resume", None) is not None and args.config is None and out and (Path(out) / "config.toml").is_file():
        args.preset, args.config = None, str(Path(out) / "config.toml")
    overrides = list(args.overrides)
    for key, value in shortcuts.items():
        if value is not None:
            overrides.append(f"{key}={value}")
    return build_config(args.preset, args.config, overrides)


def checkpoint_root(cfg, out: str | Path) -> Path:
    """Where a run's checkpoints live: ``checkpoint.dir``, else ``OUT/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(out) / "checkpoints"


def refuse_empty_paths(args: argparse.Namespace) -> None:
    """The options a command writes to (``written_paths``, set by its parser, e.g. ``("--out",)``)
    must not be empty: ``Path("")`` is the current directory, which an empty ``--out ""`` (an unset
    shell variable) would silently fill."""
    for name in getattr(args, "written_paths", ()):
        if getattr(args, name.lstrip("-").replace("-", "_").lower(), None) == "":
            raise UserError(f'{name} "" is an empty path; pass the path to write to (an empty one is not taken '
                            'as the current directory)')


#: image formats a Gantt chart can be written in (by its file name's suffix)
IMAGE_SUFFIXES = (".png", ".svg", ".pdf")


def check_output_files(args: argparse.Namespace) -> None:
    """Refuse, before the command does any work, an output file it could not write at the end:
    the options in ``output_files`` (set by its parser: option -> the file suffixes it takes, ``()``
    for any) that name a directory, lie under a file or in a place that cannot be written, or
    have a suffix not taken.  The file's directory is created (the command would create it)."""
    for flag, suffixes in getattr(args, "output_files", {}).items():
        path = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if not path:
            continue
        p = Path(path)
        if suffixes and p.suffix.lower() not in suffixes:
            raise UserError(f"{flag} {path!r}: the file type is given by its suffix, one of {', '.join(suffixes)}; "
                            f"name it e.g. {p.with_suffix(suffixes[0]).name!r}")
        if p.is_dir():
            raise UserError(f"cannot write {flag} {path!r}: it is a directory; pass a file path")
        above = next((a for a in p.parents if a.exists()), None)
        if above is not None and not above.is_dir():
            raise UserError(f"cannot write {flag} {path!r}: {str(above)!r} is a file, not a directory; "
                            "pass a path in a directory")
        existed = p.exists()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with open(p, "a"):
                pass
            if not existed:
                p.unlink()
        except OSError as e:
            raise UserError(f"cannot write {flag} {path!r}: {e.strerror}; pass a writable file path") from None


def write_output(flag: str, path: str | Path, text: str) -> None:
    """Write the text output of option ``flag``; a failure (the disk full, say) is a one-line error."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        raise UserError(f"cannot write {flag} {str(path)!r}: {e.strerror}; pass a writable file path") from None

