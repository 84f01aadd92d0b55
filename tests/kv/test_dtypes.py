"""One dtype table: names and sizes in kv/, their torch dtypes once in model/."""

import pytest

from hybridkv.kv.dtypes import DTYPE_BYTES, KV_CACHE_DTYPES, MODEL_DTYPES, canonical_dtype, dtype_bytes
from hybridkv.kv.layer_specs import checkpoint_dtype, resolve_kv_dtype


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
    "config, weights, kv_auto",
    [
        ({"torch_dtype": "float16"}, "float16", "float16"),
        ({"dtype": "torch.float32"}, "float32", "float32"),
        ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16", "bfloat16"),
        ({"torch_dtype": "float8_e4m3fn"}, "fp8_e4m3", "bfloat16"),  # an FP8 checkpoint computes in bf16
        ({"torch_dtype": "int4"}, "bfloat16", "bfloat16"),
        ({}, "bfloat16", "bfloat16"),
    ],
)
def test_checkpoint_dtype_and_auto_kv_dtype(config, weights, kv_auto):
    assert checkpoint_dtype(config) == weights
    assert resolve_kv_dtype("auto", config) == kv_auto
    assert resolve_kv_dtype("fp8", config) == resolve_kv_dtype("fp8_e4m3", config) == "fp8_e4m3"
    with pytest.raises(ValueError, match="choose auto, float32, bfloat16, float16, fp8_e4m3"):
        resolve_kv_dtype("half", config)
