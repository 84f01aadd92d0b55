"""Structured outputs through xgrammar: a grammar per request, a matcher per sequence, a token bitmask per step.

``StructuredOutputs.compile`` turns ``StructuredOutputsParams`` into an xgrammar ``CompiledGrammar``; xgrammar's
compiler keeps compiled grammars in a byte-bounded cache keyed by the spec's text, so a spec is compiled once
(JSON schemas keep their key order: it is the order the properties must come in). A compile that takes longer than
``compile_timeout_s`` is refused (and goes on in the background), and a JSON schema is first checked for a value
and for keywords xgrammar would not enforce (``json_schema_check.py``). Each sequence gets its
own ``GrammarMatcher``; every step the engine asks for the batch's bitmask (rows without a grammar allow every
token), the sampler applies it to the logits, and the sampled token advances the matcher.

xgrammar (and the transformers import it brings) loads on the first constrained request, not at engine start.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # the builtin TimeoutError from Python 3.11
from typing import TYPE_CHECKING

import torch

from hybridkv.engine.device_transfer import host_to_device
from hybridkv.engine.json_schema_check import check_schema, resolve_ref
from hybridkv.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

    from hybridkv.model.loading.tokenizer import Tokenizer

# OpenAI's JSON mode promises an object (vLLM compiles this schema too); xgrammar's builtin JSON grammar takes any
# value, ``[1]`` included.
JSON_OBJECT_SCHEMA = {"type": "object"}
# Schema keywords whose values are JSON data, not subschemas: a "$ref" key inside them is data.
_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords that describe a schema without constraining it: a schema with only these and "$ref" is the ref itself.
_ANNOTATION_KEYWORDS = frozenset({"title", "description", "$comment", "examples", "default", "deprecated"})
# Compiled grammars kept by the compiler: a JSON schema over a 49K vocabulary takes about 40-120 KB.
GRAMMAR_CACHE_BYTES = 256 << 20


class StructuredOutputs:
    """The engine's grammar compiler for one tokenizer (built on first use; safe to call from any thread)."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Sequence[int],
                 compile_timeout_s: float = 0.0) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s  # 0: wait for any compile
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._compiling: dict[tuple, Future] = {}  # by spec: compiles in flight, a refused one's included

    @property
    def compiler(self) -> xgrammar.GrammarCompiler:
        if self._tokenizer is None:
            raise ValueError("structured_outputs: grammars are compiled over the tokenizer's vocabulary, and this "
                             "engine was started with skip_tokenizer_init=True")
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar (from the cache when this spec was seen); ValueError naming the field if invalid,
        if a JSON schema refers outside itself, has no value or holds keywords the grammar would not enforce
        (``json_schema_check.py``), or if the grammar accepts no output at all."""
        compiler = self.compiler
        kind = params.kind
        if kind == "json":
            check_refs(params.json)
            try:
                check_schema(params.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json: {error}") from None
        try:
            grammar = self._compile_within_bound(compiler, params)
        except RuntimeError as error:  # xgrammar reports bad specs as RuntimeError with its C++ location first
            raise ValueError(f"structured_outputs.{kind}: {_xgrammar_message(error)}") from None
        if not self._accepts_a_first_token(grammar):
            raise ValueError(f"structured_outputs.{kind}: no output satisfies it: not even a first token is allowed")
        return grammar

    def _compile_within_bound(self, compiler: xgrammar.GrammarCompiler,
                              params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """``_compile`` in a thread of its own, waited on for at most ``compile_timeout_s`` (0: any time): ValueError
        past it.
        xgrammar cannot stop a compile, so a refused one goes on and leaves its grammar in the cache; the same spec
        sent meanwhile waits on that compile rather than starting another. (The compile releases the GIL: the
        engine and the server go on meanwhile.)"""
        key = _spec_key(params)
        with self._lock:
            future = self._compiling.get(key)
            if future is None:
                future = self._compiling[key] = Future()
                threading.Thread(target=self._run_compile, args=(key, future, compiler, params), daemon=True,
                                 name="grammar-compile").start()
        try:
            return future.result(timeout=self.compile_timeout_s or None)
        except FutureTimeout:
            raise ValueError(
                f"structured_outputs.{params.kind}: the grammar did not compile within {self.compile_timeout_s:g} s "
                "(grammar_compile_timeout_s, the server's --grammar-compile-timeout-s): it is too large (an enum of "
                "tens of thousands of values is); its compile goes on, and the same spec sent again once it is done "
                "is served from the cache") from None

    def _run_compile(self, key: tuple, future: Future, compiler: xgrammar.GrammarCompiler,
                     params: StructuredOutputsParams) -> None:
        try:
            future.set_result(_compile(compiler, params))
        except BaseException as error:  # handed to whoever waits on it
            future.set_exception(error)
        finally:
            with self._lock:
                del self._compiling[key]

    def _accepts_a_first_token(self, grammar: xgrammar.CompiledGrammar) -> bool:
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(mask, 0)
        return bool(mask.any())

    def matcher(self, params: StructuredOutputsParams) -> xgrammar.GrammarMatcher:
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(params))

    def bitmask(self, matchers: Sequence[xgrammar.GrammarMatcher | None]) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32: bit ``t`` of row ``i`` set when token ``t`` may come next."""
        import xgrammar as xgr

        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)  # all bits set: everything allowed
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, i)
        return mask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for every token whose bit is clear (``logits`` float32, [rows, vocab])."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, host_to_device(bitmask, logits.device), vocab_size=logits.shape[1])


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the vocabulary: how tokens spell bytes (detected from the tokenizer's own description),
    with special tokens spelled empty so that no grammar can take them for text; ``stop_token_ids`` end a grammar."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    probe = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend), vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
    )
    vocab = [""] * vocab_size
    for token, index in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if index < vocab_size and not tokenizer.is_special(index):
            vocab[index] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(vocab, probe.dump_metadata())


