"""``hybridkv serve``: not yet available."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server (not yet available)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    print("hybridkv serve: not yet available", file=sys.stderr)
    return 2
