"""OpenAI-compatible HTTP server: ``build_app`` (routes), ``AsyncEngine`` (engine thread), metrics.

``build_app`` loads on first use: the CLI reads ``hybridkv.server.tool_calls`` to build its parser without the
server stack and torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.server.app import build_app

__all__ = ["build_app"]


def __getattr__(name: str):
    if name != "build_app":
        raise AttributeError(f"module 'hybridkv.server' has no attribute {name!r}")
    from hybridkv.server.app import build_app

    return build_app
