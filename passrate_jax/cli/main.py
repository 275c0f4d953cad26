"""The ``passrate-jax`` command line: one subcommand per job.

Each subcommand module exposes ``add_subparser(subparsers)`` and ``run(args) -> int``; this file only
wires them. Every error the user can fix (:class:`passrate_jax.configlib.UserError`: a config key, a
file, a checkpoint, a plugin, a command's input) is caught here, once, and printed as one line naming
the key or file, the value and the fix, with exit status 2 and no traceback; ``--debug`` (anywhere on
the line) or ``PASSRATE_JAX_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from passrate_jax import __version__
from passrate_jax.configlib import ConfigError, UserError, add_config_arguments  # noqa: F401 - re-exported

EXAMPLES = """examples:
  passrate-jax train --config default                      # the built-in CPU run (presets by name)
  passrate-jax train --config sara steps=10 --run-dir runs/sara_try   # a preset plus key.sub=value overrides
  passrate-jax train --config tiny_own_model model.pretrained=tiny_qwen3 data.path=train.jsonl \\
      data.reward_fn=my_reward.py:reward                   # your own checkpoint, data and reward (docs/guide.md)

passrate-jax info --presets lists the packaged presets; passrate-jax COMMAND --help shows a command's options."""


def _info_subparser(subparsers) -> None:
    p = subparsers.add_parser("info", help="print the resolved config, devices, mesh and parameter count; "
                                           "--presets lists the packaged presets")
    add_config_arguments(p)
    p.add_argument("--presets", action="store_true", help="list the packaged presets, one line each, and exit")
    p.set_defaults(func=_run_info)


def _run_info(args) -> int:
    from passrate_jax.cli import info
    return info.run(args)


# Each subcommand's module (its add_subparser or add_subparsers registers it) and its one-line help for the
# command list. A command line imports the module of its own command only: the others import JAX, Flax and
# Orbax (about 4 s), which `passrate-jax --help`, `--version` and a typo in the command need not pay.
# tests/test_cli_info.py checks that each line here is the help its module registers.
COMMANDS = {
    "train": ("passrate_jax.cli.train", "train (or resume) a run"),
    "eval": ("passrate_jax.cli.commands", "held-out accuracy and pass@k of a run's latest checkpoint, or on --data"),
    "sft": ("passrate_jax.cli.commands", "run the supervised warm start (or load it from the cache)"),
    "generate": ("passrate_jax.cli.generate", "sample completions of a prompt from a Hugging Face checkpoint"),
    "export": ("passrate_jax.cli.export", "write a run's checkpoint as a Hugging Face model directory "
                                          "(config.json, model.safetensors, tokenizer files)"),
    "simulate": ("passrate_jax.study.simulate", "compare allocation methods on a synthetic population"),
    "plot": ("passrate_jax.run.plot", "write PNG figures of a run's metrics"),
    "study": ("passrate_jax.study.runner", "every allocation method side by side (paired seeds, rollouts to "
                                           "target accuracy with intervals), written to a Markdown report"),
}
ALL = object()  # build_parser(ALL): every command's full parser


def build_parser(command=ALL) -> argparse.ArgumentParser:
    """The command line's parser. ``command``: the command whose full parser is built (its module imported);
    every other command is listed by name and help only. ``ALL`` (the default): every command in full."""
    parser = argparse.ArgumentParser(prog="passrate-jax", description=__doc__.splitlines()[0], epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"passrate-jax {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also "
                                                             "PASSRATE_JAX_DEBUG=1)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _info_subparser(subparsers)
    full = set(COMMANDS) if command is ALL else {command} & set(COMMANDS)
    for module in dict.fromkeys(COMMANDS[name][0] for name in COMMANDS if name in full):
        register = importlib.import_module(module)
        (register.add_subparsers if hasattr(register, "add_subparsers") else register.add_subparser)(subparsers)
    for name, (_, summary) in COMMANDS.items():  # in the list by name only; the command line runs none of them
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=summary, add_help=False)
    return parser


def command_word(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that ``key=value`` overrides may also follow options
    (``train --run-dir D steps=4``): argparse stops a positional list at the first option, and
    subparsers rule out ``parse_intermixed_args``. ``--debug`` may stand anywhere."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args, extra = parser.parse_known_args([a for a in argv if a != "--debug"])
    args.debug = debug
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = list(args.overrides or []) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def debug_requested(args) -> bool:
    return bool(getattr(args, "debug", False)) or os.environ.get("PASSRATE_JAX_DEBUG", "") not in ("", "0")


# Loggers whose per-event warnings a run reports itself, counted and in one line (progress bar, summary,
# the first failing step): shown one by one, with the reward function's traceback, under --debug only.
PER_EVENT_LOGGERS = ("passrate_jax.data.math_verify_pool",)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(command_word(argv))
    args = parse(parser, argv)
    loggers = {name: logging.getLogger(name) for name in PER_EVENT_LOGGERS}
    levels = {name: logger.level for name, logger in loggers.items()}
    for logger in loggers.values():
        logger.setLevel(logging.DEBUG if debug_requested(args) else logging.ERROR)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        if debug_requested(args):
            raise
        kind = "config error" if isinstance(e, ConfigError) else "error"
        message = " ".join(str(e).split("\n"))  # one line, whatever the message holds
        print(f"passrate-jax {args.command}: {kind}: {message} (--debug shows the traceback)", file=sys.stderr)
        return 2
    finally:  # main() may run in a longer-lived process (tests, notebooks): leave its logging as it was
        for name, logger in loggers.items():
            logger.setLevel(levels[name])


if __name__ == "__main__":
    sys.exit(main())
