"""A request body decoded as JSON, refusing what JSON or the API cannot carry, with a 400 naming the field.

- Nesting deeper than the limit is refused before the decoder recurses into it (a body of 100,000 nested arrays
  would otherwise raise RecursionError).
- ``NaN`` and ``Infinity``, which Python's decoder accepts, are not JSON; numbers beyond a 64-bit float's range
  (``1e999``) would be read as infinity; integers longer than Python's int-from-text limit (4,300 digits) make its
  decoder raise ValueError. Each is refused as the number it is.
- A string (or key) that is not Unicode: an escaped unpaired surrogate such as ``"\\ud800"``, which Python's decoder
  turns into a str that no tokenizer or UTF-8 encoder takes.

Each error names the field, as a dotted path from the top (``messages.0.content``), and ``param`` its top-level
name::

    >>> decode_json(b'{"temperature": 1e999}', 128)
    Traceback (most recent call last):
    hybridkv.server.errors.APIError: temperature: 1e999 is beyond a 64-bit float's range (about 1.8e308)
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridkv.server.errors import APIError

# Python's int-from-text limit (sys.int_info.default_max_str_digits): longer integers make json.loads raise
MAX_INT_DIGITS = 4300
# Only a body with this many digits in a row can hold such an integer: the slower checked decoding runs for it alone
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))
# A JSON string (escapes included), written so the regex engine loops over plain characters without backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Only a body with a \uD800-\uDFFF escape, or those code points' (invalid) UTF-8 bytes, which json.loads decodes
# with "surrogatepass", can decode to an unpaired surrogate.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_OPENERS = np.frombuffer(b"[{", np.uint8)
_CLOSERS = np.frombuffer(b"]}", np.uint8)
_KEY = re.compile(rb'\s*:')


@dataclass(frozen=True, slots=True)
class _BadNumber:
    """Where the decoder met a number the body cannot carry: why (the decoder knows the text, not the field)."""

    why: str


def decode_json(raw: bytes, max_depth: int):
    """The decoded body; APIError 400 for malformed JSON, nesting deeper than ``max_depth``, a number that is not a
    finite 64-bit float or an integer of more than ``MAX_INT_DIGITS`` digits, or a string (or key) holding an
    unpaired surrogate."""
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # cheap: only such bodies can nest that deep
        _check_depth(raw, max_depth)
    bad: list[_BadNumber] = []

    def refuse(why: str) -> _BadNumber:
        bad.append(_BadNumber(why))
        return bad[-1]

    hooks: dict[str, Callable] = {"parse_constant": lambda name: refuse(f"{name} is not a JSON number"),
                                  "parse_float": lambda text: _float(text, refuse)}
    if _LONG_DIGITS.search(raw):
        hooks["parse_int"] = lambda text: _int(text, refuse)
    try:
        data = json.loads(raw, **hooks)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"malformed JSON in the request body: {error}") from None
    if bad:
        path, number = _find(data, lambda v: v if isinstance(v, _BadNumber) else None)
        raise APIError(400, f"{path or 'request body'}: {number.why}", _top(path))
    if _SURROGATE_BYTES.search(raw) or json.detect_encoding(raw) != "utf-8":
        found = _find(data, _surrogate)
        if found is not None:
            path, char = found
            raise APIError(400, f"{path or 'request body'}: not valid Unicode: the string holds an unpaired "
                                f"surrogate (\\u{ord(char):04x}); send UTF-8 text, or escape characters outside "
                                "the BMP as a surrogate pair", _top(path))
    return data


def _float(text: str, refuse: Callable[[str], _BadNumber]) -> float | _BadNumber:
    value = float(text)
    if math.isinf(value):
        return refuse(f"{_short(text)} is beyond a 64-bit float's range (about 1.8e308)")
    return value


def _int(text: str, refuse: Callable[[str], _BadNumber]) -> int | _BadNumber:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        return refuse(f"an integer of {digits:,} digits; at most {MAX_INT_DIGITS:,} are accepted")
    return int(text)


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:10]}...{text[-10:]} ({len(text):,} characters)"


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in ``raw`` (brackets inside strings do not count)."""
    a = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    return int(np.cumsum(_steps(a)).max(initial=0))


def _steps(a: np.ndarray) -> np.ndarray:
    return np.isin(a, _OPENERS).astype(np.int32) - np.isin(a, _CLOSERS).astype(np.int32)


def _check_depth(raw: bytes, max_depth: int) -> None:
    depth = json_depth(raw)
    if depth <= max_depth:
        return
    field = _deep_field(raw, max_depth)
    where = f"{field}: " if field else "the request body "
    raise APIError(400, f"{where}nests JSON arrays and objects {depth:,} levels deep; at most {max_depth} are "
                        "accepted", field)


def _deep_field(raw: bytes, max_depth: int) -> str | None:
    """The top-level key whose value first passes ``max_depth`` levels (None for a body that is not an object).
    Strings are blanked rather than removed, so positions stay those of ``raw``."""
    strings = list(_JSON_STRING.finditer(raw))
    a = np.frombuffer(raw, np.uint8).copy()
    for s in strings:
        a[s.start():s.end()] = ord("_")
    depth = np.cumsum(_steps(a))
    deepest = int(np.argmax(depth > max_depth))
    keys = [s for s in strings if s.end() <= deepest and depth[s.start()] == 1 and _KEY.match(raw, s.end())]
    if not keys or raw.lstrip()[:1] != b"{":
        return None
    try:
        return json.loads(keys[-1].group())
    except ValueError:
        return None


def _surrogate(value) -> str | None:
    found = _SURROGATE.search(value) if isinstance(value, str) else None
    return None if found is None else found.group()


def _find(data, match: Callable, path: str = "") -> tuple[str, object] | None:
    """(path, what ``match`` returned) for the first value or key, depth first, that ``match`` flags; or None."""
    found = match(data)
    if found is not None:
        return path, found
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        # the path goes into the error message, which must itself be valid Unicode
        name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
        where = f"{path}.{name}" if path else name
        found = (_find(key, match, where) if isinstance(key, str) else None) or _find(value, match, where)
        if found is not None:
            return found
    return None


def _top(path: str) -> str | None:
    return path.split(".")[0] or None
