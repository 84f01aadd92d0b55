"""``hybridkv --help`` stays light and complete: building the parser imports neither torch nor the server stack,
every option says what it does and what it defaults to, and no help shows reST markup."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hybridkv.cli import build_parser

REPO = Path(__file__).parents[1]


def all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("hybridkv",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, (*path, name))


def test_building_the_parser_and_its_help_imports_no_torch():
    code = ("import sys, json, hybridkv.cli as c\n"
            "p = c.build_parser()\n"
            "for a in p._actions:\n"
            "    for sub in getattr(a, 'choices', None) or {}:\n"
            "        if isinstance(a.choices, dict): a.choices[sub].format_help()\n"
            "print(json.dumps(sorted(m for m in ('torch', 'fastapi', 'uvicorn', 'transformers', 'xgrammar') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True)
    assert json.loads(out.stdout) == []


def test_every_option_has_help_and_shows_its_default():
    for path, parser in all_parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"{' '.join(path)} {name} has no help"
            if action.option_strings and not action.required:
                assert "default" in formatter._get_help_string(action), f"{' '.join(path)} {name}: no default shown"


def test_the_defaults_shown_are_the_real_ones():
    serve = dict(all_parsers(build_parser()))[("hybridkv", "serve")].format_help()
    assert "TCP port to listen on (default: 8000)" in serve
    assert "(default: on)" in serve  # --enable-prefix-caching
    assert "(default: off)" in serve  # store_true flags


def test_no_help_shows_rest_markup():
    for path, parser in all_parsers(build_parser()):
        assert "``" not in parser.format_help(), " ".join(path)
