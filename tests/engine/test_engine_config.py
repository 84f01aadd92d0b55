"""One place to add a knob: CLI flags, ``LLM`` keyword arguments and the tensor-parallel workers' spec all come
from ``EngineConfig``'s fields."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import numpy as np
import pytest

from hybridkv import LLM
from hybridkv.engine.args import add_engine_args, engine_config_from_args, engine_flags
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm import ENGINE_ARGS
from hybridkv.engine.model_runner import StepInput
from hybridkv.engine.tp_workers import WorkerSpec
from hybridkv.kv.host_tier import BlockCopy
from hybridkv.model.attention.base import StepSequence

# the flags of before the config drove them; scripts and tests/server use these names
FLAGS_KEPT = ["--dtype", "--max-model-len", "--block-size", "--enable-prefix-caching", "--no-enable-prefix-caching",
              "--kv-cache-dtype", "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory-bytes",
              "--gpu-memory-utilization", "--tensor-parallel-size", "--seed", "--device", "--skip-tokenizer-init",
              "--enforce-eager", "--load-format", "--model"]


def parser(model_positional: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p, model_positional)
    return p


def test_no_flags_give_the_configs_defaults_and_every_old_flag_name_still_parses():
    assert engine_config_from_args(parser().parse_args([])) == EngineConfig()
    names = {o for action in parser()._actions for o in action.option_strings}
    assert set(FLAGS_KEPT) <= names
    assert engine_config_from_args(parser(True).parse_args(["some/dir"])).model == "some/dir"


def _other_value(f: dataclasses.Field):
    """A value of the field's type that is not its default."""
    samples = {"model": "m", "dtype": "bfloat16", "prefix_caching_hash_algo": "sha256", "max_model_len": 77,
               "kv_cache_memory_bytes": 12345, "attention_backend": "torch", "load_format": "dummy",
               "kv_cache_dtype": "fp8_e4m3", "device": "cpu", "async_scheduling": False,
               "kv_events_config": '{"enable_kv_cache_events": true}', "data_parallel_backend": "ray"}
    if f.name in samples:
        return samples[f.name]
    if isinstance(f.default, bool):
        return not f.default
    return f.default * 2 if f.default else 3


def test_every_flag_reaches_its_config_field():
    argv, expected = [], {}
    for f in engine_flags():
        value = _other_value(f)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
        expected[f.name] = value
    config = engine_config_from_args(parser().parse_args(argv))
    assert {name: getattr(config, name) for name in expected} == expected
    # every field is a flag but the one a command sets itself, the one whose flag counts GiB (--kv-offload-gib) and
    # a replica's rank (the data-parallel front end sets it)
    assert {f.name for f in dataclasses.fields(EngineConfig)} - set(expected) == {"clamp_max_model_len",
                                                                                 "kv_offload_bytes",
                                                                                 "data_parallel_rank"}
    gib = engine_config_from_args(parser().parse_args(["--kv-offload-gib", "1.5"]))
    assert gib.kv_offload_bytes == 3 << 29
    assert all(f.metadata["help"] for f in dataclasses.fields(EngineConfig))


def test_llm_takes_every_config_field_and_refuses_others_by_name():
    assert set(ENGINE_ARGS) == {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    with pytest.raises(TypeError, match=r"unknown engine arguments \['max_seqs'\]; known: dtype, block_size"):
        LLM(max_seqs=4)


def test_a_workers_spec_carries_the_whole_config():
    config = EngineConfig(model="m", tensor_parallel_size=2, distributed_timeout_s=7.0, device="cpu", seed=9)
    spec = pickle.loads(pickle.dumps(dataclasses.replace(WorkerSpec(config, None, "float32", 10, 640, True), rank=1, port=5)))
    assert spec.config == config and (spec.rank, spec.port, spec.size, spec.timeout_s) == (1, 5, 2, 7.0)


def test_a_step_input_has_room_for_block_copies_and_pickles_to_workers():
    step = StepInput(np.array([1, 2]), [StepSequence(0, 2, [np.array([1])])], np.array([1]))
    assert step.block_ops == []
    assert pickle.loads(pickle.dumps(step)).seqs[0].query_len == 2
    # the host tier's copies reach the workers whole: direction, device blocks and host slots
    step.block_ops = [BlockCopy(True, np.array([3, 4]), np.array([0, 1])),
                      BlockCopy(False, np.array([5]), np.array([2]))]
    sent = pickle.loads(pickle.dumps(step)).block_ops
    assert [(op.to_host, op.device_blocks.tolist(), op.host_slots.tolist()) for op in sent] == [
        (True, [3, 4], [0, 1]), (False, [5], [2])]
