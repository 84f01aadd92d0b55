"""Whether a JSON schema can be honoured, decided before its grammar is compiled.

xgrammar compiles some schemas that no value satisfies (its grammar then takes values that break the schema, or never
ends), and leaves some keywords out of the grammar. ``check_schema`` refuses both, with the reason, so that every
schema the server accepts is one whose grammar takes only values that satisfy it:

    >>> check_schema({"type": "string", "const": 5})
    Traceback (most recent call last):
    ValueError: const 5 is not a string (type), so no value satisfies the schema

Unsatisfiable (no value at all): ``false``; ``type: []``; ``not`` of a schema that takes everything; ``allOf`` of
schemas with no type in common; ``const`` or every ``enum`` value outside the rest of the schema; a required
property that ``additionalProperties: false`` rules out, or whose own schema has no value; ``minItems`` with items
that have none; and ``$ref``s whose every value would have to hold itself (``a`` requires ``b``, ``b`` requires
``a``), which xgrammar compiles into a grammar that never ends.

Not enforced by xgrammar (its output could break them), refused rather than ignored: ``not``, ``allOf`` of more than
one schema, ``if``/``then``/``else``, ``dependentRequired``, ``dependentSchemas``, ``dependencies``,
``uniqueItems``, ``contains``, ``multipleOf`` other than an integer's on type integer, ``minLength``/``maxLength``
beside ``pattern`` or ``format``, a ``required`` property not declared in ``properties`` (xgrammar leaves it out),
``oneOf`` whose branches may overlap (xgrammar enforces it as ``anyOf``), an ``enum`` or ``const`` value outside the
rest of the schema.

Cheap on purpose: the check follows types, ``const``/``enum``, ``required``/``properties``, ``minItems``/``items`` and
``$ref``s. What it does not model (whether a ``pattern`` or ``format`` has a string, a range a multiple,
``minProperties`` and ``patternProperties`` an object) is left to xgrammar, whose grammar still enforces it, and a
walk longer than ``MAX_STEPS`` stops undecided.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

# kinds of JSON value; "number" is "integer" plus "fraction" (a JSON schema integer is any number with no fraction)
_TYPES = {"null": {"null"}, "boolean": {"boolean"}, "integer": {"integer"}, "number": {"integer", "fraction"},
          "string": {"string"}, "array": {"array"}, "object": {"object"}}
_ALL = frozenset().union(*_TYPES.values())
_UNENFORCED = {
    "if": "if/then/else", "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies", "contains": "contains",
}
# keywords whose values are JSON data, not subschemas
_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_ANNOTATIONS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated", "$schema", "$id",
                          "$defs", "definitions", "readOnly", "writeOnly"})
MAX_STEPS = 20_000  # subschemas visited, $refs followed again included: a schema of a few thousand nodes fits


class _Unsat(Exception):
    """No value satisfies the schema at ``path``, for ``reason``."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(reason)
        self.path, self.reason = path, reason


class _Undecided(Exception):
    pass


def check_schema(schema: object) -> None:
    """ValueError saying why no value satisfies ``schema``, or which part of it the grammar would not enforce."""
    checker = _Checker(schema)
    try:
        checker.kinds(schema, "")
    except _Unsat as unsat:
        where = f" (at {unsat.path})" if unsat.path else ""
        raise ValueError(f"{unsat.reason}{where}, so no value satisfies the schema") from None
    except _Undecided:
        pass
    problem = _unenforced(schema, schema, "")
    if problem is not None:
        raise ValueError(problem)


