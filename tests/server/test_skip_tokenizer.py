"""A server without a tokenizer (--skip-tokenizer-init): token ids in, token ids out, text refused clearly."""

from __future__ import annotations

from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig
from hybridkv.server.app import build_app


def test_completions_take_token_ids_and_text_is_refused(tiny_model, tmp_path):
    model = tiny_model("llama3")
    for f in model.path.iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    config = EngineConfig(model=str(tmp_path), device="cpu", kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    prompt = [5, 17, 33, 8]
    with TestClient(build_app(config)) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and r.json()["usage"]["completion_tokens"] == 4
        expected = model.greedy(prompt, 4)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
        r = client.post("/v1/completions", json={"prompt": "some text"})
        assert r.status_code == 400 and "send the prompt as token ids" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"]
