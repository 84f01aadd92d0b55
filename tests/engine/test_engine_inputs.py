"""What the engine is given: the device it picks, a checkpoint without a tokenizer, and request limits."""

from __future__ import annotations

import argparse

import pytest
import torch
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.args import add_engine_args, engine_config_from_args
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.runtime import resolve_device
from hybridkv.engine.output_processing import RequestOutputState


def test_auto_device_is_cuda_when_torch_sees_a_gpu(tiny_model):
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected and EngineConfig().device == "auto"
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), kv_cache_memory_bytes=1 << 20))
    assert engine.config.device == expected
    assert next(engine.model.parameters()).device.type == expected
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            resolve_device("cuda")


def test_engine_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).device == "auto"
    config = engine_config_from_args(parser.parse_args(["--skip-tokenizer-init", "--device", "cpu"]))
    assert config.skip_tokenizer_init and config.device == "cpu"


@pytest.fixture
def no_tokenizer_dir(tiny_model, tmp_path):
    """The tiny Llama's checkpoint without its tokenizer files."""
    model = tiny_model("llama3")
    for f in model.path.iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    return model, tmp_path


def test_a_directory_without_tokenizer_json_names_the_file(no_tokenizer_dir):
    _, path = no_tokenizer_dir
    with pytest.raises(FileNotFoundError, match=rf"{path}/tokenizer.json not found.*skip_tokenizer_init"):
        LLM(model=str(path), device="cpu", kv_cache_memory_bytes=1 << 20)


def test_skip_tokenizer_init_takes_and_gives_token_ids(no_tokenizer_dir):
    model, path = no_tokenizer_dir
    llm = LLM(model=str(path), device="cpu", kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    assert llm.engine.eos_token_ids == [1]  # the config's eos_token_id
    prompts = random_prompts([9, 17], seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [model.greedy(p, 6) for p in prompts]
    assert all(o.outputs[0].text == "" for o in outs)
    with pytest.raises(ValueError, match="no tokenizer.*send the prompt as token ids"):
        llm.generate("a text prompt", params, use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], params, use_tqdm=False)


def test_request_limits(tiny_model):
    llm = LLM(model=str(tiny_model("llama3").path), device="cpu", kv_cache_memory_bytes=1 << 20, max_num_seqs=4,
              max_model_len=64)
    engine = llm.engine
    with pytest.raises(ValueError, match=r"n must be <= max_num_seqs \(4\), got 5"):
        engine.add_request("a", [5, 6], SamplingParams(n=5))
    with pytest.raises(ValueError, match=r"logit_bias: token id 96 is outside the vocabulary \[0, 96\)"):
        engine.add_request("b", [5, 6], SamplingParams(logit_bias={96: 1.0}))
    with pytest.raises(ValueError, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**63)
    chars = 64 * engine.tokenizer.max_token_chars
    with pytest.raises(ValueError, match=f"the prompt is {chars + 1:,} characters long"):
        engine.add_request("c", "w" * (chars + 1), SamplingParams())
    assert not engine.has_unfinished_requests()



def test_a_request_whose_second_copy_fails_to_build_leaves_nothing_queued(tiny_model, monkeypatch):
    llm = LLM(model=str(tiny_model("llama3").path), device="cpu", kv_cache_memory_bytes=1 << 20)
    engine = llm.engine
    create = RequestOutputState.create
    calls = []

    def create_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second copy's output state broke")
        return create(*args)

    monkeypatch.setattr(RequestOutputState, "create", staticmethod(create_once))
    with pytest.raises(RuntimeError, match="second copy"):
        engine.add_request("a", [5, 6, 7], SamplingParams(n=2))
    monkeypatch.undo()
    assert not engine.scheduler.waiting and not engine.has_unfinished_requests()
    engine.add_request("a", [5, 6, 7], SamplingParams(n=2, max_tokens=2))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks

def test_logit_bias_forces_and_bans_tokens(tiny_model):
    llm = LLM(model=str(tiny_model("llama3").path), device="cpu", kv_cache_memory_bytes=1 << 20)
    prompt = {"prompt_token_ids": random_prompts([12], seed=9)[0]}
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    free = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={42: 100.0})
    assert llm.generate(prompt, forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 5
    banned = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={free[0]: -100.0})
    assert llm.generate(prompt, banned, use_tqdm=False)[0].outputs[0].token_ids[0] != free[0]
