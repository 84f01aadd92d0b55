"""``hybridkv`` command line: plan | generate | serve | bench."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybridkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "generate", "plan", "bench"):
        sub.add_parser(name)
    args = parser.parse_args(argv)
    print(f"hybridkv {args.command}: not yet available", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
