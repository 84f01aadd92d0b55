"""API keys on the /v1 routes (401 in OpenAI's error shape), /health and /metrics open, CORS with vLLM's flags."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from hybridkv.cli import build_parser
from hybridkv.commands.serve import API_KEY_ENV, server_options_from_args
from hybridkv.engine.llm_engine import EngineConfig
from hybridkv.server.app import build_app
from hybridkv.server.options import ServerOptions

KEYS = ["sk-first", "sk-second"]
ORIGIN = "https://app.example"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    options = ServerOptions(api_keys=KEYS, allowed_origins=[ORIGIN])
    with TestClient(build_app(EngineConfig(kv_cache_memory_bytes=64 << 20, max_model_len=256), options=options)) \
            as c:
        yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers, why", [
    ({}, "no API key"),
    (bearer("sk-wrong"), "incorrect API key"),
    ({"Authorization": "Basic c2stZmlyc3Q="}, "must be 'Bearer YOUR_KEY'"),
    (bearer(""), "must be 'Bearer YOUR_KEY'"),
])
def test_v1_routes_need_a_key(client, headers, why):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        r = client.request(method, path, headers=headers, json=CHAT)
        assert r.status_code == 401, r.text
        error = r.json()["error"]
        assert why in error["message"]
        assert error["type"] == "AuthenticationError" and error["code"] == 401
        assert r.headers["www-authenticate"] == "Bearer"


def test_any_of_the_keys_opens_them(client):
    for key in KEYS:
        assert client.get("/v1/models", headers=bearer(key)).status_code == 200
    r = client.post("/v1/chat/completions", headers={"authorization": f"bearer {KEYS[1]}"}, json=CHAT)
    assert r.status_code == 200, r.text


def test_health_and_metrics_stay_open(client):
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_cors_preflight_and_headers(client):
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = client.get("/v1/models", headers={"Origin": ORIGIN})  # a browser can read why it was refused
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    other = client.get("/v1/models", headers={"Origin": "https://evil.example", **bearer(KEYS[0])})
    assert "access-control-allow-origin" not in other.headers


def test_the_openai_client_sees_an_authentication_error(client):
    def make(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)

    with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
        make("sk-wrong").models.list()
    reply = make(KEYS[0]).chat.completions.create(model="smollm2-135m-instruct", **CHAT)
    assert reply.usage.completion_tokens == 2


def test_serve_flags(monkeypatch):
    parse = build_parser().parse_args
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    options = server_options_from_args(parse(["serve"]))
    assert options.api_keys == [] and options.allowed_origins == ["*"] and not options.allow_credentials
    monkeypatch.setenv(API_KEY_ENV, "sk-env")
    assert server_options_from_args(parse(["serve"])).api_keys == ["sk-env"]
    options = server_options_from_args(parse([
        "serve", "--api-key", "a", "--api-key", "b", "--allowed-origins", '["https://x"]',
        "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["Authorization"]', "--allow-credentials",
        "--max-request-body-bytes", "1000", "--request-body-timeout-s", "2.5"]))
    assert options.api_keys == ["a", "b"]  # the flag wins over the environment
    assert (options.allowed_origins, options.allowed_methods, options.allowed_headers) == (
        ["https://x"], ["GET", "POST"], ["Authorization"])
    assert options.allow_credentials and options.limits.max_body_bytes == 1000
    assert options.limits.body_read_timeout_s == 2.5
    assert server_options_from_args(parse(["serve"])).limits.body_read_timeout_s == 30.0
    with pytest.raises(ValueError, match="--request-body-timeout-s must be > 0, got 0.0"):
        server_options_from_args(parse(["serve", "--request-body-timeout-s", "0"]))
    with pytest.raises(SystemExit):
        parse(["serve", "--allowed-origins", "https://x"])  # not a JSON list


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_need_the_key(client, path):
    r = client.get(path)
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("no API key"), r.text
    assert r.headers["www-authenticate"] == "Bearer"
    r = client.get(path, headers=bearer(KEYS[1]))
    assert r.status_code == 200
    if path == "/openapi.json":
        assert "/v1/chat/completions" in r.json()["paths"]


def test_disable_fastapi_docs_turns_them_off(monkeypatch):
    parse = build_parser().parse_args
    assert server_options_from_args(parse(["serve"])).fastapi_docs
    options = server_options_from_args(parse(["serve", "--disable-fastapi-docs"]))
    assert not options.fastapi_docs
    with TestClient(build_app(EngineConfig(kv_cache_memory_bytes=16 << 20, max_model_len=64), options=options)) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404


@pytest.mark.parametrize("method, path, what", [
    ("POST", "/v1/embeddings", "embeddings"), ("POST", "/v1/audio/transcriptions", "audio"),
    ("POST", "/v1/images/generations", "image generation"), ("POST", "/v1/moderations", "moderations"),
    ("GET", "/v1/files", "files"),
])
def test_unserved_openai_routes_say_so_in_openais_error_shape(client, method, path, what):
    r = client.request(method, path, headers=bearer(KEYS[0]), json={"input": "hi", "model": "x"})
    assert r.status_code == 404
    assert r.json() == {"error": {
        "message": f"this server does not serve {what} ({path}): hybridkv serves text generation only "
                   "(/v1/completions, /v1/chat/completions)",
        "type": "NotFoundError", "param": None, "code": 404}}
    assert client.get("/v1/nothing", headers=bearer(KEYS[0])).json()["error"]["message"] == "Not Found"


def test_the_openai_client_sees_embeddings_are_not_served(client):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[0], http_client=client, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="this server does not serve embeddings"):
        api.embeddings.create(model="x", input="hi")
