import pytest


@pytest.fixture(scope="session")
def smollm_tokenizer():
    from hybridkv.model.loading.known_models import resolve_model
    from hybridkv.model.loading.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_model(None).path)
