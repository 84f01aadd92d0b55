"""``hybridkv`` command line: serve | generate | plan | bench.

Each subcommand lives in ``hybridkv/commands/<name>.py`` with an ``add_parser(subparsers)`` that sets ``run``;
heavy imports (torch, the server) happen inside ``run``, so ``hybridkv plan`` and every ``--help`` stay light
(``tests/test_cli_help.py`` checks that building the parser imports no torch).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from hybridkv.commands import bench, generate, plain_text, plan, serve

EXIT_USAGE = 2


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.required or "default" in text or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action.default, bool):
            return f"{text} (default: {'on' if action.default else 'off'})"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit 2; argparse would print the whole usage first."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridkv", description=plain_text(__doc__))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (serve, generate, plan, bench):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
