"""A thin tokenizer over ``tokenizers.Tokenizer``, built from a GGUF file or an HF directory.

Token ids, decoded text and rendered chat templates match what transformers produces for the same
files (``AutoTokenizer.from_pretrained(dir)`` or ``(dir, gguf_file=...)``).

GGUF vocabularies: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) and Gemma's SentencePiece BPE
(``"llama"`` in a gemma/gemma2/gemma3 file), rebuilt the way transformers' GGUF loader does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from hybridkv.model.loading.gguf_reader import gguf_metadata

# llama.cpp's token_type values.
_CONTROL = 3
_USER_DEFINED = 4

# Split regexes for the `tokenizer.ggml.pre` values whose merges were learned on a split other than
# GPT-2's; every other value (e.g. SmolLM2's "smollm") gets GPT-2's, as transformers does.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# The 256 characters byte-level BPE spells bytes with, and a pre-tokenizer that spells text in them.
_BYTE_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())
_BYTE_SPELLER = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}


@dataclass(slots=True)
class Tokenizer:
    backend: BackendTokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    # Every id that ends generation: the EOS plus end-of-turn ids the checkpoint declares.
    eos_token_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    _template: jinja2.Template | None = field(init=False, default=None, repr=False)
    _max_token_chars: int | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.eos_token_ids and self.eos_token_id is not None:
            self.eos_token_ids = [self.eos_token_id]
        if self.chat_template is not None:
            self._template = _compile_chat_template(self.chat_template)

    # -- constructors ------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path_or_reader: str | PathLike | gguf.GGUFReader) -> Tokenizer:
        """From a GGUF file's metadata: byte-level BPE (``tokenizer.ggml.model == "gpt2"``), or Gemma's
        SentencePiece-style BPE (``"llama"`` in a gemma-family file)."""
        reader = path_or_reader
        if not isinstance(reader, gguf.GGUFReader):
            reader = gguf.GGUFReader(path_or_reader)
        model = gguf_metadata(reader, "tokenizer.ggml.model")
        architecture = gguf_metadata(reader, "general.architecture")
        tokens = gguf_metadata(reader, "tokenizer.ggml.tokens")
        token_types = gguf_metadata(reader, "tokenizer.ggml.token_type", [])
        if model == "gpt2":
            backend = _byte_level_bpe(
                tokens,
                gguf_metadata(reader, "tokenizer.ggml.merges", []),
                token_types,
                gguf_metadata(reader, "tokenizer.ggml.pre"),
            )
        elif model == "llama" and architecture in _GEMMA_ARCHITECTURES:
            backend = _gemma_bpe(tokens, token_types)
        else:
            raise ValueError(
                f"GGUF tokenizer model {model!r} (architecture {architecture!r}) is not supported; supported: "
                f"'gpt2' (byte-level BPE), 'llama' in {', '.join(_GEMMA_ARCHITECTURES)} files (Gemma SentencePiece)"
            )
        bos_id = gguf_metadata(reader, "tokenizer.ggml.bos_token_id")
        eos_id = gguf_metadata(reader, "tokenizer.ggml.eos_token_id")
        bos_token = tokens[bos_id] if bos_id is not None else None
        eos_token = tokens[eos_id] if eos_id is not None else None
        # SentencePiece files without the flag get BOS, as llama.cpp and transformers do.
        add_bos_default = model == "llama"
        _set_post_processor(
            backend,
            bos_token if gguf_metadata(reader, "tokenizer.ggml.add_bos_token", add_bos_default) else None,
            eos_token if gguf_metadata(reader, "tokenizer.ggml.add_eos_token", False) else None,
        )
        end_ids = [eos_id] + [
            gguf_metadata(reader, f"tokenizer.ggml.{key}_token_id") for key in ("eot", "eom")
        ]
        return cls(
            backend=backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=_unique(i for i in end_ids if i is not None),
            chat_template=gguf_metadata(reader, "tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | PathLike) -> Tokenizer:
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (and ``generation_config.json`` if present)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path / 'tokenizer.json'} not found: hybridkv reads a Hugging Face directory's tokenizer from "
                "tokenizer.json (a fast tokenizer); add it, or pass skip_tokenizer_init (--skip-tokenizer-init) "
                "and send token ids"
            )
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        if not isinstance(generation_eos, list):
            generation_eos = [generation_eos]
        end_ids = [backend.token_to_id(eos_token) if eos_token else None, *generation_eos]
        return cls(
            backend=backend,
            bos_token=bos_token,
            eos_token=eos_token,
            eos_token_ids=_unique(i for i in end_ids if i is not None),
            chat_template=_hf_chat_template(path, config),
        )

    # -- encoding and decoding ---------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers, so ``len(text) / max_token_chars`` tokens at
        least: the longest vocabulary entry (byte-level entries spell one byte per character, and a character
        is at least one byte), times 4 when a normalizer could merge or drop characters (NFKC, stripping)."""
        if self._max_token_chars is None:
            longest = max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)
            self._max_token_chars = longest * (4 if self.backend.normalizer is not None else 1)
        return self._max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in ``text`` (e.g. ``<|im_start|>``) become their ids, as in HF."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Raw vocabulary strings (byte-level spelling), e.g. for spotting token boundaries."""
        return [self.backend.id_to_token(i) for i in ids]

    def is_special(self, token_id: int) -> bool:
        added = self.backend.get_added_tokens_decoder().get(token_id)
        return added is not None and added.special

    # -- chat --------------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` the way HF's ``apply_chat_template(..., tokenize=False)`` does."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except jinja2.TemplateError as error:
            roles = [message.get("role") for message in messages]
            raise ValueError(f"chat template rejected the conversation (roles {roles}): {error}") from error


