"""The app under uvicorn, with an end that clients and supervisors can see.

SIGTERM (or Ctrl-C) fails the requests in flight at once with 503, then uvicorn closes the connections and the
engine thread gets ``SHUTDOWN_GRACE_S`` to finish its step: the process is gone within a few seconds even in the
middle of a long CPU prefill, with exit status 0 (a stop asked for is a clean one; uvicorn would re-raise the
signal, status -15). A dead engine stops the server the same way once the requests in flight have had their 503
and its workers are stopped (``/health`` answers 503 meanwhile), and ``run_server`` returns 1, so a supervisor
restarts it (vLLM's server exits too).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from hybridkv.server.app import ServerState
from hybridkv.server.summary import startup_summary

log = logging.getLogger("hybridkv.server")

GRACEFUL_SHUTDOWN_S = 2.0  # uvicorn's wait for connections to close; ours have all been answered by then


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._engine = state.engine

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # listening: say what is served, and where
            log.info(startup_summary(self._state, f"http://{self.config.host}:{self.config.port}"))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:  # not re-raised once shut down (uvicorn's list of signals to re-raise)
            with contextlib.suppress(AttributeError, ValueError):
                self._captured_signals.remove(sig)
        self._engine.begin_shutdown()


def run_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> int:
    """Serve until SIGTERM (0), Ctrl-C (uvicorn re-raises SIGINT afterwards) or a dead engine (1)."""
    state: ServerState = app.state.server
    engine = state.engine
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, state)

    def on_dead() -> None:  # on the engine thread: uvicorn polls the flag from its loop
        server.should_exit = True

    engine.on_dead = on_dead
    server.run()
    if engine.failure is not None:
        log.error("exiting: %s", engine.failure)
        return 1
    return 0
