"""``hybridkv`` command line: serve | generate | plan | bench.

Each subcommand lives in ``hybridkv/commands/<name>.py`` with an ``add_parser(subparsers)`` that sets ``run``;
heavy imports (torch, the server) happen inside ``run``, so ``hybridkv plan`` stays light.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from hybridkv.commands import bench, generate, plan, serve

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """Bad input is one line on stderr and exit 2; argparse would print the whole usage first."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hybridkv", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (serve, generate, plan, bench):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