@dataclass(slots=True)
class _Checker:
    root: object
    steps: int = 0
    following: list[str] = field(default_factory=list)  # the $refs being followed, outermost first

    def kinds(self, schema: object, path: str) -> frozenset[str]:
        """The kinds of value ``schema`` takes that have a finite value; _Unsat when there are none."""
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Undecided
        if schema is True or schema == {}:
            return _ALL
        if schema is False:
            raise _Unsat(path, "the schema false takes no value")
        if not isinstance(schema, dict):
            return _ALL  # not a schema: xgrammar's error
        kinds = self._ref(schema, path) if isinstance(schema.get("$ref"), str) else _ALL
        kinds &= self._type(schema, path)
        kinds &= self._values(schema, path)
        for i, member in enumerate(_list(schema.get("allOf"))):
            member_kinds = self.kinds(member, _at(path, f"allOf.{i}"))
            if not kinds & member_kinds:
                raise _Unsat(path, f"no value is both {_names(kinds)} and {_names(member_kinds)}")
            kinds &= member_kinds
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                kinds &= self._branches(schema[keyword], _at(path, keyword))
        if "not" in schema and _takes_everything(schema["not"]):
            raise _Unsat(path, f"not: {_short(schema['not'])} rules out every value")
        if "object" in kinds and (why := self._no_object(schema, path)):
            kinds -= {"object"}
            if not kinds:
                raise _Unsat(*why)
        if "array" in kinds and (why := self._no_array(schema, path)):
            kinds -= {"array"}
            if not kinds:
                raise _Unsat(*why)
        if not kinds:
            raise _Unsat(path, "no type is left")
        return frozenset(kinds)

    def _ref(self, schema: dict, path: str) -> frozenset[str]:
        ref = schema["$ref"]
        if ref in self.following:  # a finite value never needs itself inside itself (the inner one would do)
            chain = " -> ".join([*self.following[self.following.index(ref):], ref])
            raise _Unsat(path, f"$ref {ref!r} needs a value of itself inside itself ({chain}), "
                                            "with no way to end")
        target = resolve_ref(self.root, ref)
        if target is None:
            return _ALL  # refs outside the schema, or to nothing: check_refs' and xgrammar's errors
        self.following.append(ref)
        try:
            return self.kinds(target, ref.lstrip("#/").replace("/", "."))
        finally:
            self.following.pop()

    def _type(self, schema: dict, path: str) -> frozenset[str]:
        if "type" not in schema:
            return _ALL
        types = schema["type"]
        types = types if isinstance(types, list) else [types]
        if not types:
            raise _Unsat(path, "type: [] allows no type")
        return frozenset().union(*(_TYPES.get(t, set()) for t in types if isinstance(t, str))) or _ALL

    def _values(self, schema: dict, path: str) -> frozenset[str]:
        """The kinds of the ``const`` and ``enum`` values the rest of the schema takes."""
        kinds = _ALL
        if "const" in schema:
            value = schema["const"]
            why = _misfit(value, schema)
            if why:
                raise _Unsat(path, f"const {_short(value)} {why}")
            kinds = frozenset({_kind(value)})
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            fits = [v for v in schema["enum"] if not _misfit(v, schema)]
            if not fits:
                value = schema["enum"][0]
                raise _Unsat(path, f"no enum value fits the rest of the schema ({_short(value)} "
                                                f"{_misfit(value, schema)})")
            kinds &= frozenset(map(_kind, fits))
        return kinds

    def _branches(self, branches: object, path: str) -> frozenset[str]:
        kinds: set[str] = set()
        reasons = []
        for i, branch in enumerate(_list(branches)):
            try:
                kinds |= self.kinds(branch, f"{path}.{i}")
            except _Unsat as unsat:
                reasons.append(unsat)
        if not kinds and reasons:
            first = reasons[0]
            raise _Unsat(first.path, f"no branch of {path.rsplit('.', 1)[-1]} takes a value: {first.reason}")
        return frozenset(kinds) if reasons or kinds else _ALL

    def _no_object(self, schema: dict, path: str) -> tuple[str, str] | None:
        """Why no object satisfies ``schema`` (path, reason), or None."""
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        for name in _list(schema.get("required")):
            if not isinstance(name, str):
                continue
            if name not in properties:
                if schema.get("additionalProperties") is False:
                    return path, (f"required property {name!r} is not in properties, and "
                                                   "additionalProperties is false")
                continue  # _unenforced's refusal
            where = _at(path, f"properties.{name}")
            try:
                self.kinds(properties[name], where)
            except _Unsat as unsat:  # said once, where it starts (a chain of required properties says no more)
                said = f"required property {name!r} takes no value: "
                return unsat.path, (unsat.reason if unsat.path != where or unsat.reason.startswith(said) else
                                    said + unsat.reason)
        return None

    def _no_array(self, schema: dict, path: str) -> tuple[str, str] | None:
        """Why no array satisfies ``schema`` (path, reason), or None."""
        min_items = schema.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return None
        prefix = _list(schema.get("prefixItems"))
        for i in range(min(min_items, len(prefix) + 1)):
            item, where = (prefix[i], f"prefixItems.{i}") if i < len(prefix) else (schema.get("items", True), "items")
            try:
                self.kinds(item, _at(path, where))
            except _Unsat as unsat:
                return unsat.path, (unsat.reason if unsat.path != _at(path, where) else
                                    f"minItems is {min_items}, and item {i} takes no value: {unsat.reason}")
        return None


