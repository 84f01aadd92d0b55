"""The body decoder: every number or nesting JSON or the API cannot carry is a 400 naming the field, and the
request models take booleans strictly and numbers finite, as OpenAI's API does."""

from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel, ValidationError

from hybridkv.server import protocol, responses_protocol
from hybridkv.server.app import validation_message
from hybridkv.server.errors import APIError
from hybridkv.server.json_body import MAX_INT_DIGITS, decode_json, json_depth

DEPTH = 128


def refused(raw: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        decode_json(raw, DEPTH)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("raw, message, param", [
    (b'{"seed": ' + b"7" * (MAX_INT_DIGITS + 1) + b"}", "seed: an integer of 4,301 digits; at most 4,300 are accepted",
     "seed"),
    (b'{"prompt": [1, -' + b"9" * 5000 + b"]}", "prompt.1: an integer of 5,000 digits", "prompt"),
    (b'{"temperature": 1e999}', "temperature: 1e999 is beyond a 64-bit float's range", "temperature"),
    (b'{"response_format": {"json_schema": {"schema": {"maximum": -1.5E+400}}}}',
     "response_format.json_schema.schema.maximum: -1.5E+400 is beyond", "response_format"),
    (b'{"top_p": 1' + b"0" * 400 + b'.5}', "top_p: 1000000000...00000000.5 (403 characters) is beyond", "top_p"),
    (b'{"logit_bias": {"5": NaN}}', "logit_bias.5: NaN is not a JSON number", "logit_bias"),
    (b'{"temperature": -Infinity}', "temperature: -Infinity is not a JSON number", "temperature"),
    (b'[1, NaN]', "1: NaN is not a JSON number", "1"),
])
def test_numbers_json_or_python_cannot_carry_are_a_400_naming_the_field(raw, message, param):
    error = refused(raw)
    assert error.message.startswith(message), error.message
    assert error.param == param


def test_long_digit_strings_and_long_finite_numbers_are_ordinary():
    digits = "1" * 10_000
    assert decode_json(b'{"prompt": "' + digits.encode() + b'"}', DEPTH) == {"prompt": digits}
    assert decode_json(b'{"seed": ' + b"9" * MAX_INT_DIGITS + b"}", DEPTH)["seed"] == int("9" * MAX_INT_DIGITS)
    assert decode_json(b'{"t": 1.' + b"5" * 6000 + b"e-3, \"m\": 1.7e308}", DEPTH) == {"t": 0.0015555555555555555,
                                                                                    "m": 1.7e308}


@pytest.mark.parametrize("raw, message, param", [
    (b'{"n": 1, "prompt": ' + b"[" * 200 + b"]" * 200 + b"}", "prompt: nests JSON arrays and objects 201 levels",
     "prompt"),
    (b'{"a": "[[{{", "tools": {"x": ' + b"[" * 130 + b"]" * 130 + b'}, "z": 1}', "tools: nests", "tools"),
    (b"[" * 200 + b"]" * 200, "the request body nests JSON arrays and objects 200 levels deep; at most 128", None),
])
def test_deep_nesting_names_the_field_it_is_in(raw, message, param):
    error = refused(raw)
    assert error.message.startswith(message), error.message
    assert error.param == param


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert json_depth(b'{"a": "[[[[\\"[[{{", "b": [[1], {"c": "]]]"}]}') == 3
    assert json_depth(b"[" * 10 + b"]" * 10) == 10


# ---- booleans and floats in the request models ----------------------------------------------------------------
def _models() -> list[type[BaseModel]]:
    """Every request model: protocol.py's, and the Responses API's request side (its output models are ours)."""
    ours = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, BaseModel)
            and m.__module__ == protocol.__name__]
    return ours + [responses_protocol.ResponsesRequest, responses_protocol.FunctionTool,
                   responses_protocol.TextFormat]


def _is_bool(annotation) -> bool:
    if annotation is bool:
        return True
    if typing.get_origin(annotation) is typing.Annotated:
        return _is_bool(typing.get_args(annotation)[0])
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(
        _is_bool(a) for a in typing.get_args(annotation))


def _bool_fields(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items() if _is_bool(field.annotation)]


def test_the_boolean_fields_are_found():
    assert {"echo", "stream", "skip_special_tokens"} <= set(_bool_fields(protocol.CompletionRequest))
    assert "add_special_tokens" in _bool_fields(protocol.TokenizeRequest)
    assert _bool_fields(protocol.StreamOptions) == ["include_usage"]
    assert _bool_fields(protocol.FunctionDefinition) == ["strict"]


@pytest.mark.parametrize("value", ["yes", 1, "true", 0, "false", "on", 1.0])
def test_booleans_are_strict_in_every_model(value):
    """Every boolean field of every model, the ones added later included: only true and false are booleans."""
    for model in _models():
        for name in _bool_fields(model):
            with pytest.raises(ValidationError) as info:
                model.model_validate({name: value})
            assert any(e["loc"] == (name,) and e["type"] == "bool_type" for e in info.value.errors()), (model, name)


@pytest.mark.parametrize("body, message, param", [
    ({"prompt": "x", "echo": "yes"}, "echo: Input should be a valid boolean (got 'yes')", "echo"),
    ({"prompt": "x", "stream": 1}, "stream: Input should be a valid boolean (got 1)", "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": "true"}},
     "stream_options.include_usage: Input should be a valid boolean (got 'true')", "stream_options.include_usage"),
])
def test_a_non_boolean_is_named_with_its_path(body, message, param):
    with pytest.raises(ValidationError) as info:
        protocol.CompletionRequest.model_validate(body)
    assert validation_message(info.value.errors()) == (message, param)


@pytest.mark.parametrize("value", ["inf", "-Infinity", "nan", float("inf")])
def test_floats_are_finite(value):
    with pytest.raises(ValidationError) as info:
        protocol.ChatCompletionRequest.model_validate({"messages": [{"role": "user"}], "temperature": value})
    assert validation_message(info.value.errors()) == (
        f"temperature: Input should be a finite number (got {value!r})", "temperature")
