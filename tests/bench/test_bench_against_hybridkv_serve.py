"""``hybridkv bench serve`` against the real ``hybridkv serve`` (default model, a subprocess on a free port)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from bench_fake_server import free_port

from hybridkv.cli import main

STARTUP_TIMEOUT_S = 90
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def hybridkv_server(tmp_path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"hybridkv serve did not come up:\n{(tmp_path / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_bench_against_hybridkv_serve(hybridkv_server, tmp_path, capsys):
    out, plot = tmp_path / "out.json", tmp_path / "out.png"
    code = main(["bench", "serve", "--base-url", hybridkv_server, "--num-prompts", "4", "--input-len", "32",
                 "--output-len", "8", "--json", str(out), "--plot", str(plot), "--no-progress"])
    table = capsys.readouterr().out
    assert code == 0, table
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert m["completed"] == 4 and m["failed"] == 0, m["errors"]
    assert m["total_output_tokens"] == 4 * 8  # ignore_eos: exact output lengths
    assert m["total_input_tokens"] == 4 * 32 and m["server_input_tokens"] == 4 * 32
    assert m["ttft_ms"]["mean"] > 0 and m["tpot_ms"]["mean"] > 0 and m["e2el_ms"]["mean"] > 0
    assert result["config"]["model"] and result["config"]["tokenizer"] == "smollm2-135m-instruct"
    assert all(r["output_tokens_source"] == "usage" for r in result["requests"])
    assert "Serving Benchmark Result" in table
    data = plot.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_MAGIC
