"""One dtype table: names and sizes in kv/, their torch dtypes once in model/."""

import pytest

from hybridkv.kv.dtypes import (
    DTYPE_BYTES, KV_CACHE_DTYPES, MODEL_DTYPES, canonical_dtype, dtype_bytes, resolve_kv_dtype, resolve_model_dtype,
)
from hybridkv.kv.layer_specs import checkpoint_dtype, layer_specs_from_hf_config


def test_the_docstring_examples():
    assert canonical_dtype("torch.bfloat16") == "bfloat16" and dtype_bytes("bfloat16") == 2
    assert canonical_dtype("half") == "float16" and dtype_bytes("fp8_e4m3") == 1
    assert canonical_dtype("float8_e4m3fn") == "fp8_e4m3" and canonical_dtype("int4") is None
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        dtype_bytes("int4")


def test_torch_dtypes_cover_every_name_with_the_same_size():
    torch = pytest.importorskip("torch")
    from hybridkv.model.dtypes import MODEL_TORCH_DTYPES, TORCH_DTYPES, dtype_name, torch_dtype

    assert set(TORCH_DTYPES) == set(DTYPE_BYTES) == set(KV_CACHE_DTYPES)
    for name, size in DTYPE_BYTES.items():
        assert torch.empty((), dtype=torch_dtype(name)).element_size() == size
        assert dtype_name(torch_dtype(name)) == name
    assert MODEL_TORCH_DTYPES == (torch.float32, torch.bfloat16, torch.float16)
    assert tuple(dtype_name(d) for d in MODEL_TORCH_DTYPES) == MODEL_DTYPES
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        torch_dtype("int8")


@pytest.mark.parametrize(
    "config, weights",
    [
        ({"torch_dtype": "float16"}, "float16"),
        ({"dtype": "torch.float32"}, "float32"),
        ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),
        ({"torch_dtype": "float8_e4m3fn"}, "fp8_e4m3"),
        ({"torch_dtype": "int4"}, "bfloat16"),
        ({}, "bfloat16"),
    ],
)
def test_checkpoint_dtype(config, weights):
    assert checkpoint_dtype(config) == weights


def test_auto_resolves_by_one_rule_for_the_engine_and_the_planner():
    """The model computes in float32 on the CPU and bfloat16 on a GPU whatever the checkpoint says; an ``auto``
    cache stores what the model computes, so a planned layer (a GPU's) holds bfloat16 even for a float32
    checkpoint, as the engine's cache does."""
    assert resolve_model_dtype("auto", "cpu") == "float32" and resolve_model_dtype("auto", "cuda") == "bfloat16"
    assert resolve_model_dtype("float16", "cuda") == "float16"
    assert resolve_kv_dtype("auto", "float32") == "float32" and resolve_kv_dtype("auto", "float16") == "float16"
    assert resolve_kv_dtype("fp8", "bfloat16") == resolve_kv_dtype("fp8_e4m3", "float32") == "fp8_e4m3"
    with pytest.raises(ValueError, match="choose auto, float32, bfloat16, float16, fp8_e4m3"):
        resolve_kv_dtype("half", "bfloat16")
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported"):
        resolve_kv_dtype("fp8_e5m2", "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'fp8_e4m3'; choose auto, float32, bfloat16, float16"):
        resolve_model_dtype("fp8_e4m3", "cuda")
    f32 = {"num_hidden_layers": 1, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"}
    assert layer_specs_from_hf_config(f32)[0].dtype == "bfloat16"