def _compile(compiler: xgrammar.GrammarCompiler, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = JSON_OBJECT_SCHEMA if kind == "json_object" else params.json
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=not params.disable_any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(params.choice))
    if "::=" not in params.grammar:  # Lark, which vLLM takes too (EBNF rules are written with ::=)
        import xgrammar as xgr

        return compiler.compile_grammar(xgr.Grammar.from_lark(params.grammar))
    return compiler.compile_grammar(params.grammar)


def _spec_key(params: StructuredOutputsParams) -> tuple:
    spec = getattr(params, params.kind)
    return params.kind, json.dumps(spec), params.disable_any_whitespace


def check_refs(schema: dict) -> None:
    """ValueError naming the first ``$ref`` that points outside the schema (a URL, another file: xgrammar would drop
    it silently and leave that part unconstrained; nothing is ever fetched), or that only leads, through schemas that
    are nothing but a ``$ref``, back to itself (no value satisfies it, wherever it sits)."""
    for path, ref in _refs(schema):
        if not ref.startswith("#"):
            raise ValueError(f"structured_outputs.json: $ref {ref!r} (at {path}) is not a reference inside the "
                             "schema; external schemas are never fetched: put it under $defs and refer to it as "
                             "'#/$defs/NAME'")
        if _ref_loop(schema, ref):
            raise ValueError(f"structured_outputs.json: $ref {ref!r} (at {path}) only leads back to itself through "
                             "other $refs; no value satisfies it")


def _refs(node: object, path: str = ""):
    """(where, ``$ref`` value) for every reference in a schema, depth first."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield path or "the root", ref
        for key, value in node.items():
            if key not in _VALUE_KEYWORDS:
                yield from _refs(value, f"{path}.{key}" if path else key)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}.{i}")


def _ref_loop(root: dict, ref: str) -> bool:
    seen: set[str] = set()
    while ref not in seen:
        seen.add(ref)
        target = resolve_ref(root, ref)
        if not (isinstance(target, dict) and isinstance(target.get("$ref"), str)
                and set(target) - _ANNOTATION_KEYWORDS == {"$ref"}):
            return False
        ref = target["$ref"]
    return True


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_message(error: Exception) -> str:
    # "[10:34:53] /project/cpp/json_schema_converter.cc:4944: Unsupported type ..." -> "Unsupported type ..."
    text = str(error).strip()
    head, sep, rest = text.partition(".cc:")
    if sep:
        text = rest.split(": ", 1)[-1]
    return text.strip()