def _unenforced(root: object, schema: object, path: str) -> str | None:
    """The first keyword (depth first) that xgrammar leaves out of its grammar, saying where; None if there is none."""
    if not isinstance(schema, dict):
        return None
    where = f" (at {path})" if path else ""
    for keyword, name in _UNENFORCED.items():
        if keyword in schema:
            return f"{name}{where} is not enforced by the grammar backend (xgrammar), which would let the output " \
                   "break it: leave it out, or express it with properties, required, anyOf and enum"
    if "not" in schema:
        return f"not{where} is not enforced by the grammar backend (xgrammar): express the values it allows instead"
    if len(_list(schema.get("allOf"))) > 1:
        return f"allOf{where} with more than one schema is not enforced by the grammar backend (xgrammar): merge " \
               "them into one schema"
    if "multipleOf" in schema and not (schema.get("type") == "integer" and type(schema["multipleOf"]) is int):
        return f"multipleOf{where} is enforced by the grammar backend (xgrammar) only on type integer, with an " \
               "integer divisor"
    lengths = [k for k in ("minLength", "maxLength") if k in schema]
    if lengths and ("pattern" in schema or "format" in schema):
        return f"{lengths[0]}{where} together with {'pattern' if 'pattern' in schema else 'format'} is not " \
               "enforced by the grammar backend (xgrammar): write the length into the pattern"
    if schema.get("uniqueItems") is True:
        return f"uniqueItems{where} is not enforced by the grammar backend (xgrammar): leave it out"
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [n for n in _list(schema.get("required")) if isinstance(n, str) and n not in properties]
    if missing:
        return f"required property {missing[0]!r}{where} is not in properties, and the grammar backend (xgrammar) " \
               "leaves such properties out: declare it in properties"
    if "oneOf" in schema and _may_overlap(root, _list(schema["oneOf"])):
        return f"oneOf{where}: its branches may take the same value, and the grammar backend (xgrammar) enforces " \
               "oneOf as anyOf: use anyOf, or tell the branches apart by type, or by a required property's const"
    for value in _list(schema.get("enum")) + ([schema["const"]] if "const" in schema else []):
        why = _misfit(value, schema)
        if why:
            return f"enum value {_short(value)}{where} {why}; the grammar backend (xgrammar) would still write it"
    for key, sub in schema.items():
        if key in _VALUE_KEYWORDS:
            continue
        children = sub.items() if isinstance(sub, dict) and key in ("properties", "$defs", "definitions",
                                                                      "patternProperties") else \
            enumerate(sub) if isinstance(sub, list) else [(None, sub)]
        for name, child in children:
            found = _unenforced(root, child, _at(path, key if name is None else f"{key}.{name}"))
            if found:
                return found
    return None


def _may_overlap(root: object, branches: list) -> bool:
    """Whether two branches might take one value: only types, ``const``/``enum`` values, or a required property's
    ``const``/``enum`` values (a discriminated union, as pydantic writes one) tell them apart here."""
    seen: list[tuple[frozenset[str], list | None, dict[str, list]]] = []
    for branch in branches:
        while isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
            branch = resolve_ref(root, branch["$ref"])
        if not isinstance(branch, dict):
            return True
        kinds, values, tags = _type_kinds(branch), _values_of(branch), _tags(branch)
        for other_kinds, other_values, other_tags in seen:
            if (kinds & other_kinds and not _disjoint(values, other_values)
                    and not any(_disjoint(v, other_tags.get(k)) for k, v in tags.items())):
                return True
        seen.append((kinds, values, tags))
    return False


def _type_kinds(schema: dict) -> frozenset[str]:
    types = schema.get("type")
    names = types if isinstance(types, list) else [types]
    found = frozenset().union(*(_TYPES.get(t, set()) for t in names if isinstance(t, str)))
    return found if types is not None else _ALL


def _values_of(schema: dict) -> list | None:
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _tags(schema: dict) -> dict[str, list]:
    """Each required property's const or enum values."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    return {name: values for name in _list(schema.get("required")) if isinstance(properties.get(name), dict)
            and (values := _values_of(properties[name])) is not None}


def _disjoint(values: list | None, others: list | None) -> bool:
    if values is None or others is None:
        return False
    return not any(v == w and type(v) is type(w) for v in values for w in others)


def _misfit(value: object, schema: dict) -> str | None:
    """Why ``value`` breaks ``schema``'s type, bounds, lengths or pattern (as the message's end), or None."""
    kind = _kind(value)
    types = schema.get("type")
    if types is not None:
        names = types if isinstance(types, list) else [types]
        if names and not any(kind in _TYPES.get(t, ()) for t in names if isinstance(t, str)):
            return f"is not {_a(' or '.join(map(str, names)))} (type)"
    if kind in ("integer", "fraction"):
        for keyword, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                            ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            bound = schema.get(keyword)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not ok(bound):
                return f"breaks {keyword} {bound}"
    if kind == "string":
        if isinstance(schema.get("minLength"), int) and len(value) < schema["minLength"]:
            return f"is shorter than minLength {schema['minLength']}"
        if isinstance(schema.get("maxLength"), int) and len(value) > schema["maxLength"]:
            return f"is longer than maxLength {schema['maxLength']}"
        if isinstance(schema.get("pattern"), str):
            try:
                if re.search(schema["pattern"], value) is None:
                    return f"does not match pattern {schema['pattern']!r}"
            except re.error:
                pass  # an ECMA pattern Python does not read: xgrammar decides
    return None


def _takes_everything(schema: object) -> bool:
    return schema is True or (isinstance(schema, dict) and not set(schema) - _ANNOTATIONS)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "fraction"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "object")


def _names(kinds: frozenset[str]) -> str:
    if kinds >= {"integer", "fraction"}:
        kinds = (kinds - {"integer", "fraction"}) | {"number"}
    return " or ".join(sorted("number (not an integer)" if k == "fraction" else k for k in kinds))


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _list(value: object) -> list:
    return value if isinstance(value, list) else []


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def resolve_ref(root: object, ref: str) -> object:
    """The schema a local JSON-pointer ``$ref`` (``#/$defs/a``) names; None when it names nothing."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
