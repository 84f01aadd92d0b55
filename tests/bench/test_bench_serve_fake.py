"""``hybridkv bench serve`` end to end against a fake OpenAI-compatible streaming server."""

from __future__ import annotations

import json

import pytest
from bench_fake_server import MODEL_ID, FakeOptions, running_server

from hybridkv.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(base_url: str, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    code = main(["bench", "serve", "--base-url", base_url, "--json", str(out), "--no-progress", *extra])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_completions_random_json_and_plot(tmp_path, capsys):
    options = FakeOptions()
    plot = tmp_path / "out.png"
    with running_server(options) as url:
        code, result = bench(url, tmp_path, "--dataset", "random", "--input-len", "32", "--output-len", "6",
                             "--num-prompts", "8", "--max-concurrency", "3", "--prefix-len", "8",
                             "--plot", str(plot))
    table = capsys.readouterr().out
    print(table)
    assert code == 0
    m = result["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["total_output_tokens"] == 6 * 8
    assert m["ttft_ms"]["mean"] > 0 and m["ttft_ms"]["p99"] >= m["ttft_ms"]["median"] > 0
    assert m["tpot_ms"]["mean"] > 0 and m["itl_ms"]["count"] == 5 * 8 and m["e2el_ms"]["mean"] > m["ttft_ms"]["mean"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0 and m["total_token_throughput"] > 0
    assert m["max_concurrent_requests"] <= 3
    cfg = result["config"]
    assert cfg["model"] == MODEL_ID and cfg["tokenizer"] == "smollm2-135m-instruct" and cfg["max_concurrency"] == 3
    assert result["dataset"]["exact_prompts"] == 8
    assert len(result["requests"]) == 8
    assert all(r["output_tokens"] == 6 and r["output_tokens_source"] == "usage" for r in result["requests"])
    assert all(r["prompt_len"] == 32 and len(r["chunk_times_s"]) == 6 for r in result["requests"])
    sent = options.seen
    assert len(sent) == 8 and all(b["max_tokens"] == 6 and b["ignore_eos"] and b["stream"] for b in sent)
    assert all(b["model"] == MODEL_ID and b["stream_options"]["include_usage"] for b in sent)
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table
    data = plot.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC


def test_chat_text_poisson_without_usage(tmp_path, capsys):
    options = FakeOptions(send_usage=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Paged attention stores the KV cache in fixed-size blocks. " * 5000)
    with running_server(options) as url:
        code, result = bench(url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset", "text",
                             "--dataset-path", str(corpus), "--input-len", "48", "--output-len", "4",
                             "--num-prompts", "5", "--request-rate", "50", "--summarize-instruction",
                             "--model", "my-model", "--seed", "3")
    capsys.readouterr()
    assert code == 0
    m = result["metrics"]
    assert m["completed"] == 5 and m["total_output_tokens"] == 20  # each delta is one token
    assert all(r["output_tokens_source"] == "tokenized" for r in result["requests"])
    assert all(b["model"] == "my-model" and b["messages"][0]["content"].startswith("Please summarize")
               for b in options.seen)
    assert len(set(result["dataset"]["offsets"])) == 5
    starts = sorted(r["start_s"] for r in result["requests"])
    assert starts[-1] > 0.0  # Poisson arrivals are spread out, not all at once


def test_errors_are_counted_and_reported(tmp_path, capsys):
    options = FakeOptions(fail_every=3)
    with running_server(options) as url:
        code, result = bench(url, tmp_path, "--input-len", "16", "--output-len", "3", "--num-prompts", "6",
                             "--max-concurrency", "1")
    out = capsys.readouterr().out
    m = result["metrics"]
    assert code == 0 and m["completed"] == 4 and m["failed"] == 2
    assert m["errors"] and "HTTP 500" in m["errors"][0] and "injected failure" in m["errors"][0]
    assert "Failed requests:" in out and "error: HTTP 500" in out


def test_unreachable_server_is_a_one_line_error(capsys):
    from bench_fake_server import free_port

    code = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--input-len", "8",
                 "--output-len", "2", "--num-prompts", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("hybridkv bench serve: error:")


def test_bench_requires_subcommand():
    with pytest.raises(SystemExit) as exit_info:
        main(["bench"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("flag, env, sent", [
    ((), "sk-from-env", "Bearer sk-from-env"),  # as vLLM's bench: OPENAI_API_KEY when --api-key is not given
    (("--api-key", "sk-flag"), "sk-from-env", "Bearer sk-flag"),
    ((), None, None),
])
def test_the_api_key_is_the_flag_else_openai_api_key(tmp_path, monkeypatch, flag, env, sent):
    if env is None:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    else:
        monkeypatch.setenv("OPENAI_API_KEY", env)
    options = FakeOptions()
    with running_server(options) as url:
        code, _ = bench(url, tmp_path, "--dataset", "random", "--input-len", "8", "--output-len", "2",
                        "--num-prompts", "2", "--model", MODEL_ID, *flag)
    assert code == 0
    assert options.authorizations == [sent, sent]
