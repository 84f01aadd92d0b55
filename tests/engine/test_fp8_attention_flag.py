"""The FP8 attention-compute switch: CLI flag -> EngineConfig -> LLM, and its refusal without an FP8 cache.

(The kernels it selects are checked against the torch reference in tests/gpu.)"""

import argparse

import pytest

from hybridkv import LLM
from hybridkv.engine.args import add_engine_args, engine_config_from_args
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine


def test_the_flag_reaches_the_config_and_is_off_by_default():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not engine_config_from_args(parser.parse_args([])).fp8_attention_compute
    config = engine_config_from_args(parser.parse_args(["--kv-cache-dtype", "fp8_e4m3", "--fp8-attention-compute"]))
    assert config.fp8_attention_compute and config.kv_cache_dtype == "fp8_e4m3"


def test_fp8_compute_without_an_fp8_cache_is_refused(tiny_model):
    path = str(tiny_model("llama3").path)
    with pytest.raises(ValueError, match="fp8_attention_compute needs kv_cache_dtype=fp8_e4m3"):
        LLMEngine(EngineConfig(model=path, device="cpu", kv_cache_memory_bytes=1 << 20, fp8_attention_compute=True))


def test_the_llm_kwarg_reaches_the_engine(tiny_model):
    # on the CPU the torch reference backend serves (exact: the switch only selects Triton kernels)
    llm = LLM(model=str(tiny_model("llama3").path), device="cpu", kv_cache_memory_bytes=1 << 20,
              kv_cache_dtype="fp8_e4m3", fp8_attention_compute=True)
    assert llm.engine.config.fp8_attention_compute
    # the keyword reaches the engine's own check: without an FP8 cache it is refused by name
    with pytest.raises(ValueError, match="fp8_attention_compute needs kv_cache_dtype=fp8_e4m3"):
        LLM(model=str(tiny_model("llama3").path), device="cpu", kv_cache_memory_bytes=1 << 20,
            fp8_attention_compute=True)
