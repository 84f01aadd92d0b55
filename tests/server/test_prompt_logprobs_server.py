"""``echo`` + ``logprobs`` on /v1/completions and vLLM's ``prompt_logprobs`` on both endpoints, against transformers'
log-softmax of a tiny random checkpoint (word tokenizer: token i is the word ``w<i>``)."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app

MODEL = "tiny"
PROMPT_IDS = [7, 23, 5, 61, 40, 12, 88, 19, 33, 47, 9, 70, 15]
PROMPT = " ".join(f"w{i}" for i in PROMPT_IDS)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama4")


@pytest.fixture(scope="module")
def client(model):
    # steps of 4 tokens: the prompt is prefilled over four steps
    engine = LLMEngine(EngineConfig(model=str(model.path), block_size=4, max_num_batched_tokens=4,
                                    kv_cache_memory_bytes=8 << 20, max_num_seqs=4))
    app = build_app(engine, served_model_name=MODEL, chat_template="{{ messages[0]['content'] }}")
    with TestClient(app) as c:
        c.engine = engine
        yield c


@pytest.fixture(scope="module")
def ref(model) -> torch.Tensor:
    """transformers' log-softmax at each position of the prompt plus its greedy next token."""
    ids = PROMPT_IDS + model.greedy(PROMPT_IDS, 1)
    with torch.no_grad():
        return torch.log_softmax(model.hf(torch.tensor([ids])).logits[0].float(), -1)


def completion(client, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def all_blocks_free(client) -> bool:
    kv = client.engine.kv
    return kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_echo_with_logprobs_is_what_lm_eval_reads(client, model, ref):
    # lm-eval's local-completions loglikelihood request
    out = completion(client, prompt=[PROMPT_IDS], echo=True, logprobs=1, max_tokens=1)
    choice = out["choices"][0]
    next_id = model.greedy(PROMPT_IDS, 1)[0]
    assert choice["text"] == f"{PROMPT} w{next_id}"
    lp = choice["logprobs"]
    ids = PROMPT_IDS + [next_id]
    assert lp["tokens"] == [f"w{i}" for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4), p
        best = int(ref[p - 1].argmax())
        top = lp["top_logprobs"][p]
        assert set(top) == {f"w{ids[p]}", f"w{best}"}
        assert top[f"w{best}"] == pytest.approx(ref[p - 1, best].item(), abs=1e-4)
    starts = [0]
    for token in lp["tokens"][:-1]:
        starts.append(starts[-1] + len(token))
    assert lp["text_offset"] == starts
    # vLLM also returns the prompt's scores in its own shape, beside the legacy ones
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(PROMPT_IDS)
    assert out["usage"] == {"prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14}
    assert all_blocks_free(client)


def test_echo_with_max_tokens_0_returns_the_prompt_alone(client, ref):
    choice = completion(client, echo=True, logprobs=0, max_tokens=0)["choices"][0]
    assert choice["text"] == PROMPT
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS)
    got = torch.tensor(lp["token_logprobs"][1:])
    want = ref[torch.arange(len(PROMPT_IDS) - 1), torch.tensor(PROMPT_IDS[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # k = 0: the token alone
    plain = completion(client, echo=True, max_tokens=0)
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None
    assert plain["usage"]["completion_tokens"] == 0


def stream_chunks(client, **body) -> list[dict]:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_streams_the_prompt_in_the_first_chunk(client):
    full = completion(client, echo=True, logprobs=2, max_tokens=3)["choices"][0]
    chunks = stream_chunks(client, echo=True, logprobs=2, max_tokens=3)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["text"]
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert sum((lp["tokens"] for lp in streamed), []) == full["logprobs"]["tokens"]
    assert sum((lp["token_logprobs"] for lp in streamed), []) == full["logprobs"]["token_logprobs"]
    only = stream_chunks(client, echo=True, max_tokens=0, stream_options={"include_usage": True})
    assert [c["choices"][0]["text"] for c in only[:-1]] == [PROMPT]
    assert only[0]["choices"][0]["finish_reason"] == "length"
    assert only[-1]["usage"] == {"prompt_tokens": 13, "completion_tokens": 0, "total_tokens": 13}
    assert all_blocks_free(client)


def assert_vllm_prompt_logprobs(entries, ref, k):
    assert entries[0] is None and len(entries) == len(PROMPT_IDS)
    for p in range(1, len(PROMPT_IDS)):
        entry, row, token = entries[p], ref[p - 1], PROMPT_IDS[p]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert own["rank"] == int((row > row[token]).sum()) + 1 and own["decoded_token"] == f"w{token}"
        top = torch.topk(row, k)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(t)]["rank"] == rank and entry[str(t)]["logprob"] == pytest.approx(v, abs=1e-4)
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(client, ref):
    choice = completion(client, prompt_logprobs=3, max_tokens=2)["choices"][0]
    assert_vllm_prompt_logprobs(choice["prompt_logprobs"], ref, 3)
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    # the chat template renders the message as it is, so the chat prompt is the same tokens
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                                  "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert_vllm_prompt_logprobs(r.json()["prompt_logprobs"], ref, 2)
    plain = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                      "max_tokens": 1})
    assert plain.json()["prompt_logprobs"] is None
    assert all_blocks_free(client)


@pytest.mark.parametrize("body,needle", [
    ({"prompt_logprobs": 21}, "prompt_logprobs must be <= 20, got 21"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs: not available with stream"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"echo": True, "logprobs": 21}, "logprobs must be <= 20"),
])
def test_bad_values_are_400s_naming_the_field(client, body, needle):
    r = client.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert all_blocks_free(client)


def test_tokens_a_grammar_rules_out_get_vllms_floor_not_a_500(client):
    # the grammar masks all but two words before the logprobs are taken (as in vLLM): the rest of the top 5 are -inf
    choice = completion(client, max_tokens=1, logprobs=5, echo=True,
                        structured_outputs={"choice": ["w3", "w4"]})["choices"][0]
    top = choice["logprobs"]["top_logprobs"][-1]
    assert len(top) == 5 and sorted(top.values())[:3] == [-9999.0] * 3
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1,
                                                  "logprobs": True, "top_logprobs": 5,
                                                  "structured_outputs": {"choice": ["w3", "w4"]}})
    assert r.status_code == 200, r.text
    assert [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"][2:]] == [-9999.0] * 3
    assert all_blocks_free(client)
