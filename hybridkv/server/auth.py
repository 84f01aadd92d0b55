"""Who may call the API: bearer API keys on the ``/v1`` routes and the tokenizer routes, and CORS (FastAPI's
middleware, vLLM's flags).

As in vLLM, ``/health`` and ``/metrics`` stay open (load balancers and Prometheus carry no key), and CORS
preflight requests (``OPTIONS``) pass without one, since browsers never send credentials on them. vLLM leaves its
tokenizer routes open too; here they need the key, as they spend the server's CPU on what a client sends. So do
FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json``, which vLLM leaves open (and turns off with
``--disable-fastapi-docs``, which hybridkv takes too): they describe every route to whoever asks.
"""

from __future__ import annotations

import secrets

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridkv.server.errors import error_response
from hybridkv.server.options import ServerOptions

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info",
                             "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def add_access_middleware(app: FastAPI, options: ServerOptions) -> None:
    if options.api_keys:
        app.add_middleware(BearerAuth, api_keys=options.api_keys)
    # added last, so outermost: a 401 carries CORS headers too, and a browser can read it
    app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins, allow_methods=options.allowed_methods,
                       allow_headers=options.allowed_headers, allow_credentials=options.allow_credentials)


class BearerAuth:
    """ASGI middleware: a ``/v1``, tokenizer or API-docs request without ``Authorization: Bearer <one of the
    keys>`` gets 401."""

    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and _protected(scope["path"]):
            problem = self._problem(Headers(scope=scope).get("authorization"))
            if problem:
                response = error_response(401, problem)
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _problem(self, header: str | None) -> str | None:
        """Why the request is not authorized, or None when it is."""
        if not header:
            return "no API key: send it in the Authorization header (Authorization: Bearer YOUR_KEY)"
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "the Authorization header must be 'Bearer YOUR_KEY'"
        given = token.strip().encode()
        # compare_digest against every key: the time taken says nothing about which key came close
        if not any([secrets.compare_digest(given, key) for key in self._keys]):
            return "incorrect API key provided"
        return None


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path in PROTECTED_PATHS