def word_tokenizer(vocab: int) -> Tokenizer:
    """A stand-in over a model's vocabulary (dummy weights without tokenizer files): token i is the word "w<i>",
    EOS is w1."""
    backend = BackendTokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, eos_token="w1", eos_token_ids=[1])


def _byte_level_bpe(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str | None
) -> BackendTokenizer:
    vocab = {_byte_level_spelling(token): index for index, token in enumerate(tokens)}
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=[tuple(merge.split(" ", 1)) for merge in merges], fuse_unk=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, token_types)
    return backend


_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")
_SP_SPACE = "\u2581"  # SentencePiece's visible space


def _gemma_bpe(tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    """Gemma's tokenizer as transformers' GGUF loader builds it (``gemma_tokenizer`` + ``GemmaTokenizer``).

    - Tokens made only of spaces are stored as real spaces; the model looks them up as "\u2581" runs.
    - The file has no merges: they are every split of a token into two vocabulary tokens, ranked by the
      token's position in the file (earlier first), ties broken by the shorter left piece, then the shorter
      right piece; the splits of one token are listed in order of their pieces' ids.
    - BPE with byte fallback; spaces become "\u2581" (no prefix space); decoding reverses that and fuses bytes.
    """
    spelled = [_SP_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(spelled)}
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_position(spelled, vocab),
            fuse_unk=True,
            unk_token="<unk>",
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", _SP_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    # As transformers does, added tokens come from the file's own spelling: a user-defined run of spaces
    # ("  ") is not in the respelled vocabulary, so it stays an ordinary BPE token.
    _add_sentencepiece_special_tokens(backend, tokens, token_types)
    return backend


def _merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """transformers' ``generate_merges(vocab, {token: -position})``, for a vocabulary without merges."""
    rank = {token: -index for index, token in enumerate(tokens)}  # a repeated token keeps its last position
    merges = []
    for token, score in rank.items():
        local = [
            (token[:i], token[i:], score)
            for i in range(1, len(token))
            if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_sentencepiece_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens as special added tokens; user-defined ones (``\n`` runs, ``<table>``...) as plain ones."""
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token, kind in typed if kind == _CONTROL]
    )
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in typed
            if kind == _USER_DEFINED and token in vocab
        ]
    )


def _byte_level_spelling(token: str) -> str:
    """A vocabulary entry in the byte alphabet BPE works in.

    Byte-level GGUF vocabularies are normally already spelled in it; an entry using other characters
    is raw text, which is respelled byte by byte, as transformers does.
    """
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(piece for piece, _ in _BYTE_SPELLER.pre_tokenize_str(token))



def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_gguf_special_tokens(backend: BackendTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Keep control tokens (specials, like ``<|im_end|>``) and user-defined ones whole in text.

    A control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it would grow
    the vocabulary past the model's embedding, so it is skipped (as transformers does).
    """
    typed = list(zip(tokens, token_types))
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in typed
            if kind == _CONTROL and set(token) <= _BYTE_ALPHABET
        ]
    )
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in typed
            if kind == _USER_DEFINED and token in vocab
        ]
    )


def _set_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    specials = [token for token in (bos, eos) if token is not None]
    single = " ".join(part for part in (bos and f"{bos}:0", "$A:0", eos and f"{eos}:0") if part)
    pair = " ".join(part for part in (single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1") if part)
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(token, backend.token_to_id(token)) for token in specials]
    )


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile with the same environment HF uses, so templates render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson HTML-escapes, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _hf_chat_template(path: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        # Named templates: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    return template


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialized AddedTokens.
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _unique(ids) -> list[int]:
    return list(dict.fromkeys(ids))
