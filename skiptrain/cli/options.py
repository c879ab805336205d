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
    """Preset < TOML < --set < explicit shortcut flags (e.g. --steps)."""
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
