"""Structured outputs in the engine: xgrammar over the real SmolLM2 vocabulary, the bitmask in the sampler, and
``LLM.generate`` with ``SamplingParams(structured_outputs=...)`` on the real model, constrained and free rows in
one batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import LLM, SamplingParams, StructuredOutputsParams
from hybridkv.engine.sampler import Sampler
from hybridkv.engine.structured_output import StructuredOutputs, choice_grammar
from hybridkv.model.loading.known_models import resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer

PERSON = json.loads((Path(__file__).parents[1] / "data" / "person.schema.json").read_text())  # small, closed


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model(None).path)


@pytest.fixture(scope="module")
def structured(tokenizer) -> StructuredOutputs:
    return StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object must be set, "
                                         "got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json=PERSON, regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    assert StructuredOutputsParams(json=json.dumps(PERSON)).json == PERSON  # text schemas are parsed once


@pytest.mark.parametrize("params, needle", [
    (StructuredOutputsParams(json={"type": "nonsense"}), 'structured_outputs.json: Unsupported type "nonsense"'),
    (StructuredOutputsParams(regex="(ab"), "structured_outputs.regex: Regex parsing error"),
    (StructuredOutputsParams(grammar="root ::= "), "structured_outputs.grammar: EBNF parser error"),
])
def test_bad_specs_are_value_errors_naming_the_field(structured, params, needle):
    with pytest.raises(ValueError) as info:
        structured.compile(params)
    assert str(info.value).startswith(needle) and ".cc:" not in str(info.value)


def test_each_spec_is_compiled_once(structured):
    compiler = structured.compiler
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}
    structured.compile(StructuredOutputsParams(json=schema))
    size = compiler.get_cache_size_bytes()
    assert size > 0
    structured.compile(StructuredOutputsParams(json=json.dumps(schema)))  # the same schema, sent as text
    structured.compile(StructuredOutputsParams(json=dict(schema)))
    assert compiler.get_cache_size_bytes() == size
    structured.compile(StructuredOutputsParams(json={**schema, "required": []}))
    assert compiler.get_cache_size_bytes() > size


def test_bitmask_allows_only_what_the_grammar_can_take(structured, tokenizer):
    matcher = structured.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    mask = structured.bitmask([None, matcher])
    assert mask.shape == (2, (tokenizer.vocab_size + 31) // 32) and mask.dtype == torch.int32
    bits = _allowed(mask, tokenizer.vocab_size)
    assert bits[0].all()  # a row without a grammar allows everything
    allowed = set(bits[1].nonzero().flatten().tolist())
    texts = {tokenizer.decode([t]) for t in allowed}
    assert {"yes", "no"} <= texts and all("yes".startswith(t) or "no".startswith(t) for t in texts)
    assert not set(tokenizer.eos_token_ids) & allowed  # nothing chosen yet: stopping is not allowed
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept_token(token)
    assert set(_allowed(structured.bitmask([matcher]), tokenizer.vocab_size)[0].nonzero().flatten().tolist()) == set(
        tokenizer.eos_token_ids)


@pytest.mark.parametrize("grammar", ['root ::= "one" | "two" [0-9]', 'start: "one" | "two" DIGIT\nDIGIT: /[0-9]/'])
def test_grammar_in_ebnf_or_lark(structured, grammar):
    for text, complete in (("one", True), ("two7", True), ("two", False)):
        matcher = structured.matcher(StructuredOutputsParams(grammar=grammar))
        assert matcher.accept_string(text) and matcher.is_completed() == complete
    assert not structured.matcher(StructuredOutputsParams(grammar=grammar)).accept_string("three")


def test_choice_grammar_escapes_quotes_and_newlines(structured):
    grammar = choice_grammar(['say "hi"', "a\nb", "ü"])
    assert grammar == r'root ::= "say \"hi\"" | "a\nb" | "ü"'
    structured.compile(StructuredOutputsParams(choice=['say "hi"', "a\nb", "ü"]))


def test_sampler_applies_the_bitmask_before_sampling_and_logprobs(structured, tokenizer):
    vocab = tokenizer.vocab_size
    matcher = structured.matcher(StructuredOutputsParams(regex="7"))
    mask = structured.bitmask([matcher, None])
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    logits = torch.randn(2, vocab)
    logits[:, seven] = -30.0  # the grammar's only token is the least likely one
    params = [SamplingParams(temperature=1.0, seed=3, logprobs=2), SamplingParams(temperature=0, logprobs=2)]
    out = Sampler(seed=0)(logits, params, [[1], [1]], [[], []], [None, None], token_bitmask=mask)
    assert out.token_ids[0] == seven
    assert out.logprobs[0][0] == (seven, 0.0)  # all the probability is on the one allowed token
    assert out.token_ids[1] == int(logits[1].argmax())  # the free row is untouched


SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}


LOOP_DEEP = {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
             "$defs": {"x": {"$ref": "#/$defs/y", "description": "x"}, "y": {"$ref": "#/$defs/x"}}}


@pytest.mark.parametrize("params, needle", [
    (StructuredOutputsParams(json=SELF_REF),
     "structured_outputs.json: $ref '#/$defs/a' (at the root) only leads back to itself through other $refs"),
    (StructuredOutputsParams(json=LOOP_DEEP),  # its first token, "{", is fine: found from the schema alone
     "structured_outputs.json: $ref '#/$defs/x' (at properties.a) only leads back to itself"),
    (StructuredOutputsParams(json={"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"$ref": "#"}}}),
     "structured_outputs.json: $ref '#/$defs/a' needs a value of itself inside itself (#/$defs/a -> # -> #/$defs/a)"),
    (StructuredOutputsParams(json={"type": "string", "const": 5}),
     "structured_outputs.json: const 5 is not a string (type), so no value satisfies the schema"),
    (StructuredOutputsParams(regex="[^\\s\\S]"), "structured_outputs.regex: no output satisfies it"),
    (StructuredOutputsParams(json={"$ref": "http://example.com/s.json"}),
     "structured_outputs.json: $ref 'http://example.com/s.json' (at the root) is not a reference inside the schema"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"items": [{"$ref": "other.json#/x"}]}}}),
     "structured_outputs.json: $ref 'other.json#/x' (at properties.a.items.0) is not a reference inside"),
])
def test_unsatisfiable_schemas_and_external_refs_are_refused_at_compile_time(structured, params, needle):
    with pytest.raises(ValueError) as info:
        structured.compile(params)
    assert str(info.value).startswith(needle)


def test_local_refs_and_ref_shaped_data_still_compile(structured):
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
            "required": ["kids"]}
    structured.compile(StructuredOutputsParams(json=tree))  # recursion with a way out is fine
    structured.compile(StructuredOutputsParams(json={"const": {"$ref": "http://example.com"}}))  # data, not a ref


def test_json_mode_allows_only_an_object_to_start(structured, tokenizer):
    mask = structured.bitmask([structured.matcher(StructuredOutputsParams(json_object=True))])
    allowed = _allowed(mask, tokenizer.vocab_size)[0].nonzero().flatten().tolist()
    starts = {tokenizer.decode([t], skip_special_tokens=False).lstrip()[:1] for t in allowed}
    assert starts == {"{"}, starts  # never "[", a digit or a quote


def _allowed(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((mask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()


# ---- the real model ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=256, kv_cache_memory_bytes=32 << 20)


def test_generate_with_constraints_in_one_batch(llm):
    cases = [
        ("Describe a person as JSON.", StructuredOutputsParams(json=PERSON)),
        ("Describe a person as JSON.", StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)),
        ("My phone number is", StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
        ("Is the sky blue? Answer:", StructuredOutputsParams(choice=["yes", "no", "maybe"])),
        ("Count:", StructuredOutputsParams(grammar='root ::= "one, two" (", " [a-z]+)? "."')),
        ("The capital of France is", None),
    ]
    free = llm.generate(cases[-1][0], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=c) for _, c in cases]
    outs = [o.outputs[0] for o in llm.generate([p for p, _ in cases], params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs[:-1]), [(o.text, o.finish_reason) for o in outs]
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), PERSON)
    assert outs[1].text == json.dumps(json.loads(outs[1].text))  # compact: no whitespace beyond ", " and ": "
    assert re.fullmatch(r"\d{3}-\d{4}", outs[2].text)
    assert outs[3].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"one, two(, [a-z]+)?\.", outs[4].text)
    free_ids = free.outputs[0].token_ids
    assert outs[5].token_ids[: len(free_ids)] == free_ids  # the unconstrained row is not disturbed


def test_sampled_choices_each_follow_the_schema(llm):
    # compact JSON: with free whitespace a 135M model sampled at temperature 1 can spend its 60 tokens on blanks
    # between the keys (the grammar allows them), which says nothing of the schema
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=PERSON, disable_any_whitespace=True))
    out = llm.chat([{"role": "user", "content": "Invent a person."}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for o in out.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), PERSON)


@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), temperature=st.floats(0.0, 1.5))
def test_json_mode_returns_an_object_whatever_the_seed_and_temperature(llm, seed, temperature):
    params = SamplingParams(n=2, seed=seed, temperature=temperature, max_tokens=24,
                            structured_outputs=StructuredOutputsParams(json_object=True))
    # unconstrained by an object schema, this prompt gets numbers and arrays ("[1, 2, 3]", "24.13")
    out = llm.generate("The first five prime numbers, as a JSON array: ", params, use_tqdm=False)[0]
    for o in out.outputs:
        assert o.text.lstrip().startswith("{"), o.text
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == 24


def test_a_bad_spec_is_refused_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        llm.generate("hi", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_chat_passes_tools_to_the_template(llm):
    template = "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0, max_tokens=1)
    with_tools = llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False, tools=tools,
                          chat_template=template)[0]
    assert llm.get_tokenizer().decode(with_tools.prompt_token_ids) == "[lookup]hi"


def test_min_tokens_that_forbid_the_grammars_only_stop_end_the_sequence(llm):
    """After "yes" or "no" only EOS fits the grammar, and min_tokens forbids it: the row has no token left."""
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate("Is it? Answer:", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "abort" and out.text in ("yes", "no") and len(out.token_ids) < 4
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmask_on_cuda_logits(structured, tokenizer):
    mask = structured.bitmask([structured.matcher(StructuredOutputsParams(regex="7")), None])
    seven = tokenizer.encode("7", add_special_tokens=False)[0]
    logits = torch.randn(2, tokenizer.vocab_size, device="cuda")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.5, seed=1)]
    out = Sampler(seed=0)(logits, params, [[1], [1]], [[], []], [None, None], token_bitmask=mask)
    assert out.token_ids[0] == seven
    assert torch.isfinite(logits).all()  # the sampler masks its own copy


# schemas the checker accepts and xgrammar enforces in full, hard ones among them: an output that ends with the
# grammar's own end (finish "stop", no stop string) satisfies the schema
ENFORCED = [
    {"type": "object", "properties": {"kind": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
                                      "next": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
     "required": ["kind", "next"], "additionalProperties": False},
    {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "integer", "minimum": 5}},
                "required": ["t", "x"], "additionalProperties": False},
               {"type": "object", "properties": {"t": {"const": "b"}, "y": {"enum": [True, None]}},
                "required": ["t", "y"], "additionalProperties": False}]},
    {"type": "array", "minItems": 2, "maxItems": 3, "prefixItems": [{"type": "integer", "multipleOf": 3}],
     "items": {"type": "string", "pattern": "^[a-c]+$"}},
]


# a recursive schema's samples tend to nest until max_tokens: one example of a short object lets most of them end
PROMPTS = ['Example: {"kind": 7, "next": null}\nJSON: ', "JSON: ", "JSON: "]


@pytest.mark.parametrize(("schema", "prompt"), list(zip(ENFORCED, PROMPTS)))
def test_an_output_that_stops_satisfies_its_schema(llm, schema, prompt):
    stopped, texts = [], []
    for seed in range(3, 7):  # samples until some end (any can run past max_tokens)
        params = SamplingParams(n=4, temperature=0.8, seed=seed, max_tokens=96,
                                structured_outputs=StructuredOutputsParams(json=schema))
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        stopped += [o for o in out.outputs if o.finish_reason == "stop"]
        texts += [o.text for o in out.outputs]
        if stopped:
            break
    assert stopped, texts
    for o in stopped:
        assert o.stop_reason is None
        jsonschema.validate(json.loads(o.text), schema)


def test_a_grammar_not_compiled_within_the_bound_is_refused_and_its_compile_goes_on(tokenizer):
    """A 4,000-value enum takes far longer than a millisecond to compile: refused at once; the compile finishes in
    the background, and the same spec, sent again, gets that compile's grammar."""
    structured = StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, compile_timeout_s=1e-3)
    values = [f"city number {i}" for i in range(4000)]
    params = StructuredOutputsParams(json={"type": "object", "properties": {"city": {"enum": values}},
                                           "required": ["city"]})
    with pytest.raises(ValueError) as info:
        structured.compile(params)
    assert str(info.value).startswith("structured_outputs.json: the grammar did not compile within 0.001 s "
                                      "(grammar_compile_timeout_s, the server's --grammar-compile-timeout-s)")
    (in_flight,) = structured._compiling.values()  # the one compile, going on
    structured.compile_timeout_s = 0.0  # no bound: waits for it
    matcher = structured.matcher(params)
    assert in_flight.done() and not structured._compiling
    assert matcher.accept_string('{"city": "city number 3999"}')
    assert matcher.accept_token(tokenizer.eos_token_ids[0]) and matcher.is_terminated()
    assert not structured.matcher(params).accept_string('{"city": "city number 4000"}')
