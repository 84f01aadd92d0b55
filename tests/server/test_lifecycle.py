"""A server's end, seen from outside: SIGTERM mid-prefill, a tensor-parallel worker killed mid-request.

Subprocess servers (``python -m hybridkv.cli serve``) where the process itself is under test; an in-process one
where a dead engine must stay visible."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_openai_server import Server

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine

REPO = Path(__file__).parents[2]
START_TIMEOUT = 180.0
SHUTDOWN_BOUND = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, log_level: str = "warning") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "hybridkv.cli", "serve", *args, "--host", "127.0.0.1", "--port",
               str(self.port), "--device", "cpu", "--log-level", log_level]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def __enter__(self) -> ServerProcess:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, f"server exited: {self.proc.stdout.read()}"
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.proc.stdout.close()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {s.name + (f"[{s.labels['attention_type']}]" if "attention_type" in s.labels else ""): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(pid) for pid in path.read_text().split()]


def post_in_background(url: str, body: dict) -> dict:
    """Starts the request on a thread; the dict gets its response (or exception) when it ends."""
    result: dict = {}

    def run() -> None:
        try:
            result["response"] = httpx.post(url, json=body, timeout=120)
        except Exception as error:  # noqa: BLE001 - the test reads it
            result["error"] = error

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def wait_for(condition, what: str, within: float = 60.0):
    deadline = time.monotonic() + within
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_sigterm_mid_prefill_answers_503_and_exits_within_5s():
    # SmolLM2 with a 6,000-token prompt: its one prefill step takes many seconds on a CPU
    args = ("--max-model-len", "8192", "--kv-cache-memory-bytes", str(512 << 20))
    with ServerProcess(*args) as srv:
        before = srv.metrics()
        request = post_in_background(f"{srv.url}/v1/completions", {"prompt": [504] * 6000, "max_tokens": 4})
        # the gauges show the step in flight: scheduled and holding KV, no token out yet
        during = wait_for(lambda: (m := srv.metrics())["hybridkv:num_requests_running"] == 1 and m, "running 1")
        assert during["hybridkv:kv_cache_usage_perc[full]"] > 0
        assert during["hybridkv:prompt_tokens_total"] == before["hybridkv:prompt_tokens_total"]
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(SHUTDOWN_BOUND)
        print(f"exited {code} after {time.monotonic() - start:.2f}s")
        assert code == 0  # a stop asked for is a clean exit (uvicorn alone would re-raise SIGTERM: -15)
        request["thread"].join(10)
        response = request["response"]
        assert response.status_code == 503, response.text
        assert "the server is shutting down" in response.json()["error"]["message"]


def long_context_copy(model_dir: Path, dest: Path) -> Path:
    """The tiny checkpoint with room for a long generation (same weights: RoPE has no table to grow)."""
    dest.mkdir()
    for f in model_dir.iterdir():
        (dest / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (dest / "config.json").unlink()
    (dest / "config.json").write_text(json.dumps(config))
    return dest


TP_ARGS = ("--tensor-parallel-size", "2", "--block-size", "4", "--kv-cache-memory-bytes", str(16 << 20))
LONG_REQUEST = {"prompt": [5, 6, 7, 8], "max_tokens": 16000, "ignore_eos": True}


def test_a_killed_tp_worker_answers_503_and_the_server_exits_non_zero(tiny_model, tmp_path):
    model = long_context_copy(tiny_model("llama3").path, tmp_path / "llama3")
    with ServerProcess(str(model), *TP_ARGS) as srv:
        workers = [pid for pid in srv.children() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1, workers
        request = post_in_background(f"{srv.url}/v1/completions", LONG_REQUEST)
        wait_for(lambda: srv.metrics()["hybridkv:generation_tokens_total"] > 0, "tokens")
        os.kill(workers[0], signal.SIGKILL)
        request["thread"].join(30)
        response = request["response"]
        assert response.status_code == 503, response.text
        assert "rank 1" in response.json()["error"]["message"] and "SIGKILL" in response.json()["error"]["message"]
        health = health_until_exit(srv)
        assert set(health) <= {503}, health
        assert srv.proc.wait(SHUTDOWN_BOUND) == 1


def health_until_exit(srv: ServerProcess) -> list[int | None]:
    """What /health answers until the process is gone (None: no answer), trailing no-answers dropped: the server
    stops listening just before it exits."""
    health: list[int | None] = []
    deadline = time.monotonic() + 60
    while srv.proc.poll() is None:
        assert time.monotonic() < deadline, f"the server did not exit: {health[-20:]}"
        try:
            health.append(httpx.get(f"{srv.url}/health", timeout=1).status_code)
        except httpx.TransportError:
            health.append(None)
        time.sleep(0.05)
    while health and health[-1] is None:
        health.pop()
    return health


def gone(pid: int) -> bool:
    """Ended, every thread of it: a zombie its parent has not reaped yet with no thread left but its main one (a
    killed process's main thread can turn zombie while other threads still hold its files), or reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state == "Z" and os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except FileNotFoundError:
        return True


def test_a_tp_worker_killed_while_idle_makes_health_503_until_the_server_exits(tiny_model, tmp_path):
    model = long_context_copy(tiny_model("llama3").path, tmp_path / "llama3")
    with ServerProcess(str(model), *TP_ARGS) as srv:
        [worker] = [pid for pid in srv.children() if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: gone(worker), "the worker to die")
        health = health_until_exit(srv)  # the idle engine looks at its workers every second, then exits
        assert health and set(health) == {503}, health  # from the moment the worker is dead, every answer
        assert srv.proc.wait(SHUTDOWN_BOUND) == 1
        assert "the engine is dead: tensor parallelism failed: rank 1" in srv.proc.stdout.read()


def test_a_dead_engine_stays_visible_in_process(tiny_model, tmp_path):
    model = long_context_copy(tiny_model("llama3").path, tmp_path / "llama3")
    engine = LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=2, block_size=4, device="cpu",
                                    kv_cache_memory_bytes=16 << 20))
    with Server(engine) as srv:
        request = post_in_background(f"{srv.url}/v1/completions", LONG_REQUEST)
        wait_for(lambda: srv.metrics()["hybridkv:generation_tokens_total"] > 0, "tokens")
        os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
        request["thread"].join(30)
        assert request["response"].status_code == 503
        assert httpx.get(f"{srv.url}/health").status_code == 503
        later = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        assert later.status_code == 503 and "killed by SIGKILL" in later.json()["error"]["message"]
