"""A model argument that names nothing gets an error saying which way it is wrong."""

from __future__ import annotations

import pytest

from hybridkv.model.loading.known_models import resolve_model


def test_a_missing_path_and_a_directory_without_config_json_get_different_errors(tmp_path):
    with pytest.raises(ValueError) as missing:
        resolve_model(str(tmp_path / "no-such-model"))
    assert str(missing.value).startswith(f"model '{tmp_path / 'no-such-model'}' does not exist: it is no file or "
                                         "directory, nor a known name (")
    with pytest.raises(ValueError) as empty:
        resolve_model(str(tmp_path))
    assert str(empty.value) == (f"model '{tmp_path}' is a directory without config.json: a Hugging Face model "
                                "directory has config.json, *.safetensors and tokenizer.json")
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"without config.json: .*; it holds m.gguf: pass that file"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file but not a .gguf one"):
        resolve_model(str(tmp_path / "weights.bin"))
