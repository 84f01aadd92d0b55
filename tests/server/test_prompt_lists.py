"""``/v1/completions`` with a list of prompts, as vLLM takes it (lm-eval's ``--batch_size``): each prompt answered as
if sent alone, prompt i's ``n`` choices at indices ``i*n .. i*n+n-1``, usage summed, streamed and not; a prompt the
engine refuses refuses the whole request and leaves nothing queued. A tiny random checkpoint whose tokenizer makes
token i the word ``w<i>``."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app

MODEL = "tiny"
PROMPTS = ["w5 w17 w33 w8", "w60 w6", "w11 w22 w33 w44 w55 w66 w77"]
PROMPT_IDS = [[5, 17, 33, 8], [60, 6], [11, 22, 33, 44, 55, 66, 77]]


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), block_size=4, max_num_batched_tokens=8,
                                    kv_cache_memory_bytes=8 << 20, max_num_seqs=8))
    with TestClient(build_app(engine, served_model_name=MODEL)) as c:
        c.engine = engine
        yield c


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "max_tokens": 5, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(client, **body) -> list[dict]:
    body = {"model": MODEL, "max_tokens": 5, "ignore_eos": True, "stream": True, **body}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def texts_by_index(chunks: list[dict]) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out[choice["index"]] = out.get(choice["index"], "") + choice["text"]
    return out


def all_free(client) -> bool:
    """Whether the engine holds no request and no KV block, once the aborts it was sent have reached it."""
    kv = client.engine.kv
    deadline = time.monotonic() + 30
    while kv.pool.num_free_blocks != kv.pool.num_usable_blocks or client.engine.has_unfinished_requests():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("prompts", [PROMPTS, PROMPT_IDS], ids=["strings", "token ids"])
def test_each_prompt_gets_what_it_gets_alone_in_vllms_index_order(client, prompts):
    alone = [completion(client, prompt=p, temperature=0) for p in prompts]
    batch = completion(client, prompt=prompts, temperature=0)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert batch["usage"] == {key: sum(a["usage"][key] for a in alone) for key in batch["usage"]}
    assert batch["usage"]["prompt_tokens"] == sum(map(len, PROMPT_IDS))
    assert batch["usage"]["completion_tokens"] == 5 * len(prompts)


def test_n_choices_per_prompt_sit_at_i_times_n_streamed_and_not(client):
    body = dict(prompt=PROMPTS, n=2, temperature=1.0, seed=7)
    batch = completion(client, **body)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for i, prompt in enumerate(PROMPTS):  # the seed gives each prompt's two samples what it gives it alone
        alone = completion(client, prompt=prompt, n=2, temperature=1.0, seed=7)["choices"]
        assert [c["text"] for c in batch["choices"][2 * i:2 * i + 2]] == [c["text"] for c in alone]
    chunks = streamed(client, stream_options={"include_usage": True}, **body)
    assert texts_by_index(chunks) == {c["index"]: c["text"] for c in batch["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == batch["usage"]
    finishes = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]}
    assert finishes == {i: "length" for i in range(6)}


def test_echo_and_logprobs_per_prompt(client):
    batch = completion(client, prompt=PROMPTS[:2], echo=True, logprobs=1, max_tokens=0, temperature=0)
    for choice, prompt, ids in zip(batch["choices"], PROMPTS, PROMPT_IDS):
        alone = completion(client, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)["choices"][0]
        assert choice["text"] == prompt == alone["text"]
        assert choice["logprobs"] == alone["logprobs"] and len(choice["logprobs"]["tokens"]) == len(ids)
    assert batch["usage"]["completion_tokens"] == 0 and batch["usage"]["prompt_tokens"] == 6


def test_a_refused_prompt_refuses_the_list_and_frees_the_others(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [10**9]], "max_tokens": 400,
                                             "ignore_eos": True})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
    assert all_free(client)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["w5", "w6 " * 600]})
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"], r.text
    assert all_free(client)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["w5", [5, 6]]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt"), r.text
