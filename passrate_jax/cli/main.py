"""The ``passrate-jax`` command line: one subcommand per job.

Each subcommand module exposes ``add_subparser(subparsers)`` and ``run(args) -> int``; this file only
wires them. Config errors are reported as one line naming the key and value, before any compute.
"""

from __future__ import annotations

import argparse
import sys

from passrate_jax.configlib import ConfigError, add_config_arguments  # noqa: F401 - re-exported


def _info_subparser(subparsers) -> None:
    p = subparsers.add_parser("info", help="print the resolved config, devices, mesh and parameter count")
    add_config_arguments(p)
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    from passrate_jax.cli import info
    return info.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="passrate-jax", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _info_subparser(subparsers)
    from passrate_jax.cli import commands, export, generate
    from passrate_jax.run import plot, train
    from passrate_jax.study import runner, simulate
    train.add_subparser(subparsers)
    commands.add_subparsers(subparsers)
    generate.add_subparser(subparsers)
    export.add_subparser(subparsers)
    simulate.add_subparser(subparsers)
    plot.add_subparser(subparsers)
    runner.add_subparser(subparsers)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that ``key=value`` overrides may also follow options
    (``train --run-dir D steps=4``): argparse stops a positional list at the first option, and
    subparsers rule out ``parse_intermixed_args``."""
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = list(args.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"passrate-jax {args.command}: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
