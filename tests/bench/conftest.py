import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from hybridkv.model.registry import resolve_model
    from hybridkv.model.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_model(None).path)
