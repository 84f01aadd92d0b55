"""The JSON-schema check before compiling: schemas no value satisfies, and keywords xgrammar would leave out of its
grammar, are refused with the reason; schemas with a value and only enforced keywords pass."""

from __future__ import annotations

import pytest

from hybridkv.engine.json_schema_check import MAX_STEPS, check_schema

STRING, INTEGER = {"type": "string"}, {"type": "integer"}
MUTUAL = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
          "$ref": "#/$defs/a"}

# (schema, the whole message): each one xgrammar compiles, into a grammar whose output breaks the schema
UNSATISFIABLE = {
    "not everything": ({"not": {}}, "not: {} rules out every value, so no value satisfies the schema"),
    "allOf string and integer": ({"allOf": [STRING, INTEGER]},
                                 "no value is both string and integer, so no value satisfies the schema"),
    "const of another type": ({"type": "string", "const": 5},
                              "const 5 is not a string (type), so no value satisfies the schema"),
    "required but closed": ({"type": "object", "required": ["a"], "additionalProperties": False},
                            "required property 'a' is not in properties, and additionalProperties is false, so no "
                            "value satisfies the schema"),
    "no type": ({"type": []}, "type: [] allows no type, so no value satisfies the schema"),
    "a requires b requires a": (MUTUAL, "required property 'a' takes no value: $ref '#/$defs/a' needs a value of "
                                        "itself inside itself (#/$defs/a -> #/$defs/b -> #/$defs/a), with no way to "
                                        "end (at $defs.b.properties.a), so no value satisfies the schema"),
    "itself required": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                        "required property 'a' takes no value: $ref '#' needs a value of itself inside itself (# -> "
                        "#), with no way to end (at properties.a), so no value satisfies the schema"),
    "array of itself": ({"$defs": {"a": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/a"}}},
                         "$ref": "#/$defs/a"},
                        "minItems is 1, and item 0 takes no value: $ref '#/$defs/a' needs a value of itself inside "
                        "itself (#/$defs/a -> #/$defs/a)"),
    "no enum value fits": ({"type": "string", "enum": [1, 2]},
                           "no enum value fits the rest of the schema (1 is not a string (type))"),
    "const below minimum": ({"type": "integer", "minimum": 3, "const": 2}, "const 2 breaks minimum 3"),
    "every branch empty": ({"anyOf": [{"type": []}, {"not": True}]},
                           "no branch of anyOf takes a value: type: [] allows no type (at anyOf.0)"),
    "required false": ({"type": "object", "properties": {"a": False}, "required": ["a"]},
                       "required property 'a' takes no value: the schema false takes no value (at properties.a)"),
    "nested": ({"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"not": {}}},
                                                       "required": ["y"]}}, "required": ["x"]},
               "required property 'y' takes no value: not: {} rules out every value (at properties.x.properties.y)"),
}

UNENFORCED = {
    "not": ({"type": ["string", "integer"], "not": STRING}, "not is not enforced by the grammar backend"),
    "allOf of two": ({"allOf": [{"type": "object", "properties": {"a": INTEGER}}, {"type": "object"}]},
                     "allOf with more than one schema is not enforced"),
    "uniqueItems": ({"type": "array", "uniqueItems": True}, "uniqueItems is not enforced"),
    "if": ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if/then/else is not enforced"),
    "dependentRequired": ({"type": "object", "properties": {"a": INTEGER, "b": INTEGER},
                           "dependentRequired": {"a": ["b"]}}, "dependentRequired is not enforced"),
    "contains": ({"type": "array", "contains": INTEGER}, "contains is not enforced"),
    "multipleOf on numbers": ({"type": "number", "multipleOf": 3}, "multipleOf is enforced by the grammar backend "
                                                                   "(xgrammar) only on type integer"),
    "multipleOf a fraction": ({"type": "integer", "multipleOf": 0.5}, "multipleOf is enforced"),
    "pattern and length": ({"type": "string", "pattern": "^a+$", "maxLength": 2},
                           "maxLength together with pattern is not enforced"),
    "required undeclared": ({"type": "object", "required": ["a"]},
                            "required property 'a' is not in properties, and the grammar backend (xgrammar) leaves"),
    "oneOf overlapping": ({"oneOf": [{"type": "number"}, INTEGER]}, "oneOf: its branches may take the same value"),
    "oneOf tags alike": ({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                                    {"type": "object", "properties": {"k": {"enum": ["a"]}}, "required": ["k"]}]},
                         "oneOf: its branches may take the same value"),
    "an enum value off type": ({"type": "string", "enum": ["x", 1]},
                               "enum value 1 is not a string (type); the grammar backend (xgrammar) would still "
                               "write it"),
    "deep in properties": ({"type": "object", "properties": {"x": {"type": "array", "items": {"not": STRING}}}},
                           "not (at properties.x.items) is not enforced"),
}

FINE = [
    True, {}, {"type": "object"}, STRING,
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
     "required": ["kids"]},  # recursion with a way out
    {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},  # a's b is optional
               "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
     "$ref": "#/$defs/b"},
    {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
    {"oneOf": [STRING, INTEGER]},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
               {"$ref": "#/$defs/B"}],
     "$defs": {"B": {"type": "object", "properties": {"t": {"enum": ["b", "c"]}}, "required": ["t"]}}},
    {"allOf": [{"$ref": "#/$defs/X"}], "$defs": {"X": INTEGER}},
    {"type": ["object", "null"], "properties": {"a": INTEGER}, "required": ["a"], "additionalProperties": False},
    {"enum": ["a", 1, None], "title": "t"},
    {"type": "integer", "multipleOf": 3, "minimum": 1}, {"type": "string", "format": "date"},
    {"const": {"$ref": "http://example.com", "not": {}}},  # data, not schemas
    {"type": "array", "minItems": 1, "items": False, "prefixItems": [INTEGER]},
]


@pytest.mark.parametrize("case", list(UNSATISFIABLE))
def test_schemas_no_value_satisfies_are_refused_with_the_reason(case):
    schema, message = UNSATISFIABLE[case]
    with pytest.raises(ValueError) as info:
        check_schema(schema)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("case", list(UNENFORCED))
def test_keywords_the_grammar_would_leave_out_are_refused(case):
    schema, message = UNENFORCED[case]
    with pytest.raises(ValueError) as info:
        check_schema(schema)
    assert message in str(info.value), str(info.value)


@pytest.mark.parametrize("schema", FINE)
def test_satisfiable_enforced_schemas_pass(schema):
    check_schema(schema)


def test_a_walk_past_the_step_bound_stops_undecided():
    """Twenty nested anyOf pairs of the same $ref: 2**20 paths. The check gives up (xgrammar decides) rather than
    walking them all, and returns quickly."""
    schema = {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(20)}}
    schema["$defs"]["d20"] = {"type": []}  # no value, found only at the end of every path
    schema["$ref"] = "#/$defs/d0"
    assert 2 ** 20 > MAX_STEPS
    check_schema(schema)
