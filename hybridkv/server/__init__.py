"""OpenAI-compatible HTTP server: ``build_app`` (routes), ``AsyncEngine`` (engine thread), metrics."""

from hybridkv.server.app import build_app

__all__ = ["build_app"]
