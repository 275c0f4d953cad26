"""Command-line arguments shared by the subcommands that take a config. Its own module so that the
subcommand modules need not import ``cli.py``, which imports them (no import cycle)."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config FILE`` and trailing ``key.sub=value`` overrides, shared by every subcommand that takes a config."""
    parser.add_argument("--config", default=None, help="YAML preset (default: built-in defaults)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")
